"""Fuzzing study: 100,000 hostile messages against two live nodes while a 2-worker training runs.

The fuzzer, the checks and the cluster set-up are those of tests/integration/test_hostile_input.py
(:func:`fuzz_during_training`): a 2-node local cluster checkpointing every 10 steps, a legitimate
2-worker training (tests/workers/train.py, AdamW), and once both workers are connected, mutated copies
of valid messages of every op plus random garbage (and headers nested up to msgpack's depth limit and
past it) from three DEALER sockets per node. Each reply is
checked against what a node owes a stranger (ERROR, or STATS to a STATS; a message past a stranger's
limits, such as the 1-4 MiB ``big`` ones: every earlier message answered, then the connection
closed, "disconnected as owed"); at the end the training is
compared with the undisturbed single-process reference (over 400 steps: with the same job trained
undisturbed by LuWu, bit for bit). Beside the messages (``SideAttacks``), each round raw ZMTP
connections send PINGs without reading the PONGs (each must be cut) and one client keeps 100
connections per node holding unfinished messages, past the nodes' node.peers_total_bytes (idle
holders are cut), and strangers without the job's join secret (or with a wrong one) try to connect
(each must be closed at the handshake); the counts go into the JSON and the table. The nodes ask for
the join secret of a default node (``local_cluster``'s); the fuzzer's sockets show it, so every
hostile message comes from a peer past the gate, the strongest attacker short of a worker.

Two configurations are run, each a fresh cluster and training:

- ``all``: every category, including well-formed HELLOs and ROLLBACKs claiming a worker's rank (the
  contract: a node must refuse them while that worker's connection is alive);
- ``no-rank-claims``: the same without the ``takeover`` and ``rollback`` categories and without any
  message that decodes as a HELLO for a rank inside the world; it shows what holds apart from those.

This is a robustness study, not a speed benchmark: the rates are reported for scale only.

``--reconnect-every K`` closes each fuzzer socket after K answered messages and opens a fresh one (a
new TCP connection and identity), so the run is also a connection flood; every node's RSS is sampled
every ``--rss-every`` messages (the curve goes into the JSON and, every tenth point, the markdown).
The long run of issue 19 (1,000,000 messages, a connection every 10):

    python3 benchmarks/fuzz_node.py --messages 1000000 --reconnect-every 10 --steps 30000 --only all --side-pause 10 --name fuzz_node_1m

(``--side-pause 10``: a round of side attacks every 10 s, the holders let go between rounds. Held all
the time, they keep the nodes' node.peers_total_bytes full, every peer's reads wait on the idle cut,
and the run goes at ~170 messages/s instead of thousands.)

(``--no-side-attacks``: the messages alone, as before the side attacks existed.)

The training outlasts the fuzzing there (a rank whose worker has been gone for ``worker_timeout_s`` may be
claimed again, rightly, which the checks would count as a wrong reply), and with more than 400 steps it
is compared bit for bit with the same job trained undisturbed, not with torch (see
``fuzz_during_training``).

    python3 benchmarks/fuzz_node.py [--quick] [--messages N] [--steps S] [--seed K] [--only NAME]

Writes benchmarks/results/fuzz_node.json and .md (``--quick``: 10,000 messages, fuzz_node.quick.*;
``--name``: another stem).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

import torch  # noqa: E402
from common import LoadMonitor, machine_info, md_table, write_results  # noqa: E402
from test_hostile_input import NODE_ARGS, SPEC, Fuzzer, fuzz_during_training, rss_bound  # noqa: E402

CONFIGS = {
    "all": {"allow_rank_hello": True, "categories": dict(Fuzzer.CATEGORIES)},
    "no-rank-claims": {
        "allow_rank_hello": False,
        "categories": {
            k: v for k, v in Fuzzer.CATEGORIES.items() if k not in ("takeover", "rollback")
        },
    },
}


def study(
    name: str,
    num_messages: int,
    steps: int,
    seed: int,
    reconnect_every: int = 0,
    rss_every: int = 10_000,
    side_attacks: bool = True,
    side_pause_s: float = 1.0,
) -> dict:
    cfg = CONFIGS[name]
    spec = dict(SPEC, steps=steps)
    t0 = time.monotonic()
    curve: list = []
    with tempfile.TemporaryDirectory(prefix="luwu-fuzz-") as tmp:
        res = fuzz_during_training(
            Path(tmp),
            num_messages,
            spec=spec,
            seed=seed,
            allow_rank_hello=cfg["allow_rank_hello"],
            categories=cfg["categories"],
            on_progress=lambda r: print(
                f"  [{name}] {r.sent} sent, {r.replies} replies, {r.connections} connections, {r.seconds:.0f} s",
                flush=True,
            ),
            reconnect_every=reconnect_every,
            rss_curve=curve,
            progress_every=rss_every,
            against_luwu=steps > 400,
            side_attacks=side_attacks,
            side_pause_s=side_pause_s,
        )
    rep = res.report
    mib = lambda xs: [round(x / (1 << 20), 1) for x in xs]  # noqa: E731
    return {
        "config": name,
        "messages_sent": rep.sent,
        "connections": rep.connections,
        "rss_curve": [{"sent": n, "s": t, "node_rss_mib": mib(rss)} for n, t, rss in curve],
        "rss_curve_bounded": all(
            r < rss_bound(w) for _, _, rss in curve for r, w in zip(rss, res.rss_warm)
        ),
        "replies": rep.replies,
        "no_reply": rep.missing,
        "disconnects_owed": rep.disconnects,
        "unsolicited": rep.unsolicited,
        "error_replies": rep.replies_by_op.get("ERROR", 0),
        "replies_by_op": dict(rep.replies_by_op),
        "errors_by_code": dict(rep.errors_by_code),
        "sent_by_category": dict(rep.by_category),
        "wrong_replies": rep.num_violations,
        "wrong_reply_examples": rep.violations,
        "internal_errors": sum(rep.internal_errors.values()),
        "internal_error_kinds": dict(rep.internal_errors),
        "internal_error_examples": rep.internal_examples,
        "sent_during_training": rep.sent_during_training,
        "fuzz_s": round(rep.seconds, 1),
        "messages_per_s": round(rep.sent / max(rep.seconds, 1e-9)),
        "nodes_alive": res.alive,
        "node_rss_warm_mib": mib(res.rss_warm),
        "node_rss_end_mib": mib(res.rss_end),
        "node_rss_peak_mib": mib(res.hwm_end),
        "rss_bounded": all(
            e < rss_bound(w) and h < rss_bound(w)
            for w, e, h in zip(res.rss_warm, res.rss_end, res.hwm_end)
        ),
        "node_steps_after": [s.get("step") for s in res.stats_after],
        "training_steps": steps,
        "training_error": res.training_error[-2000:] if res.training_error else None,
        "training_equal": res.training_equal,
        "max_abs_diff": res.max_abs_diff,
        "training_s": round(res.training_s, 1),
        "total_s": round(time.monotonic() - t0, 1),
        "side_attacks": res.side,
    }


def yes_no(v) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="10,000 messages per configuration: a smoke run"
    )
    ap.add_argument(
        "--messages", type=int, default=None, help="messages per configuration (default 100,000)"
    )
    ap.add_argument(
        "--steps", type=int, default=400, help="training steps (long enough to overlap the fuzzing)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=sorted(CONFIGS), help="run one configuration")
    ap.add_argument(
        "--reconnect-every",
        type=int,
        default=0,
        help="a fresh fuzzer connection after this many messages (0: never)",
    )
    ap.add_argument(
        "--rss-every",
        type=int,
        default=10_000,
        help="sample the nodes' RSS every this many messages",
    )
    ap.add_argument("--name", default="fuzz_node", help="results stem (default fuzz_node)")
    ap.add_argument(
        "--no-side-attacks",
        action="store_true",
        help="no PING and connection floods beside the messages",
    )
    ap.add_argument(
        "--side-pause",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between two rounds of side attacks; past 1 s the holders are let go between rounds (default 1.0: always held)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    n = args.messages or (10_000 if args.quick else 100_000)
    rows = []
    with LoadMonitor() as load:
        for name in [args.only] if args.only else list(CONFIGS):
            print(f"{name}: {n} messages, {args.steps} training steps", flush=True)
            rows.append(
                study(
                    name,
                    n,
                    args.steps,
                    args.seed,
                    args.reconnect_every,
                    args.rss_every,
                    not args.no_side_attacks,
                    args.side_pause,
                )
            )
    cols = [
        "config",
        "messages",
        "connections",
        "ERROR replies",
        "STATS replies",
        "disconnected as owed",
        "no reply",
        "unsolicited",
        "wrong replies",
        "internal errors",
        "during training",
        "nodes up",
        "RSS warm MiB",
        "RSS end MiB",
        "RSS peak MiB",
        "training equal",
        "unread PINGs cut",
        "holders cut",
        "strangers refused",
        "msg/s",
    ]
    table = [
        {
            "config": r["config"],
            "messages": r["messages_sent"],
            "connections": r["connections"],
            "ERROR replies": r["error_replies"],
            "STATS replies": r["replies_by_op"].get("STATS", 0),
            "disconnected as owed": r["disconnects_owed"],
            "no reply": r["no_reply"],
            "unsolicited": r["unsolicited"],
            "wrong replies": r["wrong_replies"],
            "internal errors": r["internal_errors"],
            "during training": f"{100 * r['sent_during_training'] / max(1, r['messages_sent']):.0f}%",
            "nodes up": "yes" if all(r["nodes_alive"]) else "NO",
            "RSS warm MiB": " / ".join(map(str, r["node_rss_warm_mib"])),
            "RSS end MiB": " / ".join(map(str, r["node_rss_end_mib"])),
            "RSS peak MiB": " / ".join(map(str, r["node_rss_peak_mib"])),
            "training equal": "NO (failed)" if r["training_error"] else yes_no(r["training_equal"]),
            "unread PINGs cut": f"{r['side_attacks'].get('ping_peers_cut', 0)} / {r['side_attacks'].get('ping_peers', 0)}"
            if r["side_attacks"]
            else "-",
            "holders cut": f"{r['side_attacks'].get('holders_cut', 0)} / {r['side_attacks'].get('holders', 0)}"
            if r["side_attacks"]
            else "-",
            "strangers refused": f"{r['side_attacks'].get('strangers_refused', 0)} / {r['side_attacks'].get('strangers_refused', 0) + r['side_attacks'].get('strangers_admitted', 0)}"
            if r["side_attacks"]
            else "-",
            "msg/s": r["messages_per_s"],
        }
        for r in rows
    ]
    md = [
        f"# Fuzzing live nodes during training ({n:,} messages per configuration)",
        "",
        md_table(table, cols),
        "",
    ]
    for r in rows:
        md.append(
            f"**{r['config']}**: ERROR codes {r['errors_by_code']}; sent by category {r['sent_by_category']}."
        )
        if r["training_error"]:
            md.append(f"Training failed: `{r['training_error'].strip().splitlines()[-1][:300]}`.")
        for cat, sent, got, _text in r["wrong_reply_examples"][:3]:
            md.append(f"- wrong reply {got} to `{cat}` message `{sent[:240]}`")
        for cat, sent, text in r["internal_error_examples"][:3]:
            md.append(f"- internal error `{text[:160]}` for `{cat}` message `{sent[:200]}`")
        md.append("")
        points = r["rss_curve"][:: max(1, len(r["rss_curve"]) // 10)]
        if points:
            md += [
                f"Node RSS (MiB) during **{r['config']}**, against the bound of 2 x warm + 64 MiB "
                f"({'held at every point' if r['rss_curve_bounded'] else 'EXCEEDED'}; {len(r['rss_curve'])} points in the JSON):",
                "",
                md_table(
                    [
                        {
                            "messages": p["sent"],
                            "seconds": p["s"],
                            "node 0": p["node_rss_mib"][0],
                            "node 1": p["node_rss_mib"][1],
                        }
                        for p in points
                    ],
                    ["messages", "seconds", "node 0", "node 1"],
                ),
                "",
            ]
    md.append(
        f"Nodes: 2, checkpoint every 10 steps, {' '.join(NODE_ARGS)}; training: 2 workers, {args.steps} steps of AdamW on the test MLP; fuzzer: 3 DEALER sockets per node, at most 32 unanswered each"
        + (
            f", each replaced by a fresh connection after {args.reconnect_every} messages."
            if args.reconnect_every
            else "."
        )
    )
    md.append(
        f"RSS bound checked: end and peak < 2 x RSS after 500 warm-up messages + 64 MiB. {load.line()}"
    )
    result = {
        "messages": n,
        "steps": args.steps,
        "seed": args.seed,
        "reconnect_every": args.reconnect_every,
        "rows": rows,
        "machine": machine_info(),
        "load": load.info(),
    }
    write_results(args.name, result, "\n".join(md), quick=args.quick)


if __name__ == "__main__":
    main()

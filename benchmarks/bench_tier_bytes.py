"""Node traffic with and without the switch tier (issue 35): 8 workers, 2 nodes, 2 aggregators.

The flat layout: every worker talks to both nodes. The tier: the workers in 2 groups of 4, each
group through its aggregator (``luwu aggregator``), which sums the group's pushes, passes each reply
on, and sends the group's PULLs of a bucket that are in flight at once up once. In resident mode
and in streaming mode (``--modes``; ``RemoteOptimizer(stream_weights=True)``: the model's
``--blocks`` layers are the units, their weights held only while used). Streaming node egress is
the weight fetches: PULL answers, and the weights the nodes send unasked with the answers to pushes
(the first ``prefetch`` units of the forward, and those after them while they fit
``stream_hold_bytes``).

Read from the nodes' own ``/metrics``: ``luwu_node_bytes_received_total{op="push"}`` (ingress) and
``luwu_node_bytes_sent_total{op="update"}`` (egress: every reply, a PULL's answer too). Beside them,
what explains them: the aggregators' ``luwu_aggregator_fetches_shared_total`` (PULLs that waited on
another's in flight) and ``luwu_aggregator_replies_fanned_out_total``, and from the workers the
units loaded before use (``Streamer.fetches``: PULLed or sent unasked) and the buckets they PULLed.

A step's counts are the difference of a long run and a short one: in one job of ``--steps`` steps,
the counts at its end less those after its first ``--warm`` steps (the workers wait there until the
counts have settled and been read), over the steps between; medians of ``--reps`` jobs. So the
seed, every worker's first pull and streaming's first steps (before a worker knows its forward
order and its units' sizes) are left out exactly: since the aggregators share fetches, how many of
those start-up PULLs go up depends on timing, and two separate jobs' start-ups differ by a few
buckets. Compression is off (fp32 both ways; the bytes are exact) unless ``--compression`` (the
default policy: int8 pushes after the warm-up; an aggregator's sum goes up fp32 today).

    .venv/bin/python benchmarks/bench_tier_bytes.py [--modes resident,streaming] [--blocks 4]
        [--workers 8] [--groups 2] [--reps 3]

Writes benchmarks/results/bench_tier_bytes.json and .md (``--out``). About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("resident", "streaming")
_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")


def child(spec: dict) -> None:
    import torch

    import luwu

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    w = spec["width"]
    # streaming: the blocks (the Sequential's children) are the units
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU()) for _ in range(spec["blocks"])
    ]
    model = torch.nn.Sequential(*blocks)
    opt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=spec["nodes"],
        aggregator=(spec["aggregators"] or {}).get(str(rank)),
        compression=spec["compression"],
        stream_weights=spec["stream"],
        timeout_s=120,
        lr=1e-3,
    )
    pulled = [0]  # buckets asked for with PULL (streaming; the weights sent unasked are not)
    if opt.streamer is not None:
        request = opt.worker.request_weights

        def counted(bids, **kw):
            pulled[0] += len(bids)
            return request(bids, **kw)

        opt.worker.request_weights = counted
    out = Path(spec["out"])

    def report(when: str) -> None:
        fetches = opt.streamer.fetches if opt.streamer is not None else 0
        counts = {"unit_fetches": fetches, "buckets_pulled": pulled[0]}
        (out / f"{when}.rank{rank}").write_text(json.dumps(counts))

    g = torch.Generator().manual_seed(rank)
    for step in range(spec["steps"]):
        if step == spec["warm"]:  # the nodes are read now: wait until they have been
            report("warm")
            while not (out / "go").exists():
                time.sleep(0.02)
        x = torch.randn(16, w, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    report("end")
    opt.close()


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``url``'s /metrics: (name, labels, value)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def _total(scrapes: list, name: str, **labels: str) -> float:
    """The sum of ``name`` over ``scrapes`` (each one /metrics' samples) with ``labels``."""
    return sum(
        v
        for samples in scrapes
        for n, got, v in samples
        if n == name and all(got.get(k) == want for k, want in labels.items())
    )


def _counts(c, out: Path, when: str, workers: int) -> dict:
    """What the job has done so far: the nodes' push ingress and update egress (bytes), the
    aggregators' shared fetches and fanned-out replies, the units the workers loaded and the buckets
    they PULLed; each summed."""
    nodes = [_samples(u) for u in c.metrics_urls]
    aggs = [_samples(u) for u in c.aggregator_metrics_urls]
    ranks = [json.loads((out / f"{when}.rank{r}").read_text()) for r in range(workers)]
    return {
        "in": _total(nodes, "luwu_node_bytes_received_total", op="push"),
        "out": _total(nodes, "luwu_node_bytes_sent_total", op="update"),
        "unit_fetches": sum(r["unit_fetches"] for r in ranks),
        "buckets_pulled": sum(r["buckets_pulled"] for r in ranks),
        "fetches_shared": _total(aggs, "luwu_aggregator_fetches_shared_total"),
        "replies_fanned_out": _total(aggs, "luwu_aggregator_replies_fanned_out_total"),
    }


def _await_files(paths: list[Path], procs: list, timeout_s: float = 600) -> None:
    """Wait until every one of ``paths`` exists (a worker reached the warm steps' end); a worker
    that failed meanwhile raises."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"a worker failed (exit {failed[0]})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not all reach the end of --warm in {timeout_s} s")
        time.sleep(0.05)


def _settled(read, interval_s: float = 0.25, timeout_s: float = 30) -> dict:
    """``read()`` once two reads ``interval_s`` apart agree: what the warm steps sent after every
    worker's ``step()`` returned (a delayed bucket's push, its reply) has been counted."""
    deadline, last = time.monotonic() + timeout_s, read()
    while True:
        time.sleep(interval_s)
        now = read()
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def run(args, groups: int, stream: bool) -> dict:
    """One job of ``--steps`` steps: its counts per step after the first ``--warm`` (the counts at
    its end less those at step ``--warm``, where every worker waits until they have been read)."""
    import luwu

    with (
        luwu.local_cluster(
            2,
            node_args=["--metrics.port", "0"],
            aggregators=groups,
            world_size=args.workers if groups else 0,
            aggregator_args=["--metrics.port", "0"],
        ) as c,
        tempfile.TemporaryDirectory() as tmp,
    ):
        out = Path(tmp)
        spec = {
            "nodes": c.addresses,
            "aggregators": {str(r): c.aggregator_for(r) for r in range(args.workers)}
            if groups
            else None,
            "compression": args.compression,
            "stream": stream,
            "warm": args.warm,
            "steps": args.steps,
            "width": args.width,
            "blocks": args.blocks,
            "out": tmp,
        }
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.workers)),
            )
            for r in range(args.workers)
        ]
        _await_files([out / f"warm.rank{r}" for r in range(args.workers)], procs)
        warm = _settled(lambda: _counts(c, out, "warm", args.workers))
        (out / "go").touch()
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"a worker failed (exit {p.returncode})")
        end = _counts(c, out, "end", args.workers)
    return {k: (end[k] - warm[k]) / (args.steps - args.warm) for k in end}


def measure(args, mode: str, layout: str, groups: int) -> dict:
    """One row: the counts per step, medians of ``--reps`` jobs."""
    runs: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for k, v in run(args, groups, mode == "streaming").items():
            runs.setdefault(k, []).append(v)
    row = {"mode": mode, "layout": layout}
    row["ingress_mb_per_step"] = statistics.median(runs["in"]) / 1e6
    row["egress_mb_per_step"] = statistics.median(runs["out"]) / 1e6
    for k in ("unit_fetches", "buckets_pulled", "fetches_shared", "replies_fanned_out"):
        row[f"{k}_per_step"] = statistics.median(runs[k])
    row["runs"] = runs  # each job's counts per step, bytes as counted
    return row


def write_md(args, result: dict) -> str:
    rows, ratios = result["rows"], result["ratios"]
    flags = " --compression" if args.compression else ""
    if args.modes != list(MODES):
        flags += f" --modes {','.join(args.modes)}"
    if args.blocks != 4:
        flags += f" --blocks {args.blocks}"
    lines = [
        "# Node traffic with and without the switch tier (bench_tier_bytes)",
        "",
        f"`python3 benchmarks/bench_tier_bytes.py{flags}`: {args.workers} workers, 2 nodes, flat "
        f"against {args.groups} aggregators (groups of {args.workers // args.groups}); an MLP of "
        f"{args.blocks} layers of width {args.width} (streaming: each layer a unit, prefetch 2); "
        f"compression {'default' if args.compression else 'off'}; a step's counts = (after "
        f"{args.steps} steps - after {args.warm} steps, in one job) / {args.steps - args.warm}, "
        f"medians of {args.reps} jobs. Bytes from the nodes' /metrics, both nodes summed (egress: "
        "every reply, a PULL's answer too); units fetched (loaded before use, whether PULLed or "
        "sent unasked with a push's reply) and buckets PULLed from the workers, all summed; "
        "fetches shared (PULLs that waited on another's in flight) and replies fanned out from "
        "the aggregators' /metrics.",
        "",
        "| mode | layout | node ingress MB/step (pushes) | node egress MB/step (replies) "
        "| units fetched/step | buckets PULLed/step | fetches shared/step "
        "| replies fanned out/step |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['mode']} | {r['layout']} | {r['ingress_mb_per_step']:.3f} "
            f"| {r['egress_mb_per_step']:.3f} | {r['unit_fetches_per_step']:g} "
            f"| {r['buckets_pulled_per_step']:g} | {r['fetches_shared_per_step']:g} "
            f"| {r['replies_fanned_out_per_step']:g} |"
            for r in rows
        ),
        "",
        *(
            f"- {mode}: flat / tier ingress **{q['ingress_ratio']:.2f}x**, egress "
            f"**{q['egress_ratio']:.2f}x** (target: at least 4x each)."
            for mode, q in ratios.items()
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--modes", default=",".join(MODES), help="resident, streaming or both")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4, help="layers (streaming: units)")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compression", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if not 0 <= args.warm < args.steps:
        ap.error(f"--warm must be in [0, --steps), got --warm {args.warm} --steps {args.steps}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"--modes takes {', '.join(MODES)} (comma-separated), got {args.modes!r}")
    rows, ratios = [], {}
    for mode in args.modes:
        flat = measure(args, mode, "flat", 0)
        print(json.dumps(flat), flush=True)
        tier = measure(args, mode, f"{args.groups} aggregators", args.groups)
        print(json.dumps(tier), flush=True)
        rows += [flat, tier]
        ratios[mode] = {
            "ingress_ratio": flat["ingress_mb_per_step"] / tier["ingress_mb_per_step"],
            "egress_ratio": flat["egress_mb_per_step"] / tier["egress_mb_per_step"],
        }
    result = {
        "workers": args.workers,
        "groups": args.groups,
        "nodes": 2,
        "width": args.width,
        "blocks": args.blocks,
        "compression": args.compression,
        "modes": args.modes,
        "rows": rows,
        "ratios": ratios,
    }
    stem = "bench_tier_bytes" + ("_compressed" if args.compression else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = write_md(args, result)
    (args.out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

"""Node traffic with and without the switch tier (issue 35): 8 workers, 2 nodes, 2 aggregators.

The flat layout: every worker talks to both nodes. The tier: the workers in 2 groups of 4, each group
through its aggregator (``luwu aggregator``), which sums the group's pushes and passes each reply on.
Read from the nodes' own ``/metrics``: ``luwu_node_bytes_received_total{op="push"}`` (ingress) and
``luwu_node_bytes_sent_total{op="update"}`` (egress), per step. A step's bytes are the difference of
a run of ``--steps`` and one of ``--warm`` steps (the seed and every worker's first pull are in
both), medians of ``--reps``. Compression is off (fp32 both ways; the bytes are exact) unless
``--compression`` (the default policy: int8 pushes after the warm-up; an aggregator's sum goes up
fp32 today).

    .venv/bin/python benchmarks/bench_tier_bytes.py [--workers 8] [--groups 2] [--reps 3]

Writes benchmarks/results/bench_tier_bytes.json and .md. About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(spec: dict) -> None:
    import torch

    import luwu

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    w = spec["width"]
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU()) for _ in range(4)]
    )
    opt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=spec["nodes"],
        aggregator=(spec["aggregators"] or {}).get(str(rank)),
        compression=spec["compression"],
        timeout_s=120,
        lr=1e-3,
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(spec["steps"]):
        x = torch.randn(16, w, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.close()


def _samples(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("luwu_node_bytes_received_total", "luwu_node_bytes_sent_total")):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def run(args, steps: int, groups: int) -> dict:
    """One job of ``steps`` steps: the nodes' push ingress and update egress, bytes summed."""
    import luwu

    with luwu.local_cluster(
        2,
        node_args=["--metrics.port", "0"],
        aggregators=groups,
        world_size=args.workers if groups else 0,
    ) as c:
        spec = {
            "nodes": c.addresses,
            "aggregators": {str(r): c.aggregator_for(r) for r in range(args.workers)}
            if groups
            else None,
            "compression": args.compression,
            "steps": steps,
            "width": args.width,
        }
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.workers)),
            )
            for r in range(args.workers)
        ]
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"a worker failed (exit {p.returncode})")
        got = [_samples(u) for u in c.metrics_urls]
    return {
        "in": sum(s.get('luwu_node_bytes_received_total{op="push"}', 0.0) for s in got),
        "out": sum(s.get('luwu_node_bytes_sent_total{op="update"}', 0.0) for s in got),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compression", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    rows = []
    for layout, groups in (("flat", 0), (f"{args.groups} aggregators", args.groups)):
        per_step = {"in": [], "out": []}
        for _ in range(args.reps):
            short, long = run(args, args.warm, groups), run(args, args.steps, groups)
            for k in per_step:
                per_step[k].append((long[k] - short[k]) / (args.steps - args.warm))
        rows.append(
            {
                "layout": layout,
                "ingress_mb_per_step": statistics.median(per_step["in"]) / 1e6,
                "egress_mb_per_step": statistics.median(per_step["out"]) / 1e6,
                "runs_in": per_step["in"],
                "runs_out": per_step["out"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    flat, tier = rows
    result = {
        "workers": args.workers,
        "groups": args.groups,
        "nodes": 2,
        "width": args.width,
        "compression": args.compression,
        "rows": rows,
        "ingress_ratio": flat["ingress_mb_per_step"] / tier["ingress_mb_per_step"],
        "egress_ratio": flat["egress_mb_per_step"] / tier["egress_mb_per_step"],
    }
    stem = "bench_tier_bytes" + ("_compressed" if args.compression else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Node traffic with and without the switch tier (bench_tier_bytes)",
        "",
        f"`python3 benchmarks/bench_tier_bytes.py{' --compression' if args.compression else ''}`: "
        f"{args.workers} workers, 2 nodes, flat against {args.groups} aggregators (groups of "
        f"{args.workers // args.groups}); an MLP of 4 layers of width {args.width}; compression "
        f"{'default' if args.compression else 'off'}; a step's bytes = (a {args.steps}-step run - "
        f"a {args.warm}-step run) / {args.steps - args.warm}, medians of {args.reps}; from the nodes' "
        "/metrics, both nodes summed.",
        "",
        "| layout | node ingress MB/step (pushes) | node egress MB/step (replies) |",
        "|---|---|---|",
        *(
            f"| {r['layout']} | {r['ingress_mb_per_step']:.3f} | {r['egress_mb_per_step']:.3f} |"
            for r in rows
        ),
        "",
        f"Flat / tier: ingress **{result['ingress_ratio']:.2f}x**, egress "
        f"**{result['egress_ratio']:.2f}x** (target: at least 4x each).",
        "",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Worker memory in streaming mode against resident mode, at 12, 24 and 48 blocks.

Each run is a worker process of its own (world size 1) against a fresh 2-node
``local_cluster``: it imports torch and luwu (the runtime floor, ``floor_mb``),
builds a model of ``depth`` blocks (``LayerNorm`` + two ``Linear`` of width
``width`` and ``4 * width``) with an input layer and a head, makes a
``RemoteOptimizer`` (``compression=False``; ``stream_weights=True`` or not) and
trains ``steps`` steps. Reported, from ``/proc/self/status``:

- ``peak_mb``: VmHWM over the whole run, above the floor. A streaming worker
  still builds the model whole here (the meta-device start is not there yet),
  so this peak includes the model once.
- ``train_peak_mb``: the peak while training, above the floor: VmHWM is reset
  (``/proc/self/clear_refs``) once the optimizer is built, so this is what the
  training steps hold (streaming: the units in flight, the resident root, the
  activations; resident: the model, its gradients and the bucket copies).
- ``weights_mb``: the fp32 weights of the model.

The target of the design is at most +10% of ``train_peak_mb`` per doubling of
depth in streaming mode.

    python3 benchmarks/bench_memory.py [--quick] [--width W] [--steps S] [--depths 12,24,48]

Writes benchmarks/results/bench_memory.json and .md (``--quick``: .quick.*).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import md_table, write_results

HERE = Path(__file__).resolve().parent


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(spec: dict) -> dict:
    """One worker run (in its own process): the memory it held."""
    import torch

    import luwu

    torch.set_num_threads(1)
    floor = status_bytes("VmRSS")
    width, depth = spec["width"], spec["depth"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.fc1 = torch.nn.Linear(width, 4 * width)
            self.fc2 = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(64, width)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
            self.head = torch.nn.Linear(width, 10)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    weights = sum(p.numel() for p in model.parameters()) * 4
    opt = luwu.RemoteOptimizer(model, nodes=spec["nodes"], lr=1e-3, compression=False, rank=0, world_size=1, stream_weights=spec["stream"], timeout_s=120)
    built, build_peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    g = torch.Generator().manual_seed(0)
    for _ in range(spec["steps"]):
        x, y = torch.randn(spec["batch"], 64, generator=g), torch.randint(0, 10, (spec["batch"],), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    train_peak = status_bytes("VmHWM")
    opt.close()
    mb = 1 / 2**20
    return {
        "mode": "streaming" if spec["stream"] else "resident", "depth": depth, "weights_mb": weights * mb, "floor_mb": floor * mb,
        "built_mb": (built - floor) * mb, "train_peak_mb": (train_peak - floor) * mb, "peak_mb": (max(train_peak, build_peak) - floor) * mb,
    }


def run(spec: dict) -> dict:
    import luwu

    with luwu.local_cluster(2) as c:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(dict(spec, nodes=c.addresses))], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="narrow blocks, 2 steps: a smoke run")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depths", default="12,24,48")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    width, steps = (64, 2) if args.quick else (args.width, args.steps)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for stream in (False, True):
            rows.append(run({"width": width, "depth": depth, "stream": stream, "steps": steps, "batch": args.batch}))
            print(json.dumps(rows[-1]), flush=True)
    stream_rows = [r for r in rows if r["mode"] == "streaming"]
    growth = [b["train_peak_mb"] / a["train_peak_mb"] for a, b in zip(stream_rows, stream_rows[1:]) if a["train_peak_mb"] > 0]
    result = {"width": width, "steps": steps, "batch": args.batch, "rows": rows, "streaming_train_peak_growth_per_doubling": growth}
    md = "# Worker memory: streaming vs resident (MB above the runtime floor)\n\n" + md_table(rows, ["mode", "depth", "weights_mb", "built_mb", "train_peak_mb", "peak_mb", "floor_mb"])
    md += "\n\nStreaming train peak growth per doubling of depth: " + ", ".join(f"{g:.2f}x" for g in growth) + " (target <= 1.10x)\n"
    write_results("bench_memory", result, md, quick=args.quick)


if __name__ == "__main__":
    main()

"""Memory of workers and nodes: streaming against resident mode, and a worker under a cgroup limit.

**Depth sweep** (default). Each run is a worker process of its own (world size 1)
against a fresh 2-node ``local_cluster``: it imports torch and luwu (the runtime
floor, ``floor_mb``), builds a model of ``depth`` blocks (``LayerNorm`` + two
``Linear`` of width ``width`` and ``4 * width``) with an input layer and a head
(streaming: on the meta device, so it never exists whole), makes a
``RemoteOptimizer`` (``stream_weights=True`` or not; ``compression=False``, and
with ``--defaults`` also the default compression) and trains ``steps`` steps.
Reported, from ``/proc/PID/status``:

- ``peak_mb``: the worker's VmHWM over the whole run, above the floor.
- ``train_peak_mb``: its peak while training, above the floor (VmHWM reset through
  ``/proc/self/clear_refs`` once the optimizer is built): streaming, the units in
  flight, the resident root and the activations; resident, the model, its gradients
  and the bucket copies. Target: at most +10% per doubling of depth in streaming mode.
- ``weights_mb``: the model's weights (fp32, or bf16 with ``--bf16``'s resident bf16 rows).
- ``train_b_per_param``: ``train_peak_mb`` per parameter (the model, its gradients, the buckets).
- ``node_b_per_param``: each node's VmHWM above its idle RSS, per parameter of its
  shard, against the floor of 12 (AdamW: fp32 master and two moments).

With ``--device cuda`` the worker's model lives on the GPU (built whole, then moved), and each row
also gives its GPU memory (``gpu_built_mb``: allocated once the optimizer is built;
``gpu_train_peak_mb``: the allocator's peak while training), beside local
``torch.optim.AdamW(fused=True)`` on the GPU: the memory a GPU worker saves.

**cgroup** (``--cgroup``, root): a streaming worker inside a memory cgroup (v1
``memory`` controller, or v2 where mounted) trains, for ``steps`` steps, a model
whose fp32 weights are at least ``--ratio`` times the limit, against 2 nodes
outside the cgroup; then local ``torch.optim.AdamW(fused=True)`` on the same model
under the same limit, which must be killed (the limit binds). Skips with a
message when no cgroup can be made.

    python3 benchmarks/bench_memory.py [--quick] [--width W] [--steps S] [--depths 12,24,48] [--defaults] [--bf16] [--device cuda] [--reps N]
    python3 benchmarks/bench_memory.py --cgroup [--limit-mb 512] [--ratio 4] [--width 768]

Writes benchmarks/results/bench_memory.json and .md (``--cgroup``: bench_memory_cgroup.*;
``--quick``: .quick.*).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(
    0, str(HERE.parent)
)  # the repo root: `benchmarks` as a package, also when run as a script
from benchmarks.common import md_table, write_results  # noqa: E402

MB = 1 / 2**20


def status_bytes(key: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def make_model(width: int, depth: int, meta: bool):
    """The benchmark's model: an input layer, ``depth`` residual MLP blocks and a head (seed 0)."""
    import torch

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
    with torch.device("meta") if meta else contextlib.nullcontext():
        return Net()


def child(spec: dict) -> dict:
    """One worker run (in its own process): the memory it held."""
    import torch

    import luwu

    torch.set_num_threads(1)
    floor = status_bytes("VmRSS")
    stream, local, device = (
        spec["stream"],
        spec.get("local", False),
        torch.device(spec.get("device", "cpu")),
    )
    gpu = device.type == "cuda"
    model = make_model(
        spec["width"], spec["depth"], meta=stream and not gpu
    )  # (on a GPU: built whole in host memory, then moved)
    dtype = (
        torch.bfloat16 if spec.get("bf16") else torch.float32
    )  # a bf16 model: ZeRO-Offload's layout (resident)
    model = model.to(dtype=dtype, device=device if gpu else None)
    numel = sum(p.numel() for p in model.parameters())
    weights = numel * dtype.itemsize
    if local:  # the competitor: torch's fused AdamW on the whole model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        node_bytes = []
    else:
        kw = {} if spec["compression"] else {"compression": False}
        if spec.get(
            "settings"
        ):  # --also: the same run on other settings (e.g. the setting before a change)
            from luwu.config import load_config

            kw["config"] = load_config(
                overrides=dict(kv.split("=", 1) for kv in spec["settings"].split(","))
            )
        opt = luwu.RemoteOptimizer(
            model,
            nodes=spec["nodes"],
            lr=1e-3,
            rank=0,
            world_size=1,
            stream_weights=stream,
            timeout_s=300,
            prefetch=spec.get("prefetch"),
            **kw,
        )
        node_bytes = opt.layout.node_bytes()
    built, build_peak = status_bytes("VmRSS"), status_bytes("VmHWM")
    gpu_built = torch.cuda.memory_allocated(device) if gpu else 0
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(spec["steps"]):
        x, y = (
            torch.randn(spec["batch"], 64, generator=g),
            torch.randint(0, 10, (spec["batch"],), generator=g),
        )
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(x.to(dtype=dtype, device=device)).float(), y.to(device)
        )
        loss.backward()
        opt.step()
        print(
            f"step {step} loss {loss.item():.4f} rss {status_bytes('VmRSS') * MB:.0f} MB",
            file=sys.stderr,
            flush=True,
        )
    seconds = time.perf_counter() - t0
    train_peak = status_bytes("VmHWM")
    gpu_row = (
        {
            "gpu_built_mb": gpu_built * MB,
            "gpu_train_peak_mb": torch.cuda.max_memory_allocated(device) * MB,
        }
        if gpu
        else {}
    )
    if not local:
        opt.close()
    return gpu_row | {
        "mode": "local AdamW" if local else "streaming" if stream else "resident",
        "compression": "default" if spec["compression"] else "off",
        "dtype": str(dtype).removeprefix("torch."),
        "train_b_per_param": (train_peak - floor) / numel,
        "depth": spec["depth"],
        "weights_mb": weights * MB,
        "floor_mb": floor * MB,
        "built_mb": (built - floor) * MB,
        "train_peak_mb": (train_peak - floor) * MB,
        "peak_mb": (max(train_peak, build_peak) - floor) * MB,
        "s_per_step": seconds / max(spec["steps"], 1),
        "node_params": [b // 4 for b in node_bytes],
        "settings": spec.get("settings") or "",
        "params": numel,
    }


def _child_cmd(spec: dict, cgroup_procs: str | None = None) -> list[str]:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    if cgroup_procs is None:
        return cmd
    # join the cgroup before Python starts: everything the worker maps is charged to it
    return ["sh", "-c", f'echo $$ > "{cgroup_procs}" && exec "$@"', "sh", *cmd]


def run(
    spec: dict, cgroup_procs: str | None = None, timeout_s: float = 1200
) -> tuple[dict | None, subprocess.CompletedProcess]:
    """A worker run against a fresh 2-node cluster: (its row with the nodes' bytes per parameter, or
    None when it failed; the process)."""
    import luwu

    with luwu.local_cluster(2) as c:
        idle = [status_bytes("VmRSS", p.pid) for p in c.procs]
        out = subprocess.run(
            _child_cmd(dict(spec, nodes=c.addresses), cgroup_procs),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        peaks = [status_bytes("VmHWM", p.pid) for p in c.procs]
    if out.returncode != 0:
        return None, out
    row = json.loads(out.stdout.strip().splitlines()[-1])
    per_param = [(pk - i) / n for pk, i, n in zip(peaks, idle, row.pop("node_params")) if n]
    row["node_b_per_param"] = max(per_param) if per_param else 0.0
    row["node_peak_mb"] = max(pk - i for pk, i in zip(peaks, idle)) * MB
    return row, out


def sweep(args) -> None:
    width, steps = (64, 2) if args.quick else (args.width, args.steps)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        if (
            args.device != "cpu"
        ):  # on a GPU the competitor runs too: torch's fused AdamW with the whole model on the device
            row, out = run(
                {
                    "width": width,
                    "depth": depth,
                    "stream": False,
                    "local": True,
                    "steps": steps,
                    "batch": args.batch,
                    "compression": False,
                    "device": args.device,
                }
            )
            if row is None:
                raise RuntimeError(out.stdout[-2000:] + out.stderr[-4000:])
            rows.append(row)
        for stream in (False, True):
            for compression, bf16 in [
                (c, False) for c in ((False, True) if args.defaults else (False,))
            ] + ([(args.defaults, True)] if args.bf16 and not stream else []):
                for settings in [""] + ([] if stream else args.also):
                    reps = []
                    for _ in range(
                        args.reps
                    ):  # a run's peak moves by a few MB: the median run of the repetitions
                        row, out = run(
                            {
                                "width": width,
                                "depth": depth,
                                "stream": stream,
                                "steps": steps,
                                "batch": args.batch,
                                "compression": compression,
                                "bf16": bf16,
                                "settings": settings,
                                "device": args.device,
                            }
                        )
                        if row is None:
                            raise RuntimeError(out.stdout[-2000:] + out.stderr[-4000:])
                        reps.append(row)
                    row = sorted(reps, key=lambda r: r["train_peak_mb"])[len(reps) // 2]
                    row["train_peak_mb_runs"] = [round(r["train_peak_mb"], 1) for r in reps]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    growth = {}
    for comp in {r["compression"] for r in rows}:
        srows = [r for r in rows if r["mode"] == "streaming" and r["compression"] == comp]
        growth[comp] = [
            b["train_peak_mb"] / a["train_peak_mb"]
            for a, b in zip(srows, srows[1:])
            if a["train_peak_mb"] > 0
        ]
    result = {
        "width": width,
        "steps": steps,
        "batch": args.batch,
        "rows": rows,
        "streaming_train_peak_growth_per_doubling": growth,
    }
    cols = [
        "mode",
        "dtype",
        "compression",
        *(["settings"] if args.also else []),
        "depth",
        "train_b_per_param",
        "weights_mb",
        "built_mb",
        "train_peak_mb",
        *(["train_peak_mb_runs"] if args.reps > 1 else []),
        "peak_mb",
        *(["gpu_built_mb", "gpu_train_peak_mb"] if args.device != "cpu" else []),
        "node_b_per_param",
        "floor_mb",
    ]
    md = (
        f"# Memory: streaming vs resident (worker MB above the runtime floor; node bytes per parameter of its shard)\n\n"
        f"`{' '.join(['python3', 'benchmarks/bench_memory.py', *sys.argv[1:]])}`: blocks of width {width}, {steps} steps, 1 worker, 2 nodes.\n\n"
        + md_table(rows, cols)
    )
    for comp, g in sorted((c, g) for c, g in growth.items() if g):  # (one depth: no growth to show)
        md += (
            f"\n\nStreaming train peak growth per doubling of depth, compression {comp}: "
            + ", ".join(f"{x:.2f}x" for x in g)
            + " (target <= 1.10x)"
        )
    marginal = []  # what one more parameter costs: the train peak's growth from the shallowest to the deepest model
    for key in dict.fromkeys(
        (r["mode"], r["dtype"], r["compression"], r["settings"]) for r in rows
    ):
        same = [r for r in rows if (r["mode"], r["dtype"], r["compression"], r["settings"]) == key]
        if len(same) > 1 and same[-1]["params"] > same[0]["params"]:
            grow = (
                (same[-1]["train_peak_mb"] - same[0]["train_peak_mb"])
                / MB
                / (same[-1]["params"] - same[0]["params"])
            )
            marginal.append(
                dict(
                    zip(("mode", "dtype", "compression", "settings"), key),
                    depths=f"{same[0]['depth']} -> {same[-1]['depth']}",
                    marginal_b_per_param=grow,
                )
            )
    result["marginal"] = marginal
    if marginal:
        md += (
            "\n\nBytes per parameter at the margin (the worker's train peak growth from the shallowest to the deepest model, per "
            "parameter added: what the runtime's constant part, ~78 MB for RemoteOptimizer on any model, does not blur):\n\n"
            + md_table(
                marginal,
                [
                    "mode",
                    "dtype",
                    "compression",
                    *(["settings"] if args.also else []),
                    "depths",
                    "marginal_b_per_param",
                ],
            )
        )
    md += "\n\nnode_b_per_param: a node's VmHWM above its idle RSS per parameter of its shard (floor: 12, fp32 master + AdamW's two moments).\n"
    write_results(args.name, result, md, quick=args.quick)


# ----------------------------------------------------------------- a worker under a cgroup memory limit
@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh memory cgroup limited to ``limit_bytes`` (no swap): yields ``(cgroup.procs path, read)``,
    ``read()`` giving its peak usage, limit hits and OOM kills so far, and removes it afterwards; yields
    ``(None, why)`` when none can be made (not root, no memory controller)."""
    name = f"luwu-bench-{os.getpid()}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        path, files = (
            v1 / name,
            {
                "limit": "memory.limit_in_bytes",
                "swap": "memory.memsw.limit_in_bytes",
                "peak": "memory.max_usage_in_bytes",
            },
        )
    elif "memory" in (
        (v2 / "cgroup.controllers").read_text().split()
        if (v2 / "cgroup.controllers").exists()
        else []
    ):
        path, files = (
            v2 / name,
            {"limit": "memory.max", "swap": "memory.swap.max", "peak": "memory.peak"},
        )
    else:
        yield (
            None,
            "no cgroup memory controller (v1 /sys/fs/cgroup/memory or v2 with memory) is mounted",
        )
        return
    try:
        path.mkdir()
        (path / files["limit"]).write_text(str(limit_bytes))
        if (path / files["swap"]).exists():
            (path / files["swap"]).write_text(
                "0" if files["swap"] == "memory.swap.max" else str(limit_bytes)
            )
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        yield None, f"cannot make a memory cgroup at {path}: {exc} (root is needed)"
        return

    def read() -> dict:
        out = {
            "peak_mb": int((path / files["peak"]).read_text()) * MB
            if (path / files["peak"]).exists()
            else None
        }
        if (path / "memory.failcnt").exists():
            out["limit_hits"] = int((path / "memory.failcnt").read_text())
        events = path / (
            "memory.oom_control" if files["limit"] == "memory.limit_in_bytes" else "memory.events"
        )
        for line in events.read_text().splitlines() if events.exists() else []:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                out["oom_kills"] = int(value)
        return out

    try:
        yield str(path / "cgroup.procs"), read
    finally:
        for _ in range(50):  # the worker has exited; the cgroup empties a moment later
            with contextlib.suppress(OSError):
                path.rmdir()
                break
            time.sleep(0.1)


def block_params(width: int) -> int:
    return 8 * width * width + 7 * width


def cgroup_study(args) -> None:
    limit = args.limit_mb * 2**20
    root = 65 * args.width + 11 * args.width + 10
    depth = -(-(int(args.ratio * limit) // 4 - root) // block_params(args.width))
    rows, skipped = [], None
    with memory_cgroup(limit) as (procs, read):
        if procs is None:
            skipped = read
            print(f"SKIPPED: {skipped}", flush=True)
        else:
            base = {
                "width": args.width,
                "depth": depth,
                "steps": args.steps,
                "batch": args.batch,
                "prefetch": 1,
            }
            for compression in (False, True):
                before = read()
                row, out = run(dict(base, stream=True, compression=compression), procs)
                after = read()
                rows.append(
                    {
                        **(
                            row
                            or {
                                "mode": "streaming",
                                "compression": "default" if compression else "off",
                                "depth": depth,
                            }
                        ),
                        "trained": row is not None,
                        "exit": out.returncode,
                        "limit_mb": args.limit_mb,
                        "cgroup_peak_mb": after.get("peak_mb"),
                        "oom_kills": after.get("oom_kills", 0) - before.get("oom_kills", 0),
                        "log": (out.stderr or "")[-300:],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            before = read()
            t0 = time.perf_counter()
            out = subprocess.run(
                _child_cmd(dict(base, stream=False, compression=False, local=True), procs),
                capture_output=True,
                text=True,
                timeout=1200,
            )
            after = read()
            killed = out.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
            rows.append(
                {
                    "mode": "local AdamW",
                    "compression": "-",
                    "depth": depth,
                    "trained": out.returncode == 0,
                    "exit": out.returncode,
                    "killed": killed,
                    "limit_mb": args.limit_mb,
                    "cgroup_peak_mb": after.get("peak_mb"),
                    "oom_kills": after.get("oom_kills", 0) - before.get("oom_kills", 0),
                    "seconds": time.perf_counter() - t0,
                    "log": (out.stderr or "")[-300:],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    weights_mb = (root + depth * block_params(args.width)) * 4 * MB
    result = {
        "limit_mb": args.limit_mb,
        "ratio": args.ratio,
        "width": args.width,
        "depth": depth,
        "weights_mb": weights_mb,
        "rows": rows,
        "skipped": skipped,
    }
    md = f"# A worker inside a {args.limit_mb} MiB memory cgroup trains a model of {weights_mb:.0f} MiB fp32 weights ({weights_mb / args.limit_mb:.1f}x the limit)\n\n"
    if skipped:
        md += f"Skipped: {skipped}\n"
    else:
        cols = [
            "mode",
            "compression",
            "trained",
            "exit",
            "cgroup_peak_mb",
            "oom_kills",
            "train_peak_mb",
            "s_per_step",
            "node_b_per_param",
        ]
        md += md_table([{c: r.get(c, "") for c in cols} for r in rows], cols)
        md += (
            f"\n\nStreaming workers (2 nodes outside the cgroup, prefetch 1, batch {args.batch}, {args.steps} steps, the model built on the meta device); "
            "local `torch.optim.AdamW(fused=True)` builds the same model eagerly under the same limit. cgroup_peak_mb: the cgroup's peak usage "
            "(page cache included); train_peak_mb: the worker's VmHWM while training, above its runtime floor.\n"
        )
    write_results("bench_memory_cgroup", result, md, quick=args.quick)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 steps: a smoke run")
    ap.add_argument("--width", type=int, default=None, help="block width (sweep: 256, cgroup: 768)")
    ap.add_argument(
        "--steps",
        type=int,
        default=12,
        help="training steps (default 12: past the 10-step bf16 warm-up, so the defaults run their int8 codecs)",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depths", default="12,24,48")
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="sweep: also the default compression (int8 pushes and fetches after the warm-up)",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="sweep: also a resident bf16 model (bf16 weights and gradients on the worker)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=1,
        help="sweep: runs of each configuration; each row is the run with the median train peak",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="sweep: where the worker's model lives ('cuda': adds its GPU memory and local fused AdamW on the GPU)",
    )
    ap.add_argument(
        "--cgroup", action="store_true", help="the cgroup study instead of the depth sweep (root)"
    )
    ap.add_argument("--limit-mb", type=int, default=512)
    ap.add_argument(
        "--ratio", type=float, default=4.0, help="cgroup: the model's fp32 weights over the limit"
    )
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE[,...]",
        help="sweep: run every resident row again on these settings (e.g. optimizer.grads_in_buckets=false: before the change)",
    )
    ap.add_argument(
        "--name", default="bench_memory", help="sweep: results file stem under benchmarks/results/"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.cgroup:
        args.width = args.width or (256 if args.quick else 768)
        cgroup_study(args)
    else:
        args.width = args.width or 256
        sweep(args)


if __name__ == "__main__":
    main()

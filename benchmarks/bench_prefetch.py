"""Prefetcher throughput: a ~20 ms/batch loader feeding a ~30 ms training step.

The loader does decode-like work per sample in DataLoader worker processes:
each sklearn digits image is "decoded" (bicubic upsampling to a decode
resolution), augmented with a random affine warp (rotation, scale, shift),
noise and a blur, and resized to 32x32. The step is a small CNN's forward,
backward and SGD update, torch on 1 thread in the main process. Both are
calibrated at start-up (decode resolution, CNN width) to hit the targets on
this machine. Measured side by side, repetitions interleaved, medians:

- preloaded: all batches in memory before timing (the bound: no data cost);
- plain:     ``for batch in DataLoader(...)``;
- prefetch:  ``for batch in Prefetcher(DataLoader(...))``;

for num_workers 1 and 2 (and 0: decoding in the main process, where only the
Prefetcher's thread can overlap it with the step). Throughput is samples/s over
the timed steps, after a warm-up that lets the pipelines fill (worker start-up
is not timed). Stall fraction = share of the timed wall time spent inside
next(); for prefetch rows the Prefetcher's own gauge is reported too.

The machine is shared with other jobs, and the loader pipelines need most of its
2 cores where the preloaded bound needs 1: CPU taken by other jobs slows
the pipelines and not the bound. Each run records that CPU (from /proc); after
--reps repetitions, more run (each waiting for a quiet machine, up to
--max-minutes) until every configuration has --quiet-min quiet runs, and the
table reports medians over all runs and over the quiet ones.

    python3 benchmarks/bench_prefetch.py [--quick] [--reps R] [--steps N] [--max-minutes M]

Writes benchmarks/results/bench_prefetch.json and .md (``--quick``:
bench_prefetch.quick.*).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Dataset

from luwu.gpu_workers.prefetch import Prefetcher

RESULTS = Path(__file__).resolve().parent / "results"
IMAGE = 32
BLUR = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
BLUR = (BLUR[:, None] * BLUR[None]).div_(256)[None, None]


class AugmentedDigits(Dataset):
    """Digits images decoded and augmented per sample, deterministically per index."""

    def __init__(self, length: int, decode_res: int):
        digits = load_digits()
        self.images = torch.tensor(digits.images, dtype=torch.float32).div_(16)[:, None]
        self.labels = torch.tensor(digits.target, dtype=torch.int64)
        self.length = length
        self.decode_res = decode_res

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        i = index % len(self.images)
        res = self.decode_res
        x = F.interpolate(
            self.images[i : i + 1], size=(res, res), mode="bicubic", align_corners=False
        )
        angle = (torch.rand(1, generator=g) - 0.5) * (math.pi / 6)
        scale = 0.9 + 0.2 * torch.rand(1, generator=g)
        shift = (torch.rand(2, generator=g) - 0.5) * 0.2
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack([torch.cat([cos, -sin, shift[:1]]), torch.cat([sin, cos, shift[1:]])])[
            None
        ]
        x = F.grid_sample(
            x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False
        )
        x = x + 0.05 * torch.randn(x.shape, generator=g)
        x = F.conv2d(x, BLUR, padding=2)
        x = F.interpolate(x, size=(IMAGE, IMAGE), mode="area")
        return (x[0] - 0.3) / 0.3, self.labels[i]


def make_model(width: int) -> nn.Module:
    w = width
    return nn.Sequential(
        nn.Conv2d(1, w, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, 10),
    )


class Trainer:
    """One real training step: forward, backward, SGD update (no .item(): no host sync per step)."""

    def __init__(self, width: int):
        torch.manual_seed(0)
        self.model = make_model(width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def best_ms(fn, reps: int) -> float:
    """The fastest of ``reps`` timings: on a shared machine, the closest to the uncontended cost."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def closest(candidates, measure, target_ms: float) -> tuple[int, float]:
    """The candidate whose measured time is closest to the target (times grow with the candidate)."""
    best = None
    for c in candidates:
        ms = measure(c)
        if best is None or abs(ms - target_ms) < abs(best[1] - target_ms):
            best = (c, ms)
        if ms > target_ms:
            break
    assert best is not None
    return best


def calibrate(
    batch_size: int,
    loader_ms: float,
    step_ms: float,
    reps: int,
    decode_res: int | None,
    width: int | None,
) -> dict:
    """Decode resolution and CNN width closest to the target times (or the fixed ones), with their times."""

    def decode_ms(res: int) -> float:
        ds = AugmentedDigits(batch_size, res)
        return best_ms(lambda: [ds[i] for i in range(batch_size)], reps)

    def train_ms(width: int) -> float:
        trainer = Trainer(width)
        ds = AugmentedDigits(batch_size, 32)
        batch = next(iter(DataLoader(ds, batch_size=batch_size)))
        return best_ms(lambda: trainer.step(batch), reps)

    resolutions = (
        [decode_res] if decode_res else [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192]
    )
    widths = [width] if width else [4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64]
    res, measured_loader = closest(resolutions, decode_ms, loader_ms)
    width, measured_step = closest(widths, train_ms, step_ms)
    return {
        "decode_res": res,
        "loader_ms": measured_loader,
        "width": width,
        "step_ms": measured_step,
    }


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _pipeline_cpu_s() -> dict[int, float]:
    """CPU seconds used so far by this process and by each of its children (DataLoader workers)."""
    out = {}
    for pid in [os.getpid()] + [c.pid for c in multiprocessing.active_children()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    return out


def _cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between two snapshots by the processes alive at the second (workers come and go)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (steal included: the host took them)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK  # minus idle and iowait


def wait_for_quiet(quiet_cores: float, deadline: float) -> bool:
    """Wait (idle, not adding load) until other jobs use less than ``quiet_cores``; False at the deadline."""
    while time.monotonic() < deadline:
        busy0, t0 = _machine_busy_s(), time.monotonic()
        time.sleep(2.0)
        if (_machine_busy_s() - busy0) / (time.monotonic() - t0) < quiet_cores:
            return True
        time.sleep(10.0)
    return False


def timed_run(source, trainer: Trainer, warmup: int, steps: int, batch_size: int) -> dict:
    """Samples/s and stall fraction over ``steps`` steps after ``warmup`` steps.

    ``other_cores``: CPU the rest of the machine used meanwhile (other jobs on this
    shared machine), from /proc: what the loader pipelines, which need most of the
    2 cores, compete with.
    """
    it = iter(source)
    wait, step_s = 0.0, []
    for i in range(warmup + steps):
        t_call = time.perf_counter()
        if i == warmup:
            t0, wait = t_call, 0.0
            ours0, busy0 = _pipeline_cpu_s(), _machine_busy_s()
        batch = next(it)
        t_got = time.perf_counter()
        wait += t_got - t_call
        trainer.step(batch)
        if i >= warmup:
            step_s.append(time.perf_counter() - t_got)
    elapsed = time.perf_counter() - t0
    ours, busy = _cpu_delta(ours0, _pipeline_cpu_s()), _machine_busy_s() - busy0
    del it
    return {
        "samples_per_s": batch_size * steps / elapsed,
        "stall_fraction": wait / elapsed,
        "wait_ms_per_step": wait / steps * 1e3,
        "step_ms": statistics.median(step_s) * 1e3,
        "pipeline_cores": ours / elapsed,
        "other_cores": max(0.0, busy - ours) / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps, 1 repetition: a smoke run")
    ap.add_argument(
        "--reps", type=int, default=7, help="repetitions of every configuration (interleaved)"
    )
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per run (pipelines fill)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--depth", type=int, default=2, help="Prefetcher depth")
    ap.add_argument(
        "--loader-ms", type=float, default=20.0, help="target loader CPU time per batch"
    )
    ap.add_argument("--step-ms", type=float, default=30.0, help="target training step time")
    ap.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader num_workers to try"
    )
    ap.add_argument(
        "--decode-res", type=int, help="fix the loader's decode resolution instead of calibrating"
    )
    ap.add_argument("--width", type=int, help="fix the CNN width instead of calibrating")
    ap.add_argument(
        "--quiet-cores",
        type=float,
        default=0.25,
        help="other jobs' CPU below which a run counts as quiet",
    )
    ap.add_argument("--quiet-min", type=int, default=3, help="quiet runs wanted per configuration")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=8.0,
        help="cap on extra repetitions (which wait for quiet)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup, args.quiet_min = 1, 12, 3, 0
    torch.set_num_threads(1)

    if not args.quick:  # calibrating on a busy machine would pick too little work
        wait_for_quiet(args.quiet_cores, time.monotonic() + 60 * args.max_minutes)
    reps = 3 if args.quick else 7
    cal = calibrate(
        args.batch_size, args.loader_ms, args.step_ms, reps, args.decode_res, args.width
    )
    print(
        f"calibrated: decode at {cal['decode_res']}px -> {cal['loader_ms']:.1f} ms/batch of {args.batch_size}; "
        f"CNN width {cal['width']} -> {cal['step_ms']:.1f} ms/step",
        file=sys.stderr,
    )
    n_batches = args.warmup + args.steps
    # Longer than a run reads: a DataLoader that reaches its end stops its workers,
    # and their CPU would go missing from pipeline_cores (prefetch rows read ahead).
    dataset = AugmentedDigits((n_batches + 2 * args.depth + 4) * args.batch_size, cal["decode_res"])
    preloaded = [
        batch for _, batch in zip(range(n_batches), DataLoader(dataset, batch_size=args.batch_size))
    ]
    trainer = Trainer(cal["width"])

    def loader(nw: int) -> DataLoader:
        return DataLoader(dataset, batch_size=args.batch_size, num_workers=nw)

    configs: dict[str, tuple] = {"preloaded": ("preloaded", None)}
    for nw in args.workers:
        configs[f"plain nw={nw}"] = ("plain", nw)
        configs[f"prefetch nw={nw}"] = ("prefetch", nw)
    runs: dict[str, list[dict]] = {name: [] for name in configs}

    def quiet_short() -> bool:
        return any(
            sum(r["other_cores"] < args.quiet_cores for r in rs) < args.quiet_min
            for rs in runs.values()
        )

    order = list(configs)
    deadline = time.monotonic() + 60 * args.max_minutes
    rep = 0
    # The machine is shared: past --reps, repeat (up to --max-minutes) until every
    # configuration has --quiet-min runs without other jobs competing for the cores.
    while rep < args.reps or (quiet_short() and time.monotonic() < deadline):
        if rep >= args.reps and not wait_for_quiet(args.quiet_cores, deadline):
            break
        random.Random(rep).shuffle(order)  # no configuration always runs right after another
        for name in order:
            kind, nw = configs[name]
            if kind == "preloaded":
                r = timed_run(preloaded, trainer, args.warmup, args.steps, args.batch_size)
            elif kind == "plain":
                r = timed_run(loader(nw), trainer, args.warmup, args.steps, args.batch_size)
            else:
                pf = Prefetcher(loader(nw), depth=args.depth, registry=CollectorRegistry())
                r = timed_run(pf, trainer, args.warmup, args.steps, args.batch_size)
                r["gauge_stall_fraction"] = pf.registry.get_sample_value(
                    "luwu_prefetch_stall_fraction", {"loader": "train"}
                )
                pf.close()
            runs[name].append(r)
            print(
                f"rep {rep} {name}: {r['samples_per_s']:.0f} samples/s, stall {r['stall_fraction']:.3f}, "
                f"step {r['step_ms']:.1f} ms, other jobs {r['other_cores']:.2f} cores",
                file=sys.stderr,
            )
        rep += 1

    rows = summarize(runs, args.quiet_cores)
    result = {
        "benchmark": "bench_prefetch",
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "settings": {
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "reps": args.reps,
            "depth": args.depth,
            "torch_threads_main": 1,
            "target_loader_ms": args.loader_ms,
            "target_step_ms": args.step_ms,
            "quiet_cores": args.quiet_cores,
            "repetitions_run": rep,
        },
        "calibration": {k: round(v, 2) if isinstance(v, float) else v for k, v in cal.items()},
        "target": "prefetch vs_preloaded >= 0.95",
        "rows": rows,
        "runs": runs,
    }
    md = render(result)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (
        "bench_prefetch.quick" if args.quick else "bench_prefetch"
    )  # a smoke run keeps the real results
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(md + "\n")
    return 0


def summarize(runs: dict[str, list[dict]], quiet_cores: float) -> list[dict]:
    """Medians per configuration, over all runs and over the runs on a quiet machine."""

    def med(rs: list[dict], key: str) -> float | None:
        return statistics.median(r[key] for r in rs) if rs else None

    def quiet(rs: list[dict]) -> list[dict]:
        return [r for r in rs if r["other_cores"] < quiet_cores]

    bound, bound_quiet = (
        med(runs["preloaded"], "samples_per_s"),
        med(quiet(runs["preloaded"]), "samples_per_s"),
    )
    rows = []
    for name, rs in runs.items():
        sps, sps_quiet = med(rs, "samples_per_s"), med(quiet(rs), "samples_per_s")
        row = {
            "config": name,
            "samples_per_s": round(sps, 1),
            "vs_preloaded": round(sps / bound, 3),
            "vs_preloaded_paired": round(
                statistics.median(
                    r["samples_per_s"] / p["samples_per_s"] for r, p in zip(rs, runs["preloaded"])
                ),
                3,
            ),
            "stall_fraction": round(med(rs, "stall_fraction"), 3),
            "wait_ms_per_step": round(med(rs, "wait_ms_per_step"), 2),
            "step_ms": round(med(rs, "step_ms"), 1),
            "pipeline_cores": round(med(rs, "pipeline_cores"), 2),
            "other_cores": round(med(rs, "other_cores"), 2),
            "quiet_runs": len(quiet(rs)),
            "quiet_samples_per_s": None if sps_quiet is None else round(sps_quiet, 1),
            "quiet_vs_preloaded": None
            if None in (sps_quiet, bound_quiet)
            else round(sps_quiet / bound_quiet, 3),
            "quiet_stall_fraction": None
            if not quiet(rs)
            else round(med(quiet(rs), "stall_fraction"), 3),
        }
        if "gauge_stall_fraction" in rs[0]:
            row["gauge_stall_fraction"] = round(med(rs, "gauge_stall_fraction"), 3)
        if name.startswith("prefetch"):
            row["vs_plain"] = round(
                sps / med(runs[name.replace("prefetch", "plain")], "samples_per_s"), 3
            )
        rows.append(row)
    return rows


def render(result: dict) -> str:
    s, cal = result["settings"], result["calibration"]
    cols = [
        "config",
        "samples_per_s",
        "vs_preloaded",
        "vs_preloaded_paired",
        "vs_plain",
        "stall_fraction",
        "gauge_stall_fraction",
        "step_ms",
        "pipeline_cores",
        "other_cores",
        "quiet_runs",
        "quiet_vs_preloaded",
        "quiet_stall_fraction",
    ]
    lines = [
        f"# bench_prefetch: {result['machine']['cpus']} CPUs, medians of {s['repetitions_run']} interleaved repetitions"
        + (" (quick)" if result["quick"] else ""),
        "",
        f"Loader: {cal['loader_ms']} ms of CPU per batch of {s['batch_size']} digits images (decode at "
        f"{cal['decode_res']}px, random affine, noise, blur) in DataLoader workers; step: CNN width "
        f"{cal['width']}, {cal['step_ms']} ms forward+backward+SGD, torch 1 thread. {s['steps']} timed steps "
        f"after {s['warmup']} warm-up steps; Prefetcher depth {s['depth']}; configurations in a shuffled order "
        "each repetition.",
        "",
        "stall_fraction: share of the timed wall time spent in next(); gauge_stall_fraction: the Prefetcher's "
        "own metric (wait inside next() / step time, whole pass). vs_preloaded: ratio of medians; "
        "vs_preloaded_paired: median over repetitions of the ratio to that repetition's preloaded run. "
        "step_ms: median compute time of one step. pipeline_cores / other_cores: CPU used by this benchmark "
        "(main process + loader workers) / by the rest of the machine (other jobs), from /proc. The loader "
        "pipelines need most of the 2 cores, the preloaded bound 1, so other jobs slow them and not the "
        f"bound: quiet_* are the medians over the runs "
        f"with other_cores < {s['quiet_cores']}.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in result["rows"]:
        lines.append(
            "| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in cols) + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

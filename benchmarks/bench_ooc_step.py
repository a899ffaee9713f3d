"""The node's step out of core: against the disk's floor, and against the in-RAM node (issue 34).

``bench_ooc`` streams state through a bare :class:`StateWindow`; this one times what a job sees: a
real node process (``luwu node``) stepping a shard through its ``OocShard``. One worker in this
process (``RemoteOptimizer``, resident mode, compression off, AdamW, 1 torch thread) trains a model
of ``--bucket-params``-sized flat parameters (``--state-mib`` of AdamW state at 12 B/param, one
bucket each) whose gradients are a fixed vector (backward is one multiply a parameter), against three
nodes, all alive at once, stepped round-robin (``--steps`` steps each, ``--reps`` times; these
machines are shared, so a burst of load hits all three alike):

- **in RAM**: a node without ``node.state_dir`` (today's node);
- **fits**: ``node.state_dir`` with ``node.state_memory_bytes`` of twice the state: the state fits,
  so the node keeps it in RAM and writes no files. Target: its step at least **0.97x** the in-RAM
  node's;
- **out of core**: ``node.state_memory_bytes`` a quarter of the state (its default split: a quarter
  of that for the pushes in flight, the rest the window). Target: the state bytes it moves (read +
  written, its own ``/metrics``) per second of the worker's step at least **0.8x** the disk's mixed
  floor, measured in the same repetitions: ``bench_ooc.DiskFloor``, plain threads with ``O_DIRECT``
  on the same file system, the engine's request size and depth.

**The ceiling this harness can show.** The worker's step against the in-RAM node bounds what any
node can show here: an out-of-core node as fast as the in-RAM one moves its state bytes a step in
one in-RAM step, ``state bytes a step / in-RAM step`` (the *ceiling*), which on a disk faster than
the node's path is below the issue's floor. So, from the same repetitions (paired), beside the
issue's ratio (reported unchanged, named as the issue's): the out-of-core rate against **min(disk
floor, ceiling)** (target 0.8, the issue's on a disk slower than the node's path), and its
reciprocal, the out-of-core step against **max(in-RAM step, the disk's time for the state a step)**
(the step the slower of disk and node path allows; 1/0.8 = 1.25 at most). The ceiling against the
floor says how much of the issue's target this machine can show at all.

A step is the worker's ``zero_grad``, backward and ``step()`` (pushes out, the updated weights back),
timed on the worker; the node's own optimizer seconds (``luwu_node_optimizer_step_seconds``, a
bucket's step with its reply encode and, out of core, the wait for its state) are reported beside.
Both sides use ``O_DIRECT`` (the page cache flatters neither).

**A disk slower than the node's path.** ``--disk-mb-s N`` holds this process and its nodes to N MB/s
of reads and N of writes on the disk (a blkio cgroup, ``throttled_disk``), floor included: the case
the issue's target is about, where the disk and not the node's CPU bounds the step (a node whose cores
outrun its SSDs; on a 2-core VM over a fast virtual disk the CPU binds first).

    .venv/bin/python benchmarks/bench_ooc_step.py [--quick] [--state-mib 1024] [--steps 3] [--reps 3] [--dir DIR]
        [--disk-mb-s N --name bench_ooc_step_throttled]

``--dir`` defaults to a new folder under /var/tmp or /tmp on a disk, removed at the end. Writes
benchmarks/results/bench_ooc_step.json and .md (``--quick``: .quick.*, 192 MiB of state). The
default takes about 5 minutes on a 2-core VM.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import torch
from bench_ooc import MIB, DiskFloor, pick_dir, throttled_disk
from common import (
    LoadMonitor,
    machine_info,
    md_table,
    median,
    paired_ratio,
    proc_usage,
    verdict,
    write_results,
)

import luwu
from luwu.switch_nodes.ooc.io import DEFAULT_NUM_THREADS, DEFAULT_REQUEST_BYTES

FITS_TARGET, FLOOR_TARGET = 0.97, 0.8
BOUND_STEP_TARGET = 1 / FLOOR_TARGET  # (the out-of-core step against the slower bound, at most)
KINDS = ("in RAM", "fits", "out of core")
METRICS = (
    "luwu_node_state_bytes_read_total",
    "luwu_node_state_bytes_written_total",
    "luwu_node_state_io_wait_seconds_total",
    "luwu_node_optimizer_step_seconds_sum",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in out:
            out[name] = float(value)
    return out


def minor_faults(pid: int) -> int:
    """A process's minor page faults so far (each a fresh page touched: memory not reused)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[7])


class Job:
    """One node (of ``kind``) and this process's worker training against it."""

    def __init__(self, kind: str, args, folder: Path, stack: contextlib.ExitStack):
        state = args.num_params * 12
        node_args = ["--metrics.port", str(free_port())]
        if kind != "in RAM":
            smb = 2 * state if kind == "fits" else state // 4
            node_args += ["--node.state_dir", str(folder / kind.replace(" ", "_"))]
            node_args += ["--node.state_memory_bytes", str(smb)]
        self.kind = kind
        self.cluster = stack.enter_context(luwu.local_cluster(1, node_args=node_args))
        self.url = self.cluster.metrics_urls[0]
        n = args.num_params // args.bucket_params
        self.model = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(args.bucket_params)) for _ in range(n)
        )
        g = torch.Generator().manual_seed(0)
        self.coef = [torch.randn(args.bucket_params, generator=g) for _ in range(n)]
        self.opt = luwu.RemoteOptimizer(
            self.model,
            "adamw",
            nodes=self.cluster.addresses,
            lr=1e-3,
            weight_decay=0.01,
            compression=False,
            bucket_bytes=4 * args.bucket_params,
            rank=0,
            world_size=1,
            timeout_s=args.timeout,
            layer_waits=False,  # (no forward: the gradients are set by one multiply)
        )
        stack.callback(self.opt.close)
        self.steps: list[float] = []
        self.node: list[dict[str, float]] = []
        self.faults: list[float] = []  # the node process's minor page faults a step
        self.cpu: list[float] = []  # the node process's CPU seconds a step (user + system)

    def step(self) -> None:
        self.opt.zero_grad()
        sum((p * c).sum() for p, c in zip(self.model, self.coef)).backward()
        self.opt.step()

    def run(self, steps: int) -> None:
        """``steps`` steps, timed; the node's counters over them (per step)."""
        pid = self.cluster.procs[0].pid
        before, faults, cpu = scrape(self.url), minor_faults(pid), proc_usage(pid)[0]
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.steps.append((time.perf_counter() - t0) / steps)
        after = scrape(self.url)
        self.faults.append((minor_faults(pid) - faults) / steps)
        self.cpu.append((proc_usage(pid)[0] - cpu) / steps)
        self.node.append({k: (after[k] - before[k]) / steps for k in METRICS})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk (state and floor)")
    ap.add_argument("--state-mib", type=int, default=1024, help="AdamW state, 12 B/param")
    ap.add_argument("--bucket-params", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=3, help="steps a repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--file-mib", type=int, default=512, help="size of the floor's test file")
    ap.add_argument("--timeout", type=float, default=300, help="the worker's timeout_s")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 192 MiB of state")
    ap.add_argument(
        "--disk-mb-s",
        type=float,
        default=None,
        help="hold reads and writes to this many MB/s each (a blkio cgroup): a disk slower than "
        "the node's path, where the disk bounds the step",
    )
    ap.add_argument("--name", default="bench_ooc_step", help="the results' file name")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    if args.quick:
        args.state_mib, args.bucket_params, args.file_mib, args.reps = 192, 1 << 18, 128, 2
    args.num_params = args.state_mib * MIB // 12 // args.bucket_params * args.bucket_params
    torch.set_num_threads(1)
    own_dir = args.dir is None
    folder = pick_dir() if own_dir else args.dir
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            if args.disk_mb_s:
                args.throttle = stack.enter_context(throttled_disk(folder, args.disk_mb_s))
            result, md = run(args, folder)
    finally:
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)
    write_results(args.name, result, md, quick=args.quick, out=args.out)


def run(args, folder: Path) -> tuple[dict, str]:
    bs, qd = DEFAULT_REQUEST_BYTES, DEFAULT_NUM_THREADS
    floor = DiskFloor(folder / "floor.bin", args.file_mib * MIB, bs, qd)
    mixed: list[float] = []
    with contextlib.ExitStack() as stack, LoadMonitor() as load:
        stack.callback(floor.close)
        jobs = [Job(k, args, folder, stack) for k in KINDS]
        for job in jobs:  # the seed and a first step (the files are written once): untimed
            job.step()
        floor.run("mixed")
        for _ in range(args.reps):
            for job in jobs:
                job.run(args.steps)
            t0 = time.perf_counter()
            floor.run("mixed")
            mixed.append(floor.nbytes / (time.perf_counter() - t0) / 1e6)
    return report(args, jobs, mixed, load)


def report(args, jobs: list[Job], mixed: list[float], load) -> tuple[dict, str]:
    by = {j.kind: j for j in jobs}
    ram, fits, ooc = by["in RAM"], by["fits"], by["out of core"]
    moved = [
        (n["luwu_node_state_bytes_read_total"] + n["luwu_node_state_bytes_written_total"]) / 1e6 / s
        for n, s in zip(ooc.node, ooc.steps)
    ]
    floor_ratio = paired_ratio(moved, mixed)  # the ratio
    # the ceiling: the state bytes the out-of-core node moves a step, in one in-RAM step (MB/s)
    ceiling = [
        (n["luwu_node_state_bytes_read_total"] + n["luwu_node_state_bytes_written_total"]) / 1e6 / r
        for n, r in zip(ooc.node, ram.steps)
    ]
    bound = [min(f, c) for f, c in zip(mixed, ceiling)]
    bound_ratio = paired_ratio(moved, bound)
    # the out-of-core step against the slower of the in-RAM step and the disk's time for the state
    disk_s = [c * r / f for c, r, f in zip(ceiling, ram.steps, mixed)]
    slower = [max(r, d) for r, d in zip(ram.steps, disk_s)]
    bound_step = paired_ratio(ooc.steps, slower)
    ceiling_ratio = paired_ratio(ceiling, mixed)
    fits_ratio = paired_ratio(ram.steps, fits.steps)
    node_s = {j.kind: [n["luwu_node_optimizer_step_seconds_sum"] for n in j.node] for j in jobs}
    fits_node_ratio = paired_ratio(node_s["in RAM"], node_s["fits"])
    rows = []
    for j in jobs:
        n = {k: median([x[k] for x in j.node]) for k in METRICS}
        rows.append(
            {
                "node": j.kind,
                "step_s": median(j.steps),
                "node_optimizer_s": n["luwu_node_optimizer_step_seconds_sum"],
                "state_read_mib": n["luwu_node_state_bytes_read_total"] / MIB,
                "state_written_mib": n["luwu_node_state_bytes_written_total"] / MIB,
                "io_wait_s": n["luwu_node_state_io_wait_seconds_total"],
                "node_page_faults_k": median(j.faults) / 1e3,
                "node_cpu_s": median(j.cpu),
            }
        )
    state_mib = args.num_params * 12 / MIB
    result = {
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "state_mib": state_mib,
        "rows": rows,
        "disk_mixed_mb_s": mixed,
        "ooc_moved_mb_s": moved,
        "floor_ratio": floor_ratio,
        "ceiling_mb_s": ceiling,
        "ceiling_ratio": ceiling_ratio,
        "bound_ratio": bound_ratio,
        "disk_s": disk_s,
        "bound_step_ratio": bound_step,
        "fits_ratio": fits_ratio,
        "fits_node_ratio": fits_node_ratio,
        "steps": {j.kind: j.steps for j in jobs},
        "load": load.info(),
    }
    md = "\n".join(
        [
            "# The node's step out of core (bench_ooc_step)",
            "",
            f"{args.num_params / 1e6:.1f}M parameters ({state_mib:.0f} MiB of AdamW state) in buckets of "
            f"{args.bucket_params} params, one worker (resident, compression off), one node of each kind, "
            f"stepped round-robin: {args.steps} steps a repetition, medians of {args.reps}. Out of core: "
            f"node.state_memory_bytes = {state_mib / 4:.0f} MiB (a quarter of the state).",
            "",
            *(
                [
                    f"The disk throttled to {args.disk_mb_s:.0f} MB/s of reads and as much of "
                    f"writes (a blkio cgroup holding this process and its nodes, disk "
                    f"{args.throttle['disk']}): a disk slower than the node's path, as on a node "
                    f"whose cores outrun its SSDs; the floor below is measured through the same "
                    f"throttle.",
                    "",
                ]
                if args.disk_mb_s
                else []
            ),
            md_table(rows, list(rows[0])),
            "",
            "| measure | value | target | verdict |",
            "|---|---|---|---|",
            f"| the issue's: out of core, state MB/s moved / disk mixed floor "
            f"({median(moved):.0f} / {median(mixed):.0f} MB/s) | {floor_ratio:.2f} | "
            f"{FLOOR_TARGET} | "
            f"{verdict(floor_ratio, FLOOR_TARGET)} |",
            f"| the ceiling (state a step / in-RAM step, {median(ceiling):.0f} MB/s) / disk mixed "
            f"floor: the most of the issue's ratio this harness can show | "
            f"{ceiling_ratio:.2f} | | |",
            f"| out of core: state MB/s moved / min(disk floor, ceiling) ({median(moved):.0f} / "
            f"{median(bound):.0f} MB/s) | {bound_ratio:.2f} | {FLOOR_TARGET} | "
            f"{verdict(bound_ratio, FLOOR_TARGET)} |",
            f"| out of core: step / max(in-RAM step, disk's time for the state) "
            f"({median(ooc.steps):.3f} / {median(slower):.3f} s; lower is better) | "
            f"{bound_step:.2f} | <= {BOUND_STEP_TARGET:.2f} | "
            f"{'met' if bound_step <= BOUND_STEP_TARGET else 'MISSED'} |",
            f"| fits: step vs in RAM (worker's step) | {fits_ratio:.3f} | {FITS_TARGET} | "
            f"{verdict(fits_ratio, FITS_TARGET)} |",
            f"| fits: node optimizer seconds vs in RAM | {fits_node_ratio:.3f} | {FITS_TARGET} | "
            f"{verdict(fits_node_ratio, FITS_TARGET)} |",
            "",
            "- step_s: the worker's step (zero_grad, backward, step(): pushes out, weights back); "
            "node_optimizer_s: the node's optimizer seconds a step (buckets' steps with reply encode "
            "and, out of core, the wait for their state); state_*: from the node's /metrics, a step; "
            "node_page_faults_k: the node process's minor page faults a step, thousands (fresh pages); "
            "node_cpu_s: the node process's CPU seconds a step (user + system, all its threads); "
            "ratios: medians over repetitions of the paired ratios (higher is better for ours, but "
            "for the step against the bound). The ceiling, the bound (min(floor, ceiling)) and the "
            "disk's time for the state (state bytes a step / floor) come from the same "
            "repetitions; the last two measures are reciprocals of each other, repetition by "
            "repetition.",
            f"- {load.line()}",
        ]
    )
    return result, md


if __name__ == "__main__":
    main()

"""Shared helpers of the speed benchmarks: timing, machine load, results files.

This machine is small and shared (other engineers' test runs come and go), so
every benchmark times a competitor in the same run, interleaved with ours, and
reports medians of repetitions and their ratio. :class:`LoadMonitor` records
what else was running meanwhile, so a reader can tell a quiet run from a noisy
one. A ``--quick`` run writes ``<name>.quick.*`` and leaves the real results
alone.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

MIB = 1 << 20


def median_time(
    fn: Callable[[], object],
    reps: int,
    *,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones (page faults, scratch
    buffers); ``setup`` runs untimed before every call. Returns the sorted times: [len // 2] is the median."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def interleaved(
    fns: dict[str, Callable[[], object]],
    reps: int,
    *,
    warmup: int = 1,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Time several competitors round-robin (A B C A B C ...), so a burst of load from elsewhere hits
    all of them alike. Returns each one's list of wall seconds in repetition order; ``cpu``, when given,
    receives the process CPU seconds of each call (all threads), which other processes' load inflates
    far less than wall time (a descheduled process uses no CPU)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    if cpu is not None:
        cpu.update({k: [] for k in fns})
    for _ in range(reps):
        for k, fn in fns.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu[k].append(time.process_time() - c0)
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over repetitions of num[i] / den[i]: robust when the load changes between repetitions."""
    return median([a / b for a, b in zip(num, den) if b > 0])


def proc_usage(pid: int | None = None) -> tuple[float, int]:
    """(CPU seconds, user + system, all threads; minor page faults) a live process has used so far
    (``None``: this process). NaN / -1 if unreadable. Faults count touches of fresh memory."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])
    except (OSError, ValueError, IndexError):
        return float("nan"), -1


def threads_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Thread id -> (OS thread name, CPU seconds so far) of a live process; {} if unreadable.
    Python threads all show the process name; ZeroMQ's are ``ZMQbg/...``; the main thread's id is ``pid``."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            fields = raw.rsplit(")", 1)[1].split()
            out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tck)
        except (OSError, ValueError, IndexError):
            continue
    return out


def node_threads_delta(pid: int, before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per role between two :func:`threads_cpu_s` snapshots of a node process: the event
    loop (main thread), the optimizer thread (the busiest other Python thread), ZeroMQ's I/O threads, the rest."""
    d = {tid: (comm, cpu - before.get(tid, (comm, 0.0))[1]) for tid, (comm, cpu) in after.items()}
    out = {"loop": d.pop(pid, ("", 0.0))[1], "optimizer_thread": 0.0, "zmq_io": 0.0, "other": 0.0}
    py = sorted(((c, t) for t, (n, c) in d.items() if not n.startswith("ZMQ")), reverse=True)
    if py:
        out["optimizer_thread"] = py[0][0]
        out["other"] = sum(c for c, _ in py[1:])
    out["zmq_io"] = sum(c for n, c in d.values() if n.startswith("ZMQ"))
    return out


def _cpu_busy_jiffies() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


class LoadMonitor:
    """What the machine did while a benchmark ran: load average at start and end, cores busy in total
    and cores busy outside this process tree (children count once they have been waited for)."""

    def __enter__(self) -> LoadMonitor:
        self.load_start = os.getloadavg()
        self.t0 = time.monotonic()
        self.busy0 = _cpu_busy_jiffies()
        self.own0 = self._own()
        return self

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self.t0
        self.load_end = os.getloadavg()
        busy1 = _cpu_busy_jiffies()
        own_s = self._own() - self.own0
        self.busy_cores = self.own_cores = self.other_cores = float("nan")
        if self.busy0 and busy1 and busy1[1] > self.busy0[1]:
            ncpu = os.cpu_count() or 1
            frac = (busy1[0] - self.busy0[0]) / (busy1[1] - self.busy0[1])
            self.busy_cores = frac * ncpu
            self.own_cores = own_s / max(self.wall_s, 1e-9)
            self.other_cores = max(0.0, self.busy_cores - self.own_cores)

    def info(self) -> dict:
        return {
            "loadavg_start": [round(x, 2) for x in self.load_start],
            "loadavg_end": [round(x, 2) for x in self.load_end],
            "wall_s": round(self.wall_s, 1),
            "busy_cores": round(self.busy_cores, 2),
            "own_cores": round(self.own_cores, 2),
            "other_cores": round(self.other_cores, 2),
        }

    def line(self) -> str:
        i = self.info()
        return (
            f"load: loadavg {i['loadavg_start'][0]} -> {i['loadavg_end'][0]} (1 min), over {i['wall_s']} s "
            f"{i['busy_cores']} of {os.cpu_count()} cores busy, {i['other_cores']} of them by other processes"
        )


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError):
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def md_table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def verdict(value: float, target: float) -> str:
    """'met' or how far below the target a ratio is (in percent of the target)."""
    if math.isnan(value):
        return "n/a"
    if value >= target:
        return f"met (>= {target}x)"
    return f"MISSED by {100 * (target - value) / target:.0f}% (target {target}x)"


def write_results(name: str, result: dict, md: str, *, quick: bool, out: Path = RESULTS) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` (``<name>.quick.*`` for a smoke run) and print the table."""
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}.quick" if quick else name
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(md if md.endswith("\n") else md + "\n")
    return out / f"{stem}.json"


def bf16_allreduce_hook(process_group, bucket):
    """DDP communication hook: all-reduce the bucket as bf16 (half the bytes), then back to fp32.

    torch's own ``default_hooks.bf16_compress_hook`` refuses anything but NCCL (DDP checks the hook's
    name); gloo all-reduces bf16 fine, so this is the same hook under another name (the competitor's
    gradient compression on CPU).
    """
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


def make_student(dims: list[int], seed: int = 0) -> torch.nn.Sequential:
    """The benchmarks' MLP: Linear layers of ``dims`` with ReLU between them, seeded."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)

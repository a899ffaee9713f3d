"""Where a worker's CPU goes in a step: the runtime's cost beside forward and backward (issue 36, part 1).

The cluster study's worker, on loopback: the student MLP (1024 -> 2048 x4 -> 1000, 16.7M
parameters), batch 64, AdamW on ``--nodes`` node daemons, ``--workers`` worker processes, told a
1 Gbit/s link so the compression policy picks what it picks on the emulated cluster (bf16 warm-up,
then int8 pushes with error feedback), 4 MiB buckets, 1 torch thread per process. For each mode
(resident: the default; streaming: ``optimizer.stream_weights``):

- **CPU per step, all threads** of each worker (``time.process_time``: the main thread, the
  client's I/O thread, ZeroMQ's threads) over the timed steps;
- **forward + backward alone**: the same model, batch and thread count in the same process before
  the optimizer exists, timed the same way; the runtime's own cost is the difference;
- the CPU of each **thread by name** (Linux ``/proc``: ZeroMQ's native I/O threads, which py-spy
  cannot see) and the **minor page faults** per step, beside those of forward + backward alone (a
  fresh page is mapped and zeroed by the kernel, CPU that shows wherever it was first touched);
- the **wake-ups of the I/O thread** per step (each a pass of it over the sockets and an interpreter
  lock handed over);
- streaming mode's **heap trims** per step (the streamer gives the heap's freed memory back when it
  passes a bound) and each worker's **peak RSS** (``VmHWM``), so a change that trades memory for
  fewer page faults shows both sides;
- a **profile** of rank 0 (``py-spy record``, on-CPU samples only, every thread) in a separate
  repetition, so the timed ones run unobserved: a flame graph (``<name>_<mode>.svg``) and a table of
  the samples by the innermost LuWu module on the stack (a hook that runs inside autograd counts as
  LuWu's, not as backward's), by thread, and by LuWu function.

Medians over ``--reps`` repetitions. Writes ``benchmarks/results/<name>.{json,md}`` and the flame
graphs; ``--quick`` writes ``<name>.quick.*`` and no flame graph. Needs py-spy for the profile
(``pip install -e '.[bench]'``); without it, the CPU columns alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, run as a script
from benchmarks.common import (
    RESULTS,
    LoadMonitor,
    machine_info,
    make_student,
    md_table,
    write_results,
)  # noqa: E402

DIMS = [1024, 2048, 2048, 2048, 2048, 1000]
BATCH = 64
MODES = ("resident", "streaming")
#: a frame of ours: a file under one of the installed package's folders
OURS = re.compile(r"(?:^|[\s(/])(luwu|gpu_workers|protocol|switch_nodes)/([\w/]+)\.py")


def _cluster_file(path: Path, addresses: list[str], workers: int, mode: str, job: str) -> None:
    """The cluster study's LuWu settings (benchmarks/cluster_study.py, ``_cluster_file``) on loopback."""
    path.write_text(
        "\n".join(
            [
                "[cluster]",
                f'job = "{job}"',
                "nodes = [" + ", ".join(f'"{a}"' for a in addresses) + "]",
                f"world_size = {workers}",
                "[optimizer]",
                'name = "adamw"',
                f"stream_weights = {str(mode == 'streaming').lower()}",
                "[compression]",
                "warmup_steps = 10",
                "link_gbps = 1",
                "[transport]",
                f"bucket_bytes = {4 << 20}",
                "",
            ]
        )
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, DIMS[0], generator=g), torch.randint(
        0, DIMS[-1], (BATCH,), generator=g
    )


def _fwd_bwd_cpu(model: torch.nn.Module, rank: int, steps: int = 8) -> tuple[float, float]:
    """CPU seconds and minor page faults per step of forward and backward alone (no optimizer, no
    hooks), medians."""
    times, faults = [], []
    for step in range(steps + 2):
        x, y = _batch(rank, step)
        t0, f0 = time.process_time(), minor_faults()
        F.cross_entropy(model(x), y).backward()
        times.append(time.process_time() - t0)
        faults.append(minor_faults() - f0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[2:]), statistics.median(faults[2:])


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far, summed by thread name (Linux's
    ``/proc``; empty elsewhere). ZeroMQ's own threads (``ZMQbg/...``) are native: py-spy does not see
    them, their CPU shows here."""
    out: Counter = Counter()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (a thread that ended meanwhile)
            continue
        out[re.sub(r"\d+$", "N", name)] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def minor_faults() -> int:
    """Minor page faults of this process so far (Linux; 0 elsewhere): each is a fresh page the kernel
    maps and zeroes, CPU that shows in whatever touched the page first."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, MiB (Linux ``VmHWM``; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def _worker(rank: int, world: int, cluster_file: str, steps: int, warmup: int, q) -> None:
    torch.set_num_threads(1)
    import luwu
    from luwu.config import load_config

    try:
        model = make_student(DIMS)
        fwd_bwd, fwd_bwd_faults = _fwd_bwd_cpu(model, rank)
        opt = luwu.RemoteOptimizer.from_config(
            model,
            load_config(cluster_file),
            rank=rank,
            world_size=world,
            lr=1e-3,
            weight_decay=0.01,
        )
        try:
            for step in range(steps):
                if step == warmup:
                    q.put(("timed", rank, os.getpid()))
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    threads0, faults0 = thread_cpu(), minor_faults()
                    trims0 = getattr(opt.streamer, "heap_trims", 0)  # (0: resident mode)
                    wakes0 = _wakes(opt)
                x, y = _batch(rank, step)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.synchronize()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            threads, faults = thread_cpu(), minor_faults() - faults0
            trims = getattr(opt.streamer, "heap_trims", 0) - trims0
            wakes = _wakes(opt) - wakes0
        finally:
            opt.close()
        n = steps - warmup
        by_thread = {k: 1e3 * (v - threads0.get(k, 0.0)) / n for k, v in threads.items()}
        q.put(
            (
                "done",
                rank,
                {
                    "cpu_ms": 1e3 * cpu / n,
                    "wall_ms": 1e3 * wall / n,
                    "fwd_bwd_ms": 1e3 * fwd_bwd,
                    "thread_cpu_ms": by_thread,
                    "minor_faults": faults / n,
                    "fwd_bwd_faults": fwd_bwd_faults,
                    "heap_trims": trims / n,
                    "io_wakeups": wakes / n,
                    "peak_rss_mb": peak_rss_mb(),
                },
            )
        )
    except BaseException as exc:
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise


def _wakes(opt) -> int:
    """Wake-ups of the worker's I/O thread so far (pipe writes of ``client.wake``; 0 where the
    client has none)."""
    return getattr(getattr(opt.client, "wake", None), "writes", 0)


def _py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


def run_once(mode: str, args, profile_to: tuple[str, Path] | None = None) -> dict:
    """One run of ``mode``: per-worker CPU and wall per timed step, and (``profile_to``: py-spy
    format and output file) a profile of rank 0 over the timed steps."""
    import luwu

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp, luwu.local_cluster(args.nodes) as cluster:
        cf = Path(tmp) / "cluster.toml"
        _cluster_file(cf, cluster.addresses, args.workers, mode, cluster.job)
        procs = [
            ctx.Process(target=_worker, args=(r, args.workers, str(cf), args.steps, args.warmup, q))
            for r in range(args.workers)
        ]
        for p in procs:
            p.start()
        spy, results, deadline = None, {}, time.monotonic() + 600
        try:
            while len(results) < args.workers:
                try:
                    kind, rank, payload = q.get(timeout=1.0)
                except Exception:
                    if time.monotonic() > deadline or any(
                        p.exitcode not in (None, 0) for p in procs
                    ):
                        raise RuntimeError(f"{mode}: a worker failed or timed out") from None
                    continue
                if kind == "error":
                    raise RuntimeError(f"{mode}: worker {rank} failed: {payload}")
                if kind == "timed" and rank == 0 and profile_to:
                    fmt, out = profile_to
                    spy = subprocess.Popen(
                        [_py_spy(), "record", "--pid", str(payload), "--rate", "200", "--threads"]
                        + ["--nonblocking", "--format", fmt, "--output", str(out)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                if kind == "done":
                    results[rank] = payload
                    if rank == 0 and spy:
                        spy.send_signal(signal.SIGINT)
        finally:
            if spy:
                try:
                    spy.wait(30)
                except subprocess.TimeoutExpired:
                    spy.kill()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return results


# ----------------------------------------------------------------------------- the profile's table


def _frames(stack: str) -> list[str]:
    return stack.split(";")


def _ours(frame: str) -> str | None:
    """``gpu_workers/client`` for a frame in gpu_workers/client.py (None: not ours)."""
    m = OURS.search(frame)
    if not m:
        return None
    return f"{m.group(1)}/{m.group(2)}"


def _thread(frames: list[str]) -> str:
    """The thread a sample ran on, by name (py-spy's first frame: ``thread (tid): name``)."""
    name = frames[0].partition("): ")[2] if frames[0].startswith("thread (") else ""
    return {"MainThread": "main (training loop)"}.get(name, name or "other")


def profile_table(raw: Path) -> dict:
    """Shares of on-CPU samples by innermost LuWu module, by thread, and by LuWu function."""
    by_module, by_thread, by_function = Counter(), Counter(), Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = _frames(stack)
        total += n
        mine = [f for f in frames if _ours(f)]
        if mine:
            by_module[_ours(mine[-1])] += n
            by_function[mine[-1].split(" (", 1)[0] + " (" + _ours(mine[-1]) + ")"] += n
        elif any("backward" in f for f in frames):
            by_module["backward (torch autograd)"] += n
        elif any("torch/nn/" in f for f in frames):
            by_module["forward (torch modules)"] += n
        else:
            by_module["other (Python, torch outside a module)"] += n
        by_thread[_thread(frames)] += n

    def shares(c: Counter, top: int) -> list[dict]:
        return [{"where": k, "share": v / max(total, 1)} for k, v in c.most_common(top)]

    return {
        "samples": total,
        "by_module": shares(by_module, 20),
        "by_thread": shares(by_thread, 10),
        "by_function": shares(by_function, 15),
    }


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--warmup", type=int, default=14, help="steps before the timed ones (past the bf16 warm-up)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="worker_cpu")
    ap.add_argument("--quick", action="store_true", help="1 rep, 20 steps, no profile")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 20, 12
    spy = _py_spy() if not args.quick else None
    result = {"machine": machine_info(), "settings": vars(args), "modes": {}}
    with LoadMonitor() as load:
        for mode in args.modes:
            runs = [run_once(mode, args) for _ in range(args.reps)]
            rows = [r for run in runs for r in run.values()]
            med = {
                k: statistics.median(r.get(k, 0.0) for r in rows)
                for k in (
                    "cpu_ms",
                    "wall_ms",
                    "fwd_bwd_ms",
                    "minor_faults",
                    "fwd_bwd_faults",
                    "heap_trims",
                    "io_wakeups",
                    "peak_rss_mb",
                )
            }
            med["runtime_cpu_ms"] = med["cpu_ms"] - med["fwd_bwd_ms"]
            names = sorted({k for r in rows for k in r.get("thread_cpu_ms", {})})
            med["thread_cpu_ms"] = {
                k: statistics.median(r.get("thread_cpu_ms", {}).get(k, 0.0) for r in rows)
                for k in names
            }
            entry = {"median": med, "runs": runs}
            if spy:
                raw = Path(tempfile.mkdtemp()) / "profile.txt"
                svg = RESULTS / f"{args.name}_{mode}.svg"
                run_once(mode, args, ("raw", raw))
                run_once(mode, args, ("flamegraph", svg))
                entry["profile"] = profile_table(raw) if raw.exists() else None
                entry["flame_graph"] = svg.name if svg.exists() else None
            result["modes"][mode] = entry
    result["load"] = load.info()
    write_results(args.name, result, _markdown(result, load), quick=args.quick)
    return 0


def _markdown(result: dict, load: LoadMonitor) -> str:
    s = result["settings"]
    md = [
        "# Worker CPU per step: the runtime beside forward and backward (profile_worker)",
        "",
        f"The cluster study's worker on loopback: student MLP {' -> '.join(map(str, DIMS))} (16.7M params), "
        f"batch {BATCH}, {s['workers']} workers, {s['nodes']} nodes, told 1 Gbit/s (int8 pushes after 10 bf16 "
        f"steps), 4 MiB buckets, 1 torch thread; steps {s['warmup']}..{s['steps'] - 1} timed; medians of "
        f"{s['reps']} runs x {s['workers']} workers. `runtime` = CPU per step (all threads) minus forward + "
        "backward alone (same process, before the optimizer exists).",
        "",
    ]
    rows = [
        {
            "mode": mode,
            "CPU ms/step (all threads)": e["median"]["cpu_ms"],
            "fwd+bwd CPU ms": e["median"]["fwd_bwd_ms"],
            "runtime CPU ms/step": e["median"]["runtime_cpu_ms"],
            "wall ms/step": e["median"]["wall_ms"],
            "page faults/step": e["median"].get("minor_faults"),
            "fwd+bwd page faults": e["median"].get("fwd_bwd_faults"),
            "heap trims/step": e["median"].get("heap_trims"),
            "I/O-thread wake-ups/step": e["median"].get("io_wakeups"),
            "peak RSS MiB": e["median"].get("peak_rss_mb"),
        }
        for mode, e in result["modes"].items()
    ]
    md += [md_table(rows, list(rows[0])), ""]
    threads = [
        {"mode": mode, "thread": name, "CPU ms/step": ms}
        for mode, e in result["modes"].items()
        for name, ms in sorted(e["median"].get("thread_cpu_ms", {}).items(), key=lambda kv: -kv[1])
        if ms >= 0.05
    ]
    if threads:
        md += [
            "CPU per step by thread (`/proc`, median per name; the main thread runs forward and "
            "backward; ZeroMQ's native threads are invisible to py-spy):",
            "",
            md_table(threads, list(threads[0])),
            "",
        ]
    for mode, e in result["modes"].items():
        prof = e.get("profile")
        if not prof:
            continue
        md += [
            f"## {mode}: where rank 0's on-CPU samples are ({prof['samples']} samples, py-spy, 200 Hz)",
            "",
        ]
        if e.get("flame_graph"):
            md += [f"Flame graph: [`{e['flame_graph']}`]({e['flame_graph']}).", ""]
        for key, title in (
            ("by_module", "innermost LuWu module"),
            ("by_thread", "thread"),
            ("by_function", "LuWu function"),
        ):
            md += [
                md_table(
                    [{title: r["where"], "share": f"{100 * r['share']:.1f}%"} for r in prof[key]],
                    [title, "share"],
                ),
                "",
            ]
    md += [
        f"- {load.line()}",
        f"- command: `python benchmarks/profile_worker.py --reps {s['reps']} --name {s['name']}`",
    ]
    return "\n".join(md)


if __name__ == "__main__":
    sys.exit(main())

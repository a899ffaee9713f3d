"""Out-of-core state: the window's streaming throughput against the disk's own (issue 34, first half).

In one run, repetitions interleaved (these machines are shared), medians of ``--reps``:

1. **The disk's floor**, fio-style, on the file system of ``--dir``: passes over one
   ``O_DIRECT`` file of ``--file-mib`` with the engine's request size (1 MiB) and
   queue depth (its 4 threads), by plain threads calling ``os.preadv`` /
   ``os.pwritev`` and nothing else (no pool, no window, no checksum): reads,
   writes (then ``fdatasync``) and a 50/50 random mix of the two (then
   ``fdatasync``), as fio's ``rw=read|write|rw, rwmixread=50`` would. Where
   ``fio`` is installed, the same three jobs through fio itself as a cross-check,
   with ``psync`` and ``numjobs`` = the queue depth (what the engine does), and
   with ``io_uring`` at the same depth (whether a ring would beat threads here).
2. **The engine**: an AdamW state (fp32 ``params``, ``exp_avg``, ``exp_avg_sq`` and
   a step counter per bucket, 12 B/param) of ``--state-mib`` in buckets of
   ``--bucket-params``, in its state files under ``--dir``, streamed through a
   :class:`StateWindow` of ``--budget-mib`` (the state is at least 4x the budget).
   A pass steps every bucket once: ``acquire`` (read ahead), the node's AdamW
   (``torch._fused_adamw_`` through ``optimizers.apply_``, 1 torch thread like a
   node) with a gradient, ``release`` (write back into the other slot, journal
   commit); the pass ends when every write is committed. Reported: state bytes
   moved per second (read + written) against the mixed floor (target >= 0.8x),
   and, for scale, the AdamW alone on the same buckets in RAM.
3. **The page cache's role**: both sides use ``O_DIRECT``, so neither is flattered
   by cached pages; the state file's and the floor file's pages in the page cache
   after the runs (``mincore``) show it (expected: none).

    .venv/bin/python benchmarks/bench_ooc.py [--dir DIR] [--quick] [--reps R] [--threads N] [--request-kib K]

``--dir`` defaults to a new folder under /var/tmp or /tmp, whichever is on a disk (not
tmpfs), removed at the end. Writes benchmarks/results/bench_ooc.json and .md
(``--quick``: bench_ooc.quick.*). Under a minute on a 2-core VM; fio, where installed, runs after the
interleaved repetitions, as a cross-check of the threads' numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import random
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import (
    LoadMonitor,
    interleaved,
    machine_info,
    md_table,
    median,
    paired_ratio,
    verdict,
    write_results,
)

from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout, StateWindow
from luwu.switch_nodes.ooc.io import DEFAULT_NUM_THREADS, DEFAULT_REQUEST_BYTES
from luwu.switch_nodes.optimizers import ADAMW, apply_

MIB = 1 << 20
TARGET = 0.8
HYPER = dict(ADAMW.defaults) | {"lr": 1e-3, "weight_decay": 0.01}
NAMES = ADAMW.state_for(HYPER)  # exp_avg, exp_avg_sq
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}


def fs_type(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it)."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def pick_dir() -> Path:
    for base in ("/var/tmp", "/tmp"):
        if os.path.isdir(base) and fs_type(Path(base)) not in MEMORY_FS:
            return Path(base) / f"luwu-bench-ooc-{os.getpid()}"
    raise SystemExit("no disk-backed /var/tmp or /tmp: pass --dir on a real disk")


BLKIO = Path("/sys/fs/cgroup/blkio")


def whole_disk(path: Path) -> str:
    """``major:minor`` of the disk under ``path`` (a partition's own disk: throttles sit on disks)."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (sysfs / "partition").exists():
        return (sysfs.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


@contextlib.contextmanager
def throttled_disk(folder: Path, mb_s: float):
    """This process, and every process it starts inside, held to ``mb_s`` MB/s of reads and as much
    of writes on the disk under ``folder``: a blkio cgroup (v1) of their own, which throttles
    ``O_DIRECT`` I/O at the block layer. It emulates a disk slower than the node's path, as on a
    node whose cores outrun its SSDs; the floor measured inside is that disk's."""
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        raise SystemExit(f"--disk-mb-s needs the cgroup v1 blkio controller at {BLKIO}")
    group, disk, bps = BLKIO / f"luwu-bench-{os.getpid()}", whole_disk(folder), int(mb_s * 1e6)
    home = next(  # (the blkio cgroup this process is in now: it goes back there)
        BLKIO / line.rpartition(":")[2].lstrip("/")
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if ":blkio:" in line
    )
    group.mkdir()
    try:
        for kind in ("read", "write"):
            (group / f"blkio.throttle.{kind}_bps_device").write_text(f"{disk} {bps}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield {"disk": disk, "read_mb_s": mb_s, "write_mb_s": mb_s}
        finally:
            (home / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        group.rmdir()


def cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (mincore over a mapping that touches nothing)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        ok = libc.mincore(addr, size, vec) == 0
        libc.munmap(addr, size)
        return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE if ok else -1
    finally:
        os.close(fd)


class DiskFloor:
    """What the disk gives this process: passes over one O_DIRECT file, ``qd`` threads, ``bs`` requests."""

    def __init__(self, path: Path, nbytes: int, bs: int, qd: int):
        self.path, self.nbytes, self.bs, self.qd = path, nbytes // bs * bs, bs, qd
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, self.nbytes)
        self.bufs = [mmap.mmap(-1, bs) for _ in range(qd)]
        for m in self.bufs:
            m.write(os.urandom(bs))
        self.pool = ThreadPoolExecutor(qd, thread_name_prefix="floor")
        rng = random.Random(0)
        self.mix = [rng.random() < 0.5 for _ in range(self.nbytes // bs)]  # True: read

    def run(self, mode: str) -> None:
        ops = [
            (o, mode == "read" or (mode == "mixed" and self.mix[o // self.bs]))
            for o in range(0, self.nbytes, self.bs)
        ]

        def job(i: int) -> None:
            buf = self.bufs[i]
            for off, read in ops[i :: self.qd]:
                (os.preadv if read else os.pwritev)(self.fd, [buf], off)

        list(self.pool.map(job, range(self.qd)))
        if mode != "read":
            os.fdatasync(self.fd)

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def fio_mb_s(path: Path, nbytes: int, bs: int, qd: int, mode: str, engine: str) -> float:
    """fio's bandwidth (read + write, MB/s) for the same job, or NaN when fio is absent or fails."""
    if shutil.which("fio") is None:
        return float("nan")
    rw = {"read": "read", "write": "write", "mixed": "rw"}[mode]
    jobs = [
        "--ioengine=psync",
        f"--numjobs={qd}",
        f"--size={nbytes // qd}",
        f"--offset_increment={nbytes // qd}",
    ]
    if engine == "io_uring":
        jobs = ["--ioengine=io_uring", f"--iodepth={qd}", "--numjobs=1", f"--size={nbytes}"]
    cmd = [
        "fio",
        "--name=floor",
        f"--filename={path}",
        f"--bs={bs}",
        "--direct=1",
        f"--rw={rw}",
        "--rwmixread=50",
        "--group_reporting",
        "--output-format=json",
        f"--end_fsync={int(mode != 'read')}",
        *jobs,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    try:
        job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
    except (ValueError, KeyError, IndexError):
        return float("nan")
    return (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / 1e6


class EngineRun:
    """An AdamW state in files under ``folder`` streamed through a window of ``budget`` bytes."""

    def __init__(
        self, folder: Path, state_bytes: int, bucket_params: int, budget: int, bs: int, qd: int
    ):
        nb = max(1, state_bytes // (bucket_params * 12))
        self.layout = StateLayout.for_shard(
            "bench-ooc", [(b, bucket_params, 1) for b in range(nb)], NAMES
        )
        self.engine = IOEngine(num_threads=qd, request_bytes=bs)
        self.sf = StateFile.open(folder, self.layout, self.engine)
        self.order = list(range(nb))
        self.window = StateWindow(self.sf, self.order, budget)
        self.grad = torch.randn(bucket_params, generator=torch.Generator().manual_seed(0))
        self.slot_bytes = sum(b.slot_bytes for b in self.layout.buckets)
        # for the compute-only reference: one bucket's tensors in RAM
        self.ram = {n: torch.zeros(bucket_params) for n in ("params", *NAMES)} | {
            "steps": torch.zeros(1)
        }

    def step(self, t: dict[str, torch.Tensor]) -> None:
        apply_(
            ADAMW, [t["params"]], [self.grad], {n: [t[n]] for n in NAMES}, [t["steps"][0]], HYPER
        )

    def stream(self) -> None:
        """One pass: every bucket acquired, stepped, released; returns once all its writes are durable."""
        w = self.window
        for b in self.order:
            v = w.acquire(b)
            self.step(v.tensors)
            w.release(b, (v.version or 0) + 1)
        w.flush()

    def compute_only(self) -> None:
        for _ in self.order:
            self.step(self.ram)

    def close(self) -> None:
        self.window.close()
        self.sf.close()
        self.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="folder on the disk to measure (default: under /var/tmp or /tmp)",
    )
    ap.add_argument("--state-mib", type=int, default=1024)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--bucket-params", type=int, default=1 << 20)
    ap.add_argument("--file-mib", type=int, default=512, help="size of the floor's test file")
    ap.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_NUM_THREADS,
        help="requests in flight (engine and floor)",
    )
    ap.add_argument(
        "--request-kib",
        type=int,
        default=DEFAULT_REQUEST_BYTES >> 10,
        help="request size (engine and floor)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 256 MiB of state, 64 MiB budget"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    if args.quick:
        args.state_mib, args.budget_mib, args.file_mib, args.bucket_params = 256, 64, 128, 1 << 18
    if args.state_mib < 4 * args.budget_mib:
        raise SystemExit(
            f"--state-mib {args.state_mib} must be at least 4x --budget-mib {args.budget_mib}"
        )
    torch.set_num_threads(1)
    own_dir = args.dir is None
    folder = pick_dir() if own_dir else args.dir
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result, md = run(args, folder)
    finally:
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)
    write_results("bench_ooc", result, md, quick=args.quick, out=args.out)


def run(args, folder: Path) -> tuple[dict, str]:
    bs, qd = args.request_kib << 10, args.threads
    floor = DiskFloor(folder / "floor.bin", args.file_mib * MIB, bs, qd)
    eng = EngineRun(
        folder / "state", args.state_mib * MIB, args.bucket_params, args.budget_mib * MIB, bs, qd
    )
    try:
        with LoadMonitor() as load:
            eng.stream()  # first pass: creates every bucket (writes only)
            s0 = eng.window.stats_dict()
            fns = {
                "write": lambda: floor.run("write"),
                "read": lambda: floor.run("read"),
                "mixed": lambda: floor.run("mixed"),
                "engine": eng.stream,
                "compute": eng.compute_only,
            }
            cpu: dict[str, list[float]] = {}
            times = interleaved(fns, args.reps, warmup=1, cpu=cpu)
            s1 = eng.window.stats_dict()
            fio = {
                f"{e} {m}": fio_mb_s(folder / "floor.bin", floor.nbytes, bs, qd, m, e)
                for e in ("psync", "io_uring")
                for m in ("read", "write", "mixed")
            }
        cache = {
            "state file": cached_bytes(folder / "state" / "slots.bin"),
            "floor file": cached_bytes(folder / "floor.bin"),
        }
    finally:
        floor.close()
        eng.close()
    return report(args, floor, eng, times, cpu, s0, s1, fio, cache, load)


WINDOW_KEYS = (
    "reads",
    "writes",
    "hits",
    "misses",
    "stall_s",
    "commits",
    "commit_batches",
    "evictions",
)


def report(args, floor, eng, times, cpu, s0, s1, fio, cache, load) -> tuple[dict, str]:
    passes = args.reps + 1  # the warm-up round of interleaved() streamed a pass too
    moved = sum(s1[k] - s0[k] for k in ("bytes_read", "bytes_written")) / passes
    mb_s = {m: [floor.nbytes / t / 1e6 for t in times[m]] for m in ("read", "write", "mixed")}
    mb_s["engine"] = [moved / t / 1e6 for t in times["engine"]]
    # the same bytes at the disk's speed, per repetition: as the mixed pass moved them, or read then
    # written one after the other (no overlap at all)
    mixed_s = [t * moved / floor.nbytes for t in times["mixed"]]
    serial_s = [
        (tr + tw) * moved / 2 / floor.nbytes for tr, tw in zip(times["read"], times["write"])
    ]
    ratio = paired_ratio(mixed_s, times["engine"])
    result = {
        "machine": machine_info(),
        "load": load.info(),
        "load_line": load.line(),
        "config": {
            "dir": str(args.dir or "auto"),
            "fs": fs_type(Path(floor.path)),
            "state_bytes": eng.slot_bytes,
            "budget_bytes": eng.window.budget_bytes,
            "buckets": len(eng.order),
            "bucket_params": args.bucket_params,
            "request_bytes": floor.bs,
            "queue_depth": floor.qd,
            "commit_interval_s": eng.window.commit_interval_s,
            "floor_file_bytes": floor.nbytes,
            "reps": args.reps,
        },
        "mb_s": mb_s,
        "fio_mb_s": fio,
        "seconds": times,
        "cpu_seconds": cpu,
        "engine": {
            "bytes_moved_per_pass": moved,
            "ratio_to_mixed_floor": ratio,
            "ratio_to_serial_floor": paired_ratio(serial_s, times["engine"]),
            "verdict": verdict(ratio, TARGET),
            "pass_s": median(times["engine"]),
            "mixed_floor_pass_s": median(mixed_s),
            "serial_floor_pass_s": median(serial_s),
            "compute_only_pass_s": median(times["compute"]),
            "window_per_pass": {k: (s1[k] - s0[k]) / passes for k in WINDOW_KEYS},
            "peak_resident_bytes": s1["peak_resident_bytes"],
        },
        "page_cache_bytes_after": cache,
    }
    return result, markdown(result)


def markdown(r: dict) -> str:
    cfg, e, fio, cache = r["config"], r["engine"], r["fio_mb_s"], r["page_cache_bytes_after"]
    rows = [
        {
            "measure": f"disk {m}: threads, O_DIRECT",
            "MB/s": median(r["mb_s"][m]),
            "fio psync": fio[f"psync {m}"],
            "fio io_uring": fio[f"io_uring {m}"],
        }
        for m in ("read", "write", "mixed")
    ]
    rows.append(
        {
            "measure": "engine: state streamed through the window",
            "MB/s": median(r["mb_s"]["engine"]),
        }
    )
    window = {k: round(v, 3) for k, v in e["window_per_pass"].items()}
    return "\n".join(
        [
            "# Out-of-core state: streaming through the window vs the disk (bench_ooc)",
            "",
            (
                f"{cfg['state_bytes'] / MIB:.0f} MiB of AdamW state ({cfg['buckets']} buckets of "
                f"{cfg['bucket_params']} params) through a {cfg['budget_bytes'] / MIB:.0f} MiB window on "
                f"{cfg['fs']} ({cfg['dir']}); requests of {cfg['request_bytes'] // 1024} KiB, "
                f"{cfg['queue_depth']} in flight, a commit every {cfg['commit_interval_s']} s at most; "
                f"medians of {cfg['reps']}, interleaved."
            ),
            "",
            md_table(rows, ["measure", "MB/s", "fio psync", "fio io_uring"]),
            "",
            (
                f"- engine / mixed floor: **{e['ratio_to_mixed_floor']:.2f}x** ({e['verdict']}); / serial "
                f"floor (the reads, then the writes): {e['ratio_to_serial_floor']:.2f}x"
            ),
            (
                f"- a pass moves {e['bytes_moved_per_pass'] / MIB:.0f} MiB (read + written) in "
                f"{e['pass_s']:.2f} s; at the disk's mixed speed {e['mixed_floor_pass_s']:.2f} s, serial "
                f"{e['serial_floor_pass_s']:.2f} s; AdamW alone on the same buckets {e['compute_only_pass_s']:.2f} s"
            ),
            f"- window per pass: {json.dumps(window)}; peak resident {e['peak_resident_bytes'] / MIB:.0f} MiB",
            (
                f"- page cache after the runs (mincore): state file {cache['state file'] / MIB:.1f} MiB, "
                f"floor file {cache['floor file'] / MIB:.1f} MiB (O_DIRECT on both sides: neither side's "
                "numbers come from cached pages)"
            ),
            f"- {r['load_line']}",
        ]
    )


if __name__ == "__main__":
    main()

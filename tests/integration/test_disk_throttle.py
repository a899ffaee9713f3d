"""``bench_ooc.throttled_disk``: the slower disk ``bench_ooc_step --disk-mb-s`` measures on holds the
``O_DIRECT`` I/O of the benchmark's process and of the node processes it starts to the rate, and
leaves no cgroup behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2] / "benchmarks")
)  # (its scripts' imports)
import bench_ooc  # noqa: E402
from bench_ooc import BLKIO, MEMORY_FS, fs_type, throttled_disk  # noqa: E402

MB = 1_000_000
NBYTES = 16 << 20


def direct_write_s(path: Path) -> float:
    """Seconds to write NBYTES to ``path`` with O_DIRECT, from a process started now (as a node is)."""
    code = (
        "import mmap, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)\n"
        "buf = mmap.mmap(-1, 1 << 20)\n"
        "t = time.perf_counter()\n"
        f"for off in range(0, {NBYTES}, 1 << 20):\n"
        "    os.pwritev(fd, [buf], off)\n"
        "os.fdatasync(fd)\n"
        "print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return float(out.stdout)


def blkio_group() -> str:
    return next(
        line.rpartition(":")[2]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if ":blkio:" in line
    )


@pytest.mark.timeout(120)
def test_a_throttled_disk_holds_the_processes_it_starts_and_leaves_nothing_behind():
    if os.geteuid() != 0 or not (BLKIO / "blkio.throttle.read_bps_device").exists():
        pytest.skip("needs root and the cgroup v1 blkio controller")
    base = Path("/var/tmp")
    if fs_type(base) in MEMORY_FS:
        pytest.skip("/var/tmp is not on a disk")
    folder = base / f"luwu-test-throttle-{os.getpid()}"
    folder.mkdir()
    try:
        before = blkio_group()
        with throttled_disk(folder, 20) as t:
            assert t["read_mb_s"] == t["write_mb_s"] == 20
            group = BLKIO / f"luwu-bench-{os.getpid()}"
            assert blkio_group() == f"/{group.name}"
            held = direct_write_s(folder / "held.bin")
        assert held >= 0.5 * NBYTES / (20 * MB), held  # (the throttle lets a short burst through)
        assert blkio_group() == before and not group.exists()
        free = min(direct_write_s(folder / "free.bin") for _ in range(2))
        assert free < held / 2, (free, held)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_throttled_disk_without_blkio_says_what_it_needs(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_ooc, "BLKIO", tmp_path / "absent")
    with pytest.raises(SystemExit, match="--disk-mb-s needs the cgroup v1 blkio controller"):
        with throttled_disk(tmp_path, 20):
            pass

"""A streaming worker inside a cgroup memory limit trains a model whose fp32 weights exceed the limit,
and local torch AdamW on the same model under the same limit is killed (the limit binds).

The short version of ``benchmarks/bench_memory.py --cgroup`` (which runs 4x the limit): 1.5x here, two
steps, so that it stays well under a minute. Needs root and a cgroup memory controller; skipped without.
"""

import subprocess

import pytest

from benchmarks.bench_memory import _child_cmd, block_params, memory_cgroup, run

LIMIT_MB, RATIO, WIDTH = 400, 1.5, 256


@pytest.mark.timeout(600)
def test_a_streaming_worker_trains_a_model_larger_than_its_memory_limit():
    root = 76 * WIDTH + 10
    depth = -(-(int(RATIO * LIMIT_MB * 2**20) // 4 - root) // block_params(WIDTH))
    spec = {"width": WIDTH, "depth": depth, "steps": 2, "batch": 8, "prefetch": 1}
    with memory_cgroup(LIMIT_MB * 2**20) as (procs, read):
        if procs is None:
            pytest.skip(read)
        row, out = run(dict(spec, stream=True, compression=True), procs, timeout_s=400)
        assert row is not None, (
            f"the streaming worker failed (exit {out.returncode}): {out.stderr[-3000:]}"
        )
        assert row["weights_mb"] >= RATIO * LIMIT_MB
        assert read().get("oom_kills", 0) == 0
        local = subprocess.run(
            _child_cmd(dict(spec, stream=False, compression=False, local=True), procs),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert local.returncode == -9, (
            f"local AdamW was not killed by the limit (exit {local.returncode}): {local.stderr[-2000:]}"
        )
        assert read().get("oom_kills", 0) >= 1

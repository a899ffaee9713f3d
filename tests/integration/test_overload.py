"""Overload: 16 worker processes on one node. No deadlock, every step correct, node memory bounded."""

from __future__ import annotations

import threading
import time

import pytest
from harness import assert_params_close, proc_status, run_training
from workers.train import reference

import luwu

WORKERS = 16
# A small model and batch: the point is 16 concurrent pushers of every bucket, not compute. Buckets of
# 1 KiB give 8 buckets, so each step the node aggregates 128 pushes.
SPEC = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01, "weight_decay": 0.01},
    "steps": 10,
    "batch": 2,
    "bucket_bytes": 1024,
    "timeout_s": 60.0,
}
#: What the node may grow by over its size before the workers connect: its accumulators and reply
#: buffers are per bucket (pooled), so 16 workers must not cost more than a few MiB on this model.
RSS_MARGIN = 64 << 20


@pytest.mark.timeout(300)
def test_sixteen_workers_on_one_node_train_exactly(tmp_path):
    with luwu.local_cluster(1) as cluster:
        pid = cluster.procs[0].pid
        base = proc_status(pid)
        samples: list[int] = []
        done = threading.Event()

        def sample():  # the node's RSS while the 16 workers connect and train
            while not done.wait(0.1):
                try:
                    samples.append(proc_status(pid)["VmRSS"])
                except OSError:
                    return

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t0 = time.monotonic()
        try:
            results = run_training(
                SPEC, cluster.addresses, tmp_path, world_size=WORKERS, timeout_s=240
            )
        finally:
            done.set()
            th.join(5)
        seconds = time.monotonic() - t0
        assert cluster.procs[0].poll() is None, "the node died under 16 workers"
        peak = proc_status(pid)["VmHWM"]
    want, _ = reference(dict(SPEC, world_size=WORKERS))
    assert len(results) == WORKERS
    for r in results:
        assert_params_close(r["params"], want)
        assert len(r["losses"]) == SPEC["steps"]
    grown = max(max(samples, default=0) - base["VmRSS"], peak - base["VmHWM"])
    assert grown < RSS_MARGIN, (
        f"node RSS {base['VmRSS'] >> 20} MiB (peak {base['VmHWM'] >> 20}) before the workers grew by {grown >> 20} MiB "
        f"with {WORKERS} workers ({seconds:.0f} s of training)"
    )

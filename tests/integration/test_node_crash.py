"""Durable node state and exactly-once training under a node crash (rollback recovery)."""

import os
import random
import time

import pytest
import torch
from harness import TRAIN, assert_params_close, kill_node_after_step, start_workers, wait_all
from workers.train import reference

import luwu
from luwu.switch_nodes.checkpoint import CheckpointStore, CorruptCheckpointError


def test_checkpoint_roundtrip_atomic_and_corruption_detected(tmp_path):
    store = CheckpointStore(str(tmp_path), node_index=0, keep=3)
    meta = lambda step: {"job": "j", "step": step, "buckets": [{"id": 0, "numels": [10, 10, 2]}]}  # noqa: E731
    for step in (5, 10, 15, 20):
        store.save(meta(step), {0: [torch.full((10,), float(step)), torch.arange(10.0), torch.ones(2)]})
    assert [s for s, _ in store.list()] == [10, 15, 20]  # the oldest is pruned
    assert not list(tmp_path.glob("*.tmp"))
    ck = store.latest()
    assert ck.meta["step"] == 20 and torch.equal(ck.tensors[0][0], torch.full((10,), 20.0))
    # flip one byte of the newest: it is detected and the previous one is used
    path = store.list()[-1][1]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        store.load(path)
    assert store.latest().meta["step"] == 15
    # a truncated file too
    p15 = store.list()[-2][1]
    p15.write_bytes(p15.read_bytes()[:-7])
    assert store.latest().meta["step"] == 10


SPEC = {"optimizer": "adamw", "hyper": {"lr": 0.01}, "steps": 30, "resilient": True, "step_sleep": 0.03, "timeout_s": 20.0}


@pytest.mark.timeout(240)
def test_sigkill_node_at_random_step_restart_final_params_equal(tmp_path):
    kill_at = random.Random(os.environ.get("LUWU_TEST_SEED", time.time_ns())).randint(6, 22)
    print(f"killing node 1 after step {kill_at}")
    args = ["--node.checkpoint_dir", str(tmp_path / "ckpt"), "--node.checkpoint_every", "5"]
    with luwu.local_cluster(2, node_args=args) as cluster:
        spec = dict(SPEC, nodes=cluster.addresses, world_size=2, out=str(tmp_path / "res"))
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        seen = kill_node_after_step(cluster, procs[0], kill_at)
        outs = wait_all(procs, 180)
    results = [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]
    assert all(r["recoveries"] >= 1 for r in results), "".join(seen) + outs[0][-2000:]
    want, _ = reference(dict(SPEC, world_size=2))
    for r in results:
        assert_params_close(r["params"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_sigterm_writes_checkpoint_and_restart_restores(tmp_path):
    args = ["--node.checkpoint_dir", str(tmp_path / "ckpt")]
    with luwu.local_cluster(1, node_args=args) as cluster:
        model = torch.nn.Linear(8, 4)
        opt = luwu.RemoteOptimizer(model, nodes=cluster.addresses, lr=0.1, timeout_s=10)
        try:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
            before = [p.detach().clone() for p in model.parameters()]
            cluster.procs[0].terminate()  # SIGTERM: the node checkpoints, then exits
            assert cluster.procs[0].wait(30) == 0
            assert CheckpointStore(str(tmp_path / "ckpt"), 0).latest().meta["step"] == 3
            cluster.restart(0)
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            with pytest.raises(luwu.RollbackError) as err:
                opt.step()
            assert err.value.step == 3
            assert opt.recover() == 3
            assert_params_close(list(model.parameters()), before, rtol=0, atol=0)
        finally:
            opt.close()

"""Durable node state and exactly-once training under a node crash (rollback recovery)."""

import json
import os
import random
import time

import pytest
import torch
from checkpoint_files import rewrite_manifest, save_small
from harness import TRAIN, assert_params_close, kill_node_after_step, start_workers, wait_all
from workers.train import reference

import luwu
from luwu.switch_nodes.checkpoint import DATA, CheckpointStore, CorruptCheckpointError


def test_checkpoint_roundtrip_atomic_and_corruption_detected(tmp_path):
    store = CheckpointStore(str(tmp_path), node_index=0, keep=3)
    for step in (5, 10, 15, 20):
        save_small(store, step)
    assert [s for s, _ in store.list()] == [10, 15, 20]  # the oldest is pruned
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
    ck = store.latest()
    assert ck.meta["step"] == 20 and torch.equal(ck.tensors[0][0], torch.full((10,), 20.0))
    assert torch.equal(ck.tensors[0][1], torch.arange(10.0)) and torch.equal(
        ck.tensors[0][-1], torch.full((2,), 20.0)
    )
    # flip one byte of the newest's tensor file: it is detected and the previous one is used
    path = store.list()[-1][1] / DATA
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        store.load(path.parent)
    assert store.latest().meta["step"] == 15
    # a truncated file too
    p15 = store.list()[-2][1] / DATA
    p15.write_bytes(p15.read_bytes()[:-7])
    assert store.latest().meta["step"] == 10


@pytest.mark.parametrize("numel", [-5, 2**62, 11, 10.0, True])
def test_a_manifest_with_impossible_sizes_is_refused_before_allocating(tmp_path, numel):
    """A bucket size that is negative, huge, not an int or that does not match its segments is refused as
    corrupt before any tensor is allocated (its checksum valid), and the valid older checkpoint is used."""
    store = CheckpointStore(str(tmp_path), node_index=0, keep=3)
    for step in (5, 10):
        save_small(store, step)

    def change(m):
        m["buckets"][0]["spec"][2] = numel
        return json.dumps(m).encode()

    rewrite_manifest(store.list()[-1][1], change)
    with pytest.raises(CorruptCheckpointError):
        store.load(store.list()[-1][1])
    assert store.latest().meta["step"] == 5


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path), node_index=0, keep=3)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_small(store, 5)
    assert list(tmp_path.iterdir()) == []


SPEC = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01},
    "steps": 30,
    "resilient": True,
    "step_sleep": 0.03,
    "timeout_s": 20.0,
}


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
                opt.synchronize()  # (per-layer waits: or at the weights' next read)
            assert err.value.step == 3
            assert opt.recover() == 3
            assert_params_close(list(model.parameters()), before, rtol=0, atol=0)
        finally:
            opt.close()


@pytest.mark.timeout(120)
def test_a_node_restarted_without_checkpoints_says_its_state_is_lost():
    """No checkpoint_dir: the restarted node comes back empty, and the worker gets NodeStateLostError
    saying what happened and what to do (it used to be "HEARTBEAT from a peer that did not say HELLO")."""
    with luwu.local_cluster(1) as cluster:
        model = torch.nn.Linear(8, 4)
        opt = luwu.RemoteOptimizer(
            model, nodes=cluster.addresses, lr=0.1, timeout_s=10, rank=0, world_size=1
        )
        try:
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.synchronize()  # step 0 complete before the kill
            cluster.kill(0)
            cluster.restart(0)
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            with pytest.raises(
                luwu.NodeStateLostError, match="restarted without node.checkpoint_dir"
            ):
                opt.step()
                opt.synchronize()  # (per-layer waits: or at the weights' next read)
        finally:
            opt.close()


@pytest.mark.timeout(180)
def test_a_full_checkpoint_disk_does_not_stop_training(tmp_path):
    """The periodic checkpoint cannot be written (a 64 KiB tmpfs): the node logs it and the steps go on
    (they used to wait for the checkpoint forever), and no partial file is left behind."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (root is needed)")
    try:
        with luwu.local_cluster(
            1, node_args=["--node.checkpoint_dir", str(disk), "--node.checkpoint_every", "2"]
        ) as cluster:
            model = torch.nn.Sequential(
                torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)
            )  # 1 MB of state: never fits
            opt = luwu.RemoteOptimizer(
                model.parameters(),
                nodes=cluster.addresses,
                lr=0.01,
                compression=False,
                rank=0,
                world_size=1,
                timeout_s=20,
            )
            try:
                for _ in range(5):
                    opt.zero_grad()
                    model(torch.randn(8, 256)).sum().backward()
                    opt.step()
                assert opt.worker.step_num == 5
            finally:
                opt.close()
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)

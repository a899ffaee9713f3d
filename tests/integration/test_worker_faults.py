"""Workers that die (SIGKILL) or stall (SIGSTOP): strict mode names the missing rank, elastic mode goes on."""

import signal
import time

import pytest
import torch
from harness import TRAIN, start_workers, wait_all

import luwu

SPEC = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01},
    "steps": 30,
    "step_sleep": 0.05,
    "timeout_s": 20.0,
}


def read_until(proc, text, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.strip() == text:
            return lines
    raise AssertionError(f"never saw {text!r}: {''.join(lines)[-2000:]}")


def end_workers(procs) -> None:
    """Kill every worker still running, a stopped one included."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_strict_mode_names_the_missing_rank(sig, tmp_path):
    args = ["--node.worker_policy", "strict", "--node.worker_timeout_s", "2"]
    with luwu.local_cluster(1, node_args=args) as cluster:
        spec = dict(SPEC, nodes=cluster.addresses, world_size=2, out=str(tmp_path / "res"))
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        try:
            read_until(procs[1], "STEP 5")
            procs[1].send_signal(sig)
            t0 = time.monotonic()
            out, _ = procs[0].communicate(timeout=60)
            assert procs[0].returncode != 0
            assert "WorkerLostError" in out and "workers [1]" in out, out[-2000:]
            assert time.monotonic() - t0 < 30
        finally:
            end_workers(procs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pull", [None, "int8_delta", "bf16_steps"])
def test_elastic_mode_drops_a_killed_worker_and_a_new_one_rejoins(tmp_path, pull):
    """Uncompressed, and with the delta pulls (each reply a step from what the workers hold): the joiner pulls
    the weights whole, then holds exactly what the worker that never left holds."""
    args = ["--node.worker_policy", "elastic", "--node.worker_timeout_s", "2"]
    compression = (
        None if pull is None else {"pull_codec": pull, "warmup_steps": 0, "link_gbps": 1.0}
    )
    with luwu.local_cluster(2, node_args=args) as cluster:
        # slow enough that rank 0 is still training when the new process has started and joins
        spec = dict(
            SPEC,
            nodes=cluster.addresses,
            world_size=2,
            out=str(tmp_path / "res"),
            resilient=True,
            steps=120,
            step_sleep=0.1,
            compression=compression,
        )
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        read_until(procs[1], "STEP 5")
        procs[1].kill()
        procs[1].wait(10)
        read_until(procs[0], "STEP 15")  # rank 0 goes on alone after the deadline
        rejoin = start_workers(TRAIN, spec, 2, tmp_path)  # a new rank 1 joins the running job
        rejoin[0].kill()
        rejoin[0].wait(10)
        wait_all([procs[0], rejoin[1]], 150)
    a, b = torch.load(f"{spec['out']}.rank0"), torch.load(f"{spec['out']}.rank1")
    assert len(b["losses"]) >= 10, "the new rank 1 joined a running job and trained with rank 0"
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)  # the rejoined worker holds the same weights at the end


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pull", [None, "bf16_steps"])
def test_elastic_mode_stalled_worker_is_dropped_then_recovers(tmp_path, pull):
    args = ["--node.worker_policy", "elastic", "--node.worker_timeout_s", "2"]
    compression = (
        None if pull is None else {"pull_codec": pull, "warmup_steps": 0, "link_gbps": 1.0}
    )
    with luwu.local_cluster(1, node_args=args) as cluster:
        spec = dict(
            SPEC,
            nodes=cluster.addresses,
            world_size=2,
            out=str(tmp_path / "res"),
            resilient=True,
            steps=120,
            step_sleep=0.1,
            compression=compression,
        )
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        read_until(procs[1], "STEP 5")
        procs[1].send_signal(signal.SIGSTOP)
        read_until(procs[0], "STEP 15")
        procs[1].send_signal(signal.SIGCONT)
        outs = wait_all(procs, 150)
    assert "RECOVERED" in outs[1] and "WorkerLostError" in outs[1], outs[1][-2000:]
    resumed = int(outs[1].split("RECOVERED ")[1].split()[0])
    assert resumed <= 110, f"rank 1 resumed at step {resumed}: it should train on with rank 0"
    a, b = torch.load(f"{spec['out']}.rank0"), torch.load(f"{spec['out']}.rank1")
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)

"""Two out-of-core nodes (node.state_dir, node.state_memory_bytes), real processes, 2 workers: one
node SIGKILLed the moment a worker has the replies of a step, again and again, restarts from its state files at
its newest committed step, the survivor rolls back to it (ROLLBACK), and the run ends bit for bit as
the failure-free one. A step is committed on every node before its last reply leaves, so no worker
pushes step t + 1 before both nodes committed step t: the survivor is never more than one step ahead
of the restarted node, which its two slots a bucket still hold."""

import json
import os
import random
import signal
import time

import pytest
import torch
from harness import TRAIN, run_training, start_workers, wait_all
from support.worker_output import read_until_step

import luwu
from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout

SLOT = 4 * 4096  # an AdamW bucket of at most 1024 elements: params, 2 moments, steps, 4 KiB each
BUDGET = 2 * SLOT
SPEC = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01},
    "steps": 44,
    "bucket_bytes": 1024,
    "resilient": True,
    "step_sleep": 0.02,
    "timeout_s": 20.0,
}
KILLS = 5  # (a worker gives up after 6 recoveries)


def _stop_and_kill(proc) -> None:
    """SIGSTOP the node at once (its last reply of the step just went out: without the commit before it,
    that step's write-backs are likely uncommitted still), then SIGKILL it."""
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _state_bytes(folder) -> int:
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    engine = IOEngine()
    StateFile.open(folder, layout, engine).close()
    engine.close()
    return sum(b.slot_bytes for b in layout.buckets)


@pytest.mark.timeout(600)
def test_sigkill_one_of_two_ooc_nodes_repeatedly_final_params_equal(tmp_path):
    rng = random.Random(os.environ.get("LUWU_TEST_SEED", time.time_ns()))
    with luwu.local_cluster(2) as c:
        want = [
            r["params"] for r in run_training(dict(SPEC, resilient=False), c.addresses, tmp_path)
        ]
    state_dir = tmp_path / "state"
    args = ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(BUDGET)]
    spec = dict(SPEC, out=str(tmp_path / "res"), world_size=2)
    seen, killed = [], []
    with luwu.local_cluster(2, node_args=args) as cluster:
        spec["nodes"] = cluster.addresses
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        target = 0
        for _ in range(KILLS):
            target += rng.randint(4, 7)
            node = rng.randrange(2)
            read_until_step(procs[0], target, seen)
            _stop_and_kill(cluster.procs[node])
            killed.append((target, node))
            cluster.restart(node)
        outs = wait_all(procs, 300)
        alive = [p.poll() is None for p in cluster.procs]
    print(f"killed (after step, node): {killed}")
    assert all(alive), outs[0][-3000:]
    results = [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]
    assert all(r["recoveries"] >= 1 for r in results), "".join(seen[-30:]) + outs[0][-2000:]
    for rank in range(2):
        for i, (a, b) in enumerate(zip(results[rank]["params"], want[rank])):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")
    for node in range(2):  # (both nodes out of core: their state is twice their budget or more)
        assert _state_bytes(state_dir / f"luwu-node{node}") >= 2 * BUDGET

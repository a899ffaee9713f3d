"""A worker killed between its pushes of a step leaves the nodes at two steps; restarted with
``resume=True`` it is refused at once, with the fix (resumed, it would train on partly newer weights,
and its first step's global round would wait for norms no node keeps: a timeout, measured here before
the refusal)."""

import subprocess
import sys
import time

import pytest
import torch

import luwu

JOB = "resume-mixed"
BUCKET_BYTES = 64 * 64 * 4 + 64 * 4  # one Linear layer a bucket: several buckets on each node

# trains with the real RemoteOptimizer and dies (SIGKILL-like, no BYE) at the first push of step
# `die` to a node other than the one that step's pushes went to so far, a second after those
DIES_BETWEEN_NODES = r"""
import os, sys, time, torch, luwu
from luwu.gpu_workers.client import WorkerClient
from luwu.protocol.messages import Op

nodes, die = sys.argv[1].split(","), int(sys.argv[2])
send, seen = WorkerClient.send, set()

def dying_send(self, node, header, payload=(), priority=None):
    if header.get("op") == Op.PUSH and header.get("step") == die:
        if seen and node not in seen:
            time.sleep(1.0)  # the pushes to the first node are out
            os._exit(9)
        seen.add(node)
    return send(self, node, header, payload, priority)

WorkerClient.send = dying_send
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = luwu.RemoteOptimizer(model, "adamw", nodes=nodes, job=sys.argv[3], lr=0.01,
                           compression=False, bucket_bytes=int(sys.argv[4]), timeout_s=30)
for step in range(die + 1):
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.timeout(120)
def test_a_worker_resumed_after_dying_between_its_pushes_is_refused_with_the_fix():
    # (a killed worker's rank is free once the node has not heard from it for worker_timeout_s)
    with luwu.local_cluster(2, job=JOB, node_args=["--node.worker_timeout_s", "2"]) as cluster:
        args = [",".join(cluster.addresses), "2", JOB, str(BUCKET_BYTES)]
        died = subprocess.run(
            [sys.executable, "-c", DIES_BETWEEN_NODES, *args], timeout=90, capture_output=True
        )
        assert died.returncode == 9, died.stderr.decode()[-2000:]
        time.sleep(3)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        kw = dict(job=JOB, lr=0.01, compression=False, bucket_bytes=BUCKET_BYTES, timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(luwu.StepMismatchError) as err:
            luwu.RemoteOptimizer(model, "adamw", nodes=cluster.addresses, resume=True, **kw)
        said = str(err.value)
        assert time.monotonic() - t0 < 20  # at once, not after a timeout
        assert "cannot resume job" in said and "step 2 was already applied" in said, said
        assert "node.checkpoint_dir" in said, said
        # the refused worker holds no rank (it said BYE): asked again, the same refusal, not a held rank
        with pytest.raises(luwu.StepMismatchError, match="cannot resume job"):
            luwu.RemoteOptimizer(model, "adamw", nodes=cluster.addresses, resume=True, **kw)


def test_nodes_at_one_step_say_nothing():
    from luwu.resumed import mixed_steps

    same = [{"versions": {"0": 3, "2": 3}}, {"versions": {"1": 3}}]
    assert mixed_steps(same, 0, JOB) is None and mixed_steps([], 0, JOB) is None
    two = [{"versions": {"0": 3, "2": 4}}, {"versions": {"1": 4, "3": 3}}]
    said = mixed_steps(two, 1, JOB)
    assert "worker 1" in said and "node 0: bucket 2; node 1: bucket 1" in said, said

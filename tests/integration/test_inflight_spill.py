"""Two-phase steps on an out-of-core node with a push budget, real processes: the summed gradients
that wait for the workers' COMMIT are spilled to a scratch file under node.state_dir while pushes wait
for room, so the pushes in flight stay within node.push_memory_bytes, and the weights are those of an
in-RAM node without a budget, bit for bit.

A two-phase step (global-norm clipping, AMP, every job's first step) keeps each (step, bucket)'s fp32
sum until COMMIT, which needs every bucket's norm: without the spill the node holds all its buckets'
accumulators at once (8 buckets here, the budget is 3 buckets' pushes) and its in-flight peak passes
the budget. Two workers, compression off, clipping at every step; and a job's first step without
clipping.
"""

import pytest
import torch
from harness import run_training
from support.node_metrics import free_port, scrape

import luwu

#: the MLP of tests/workers/train.py in buckets of 256 parameters: 8 buckets
NEED = 256 * 4 * (2 + 2)  # a bucket's accumulator, 2 workers' fp32 pushes and its reply
PUSHES = 3 * NEED  # three open (step, bucket)s: a two-phase step without the spill holds 8
WINDOW = 2 * 4 * 4096  # two buckets' slots (weights, 2 moments, steps: 4 KiB each)
PULLS = 1797 * 4  # the fp32 weights rank 1 pulls at its start: one answer, larger than NEED


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "spec",
    [
        {"steps": 6, "max_grad_norm": 1.0},  # global-norm clipping at every step
        {"steps": 1},  # a job's first step: two-phase without clipping
    ],
    ids=["clipping", "first-step"],
)
def test_two_phase_sums_are_spilled_within_the_push_budget_and_weights_equal(spec, tmp_path):
    spec = dict(spec, bucket_bytes=1024, hyper={"lr": 0.01})
    with luwu.local_cluster(1) as c:
        want = [r["params"] for r in run_training(spec, c.addresses, tmp_path)]
    port = free_port()
    state = tmp_path / "state"
    args = [
        *("--node.state_dir", str(state)),
        *("--node.state_memory_bytes", str(WINDOW + PUSHES)),
        *("--node.push_memory_bytes", str(PUSHES)),
        *("--metrics.port", str(port)),
    ]
    with luwu.local_cluster(1, node_args=args) as c:
        got = [r["params"] for r in run_training(spec, c.addresses, tmp_path, timeout_s=200)]
        m = scrape(port, "luwu_node_inflight", "luwu_node_spill")
    print(m)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(got[rank], want[rank])):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda s, i=i: f"param {i}: {s}")
    assert m["luwu_node_inflight_limit_bytes"] == PUSHES
    # past the budget only by what an overdraft let in: a push (NEED; workers pushing in different
    # orders) or the answer to rank 1's first PULLs (they wait for room, and go past it when nothing
    # in flight can be released without them: PULLS, more than NEED); without the spill
    # a two-phase step holds all 8 buckets' 16 B/param (28752 B) at once
    over = m["luwu_node_inflight_overdrafts_total"] * NEED + PULLS
    assert 0 < m["luwu_node_inflight_peak_bytes"] <= PUSHES + over, m
    # sums went to the scratch file (a page each) and came back at COMMIT
    assert m["luwu_node_spill_bytes_written_total"] >= 4096, m
    assert m["luwu_node_spill_bytes_read_total"] >= 4096, m
    assert m["luwu_node_inflight_bytes"] == 0, m  # everything given back once the job is done
    assert not list(state.rglob("*.scratch")), "the scratch file outlives the node"

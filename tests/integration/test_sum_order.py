"""Four workers, real processes: the node sums each (step, bucket)'s pushes as a pairwise tree over
the ranks (switch_nodes/summation.py), so a run whose rank 0 is always late and one whose ranks 2 and
3 are end with the same weights bit for bit. Summed as they arrived, three or more pushes gave bits
that depended on the network's timing (tests/unit/test_summation.py shows the orders differ)."""

import pytest
from harness import assert_params_close, run_training
from workers.train import reference

import luwu

SPEC = {"optimizer": "adamw", "hyper": {"lr": 0.01}, "steps": 6, "batch": 4, "bucket_bytes": 2048}


@pytest.mark.timeout(300)
def test_four_workers_give_the_same_bits_whatever_order_their_pushes_arrive_in(tmp_path):
    runs = []
    for late in ([0], [2, 3]):
        with luwu.local_cluster(2) as cluster:
            spec = dict(SPEC, late_ranks=late)
            runs.append(run_training(spec, cluster.addresses, tmp_path, world_size=4))
    for rank in range(4):
        for i, (a, b) in enumerate(zip(runs[0][rank]["params"], runs[1][rank]["params"])):
            assert a.equal(b), f"rank {rank} parameter {i}: the bits depend on the arrival order"
    want, _ = reference(dict(SPEC, world_size=4))  # and it is the average torch's AdamW steps on
    assert_params_close(runs[0][0]["params"], want, rtol=1e-5, atol=1e-6)

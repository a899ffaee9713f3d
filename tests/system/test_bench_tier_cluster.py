"""A tiny run of the switch tier's rack study (benchmarks/bench_tier_cluster.py): 4 workers in 2 racks
behind 1 Gbit/s uplinks, 2 nodes on the core, LuWu through 2 aggregators against LuWu flat, compression
off. The tier trains the flat run's model bit for bit, each rack's uplink carries one push of the model
a step instead of one per worker, and nothing is left behind. Behaviour only: no timing is asserted.

Needs root, iproute2, veth, bridge and tbf; skipped with the reason otherwise. Only addresses inside
the namespaces built here are contacted.
"""

from __future__ import annotations

import os

import pytest

from benchmarks import bench_tier_cluster as bt
from benchmarks import cluster_study as cs

pytestmark = pytest.mark.system

SETTINGS = cs.Settings(
    dims=(64, 256, 256, 10),
    batch=32,
    steps=8,
    warmup=4,
    eval_every=4,
    eval_samples=256,
    subspace=8,
    lr=3e-3,
    bucket_bytes=64 * 1024,
    compression_warmup=2,
    timeout_s=60.0,
)
SHAPE = bt.Shape(workers=4, groups=2, nodes=2)


@pytest.fixture(scope="module")
def rows():
    ok, reason = cs.netns_available()
    if not ok:
        pytest.skip(reason)
    prefix = f"luwu-{os.getpid()}-"
    runs = bt.competitors(SHAPE, only=["fp32_tier", "fp32_flat"])
    got, topology, failures = bt.run_all(runs, SHAPE, SETTINGS, reps=1)
    assert failures == []
    assert not [ns for ns in cs.list_namespaces() if ns.startswith(prefix)]
    assert [h["rack"] for h in topology] == [0, 0, 1, 1, None, None, 0, 1]
    return {r["layout"]: r for r in got}


@pytest.mark.timeout(420)
def test_the_tier_trains_the_flat_model_bit_for_bit(rows):
    assert set(rows) == {"tier", "flat"}
    assert bt.same_curves(list(rows.values())) is True
    first, last = rows["tier"]["curve"][0]["eval_loss"], rows["tier"]["curve"][-1]["eval_loss"]
    assert last < first


@pytest.mark.timeout(420)
def test_each_uplink_carries_one_push_through_the_tier(rows):
    model_bytes = 4 * SETTINGS.num_params
    tier, flat = rows["tier"], rows["flat"]
    for k in range(SHAPE.groups):
        # kernel counters of the uplink: headers and acknowledgements on top of the payload
        assert 1.0 <= tier[f"rack{k}_up_mb"] * 1e6 / model_bytes < 1.15, tier[f"rack{k}_up_mb"]
        assert 1.0 <= tier[f"rack{k}_down_mb"] * 1e6 / model_bytes < 1.15
        per_worker = flat[f"rack{k}_up_mb"] * 1e6 / (SHAPE.size * model_bytes)
        assert 1.0 <= per_worker < 1.15, flat[f"rack{k}_up_mb"]
    assert tier["node_rx_mb"] < 0.6 * flat["node_rx_mb"]
    assert len(tier["agg_cpu_share"]) == SHAPE.groups and min(tier["agg_cpu_share"]) > 0
    assert flat["agg_cpu_share"] == []

"""The switch tier: real ``luwu aggregator`` daemons in front of real nodes, real worker processes.

An aggregator sums its group's pushes of each (step, bucket) in the node's own order and sends one,
and passes each reply on to its workers: with compression off, a job trained through aggregators
ends with the bits of the same job trained without them, and the nodes receive one push per bucket
from each aggregator instead of one from each worker (their own ``/metrics``)."""

import random

import pytest
import torch
from harness import (
    STREAM,
    TRAIN,
    assert_params_close,
    run_streaming,
    run_training,
    start_workers,
)
from support.node_metrics import scrape
from support.worker_output import read_until_step
from workers.train import reference

import luwu

SPEC = {"optimizer": "adamw", "hyper": {"lr": 0.01}, "steps": 5, "batch": 4, "bucket_bytes": 2048}
METRICS = ["--metrics.port", "0"]


def _pushes(cluster) -> tuple[float, float]:
    """(pushes, push bytes) the nodes received, from their /metrics."""
    n = b = 0.0
    for url in cluster.metrics_urls:
        got = scrape(int(url.rsplit(":", 1)[1]), "luwu_node_pushes_total", "luwu_node_bytes_rec")
        n += got["luwu_node_pushes_total"]
        b += got['luwu_node_bytes_received_total{op="push"}']
    return n, b


def _sent(cluster) -> float:
    """Weight bytes (UPDATE payloads) the nodes sent, from their /metrics."""
    got = [scrape(int(u.rsplit(":", 1)[1]), "luwu_node_bytes_sent") for u in cluster.metrics_urls]
    return sum(g.get('luwu_node_bytes_sent_total{op="update"}', 0.0) for g in got)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,aggregators", [(4, 2), (3, 1)])
def test_training_through_aggregators_equals_training_without_them(tmp_path, world, aggregators):
    with luwu.local_cluster(2, node_args=METRICS) as flat:
        want = run_training(SPEC, flat.addresses, tmp_path, world_size=world)
        flat_pushes = _pushes(flat)
    with luwu.local_cluster(
        2, node_args=METRICS, aggregators=aggregators, world_size=world, aggregator_args=METRICS
    ) as tier:
        spec = dict(SPEC, aggregators={str(r): tier.aggregator_for(r) for r in range(world)})
        got = run_training(spec, tier.addresses, tmp_path, world_size=world)
        tier_pushes = _pushes(tier)
        agg = [
            scrape(int(u.rsplit(":", 1)[1]), "luwu_aggregator")
            for u in tier.aggregator_metrics_urls
        ]
    for rank in range(world):
        for i, (a, b) in enumerate(zip(got[rank]["params"], want[rank]["params"])):
            assert a.equal(b), f"rank {rank} parameter {i}: not the bits of the flat run"
    ref, _ = reference(dict(SPEC, world_size=world))
    assert_params_close(got[0]["params"], ref, rtol=1e-5, atol=1e-6)
    # groups of 2 (2, 2) go up as one push each; a group of 3 as a sum of 2 and one push as it came
    per_group = {(4, 2): 1, (3, 1): 2}[(world, aggregators)]
    expect = flat_pushes[0] * aggregators * per_group / world
    assert tier_pushes[0] == pytest.approx(expect, rel=0.05), (tier_pushes, flat_pushes)
    assert tier_pushes[1] < flat_pushes[1] * 0.75
    # the aggregators' own /metrics: what they summed, sent up and passed on
    sent_up = sum(
        a["luwu_aggregator_sums_sent_total"] + a["luwu_aggregator_pushes_passed_total"] for a in agg
    )
    assert sent_up == tier_pushes[0]
    summed = sum(a["luwu_aggregator_pushes_summed_total"] for a in agg)
    assert summed + sum(a["luwu_aggregator_pushes_passed_total"] for a in agg) == flat_pushes[0]
    up = sum(a['luwu_aggregator_bytes_sent_total{direction="nodes",op="push"}'] for a in agg)
    assert up == tier_pushes[1]
    assert all(a["luwu_aggregator_group_wait_seconds_count"] > 0 for a in agg)


@pytest.mark.timeout(300)
def test_a_model_whose_links_are_probed_trains_through_aggregators(tmp_path):
    """Buckets of a few MiB a node: each worker probes its links (STATS with a payload, answered to
    the rank that asked, which the aggregator passes back to it) before the first step. Before the
    node named the asking rank in its answer, every answer went to rank 0 and the others waited."""
    spec = dict(SPEC, steps=2, hidden=20000, bucket_bytes=4 << 20)
    with luwu.local_cluster(2) as flat:
        want = run_training(spec, flat.addresses, tmp_path, world_size=4, timeout_s=90)
    with luwu.local_cluster(2, aggregators=2, world_size=4) as tier:
        spec["aggregators"] = {str(r): tier.aggregator_for(r) for r in range(4)}
        got = run_training(spec, tier.addresses, tmp_path, world_size=4, timeout_s=90)
    for i, (a, b) in enumerate(zip(got[3]["params"], want[3]["params"])):
        assert a.equal(b), f"parameter {i}: not the bits of the flat run"


@pytest.mark.timeout(300)
def test_streaming_workers_through_aggregators_equal_the_flat_run(tmp_path):
    """Streaming mode (weights fetched per unit, pushes answered with an ack, the next units' weights
    sent unasked): its pushes are summed, and a group's PULLs of a bucket in flight at once go up
    once, their answer passed to each: the nodes send fewer weight bytes."""
    spec = {"steps": 4}
    with luwu.local_cluster(2, node_args=METRICS) as flat:
        want = run_streaming(spec, flat.addresses, tmp_path, world_size=4)
        flat_out = _sent(flat)
    with luwu.local_cluster(
        2, node_args=METRICS, aggregators=2, world_size=4, aggregator_args=METRICS
    ) as tier:
        spec["aggregators"] = {str(r): tier.aggregator_for(r) for r in range(4)}
        got = run_streaming(spec, tier.addresses, tmp_path, world_size=4, timeout_s=120)
        tier_out = _sent(tier)
        shared = sum(
            scrape(int(u.rsplit(":", 1)[1]), "luwu_aggregator_fetches")[
                "luwu_aggregator_fetches_shared_total"
            ]
            for u in tier.aggregator_metrics_urls
        )
    assert shared > 0 and tier_out < 0.75 * flat_out, (flat_out, tier_out, shared)
    for rank in (0, 3):
        for name, w in want[rank]["params"].items():
            assert got[rank]["params"][name].equal(w), (
                f"rank {rank} {name}: not the flat run's bits"
            )


@pytest.mark.timeout(300)
def test_compressed_pushes_go_up_compressed_under_the_uplinks_policy(tmp_path):
    """Workers that compress (int8 with error feedback after the warm-up, told 1 Gbit/s): each
    aggregator sums their pushes in fp32 and sends the sum under its own uplink's policy (told 1
    Gbit/s: int8, its own error feedback), so the nodes receive ~1 B a parameter a block, not 4;
    the run trains as the flat compressed run does."""
    comp = {"link_gbps": 1.0, "warmup_steps": 2}
    spec = dict(SPEC, steps=8, hidden=512, compression=comp)
    with luwu.local_cluster(2, node_args=METRICS) as flat:
        want = run_training(spec, flat.addresses, tmp_path, world_size=4)
    link = ["--compression.link_gbps", "1", "--compression.warmup_steps", "2", *METRICS]
    with luwu.local_cluster(
        2, node_args=METRICS, aggregators=2, world_size=4, aggregator_args=link
    ) as tier:
        spec["aggregators"] = {str(r): tier.aggregator_for(r) for r in range(4)}
        got = run_training(spec, tier.addresses, tmp_path, world_size=4)
        agg = [
            scrape(int(u.rsplit(":", 1)[1]), "luwu_aggregator")
            for u in tier.aggregator_metrics_urls
        ]
        node_in = _pushes(tier)[1]
    got_in = sum(
        a['luwu_aggregator_bytes_received_total{direction="workers",op="push"}'] for a in agg
    )
    # 4 workers' compressed pushes in, 2 compressed sums out: about half, not 2x (fp32 sums would be)
    assert node_in < 0.7 * got_in, (node_in, got_in)
    ref, _ = reference(dict(spec, world_size=4, compression=None))
    for i, (a, b, r) in enumerate(zip(got[0]["params"], want[0]["params"], ref)):
        # as close to the fp32 reference as the flat compressed run is (compression's own error)
        assert (a - r).norm() <= 1.5 * (b - r).norm() + 1e-6, f"parameter {i}"


def _kill_one_aggregator_at(spec: dict, tmp_path, step: int, script=TRAIN) -> list[dict]:
    """Train ``spec`` through 2 aggregators, SIGKILL the first once rank 0 reached ``step``; each
    rank's result (every worker must finish)."""
    world = 4
    with luwu.local_cluster(2, aggregators=2, world_size=world) as tier:
        out = str(tmp_path / f"killed-{step}")
        spec = dict(spec, nodes=tier.addresses, world_size=world, out=out)
        spec["aggregators"] = {str(r): tier.aggregator_for(r) for r in range(world)}
        procs = start_workers(script, spec, world, tmp_path)
        seen: list[str] = []
        try:
            read_until_step(procs[0], step, seen)
            tier.aggregator_procs[0].kill()
            outs = [p.communicate(timeout=90)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        failed = [
            f"rank {r}:\n{t[-6000:]}" for r, (p, t) in enumerate(zip(procs, outs)) if p.returncode
        ]
        assert not failed, "".join(seen) + "\n".join(failed)
        for rank in (0, 1):  # (its workers said what they did)
            assert "goes on directly" in outs[rank], outs[rank][-2000:]
    return [torch.load(f"{out}.rank{r}") for r in range(world)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("clip", [None, 1.0], ids=["one-phase", "two-phase"])
def test_an_aggregator_killed_at_a_random_step_changes_nothing(tmp_path, clip):
    """A SIGKILLed aggregator's workers fall back to the nodes, send again what it had not answered,
    and the job ends with the bits of the run nobody killed (compression off): no gradient lost or
    counted twice. Two-phase (global-norm clipping): the NORMs and the COMMIT go again too."""
    step = random.Random().randint(2, 14)
    spec = dict(SPEC, steps=20, step_sleep=0.05, max_grad_norm=clip, timeout_s=30.0)
    with luwu.local_cluster(2) as flat:
        want = run_training(spec, flat.addresses, tmp_path, world_size=4)
    got = _kill_one_aggregator_at(spec, tmp_path, step)
    for rank in range(4):
        for i, (a, b) in enumerate(zip(got[rank]["params"], want[rank]["params"])):
            assert a.equal(b), f"killed at step {step}: rank {rank} parameter {i} differs"


@pytest.mark.timeout(300)
def test_streaming_workers_whose_aggregator_is_killed_fetch_and_push_on_exactly_once(tmp_path):
    """Streaming mode: the PULLs of units the dead aggregator had not answered go again with the
    pushes; the weights (held by the nodes) end as in the run nobody killed."""
    step = random.Random().randint(2, 8)
    spec = {"steps": 12, "step_sleep": 0.05, "timeout_s": 30.0}
    with luwu.local_cluster(2) as flat:
        want = run_streaming(spec, flat.addresses, tmp_path, world_size=4)
    got = _kill_one_aggregator_at(spec, tmp_path, step, script=STREAM)
    for rank in (0, 3):
        for name, w in want[rank]["params"].items():
            assert got[rank]["params"][name].equal(w), f"killed at step {step}: rank {rank} {name}"

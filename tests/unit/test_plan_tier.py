"""`luwu plan`'s switch tier: hand-computed aggregator terms, the group-size recommendation, checks
and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from luwu.cli import main
from luwu.plan import PlanSpec, plan, recommend
from luwu.protocol.errors import ConfigError

P = 16_700_000  # the cluster study's MLP
GBIT = 1e9 / 8  # bytes/s of 1 Gbit/s


def spec(**kw) -> PlanSpec:
    """The issue's layout: 8 workers, 2 nodes, fp32 both ways, no codec cost, full line rate;
    workers on 10 Gbit/s, nodes on 1 Gbit/s."""
    base = dict(
        num_params=P,
        workers=8,
        nodes=2,
        worker_gbps=10.0,
        node_gbps=1.0,
        push_bytes_per_elem=4.0,
        pull_bytes_per_elem=4.0,
        compute_s=0.2,
        protocol_efficiency=1.0,
        opt_params_per_s=1e9,
    )
    return PlanSpec(**(base | kw))


def test_two_groups_of_four_cut_node_traffic_fourfold_by_hand():
    flat = plan(spec())
    tier = plan(spec(group_size=4, group_gbps=10.0, aggregator_gbps=1.0))
    t = tier.tier
    assert t.aggregators == 2 and t.group_size == 4
    # a node's shard is P/2; flat it hears 8 workers, tiered 2 aggregators: 4x fewer bytes each way
    assert flat.node_down_bytes == pytest.approx((8 * P / 2 * 4,) * 2)
    assert tier.node_down_bytes == pytest.approx((2 * P / 2 * 4,) * 2)
    assert tier.node_up_bytes == pytest.approx((2 * P / 2 * 4,) * 2)
    assert flat.node_down_bytes[0] / tier.node_down_bytes[0] == pytest.approx(4.0)
    # the aggregator: its 4 workers' pushes in at 10 Gbit/s, one sum up at 1 Gbit/s
    assert t.group_in_bytes == pytest.approx(4 * 4 * P)
    assert t.group_in_s == pytest.approx(4 * 4 * P / (10 * GBIT))
    assert t.uplink_up_bytes == t.uplink_down_bytes == pytest.approx(4 * P)
    assert t.uplink_up_s == pytest.approx(4 * P / GBIT)
    assert t.group_out_s == pytest.approx(t.group_in_s)
    assert t.cpu_s == 0.0  # no codec cost given
    # six stages in series, pipelined over the 16 buckets
    k = math.ceil(4 * P / (4 << 20))
    node_link = 2 * P / 2 * 4 / GBIT
    stages = (
        max(4 * P / (10 * GBIT), t.group_in_s),  # worker up / group in
        0.0,  # the sum
        max(t.uplink_up_s, node_link),  # uplink up / node down
        P / 2 / 1e9,  # the node's optimizer
        max(node_link, t.uplink_down_s),
        max(t.group_out_s, 4 * P / (10 * GBIT)),
    )
    path = max(stages) + (sum(stages) - max(stages)) / k
    assert tier.path_s == pytest.approx(path)
    assert tier.push_s == pytest.approx(max(stages[:3]))
    assert tier.pull_s == pytest.approx(max(stages[4:]))
    f = 2 / 3 * (1 - 1 / k)
    C = 0.2
    assert tier.sync_step_s == pytest.approx(C + max(path - f * C, sum(stages) / k))
    assert tier.sync_step_s < flat.sync_step_s / 2
    # an aggregator's uplink carries one model's worth, as much as a node's link now: a tie
    assert tier.resources["aggregator uplink up"] == pytest.approx(
        tier.resources["node 0 downlink"]
    )
    assert tier.bottleneck == "node 0 downlink"  # (ties go to the first in order)
    assert tier.resources["aggregator group link in"] == pytest.approx(t.group_in_s)


def test_the_aggregator_decodes_each_push_and_encodes_one_sum():
    s = spec(group_size=4, aggregator_threads=2, push_decode_s_per_elem=2e-9)
    s = dataclasses.replace(s, push_encode_s_per_elem=1e-9)
    p = plan(s)
    assert p.tier.cpu_s == pytest.approx(P * (4 * 2e-9 + 1e-9) / 2)
    # a node decodes one push per aggregator: 2, not 8
    flat = plan(dataclasses.replace(s, group_size=None))
    node_decode = flat.node_cpu_s[0] - flat.node_opt_s[0]
    assert p.node_cpu_s[0] - p.node_opt_s[0] == pytest.approx(node_decode * 2 / 8)


def test_shared_cores_count_the_aggregators_and_bytes_crossing_twice():
    kw = dict(shared_cores=2.0, net_cpu_s_per_byte=1e-9, push_decode_s_per_elem=1e-9)
    flat, tier = plan(spec(**kw)), plan(spec(group_size=8, **kw))
    moved_flat = 8 * (4 * P + 4 * P)
    assert flat.net_cpu_s == pytest.approx(1e-9 * moved_flat)
    assert tier.net_cpu_s == pytest.approx(1e-9 * (moved_flat + 1 * (4 * P + 4 * P)))
    work = 8 * (tier.compute_eff_s / 4 + tier.write_s / 4) + sum(tier.node_cpu_s)
    work += tier.tier.cpu_s + tier.net_cpu_s  # (compute_eff_s is already 4x: 8 workers, 2 cores)
    assert tier.shared_cpu_s == pytest.approx(work / 2)


def test_recommendation_picks_few_aggregators_where_node_links_bind_and_flat_where_not():
    rec = recommend(spec())
    by = {o.group_size: o for o in rec.group_options}
    assert None in by and 2 in by and 8 in by
    assert rec.group_size is not None and rec.group_size >= 4
    assert by[rec.group_size].step_s < by[None].step_s / 2
    # the fewest aggregators within tolerance of the best
    best = min(o.step_s for o in rec.group_options)
    fewer = [
        o
        for o in rec.group_options
        if o.group_size and o.aggregators < by[rec.group_size].aggregators
    ]
    assert all(o.step_s > best * 1.05 for o in fewer)
    # fast node links, a slow aggregator uplink: the tier only adds a hop, flat stays
    rec = recommend(spec(node_gbps=100.0, worker_gbps=100.0, aggregator_gbps=1.0))
    assert rec.group_size is None


@pytest.mark.parametrize(
    "bad, word",
    [
        (dict(group_size=0), "group_size"),
        (dict(group_size=9), "larger than workers=8"),
        (dict(group_size=2, aggregator_gbps=0.0), "aggregator_gbps"),
        (dict(aggregator_threads=0), "aggregator_threads"),
    ],
)
def test_bad_tier_settings_are_refused_by_name(bad, word):
    with pytest.raises(ConfigError, match=word):
        spec(**bad)


def test_luwu_plan_shows_the_aggregators_and_recommends_a_group(capsys):
    common = ["--params", "16.7M", "--workers", "8", "--nodes", "2", "--compute-ms", "200"]
    common += ["--worker-gbps", "10", "--node-gbps", "1", "--push-codec", "none"]
    common += ["--pull-codec", "none"]
    assert main(["plan", *common, "--group-size", "4", "--aggregator-gbps", "1"]) == 0
    out = capsys.readouterr().out
    assert "aggregator group link in (2 of 4 workers)" in out
    assert "aggregator uplink (one sum)" in out
    assert "switch tier: groups of" in out
    assert main(["plan", *common, "--group-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["tier"]["aggregators"] == 2
    assert data["recommendation"]["group_size"] >= 4
    assert main(["plan", *common, "--group-size", "9"]) == 2
    assert "group_size" in capsys.readouterr().err

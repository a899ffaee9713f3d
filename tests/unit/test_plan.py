"""`luwu plan`: hand-computed cases of the step model, its recommendations, input checks and the CLI."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.plan import (
    PlanSpec,
    add_arguments,
    codec_profile,
    parse_count,
    plan,
    recommend,
    run,
    spec_with_codecs,
    stream_refetch_share,
)
from luwu.protocol.errors import ConfigError

P = 16_700_000  # the 1024 -> 2048 x4 -> 1000 MLP
GBIT = 1e9 / 8  # bytes/s of 1 Gbit/s


def spec(**kw) -> PlanSpec:
    """1 Gbit/s everywhere at full line rate, fp32 both ways, no codec cost: numbers by hand."""
    base = dict(
        num_params=P,
        workers=4,
        nodes=1,
        worker_gbps=1.0,
        node_gbps=1.0,
        push_bytes_per_elem=4.0,
        pull_bytes_per_elem=4.0,
        compute_s=0.2,
        protocol_efficiency=1.0,
        opt_params_per_s=1e9,
    )
    base.update(kw)
    return PlanSpec(**base)


def test_one_node_incast_binds_at_one_gbit():
    p = plan(spec())
    assert p.node_down_bytes == pytest.approx((4 * 66.8e6,))  # 267.2 MB: every worker's whole model
    assert p.node_down_s[0] == pytest.approx(267.2e6 / GBIT)  # 2.14 s
    assert p.node_up_bytes[0] == pytest.approx(267.2e6)
    assert p.worker_up_bytes == pytest.approx(66.8e6)
    assert p.worker_up_s == pytest.approx(66.8e6 / GBIT)
    assert p.worker_down_s == pytest.approx(66.8e6 / GBIT)
    assert p.node_opt_s[0] == pytest.approx(P / 1e9)
    assert p.bottleneck == "node 0 downlink"
    assert p.node_link_binds

    # pipeline: 16 buckets of 4 MiB, push and pull limited by the node link
    k = math.ceil(4 * P / (4 << 20))
    assert p.num_buckets == k == 16
    link = 267.2e6 / GBIT
    stages = (link, P / 1e9, link, 0.0)
    path = max(stages) + (sum(stages) - max(stages)) / k
    f = 2 / 3 * (1 - 1 / k)
    assert p.overlap_fraction == pytest.approx(f)
    assert p.path_s == pytest.approx(path)
    assert p.sync_step_s == pytest.approx(0.2 + path - f * 0.2)
    assert p.delayed_step_s == pytest.approx(max(0.2, link, ((1 - f) * 0.2 + path) / 2))


def test_two_nodes_halve_each_node_link():
    one, two = plan(spec()), plan(spec(nodes=2))
    for j in range(2):
        assert two.node_down_bytes[j] == pytest.approx(one.node_down_bytes[0] / 2)
        assert two.node_up_s[j] == pytest.approx(one.node_up_s[0] / 2)
        assert two.node_opt_s[j] == pytest.approx(one.node_opt_s[0] / 2)
    assert two.worker_up_bytes == one.worker_up_bytes  # a worker still sends the whole model
    assert two.sync_step_s < one.sync_step_s


def test_compression_reduces_bytes_and_time():
    fp32 = plan(spec())
    bf16 = plan(spec(push_bytes_per_elem=2.0, pull_bytes_per_elem=2.0))
    int8 = plan(spec_with_codecs(spec(), "int8", "int8", codec_costs=False))
    assert bf16.worker_up_bytes == pytest.approx(fp32.worker_up_bytes / 2)
    assert bf16.node_down_bytes[0] == pytest.approx(fp32.node_down_bytes[0] / 2)
    assert int8.node_down_bytes[0] < bf16.node_down_bytes[0]
    assert int8.sync_step_s < bf16.sync_step_s < fp32.sync_step_s


def test_capacities_and_node_bandwidth_weight_the_shards():
    p = plan(spec(nodes=2, capacities=(3.0, 1.0), node_gbps=(3.0, 1.0)))
    assert p.shard_params == pytest.approx((0.75 * P, 0.25 * P))
    assert p.node_down_bytes[0] == pytest.approx(3 * p.node_down_bytes[1])
    assert p.node_down_s[0] == pytest.approx(
        p.node_down_s[1]
    )  # weighted like the links: equal times


def test_protocol_efficiency_scales_link_time():
    assert plan(spec(protocol_efficiency=0.5)).worker_up_s == pytest.approx(
        2 * plan(spec()).worker_up_s
    )


def test_codec_and_optimizer_time_on_the_node():
    s = spec(
        push_decode_s_per_elem=2e-9,
        pull_encode_s_per_elem=1e-9,
        node_threads=2,
        push_encode_s_per_elem=3e-9,
        pull_decode_s_per_elem=4e-9,
    )
    p = plan(s)
    # W decodes of the pushes + 1 encode of the reply, over the shard, shared by the threads
    assert p.node_cpu_s[0] == pytest.approx(P * (1 / 1e9 + 4 * 2e-9 + 1e-9) / 2)
    assert p.node_opt_s[0] == pytest.approx(P / 1e9 / 2)
    assert p.worker_codec_s == pytest.approx(P * (3e-9 + 4e-9))


def test_encoding_lengthens_backward_and_writing_follows_the_last_reply():
    # worker codec work sits on the training thread: encode inside backward, decode after the wait
    base = spec(worker_gbps=100.0, node_gbps=100.0)
    p = plan(
        spec(
            worker_gbps=100.0,
            node_gbps=100.0,
            push_encode_s_per_elem=3e-9,
            pull_decode_s_per_elem=1e-9,
        )
    )
    q = plan(base)
    assert p.compute_eff_s == pytest.approx(0.2 + P * 3e-9)
    assert p.write_s == pytest.approx(P * 1e-9)
    assert p.sync_step_s == pytest.approx(
        p.compute_eff_s + max(q.path_s - p.overlap_fraction * p.compute_eff_s, q.tail_s) + p.write_s
    )
    assert p.delayed_step_s == pytest.approx(
        max(
            p.compute_eff_s + p.write_s,
            max(q.push_s, q.node_s, q.pull_s),
            ((1 - p.overlap_fraction) * p.compute_eff_s + q.path_s + p.write_s) / 2,
        )
    )


def test_one_bucket_cannot_overlap_backward():
    p = plan(spec(bucket_bytes=1 << 40))
    assert p.num_buckets == 1 and p.overlap_fraction == 0.0
    stages = (p.push_s, p.node_s, p.pull_s, p.worker_codec_s)
    assert p.sync_step_s == pytest.approx(0.2 + sum(stages))


def test_compute_bound_when_links_are_fast():
    p = plan(spec(worker_gbps=100.0, node_gbps=100.0, compute_s=1.0, batch_per_worker=64))
    assert p.bottleneck == "compute"
    assert p.delayed_step_s == pytest.approx(1.0)
    assert p.sync_step_s == pytest.approx(1.0 + p.tail_s)  # only the last bucket is exposed
    assert p.samples_per_s == pytest.approx(4 * 64 / p.sync_step_s)
    assert plan(spec(delayed_update=True, batch_per_worker=64)).samples_per_s == pytest.approx(
        4 * 64 / plan(spec()).delayed_step_s
    )


@settings(max_examples=200, deadline=None)
@given(
    num_params=st.integers(1, 10**11),
    workers=st.integers(1, 256),
    nodes=st.integers(1, 16),
    worker_gbps=st.floats(0.1, 400),
    node_gbps=st.floats(0.1, 400),
    push=st.floats(0.01, 4),
    pull=st.floats(0.01, 4),
    compute_s=st.floats(0, 100),
    overlap=st.one_of(st.none(), st.floats(0, 1)),
    bucket_bytes=st.integers(1, 1 << 30),
    decode=st.floats(0, 1e-8),
)
def test_delayed_update_never_slower_than_sync(
    num_params,
    workers,
    nodes,
    worker_gbps,
    node_gbps,
    push,
    pull,
    compute_s,
    overlap,
    bucket_bytes,
    decode,
):
    p = plan(
        PlanSpec(
            num_params=num_params,
            workers=workers,
            nodes=nodes,
            worker_gbps=worker_gbps,
            node_gbps=node_gbps,
            push_bytes_per_elem=push,
            pull_bytes_per_elem=pull,
            compute_s=compute_s,
            overlap_fraction=overlap,
            bucket_bytes=bucket_bytes,
            push_decode_s_per_elem=decode,
        )
    )
    assert p.delayed_step_s <= p.sync_step_s * (1 + 1e-9)
    assert p.sync_step_s >= max(p.resources.values()) * (
        1 - 1e-9
    )  # no step beats its busiest resource
    assert p.delayed_step_s >= max(p.resources.values()) * (1 - 1e-9)


def test_recommend_adds_nodes_while_node_links_bind():
    rec = recommend(spec())
    # fp32 at equal link rates: a node link carries W shards, so N = W nodes match one worker link
    assert rec.nodes_unbind_links == 4
    assert rec.nodes > 1
    by_nodes = {o.nodes: o.sync_step_s for o in rec.node_options}
    assert sorted(by_nodes) == list(range(1, 9))
    assert by_nodes[2] < by_nodes[1]
    assert rec.step_s < rec.current_step_s and rec.speedup > 1
    assert rec.delayed_update  # 0.2 s of compute hides a lot of link time


def test_recommend_keeps_one_node_and_no_compression_when_compute_binds():
    rec = recommend(spec(worker_gbps=400.0, node_gbps=400.0, compute_s=2.0), codec_costs=False)
    assert rec.nodes == 1
    assert rec.nodes_unbind_links == 1
    assert (rec.push_codec, rec.pull_codec) == ("none", "none")
    assert not rec.delayed_update


def test_recommend_compresses_when_links_bind_even_with_many_nodes():
    rec = recommend(spec(compute_s=0.05, worker_gbps=1.0, node_gbps=1.0), codec_costs=False)
    assert codec_profile(rec.push_codec).bytes_per_elem < 4.0
    fp32 = next(o for o in rec.codec_options if (o.push_codec, o.pull_codec) == ("none", "none"))
    assert rec.step_s < fp32.delayed_step_s


def test_codec_table():
    assert codec_profile("none").bytes_per_elem == 4.0
    assert codec_profile("bf16").bytes_per_elem == 2.0
    assert codec_profile("fp16").bytes_per_elem == 2.0
    assert 1.0 < codec_profile("int8").bytes_per_elem < 1.1  # one int8 + a share of a block scale
    assert 0.5 < codec_profile("int4").bytes_per_elem < 0.6
    assert codec_profile("topk").bytes_per_elem < 0.2
    assert codec_profile("topk:0.05").bytes_per_elem == pytest.approx(
        0.4
    )  # fp32 value + int32 index
    for bad in ("zstd", "topk:0", "topk:2"):
        with pytest.raises(ConfigError, match="codec|density"):
            codec_profile(bad)


@pytest.mark.parametrize(
    "text,value",
    [
        ("16.7M", 16_700_000),
        ("1.5B", 1_500_000_000),
        ("7e9", 7_000_000_000),
        ("350k", 350_000),
        ("16_700_000", 16_700_000),
        ("2G", 2_000_000_000),
    ],
)
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "M", "16.7Q", "-5", "0", "1.5 B B"])
def test_parse_count_refuses(text):
    with pytest.raises(ConfigError):
        parse_count(text)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_params", 0),
        ("num_params", 1.5),
        ("workers", 0),
        ("workers", True),
        ("nodes", -1),
        ("worker_gbps", 0.0),
        ("node_gbps", float("nan")),
        ("push_bytes_per_elem", -1.0),
        ("pull_bytes_per_elem", float("inf")),
        ("opt_params_per_s", 0),
        ("compute_s", -0.1),
        ("push_decode_s_per_elem", -1e-9),
        ("overlap_fraction", 1.5),
        ("protocol_efficiency", 0.0),
        ("protocol_efficiency", 1.2),
        ("bucket_bytes", 0),
        ("batch_per_worker", 0),
        ("node_threads", 0),
        ("shared_cores", 0.0),
        ("shared_cores", float("inf")),
        ("net_cpu_s_per_byte", -1e-9),
    ],
)
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field) as info:
        spec(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(nodes=2, capacities=(1.0,)), "capacities"),
        (dict(nodes=2, capacities=(1.0, -1.0)), r"capacities\[1\]"),
        (dict(nodes=2, node_gbps=(1.0, 1.0, 1.0)), "node_gbps"),
        (dict(nodes=2, node_gbps=(1.0, 0.0)), r"node_gbps\[1\]"),
    ],
)
def test_per_node_lists_are_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        spec(**kw)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="luwu plan")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_prints_table_and_returns_zero(capsys):
    args = parse(
        "--params",
        "16.7M",
        "--workers",
        "4",
        "--nodes",
        "1",
        "--worker-gbps",
        "1",
        "--node-gbps",
        "1",
        "--push-codec",
        "none",
        "--pull-codec",
        "none",
        "--compute-ms",
        "200",
        "--batch",
        "64",
    )
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "node 0 downlink" in out and "267.2 MB" in out
    assert "bottleneck: node 0 downlink" in out
    assert "recommended:" in out and "samples/s" in out


def test_cli_json_matches_plan(capsys):
    args = parse(
        "--params",
        "1.5B",
        "--workers",
        "8",
        "--nodes",
        "2",
        "--worker-gbps",
        "10",
        "--node-gbps",
        "25,25",
        "--push-codec",
        "int8",
        "--pull-codec",
        "bf16",
        "--compute-ms",
        "500",
        "--delayed-update",
        "--no-codec-cost",
        "--json",
    )
    assert run(args) == 0
    data = json.loads(capsys.readouterr().out)
    expected = plan(
        spec_with_codecs(
            PlanSpec(
                num_params=1_500_000_000,
                workers=8,
                nodes=2,
                worker_gbps=10.0,
                node_gbps=(25.0, 25.0),
                compute_s=0.5,
                delayed_update=True,
            ),
            "int8",
            "bf16",
            codec_costs=False,
        )
    )
    assert data["plan"]["step_s"] == pytest.approx(expected.delayed_step_s)
    assert data["plan"]["bottleneck"] == expected.bottleneck
    assert data["plan"]["node_down_bytes"] == pytest.approx(list(expected.node_down_bytes))
    assert data["recommendation"]["nodes"] >= 1


def test_cli_bad_setting_returns_two(capsys):
    assert run(parse("--params", "16.7M", "--workers", "0", "--compute-ms", "100")) == 2
    assert "workers" in capsys.readouterr().err
    assert run(parse("--params", "16.7M", "--compute-ms", "100", "--push-codec", "zstd")) == 2
    assert "zstd" in capsys.readouterr().err


def test_shared_cores_add_a_cpu_floor_and_slow_compute():
    # 4 workers and 1 node on 2 shared cores: compute runs 2x slower, and the step can never beat all
    # the step's CPU work (compute, codecs, node, network stack) spread over the cores
    s = spec(
        worker_gbps=100.0,
        node_gbps=100.0,
        shared_cores=2.0,
        net_cpu_s_per_byte=1e-9,
        push_decode_s_per_elem=1e-9,
        push_encode_s_per_elem=2e-9,
    )
    p, alone = (
        plan(s),
        plan(
            spec(
                worker_gbps=100.0,
                node_gbps=100.0,
                push_decode_s_per_elem=1e-9,
                push_encode_s_per_elem=2e-9,
            )
        ),
    )
    assert p.compute_eff_s == pytest.approx(
        (0.2 + P * 2e-9) * 4 / 2
    )  # the hooks encode on the training thread
    assert p.net_cpu_s == pytest.approx(1e-9 * 4 * (P * 4.0 + P * 4.0))
    work = 4 * (0.2 + p.worker_codec_s) + p.node_cpu_s[0] + p.net_cpu_s
    assert p.shared_cpu_s == pytest.approx(work / 2)
    assert p.resources["shared cores"] == pytest.approx(p.shared_cpu_s)
    assert p.bottleneck == "shared cores"
    assert p.sync_step_s >= p.shared_cpu_s and p.delayed_step_s == pytest.approx(p.shared_cpu_s)
    assert p.sync_step_s > alone.sync_step_s
    assert alone.shared_cpu_s == 0.0 and "shared cores" not in alone.resources
    assert alone.compute_eff_s == pytest.approx(0.2 + P * 2e-9)


def test_shared_cores_do_not_slow_compute_when_each_worker_has_a_core():
    p = plan(spec(workers=2, shared_cores=4.0))
    assert p.compute_eff_s == pytest.approx(0.2)
    assert p.overlap_fraction == pytest.approx(
        2 / 3 * (1 - 1 / p.num_buckets)
    )  # a core is left for the pushes


def test_no_streaming_overlap_when_workers_take_every_shared_core():
    p = plan(spec(shared_cores=2.0))
    assert p.overlap_fraction == 0.0
    assert (
        plan(spec(shared_cores=2.0, overlap_fraction=0.5)).overlap_fraction == 0.5
    )  # an explicit value stands
    assert p.sync_step_s == pytest.approx(
        max(p.compute_eff_s + max(p.path_s, p.tail_s) + p.write_s, p.shared_cpu_s)
    )


def test_int8_delta_pull_codec_and_cli_shared_cores(capsys):
    q = codec_profile("int8_delta")
    assert q.bytes_per_elem == pytest.approx(codec_profile("int8").bytes_per_elem)
    assert (
        q.encode_s_per_elem > codec_profile("int8").encode_s_per_elem
    )  # the shadow and the feedback
    args = parse(
        "--params",
        "16.7M",
        "--workers",
        "4",
        "--nodes",
        "2",
        "--worker-gbps",
        "1",
        "--compute-ms",
        "100",
        "--pull-codec",
        "int8_delta",
        "--shared-cores",
        "2",
        "--net-cpu-ns",
        "0.8",
        "--json",
    )
    assert run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["spec"]["shared_cores"] == 2.0
    assert data["plan"]["shared_cpu_s"] > 0
    assert run(parse("--params", "16.7M", "--compute-ms", "100", "--shared-cores", "0")) == 2
    assert "shared_cores" in capsys.readouterr().err


def test_streaming_fetches_every_weight_twice_and_overlaps_it_with_compute():
    base = dict(
        num_params=16_700_000,
        workers=4,
        nodes=2,
        compute_s=0.12,
        worker_gbps=1.0,
        node_gbps=1.0,
        push_bytes_per_elem=2.0,
        pull_bytes_per_elem=2.0,
        bucket_bytes=4 << 20,
    )
    resident, stream = plan(PlanSpec(**base)), plan(PlanSpec(**base, stream_weights=True))
    assert stream.worker_down_bytes == 2 * resident.worker_down_bytes
    assert stream.node_up_bytes == tuple(2 * b for b in resident.node_up_bytes)
    assert stream.worker_up_bytes == resident.worker_up_bytes
    # each resource busy once per step, side by side: the busiest (a node's uplink) plus one bucket's tail
    busiest = max(stream.push_s, stream.node_s, stream.pull_s)
    assert stream.bottleneck == "node 0 uplink"
    assert stream.step_s == pytest.approx(
        max(stream.compute_eff_s + stream.write_s, busiest) + stream.tail_s
    )
    # a unit is waited for whole: with 5 units the exposed tail is a fifth of the stages, not a bucket's share
    five = plan(PlanSpec(**base, stream_weights=True, stream_units=5))
    assert (
        five.tail_s == pytest.approx((five.push_s + five.node_s + five.pull_s) / 5)
        and five.tail_s > stream.tail_s
    )
    assert plan(PlanSpec(**base, stream_weights=True, stream_units=10**6)).tail_s == pytest.approx(
        stream.tail_s
    )  # at most one per bucket
    with pytest.raises(ConfigError, match="stream_units"):
        PlanSpec(**base, stream_weights=True, stream_units=0)
    with pytest.raises(ConfigError, match="stream_weights and delayed_update"):
        PlanSpec(**base, stream_weights=True, delayed_update=True)
    # the share kept for backward is not fetched again (the writes stay two)
    kept = plan(PlanSpec(**base, stream_weights=True, stream_refetch=0.25))
    assert (
        kept.worker_down_bytes == pytest.approx(1.25 * resident.worker_down_bytes)
        and kept.write_s == stream.write_s
    )
    with pytest.raises(ConfigError, match="stream_refetch"):
        PlanSpec(**base, stream_weights=True, stream_refetch=1.5)


def test_stream_refetch_share_counts_the_turn_and_the_kept_replies():
    """The last max(1, prefetch) units stay for their backward; the units before them are kept while their
    replies fit max(1, prefetch) units of fp32 (the default stream_hold_bytes)."""
    assert stream_refetch_share(10, 2, 4.0) == pytest.approx(
        6 / 10
    )  # fp32 replies: 2 kept + the 2 of the turn
    assert stream_refetch_share(10, 2, 2.0) == pytest.approx(4 / 10)  # bf16: 4 kept
    assert stream_refetch_share(48, 2, 1.0 + 4 / 256) == pytest.approx(
        39 / 48
    )  # int8 with scales: 7 kept
    assert stream_refetch_share(5, 2, 1.0) == 0.0  # every unit before the turn fits
    assert stream_refetch_share(1, 0, 4.0) == 0.0


def test_plan_cli_models_streaming(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--params",
            "16.7M",
            "--compute-ms",
            "120",
            "--worker-gbps",
            "1",
            "--node-gbps",
            "1",
            "--nodes",
            "2",
            "--stream",
            "--json",
        ]
    )
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["spec"]["stream_weights"] is True
    # one unit per 4 MiB bucket of int8 fetches: 16 units, 2 of the turn and 7 kept, 7 fetched again
    assert out["plan"]["spec"]["stream_refetch"] == pytest.approx(7 / 16)


def test_cli_models_the_default_weight_codec_of_the_link_and_mode():
    """Without --pull-codec the plan models what the defaults send: ``pull_codec = auto`` by the cost rule
    at the worker link's speed (bf16 steps at 1 Gbit/s, bf16 at 10, fp32 at 400), and with --stream the fetches'
    ``stream_codec`` (int8); the streaming recommendation never names int8 deltas (a fetch is full weights)."""
    from luwu.plan.cli import default_pull_codec, spec_from_args

    common = ("--params", "16.7M", "--workers", "4", "--nodes", "2", "--compute-ms", "100")
    assert default_pull_codec(parse(*common, "--worker-gbps", "1")) == "bf16_steps"
    assert default_pull_codec(parse(*common, "--worker-gbps", "10")) == "bf16"
    assert default_pull_codec(parse(*common, "--worker-gbps", "400")) == "none"
    assert default_pull_codec(parse(*common, "--worker-gbps", "1", "--stream")) == "int8"
    assert (
        default_pull_codec(parse(*common, "--worker-gbps", "1", "--pull-codec", "none")) == "none"
    )
    args = parse(*common, "--worker-gbps", "1", "--stream", "--json")
    assert run(args) == 0
    assert spec_from_args(args).pull_bytes_per_elem == pytest.approx(
        codec_profile("int8").bytes_per_elem
    )

"""`luwu plan`: hand-computed cases of the step model, its recommendations, input checks and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.plan import (
    PlanSpec,
    add_arguments,
    codec_profile,
    disk_stream_s,
    parse_count,
    parse_size,
    plan,
    recommend,
    run,
    size_cluster,
    spec_from_args,
    spec_with_codecs,
    state_bytes_per_param,
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
        ("disks", -1),
        ("disks", 1.5),
        ("disk_read_gb_s", 0.0),
        ("disk_write_gb_s", float("inf")),
        ("disk_mixed_gb_s", float("nan")),
        ("state_memory_bytes", 0),
        ("disk_bytes", -1.0),
        ("state_bytes_per_param", -12.0),
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


# ----------------------------------------------------------------- out-of-core nodes (issue 34)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BENCH_OOC = RESULTS / "bench_ooc.json"
BENCH_OOC_STEP = RESULTS / "bench_ooc_step.json"


def ooc_spec(**kw) -> PlanSpec:
    """1e9 params of AdamW state (12 GB) on one node with 1 GB of RAM for it: out of core."""
    base = dict(
        num_params=1_000_000_000,
        workers=2,
        worker_gbps=1000.0,
        node_gbps=1000.0,
        push_bytes_per_elem=2.0,
        pull_bytes_per_elem=2.0,
        compute_s=1.0,
        protocol_efficiency=1.0,
        opt_params_per_s=1e12,
        overlap_fraction=2 / 3,
        state_memory_bytes=1e9,
        disks=2,
        disk_read_gb_s=3.0,
        disk_write_gb_s=2.0,
    )
    base.update(kw)
    return PlanSpec(**base)


def test_state_bytes_per_param_come_from_the_nodes_optimizers():
    assert state_bytes_per_param("adamw") == 12.0  # fp32 master + exp_avg + exp_avg_sq
    assert state_bytes_per_param("Adam") == 12.0
    assert state_bytes_per_param("sgd") == 4.0  # torch's default SGD keeps no momentum
    assert state_bytes_per_param("adagrad") == 8.0
    assert state_bytes_per_param("rmsprop") == 8.0  # square_avg; momentum and centered are off
    # factored: row and column statistics of a 4096 x 16384 matrix, next to nothing per parameter
    assert state_bytes_per_param("adafactor") == pytest.approx(4 + 4 * (1 / 16384 + 1 / 4096))
    with pytest.raises(ConfigError, match="lbfgs"):
        state_bytes_per_param("lbfgs")


def test_disk_streams_the_state_read_and_written_once_a_step():
    p = plan(ooc_spec())
    assert p.node_state_bytes == pytest.approx((12e9,)) and p.node_out_of_core == (True,)
    # 12 GB read over 2 disks at 3 GB/s, then written at 2 GB/s: they take turns
    assert p.node_disk_s[0] == pytest.approx(12e9 / 6e9 + 12e9 / 4e9)  # 5 s
    # a 50/50 mix measured at 2.2 GB/s per disk: 24 GB at 4.4 GB/s, never faster than writing alone
    mixed = plan(ooc_spec(disk_mixed_gb_s=2.2))
    assert mixed.node_disk_s[0] == pytest.approx(24e9 / 4.4e9)
    assert plan(ooc_spec(disk_mixed_gb_s=50.0)).node_disk_s[0] == pytest.approx(12e9 / 4e9)
    assert disk_stream_s(0, 0, 0, 1.0, 1.0) == 0.0
    # the window (1 GB) is read ahead during forward (1/3 of the 1 s compute): 1 GB at 6 GB/s
    assert p.node_disk_ahead_s[0] == pytest.approx(1e9 / 6e9)
    # the rest streams while the gradients arrive: the node's stage, pipelined with the pushes
    assert p.node_s == pytest.approx(5.0 - 1e9 / 6e9)
    assert p.bottleneck == "node 0 disk" and p.resources["node 0 disk"] == pytest.approx(5.0)
    C, f = p.compute_eff_s, p.overlap_fraction
    assert p.sync_step_s == pytest.approx(max(C + p.path_s - f * C + p.write_s, 5.0))
    assert p.sync_step_s >= 5.0 and p.delayed_step_s >= 5.0  # the disk is busy 5 s every step
    # the read-ahead is bounded by forward's time too, and by the disk time itself
    short = plan(ooc_spec(state_memory_bytes=11e9))
    assert short.node_disk_ahead_s[0] == pytest.approx(1 / 3)
    # more disks: proportionally less time
    assert plan(ooc_spec(disks=4)).node_disk_s[0] == pytest.approx(2.5)


def test_a_state_that_fits_its_ram_stays_off_the_disks():
    for kw in (
        dict(state_memory_bytes=12e9),
        dict(state_memory_bytes=None),
        dict(disks=0, state_memory_bytes=None),
    ):
        p = plan(ooc_spec(**kw))
        assert p.node_out_of_core == (False,) and p.node_disk_s == (0.0,) and p.fits
        assert "node 0 disk" not in p.resources
    # two nodes halve the state: 6 GB each fits 6 GB of RAM
    two = plan(ooc_spec(nodes=2, state_memory_bytes=6e9))
    assert two.node_state_bytes == pytest.approx((6e9, 6e9)) and not any(two.node_out_of_core)
    # Adafactor's state (~4 B/param) fits where AdamW's does not
    ada = ooc_spec(state_memory_bytes=5e9, state_bytes_per_param=state_bytes_per_param("adafactor"))
    assert (
        not plan(ada).node_out_of_core[0]
        and plan(ooc_spec(state_memory_bytes=5e9)).node_out_of_core[0]
    )


def test_a_node_that_cannot_hold_its_state_does_not_fit():
    assert not plan(ooc_spec(disks=0)).fits  # out of core without disks
    assert not plan(
        ooc_spec(state_memory_bytes=1e6)
    ).fits  # a window smaller than a 4 MiB bucket's 12 MiB
    # the state files hold two slots: 24 GB over 2 disks
    assert not plan(ooc_spec(disk_bytes=11.9e9)).fits
    assert plan(ooc_spec(disk_bytes=12e9)).fits


def test_disk_model_within_25_percent_of_bench_ooc():
    """bench_ooc's measured read, write and mixed bandwidth (O_DIRECT, the engine's request size and
    depth) and its state, fed to the plan model: the predicted time to stream the state once (read and
    written, the disk part of a node's step) is within 25% of the engine's measured pass over the same
    state on the same disk (a real node's step: the next test)."""
    r = json.loads(BENCH_OOC.read_text())
    cfg, mb_s = r["config"], r["mb_s"]
    assert cfg["state_bytes"] > 3 * cfg["budget_bytes"]  # out of core (about 4x), as a node runs it
    s = PlanSpec(
        num_params=cfg["buckets"] * cfg["bucket_params"],
        workers=1,
        compute_s=0.0,  # a pass with nothing to hide behind: the disk alone
        bucket_bytes=cfg["bucket_params"] * 4,
        state_memory_bytes=cfg["budget_bytes"],
        disks=1,
        disk_read_gb_s=statistics.median(mb_s["read"]) / 1e3,
        disk_write_gb_s=statistics.median(mb_s["write"]) / 1e3,
        disk_mixed_gb_s=statistics.median(mb_s["mixed"]) / 1e3,
    )
    p = plan(s)
    # the model's state is the bench's, less one aligned block per bucket (the step counters)
    assert p.node_state_bytes[0] == pytest.approx(cfg["state_bytes"], rel=1e-3)
    assert p.node_out_of_core == (True,) and p.bottleneck == "node 0 disk"
    measured = r["engine"]["pass_s"]
    assert p.node_disk_s[0] == pytest.approx(measured, rel=0.25), (p.node_disk_s[0], measured)
    assert p.step_s == pytest.approx(measured, rel=0.25)


def test_disk_time_a_node_step_adds_within_25_percent_of_bench_ooc_step():
    """bench_ooc_step times one worker's step against a real node in RAM and out of core (a quarter of
    the state in node.state_memory_bytes), and the disk's mixed O_DIRECT floor, in the same run. Fed
    that floor, the shard and the in-RAM node's measured optimizer rate, the model's step out of core
    less its step in RAM (what the state's disk traffic adds to a node's step, not hidden behind its
    CPU) is within 25% of the measured difference. (The in-RAM step itself the model puts lower than
    measured there: one worker and three nodes share 2 cores, and the transport's CPU is left out.)"""
    r = json.loads(BENCH_OOC_STEP.read_text())
    rows, numel = {row["node"]: row for row in r["rows"]}, r["args"]["num_params"]
    mixed = statistics.median(r["disk_mixed_mb_s"]) / 1e3
    base = dict(
        num_params=numel,
        workers=1,
        compute_s=0.0,  # backward is one multiply a parameter
        opt_params_per_s=numel / rows["in RAM"]["node_optimizer_s"],
        bucket_bytes=r["args"]["bucket_params"] * 4,
        disks=1,
        disk_read_gb_s=mixed,  # (only the mix is measured: it bounds both)
        disk_write_gb_s=mixed,
        disk_mixed_gb_s=mixed,
    )
    ram = plan(PlanSpec(**base))
    ooc = plan(PlanSpec(**base, state_memory_bytes=r["state_mib"] * 2**20 / 4))
    assert not ram.node_out_of_core[0] and ooc.node_out_of_core[0]
    assert rows["out of core"]["state_read_mib"] == pytest.approx(r["state_mib"], rel=0.01)
    measured = rows["out of core"]["step_s"] - rows["in RAM"]["step_s"]
    predicted = ooc.step_s - ram.step_s
    assert predicted == pytest.approx(measured, rel=0.25), (predicted, measured)


def test_sizing_prefers_the_fewest_nodes_then_disks_that_meet_the_target():
    # 12 GB of state, 5 GB of RAM a node, slow disks (1 GB/s): one node needs more than 16 disks for
    # a 1.2 s step, two nodes (6 GB each, still out of core) need some, three hold it in RAM
    s = ooc_spec(disk_read_gb_s=1.0, disk_write_gb_s=1.0, state_memory_bytes=5e9, compute_s=0.1)
    sized = size_cluster(s, target_step_s=1.2, max_nodes=4, max_disks=16)
    assert sized.nodes == 2 and sized.rows[0].meets is False
    k = sized.disks
    at = lambda n, d: plan(dataclasses.replace(s, nodes=n, disks=d)).step_s  # noqa: E731
    assert at(2, k) <= 1.2 < at(2, k - 1) and at(1, 16) > 1.2
    assert sized.step_s == pytest.approx(at(2, k))
    assert [r.out_of_core for r in sized.rows] == [True, True, False, False]
    assert [r.disks_to_fit for r in sized.rows] == [1, 1, 0, 0]
    # without a target: the fewest nodes that hold the state, with the disks past which more do not pay
    free = size_cluster(s, max_nodes=4, max_disks=16)
    assert free.nodes == 1 and free.rows[0].meets
    best = min(o.step_s for o in free.options if o.nodes == 1 and o.fits)
    assert free.step_s <= best * 1.05 < at(1, free.disks - 1)
    # no disks at all: the fewest nodes whose state fits their RAM
    ram = size_cluster(s, max_nodes=4, max_disks=0)
    assert ram.nodes == 3 and ram.disks == 0
    assert size_cluster(s, max_nodes=2, max_disks=0).nodes is None
    with pytest.raises(ConfigError, match="max_disks"):
        size_cluster(s, max_disks=-1)


def test_recommend_skips_node_counts_that_cannot_hold_their_state():
    s = ooc_spec(disks=0, state_memory_bytes=5e9, compute_s=10.0)  # compute binds everywhere
    rec = recommend(s, max_nodes=4)
    assert rec.nodes == 3  # 1 and 2 nodes cannot hold 12 GB in 5 GB of RAM without disks


@pytest.mark.parametrize(
    "text,value",
    [
        ("256GiB", 256 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512G", 512e9),
        ("4e9", 4e9),
        ("64 MiB", 64 * 2**20),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "0", "-5GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_cli_takes_disks_and_node_ram_and_sizes_nodes_and_disks(capsys):
    common = ("--params", "70B", "--workers", "8", "--disks", "4", "--disk-read-gb-s", "3")
    common += ("--disk-write-gb-s", "2", "--node-ram", "256GiB", "--compute-ms", "20000")
    assert run(parse(*common, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    spec_out = out["plan"]["spec"]
    assert spec_out["state_memory_bytes"] == 256 * 2**30 and spec_out["disks"] == 4
    assert spec_out["state_bytes_per_param"] == 12.0
    assert out["plan"]["node_state_bytes"] == [pytest.approx(840e9)]
    assert out["plan"]["node_disk_s"] == [pytest.approx(840e9 / 12e9 + 840e9 / 8e9)]
    rows = out["sizing"]["rows"]
    assert [r["out_of_core"] for r in rows[:4]] == [True, True, True, False]  # 210 GB < 256 GiB
    assert out["sizing"]["nodes"] == 1
    assert run(parse(*common, "--target-ms", "25000")) == 0
    text = capsys.readouterr().out
    assert "node 0 state: 840.0 GB (12 B/param) on 4 disk(s)" in text
    assert "nodes and disks (disks per node to meet 25.0 s)" in text and "sized:" in text
    # the optimizer sets the state per parameter; an explicit --state-bytes wins
    assert spec_from_args(parse(*common, "--optimizer", "adafactor")).state_bytes_per_param < 4.01
    assert spec_from_args(parse(*common, "--state-bytes", "8")).state_bytes_per_param == 8.0
    # compute from tokens and achieved FLOP/s: 6 * P * tokens / flops
    derived = spec_from_args(parse("--params", "70B", "--tokens", "4096", "--worker-tflops", "100"))
    assert derived.compute_s == pytest.approx(6 * 70e9 * 4096 / 100e12)
    assert run(parse("--params", "70B")) == 2 and "--compute-ms" in capsys.readouterr().err
    assert run(parse("--compute-ms", "10")) == 2 and "--params" in capsys.readouterr().err


def test_luwu_paper_preset_predicts_a_step_and_states_its_assumptions(capsys):
    assert run(parse("--preset", "luwu-paper", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["plan"]["spec"]
    # the paper's testbed: 175B parameters, 8 workers, 100 Gbit/s, one node with 12 SSDs
    assert (s["num_params"], s["workers"], s["nodes"], s["disks"]) == (175_000_000_000, 8, 1, 12)
    assert (s["worker_gbps"], s["node_gbps"]) == (100.0, 100.0)
    assert s["stream_weights"] and s["state_memory_bytes"] == 512 * 2**30
    expected = plan(spec_from_args(parse("--preset", "luwu-paper")))
    assert out["plan"]["step_s"] == pytest.approx(expected.step_s)
    assert expected.node_out_of_core == (True,)
    assert expected.node_disk_s[0] == pytest.approx(2.1e12 / 36e9 + 2.1e12 / 24e9)
    sources = {a["what"]: a["source"] for a in out["preset"]["assumptions"]}
    assert sources["disks"] == "paper" and sources["SSD read"] == "assumed"
    assert {"compute", "node optimizer", "node RAM for state", "codecs", "layout"} <= set(sources)
    assert run(parse("--preset", "luwu-paper")) == 0
    text = capsys.readouterr().out
    assert "step (streaming):" in text and "assumptions:" in text
    assert "SSD read: 3.0 GB/s per SSD (assumed" in text and "[overridden" not in text
    # an option given on the command line wins, and the assumption it replaces says so
    assert run(parse("--preset", "luwu-paper", "--disks", "6", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["spec"]["disks"] == 6
    assert run(parse("--preset", "luwu-paper", "--disks", "6")) == 0
    assert "12 SSDs in the node (paper: the paper's node) [overridden" in capsys.readouterr().out

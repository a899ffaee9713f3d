"""A tiny emulated head-to-head (benchmarks/cluster_study.py): DDP and LuWu train the same task on
network-namespace hosts behind tbf links, the bytes on each host's link are what the layout says, and
nothing is left behind. Behaviour only: no timing is asserted.

Needs root, iproute2, veth, bridge and tbf; skipped with the reason otherwise. Only addresses inside
the namespaces built here are contacted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics

import pytest

from benchmarks import cluster_study as cs

pytestmark = pytest.mark.system

# 85k parameters, 2 workers of 32 samples: a few seconds of compute per run; the buckets of 64 KiB
# make six of them, so a 2:1 capacity split is visible in the bytes of each node's link.
SETTINGS = cs.Settings(
    dims=(64, 256, 256, 10),
    batch=32,
    steps=24,
    warmup=12,
    eval_every=6,
    eval_samples=512,
    subspace=8,
    lr=3e-3,
    bucket_bytes=64 * 1024,
    compression_warmup=4,
    timeout_s=60.0,
)
CAPACITIES = (2.0, 1.0)


@pytest.fixture(scope="module")
def rows():
    ok, reason = cs.netns_available()
    if not ok:
        pytest.skip(reason)
    prefix = f"luwu-{os.getpid()}-"
    configs = [
        cs.RunConfig("ddp", "fp32", 2, rate="1gbit"),
        cs.RunConfig("luwu", "sync", 2, 2, rate="1gbit", compression=False, capacities=CAPACITIES),
        cs.RunConfig(
            "luwu", "partial", 2, 1, rate="1gbit", compression=True
        ),  # first layer delayed (cluster file)
        cs.RunConfig("fsdp", "fp32", 2, rate="1gbit"),  # torch FSDP2 over gloo
        cs.RunConfig(
            "luwu", "stream", 2, 2, rate="1gbit", compression=False
        ),  # the model in the network
    ]
    out = {r["config"]: r for r in cs.run_many(configs, SETTINGS)}
    # the cluster is gone, and with it every process that ran inside
    assert not [ns for ns in cs.list_namespaces() if ns.startswith(prefix)]
    return out


@pytest.mark.timeout(240)
def test_ddp_and_luwu_both_train_the_task(rows):
    assert set(rows) == {
        "ddp_fp32",
        "luwu_sync_n2_fp32",
        "luwu_partial_n1",
        "fsdp_fp32",
        "luwu_stream_n2_fp32",
    }
    for name, r in rows.items():
        first, last = r["curve"][0]["eval_loss"], r["curve"][-1]["eval_loss"]
        assert [p["step"] for p in r["curve"]] == [0, 6, 12, 18, 24], name
        assert last < 0.7 * first, (name, first, last)
        assert r["samples_per_s"] > 0 and math.isfinite(r["step_ms"])


@pytest.mark.timeout(240)
def test_luwu_sync_uncompressed_matches_ddp(rows):
    # the same global batches, initial weights and AdamW on the averaged gradient: the same model
    ddp = rows["ddp_fp32"]
    for name in (
        "luwu_sync_n2_fp32",
        "luwu_stream_n2_fp32",
        "fsdp_fp32",
    ):  # resident, streaming and FSDP2 alike
        for a, b in zip(ddp["curve"], rows[name]["curve"]):
            assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4), (name, a, b)
    assert all(r["worker_peak_mb"] > 0 for r in rows.values())
    assert rows["luwu_stream_n2_fp32"]["fetch_share"] > 0


@pytest.mark.timeout(240)
def test_bytes_per_host_follow_the_layout(rows):
    r = rows["luwu_sync_n2_fp32"]
    buckets = r["layout"]["buckets"]  # [numel, owner node] per bucket
    num_params = sum(numel for numel, _ in buckets)
    assert num_params == SETTINGS.num_params
    shard_bytes = [4 * sum(n for n, node in buckets if node == j) for j in range(2)]
    assert shard_bytes[0] > 1.5 * shard_bytes[1]  # capacities 2:1 from the cluster file
    # payload: every worker pushes and receives the whole model in fp32, exactly
    assert r["payload_push_bytes"] == 4 * num_params
    assert r["payload_pull_bytes"] == 4 * num_params
    # on the wire (kernel counters, headers and acknowledgements included): each node's link carries
    # every worker's share of its buckets, each worker's link the whole model, both ways
    workers = r["workers"]
    for j in range(2):
        for direction in ("node_rx_bytes", "node_tx_bytes"):
            ratio = r[direction][j] / (workers * shard_bytes[j])
            assert 1.0 <= ratio < 1.08, (direction, j, ratio)
    for direction in ("worker_tx_bytes", "worker_rx_bytes"):
        for got in r[direction]:
            assert 1.0 <= got / (4 * num_params) < 1.08, (direction, got)


@pytest.mark.timeout(240)
def test_compression_cuts_the_bytes_on_the_wire(rows):
    fp32, hybrid = rows["luwu_sync_n2_fp32"], rows["luwu_partial_n1"]
    assert hybrid["payload_push_bytes"] < 0.6 * fp32["payload_push_bytes"]
    assert statistics.fmean(hybrid["worker_tx_bytes"]) < 0.6 * statistics.fmean(
        fp32["worker_tx_bytes"]
    )


def test_time_to_loss_and_loss_at_interpolate():
    curve = [
        {"step": 0, "clock_s": 0.0, "eval_loss": 4.0},
        {"step": 5, "clock_s": 2.0, "eval_loss": 2.0},
        {"step": 10, "clock_s": 4.0, "eval_loss": 1.0},
    ]
    assert cs.time_to_loss(curve, 3.0) == pytest.approx(1.0)
    assert cs.time_to_loss(curve, 1.0) == pytest.approx(4.0)
    assert cs.time_to_loss(curve, 0.5) == math.inf
    assert cs.loss_at(curve, 7.5) == pytest.approx(1.5)


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="warmup"):
        dataclasses.replace(SETTINGS, warmup=24)
    with pytest.raises(ValueError, match="target_frac"):
        dataclasses.replace(SETTINGS, target_frac=0.0)

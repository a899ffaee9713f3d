"""Delayed update, async and bounded-staleness modes train a real model (digits) as well as sync mode.

The eval loss is the median of ten evaluations over the last 100 steps, and a mode passes if its loss
is at most 2% above sync mode's. A median, not a mean: async training on stale gradients has
transient loss spikes (one evaluation at 3-4x the loss around it, then back), and a spike that falls
in a short window decided the verdict (CI saw 1.18x sync once, where the run's curve sat at 0.6-0.8x
sync before and after it). Staleness costs early in training (ZeRO-Offload turns DPU on after a
warm-up for that reason): 400 steps let both settle.
"""

import pytest
from harness import load_benchmark, run_training

import luwu

SPEC = {"model": "digits", "optimizer": "adamw", "hyper": {"lr": 2e-3, "weight_decay": 0.01}, "steps": 400, "batch": 64, "bucket_bytes": 64 * 1024}


@pytest.fixture(scope="module")
def sync_loss(tmp_path_factory):
    with luwu.local_cluster(2) as c:
        res = run_training(SPEC, c.addresses, tmp_path_factory.mktemp("sync"), timeout_s=240)
    assert res[0]["eval_loss"] == res[1]["eval_loss"]
    return res[0]["eval_loss"]


@pytest.mark.timeout(300)
def test_delayed_update_within_2_percent_of_sync(sync_loss, tmp_path):
    with luwu.local_cluster(2) as c:
        res = run_training(dict(SPEC, delayed_update=True), c.addresses, tmp_path, timeout_s=240)
    assert res[0]["eval_loss"] <= sync_loss * 1.02, (res[0]["evals"], sync_loss)


@pytest.mark.timeout(180)
def test_delayed_update_warmup_runs_the_first_steps_in_sync(tmp_path):
    """``delayed_update_warmup=5``: steps 0..4 wait for their weights, so the losses of steps 0..5 are
    sync's to the bit; step 6 is the first forward on weights missing an update. Without a warm-up
    the delay starts at step 1."""
    spec = dict(SPEC, steps=10)
    runs = {}
    for name, extra in (("sync", {}), ("warm", {"delayed_update": True, "delayed_update_warmup": 5}), ("dpu", {"delayed_update": True})):
        with luwu.local_cluster(1) as c:
            runs[name] = run_training(dict(spec, **extra), c.addresses, tmp_path, timeout_s=120)[0]["losses"]
    sync, warm, dpu = runs["sync"], runs["warm"], runs["dpu"]
    # equal to rounding: the node sums two pushes in arrival order, which moves the last bit now and then
    assert warm[:6] == pytest.approx(sync[:6], rel=1e-6, abs=0), (warm, sync)
    assert abs(warm[6] - sync[6]) > 1e-5 * abs(sync[6]), (warm, sync)
    assert dpu[0] == sync[0] and dpu[1] != sync[1], (dpu, sync)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [0, 2])
def test_async_and_bounded_staleness_within_2_percent_of_sync(staleness, sync_loss, tmp_path):
    args = ["--node.mode", "async", "--node.staleness", str(staleness)]
    with luwu.local_cluster(2, node_args=args) as c:
        res = run_training(dict(SPEC, mode="async"), c.addresses, tmp_path, timeout_s=240)
    for r in res:
        assert r["eval_loss"] <= sync_loss * 1.02, (r["evals"], sync_loss)


@pytest.mark.timeout(120)
def test_plain_torch_dpu_reference_is_sync_until_the_delay_starts():
    """benchmarks/dpu_reference.py (the plain-torch cost of a delayed update, against which
    cluster.md's delayed rows are read) on a tiny student: a delay that never starts is sync to the
    bit; a delay from step 1 trains differently."""
    ref = load_benchmark("dpu_reference")
    s = ref.Settings(dims=(32, 64, 10), batch=16, steps=8, warmup=2, eval_every=4, eval_samples=128, subspace=4, lr=3e-3)
    sync = ref.train(s, 2, s.lr, None)
    never = ref.train(s, 2, s.lr, s.steps)
    late = ref.train(s, 2, s.lr, 1)
    assert never == sync
    assert late["eval_loss"] != sync["eval_loss"] and late["train_loss_every_10"][0] == sync["train_loss_every_10"][0]

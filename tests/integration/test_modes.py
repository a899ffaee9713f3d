"""Delayed update, async and bounded-staleness modes train a real model (digits) as well as sync mode.

The eval loss is the median of ten evaluations over the last 100 steps, and a mode passes if its loss
is at most 2% above sync mode's. A median, not a mean: async training on stale gradients has
transient loss spikes (one evaluation at 3-4x the loss around it, then back), and a spike that falls
in a short window decided the verdict (CI saw 1.18x sync once, where the run's curve sat at 0.6-0.8x
sync before and after it). Staleness costs early in training (ZeRO-Offload turns DPU on after a
warm-up for that reason): 400 steps let both settle.

Async and bounded-staleness runs anneal the learning rate to zero (cosine over the 400 steps, as real
runs end) and are compared with sync annealed alike: at a constant rate the last evaluations of a run
swung 0.067-0.094 in sync mode too, and async's ratio to sync spread 0.72-1.03 over runs (CI saw the
1.03); annealed, sync's last ten evaluations sat within 0.075-0.081 and async's ratio was 0.81-0.89 over
six runs. The delayed update keeps the constant rate: it is deterministic, and under cosine annealing
DPU itself ends 19% above sync on this task (plain torch: 0.094 vs 0.079; 1.015x at a constant rate).
"""

import pytest
import torch
from harness import run_training

import luwu
from benchmarks import dpu_reference

SPEC = {
    "model": "digits",
    "optimizer": "adamw",
    "hyper": {"lr": 2e-3, "weight_decay": 0.01},
    "steps": 400,
    "batch": 64,
    "bucket_bytes": 64 * 1024,
}

ANNEALED = dict(SPEC, scheduler=["CosineAnnealingLR", {"T_max": SPEC["steps"]}])


def _sync_loss(spec, tmp) -> float:
    with luwu.local_cluster(2) as c:
        res = run_training(spec, c.addresses, tmp, timeout_s=240)
    assert res[0]["eval_loss"] == res[1]["eval_loss"]
    return res[0]["eval_loss"]


@pytest.fixture(scope="module")
def sync_loss(tmp_path_factory):
    return _sync_loss(SPEC, tmp_path_factory.mktemp("sync"))


@pytest.fixture(scope="module")
def annealed_sync_loss(tmp_path_factory):
    return _sync_loss(ANNEALED, tmp_path_factory.mktemp("sync-annealed"))


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
    for name, extra in (
        ("sync", {}),
        ("warm", {"delayed_update": True, "delayed_update_warmup": 5}),
        ("dpu", {"delayed_update": True}),
    ):
        with luwu.local_cluster(1) as c:
            runs[name] = run_training(dict(spec, **extra), c.addresses, tmp_path, timeout_s=120)[0][
                "losses"
            ]
    sync, warm, dpu = runs["sync"], runs["warm"], runs["dpu"]
    # equal to rounding: the node sums two pushes in arrival order, which moves the last bit now and then
    assert warm[:6] == pytest.approx(sync[:6], rel=1e-6, abs=0), (warm, sync)
    assert abs(warm[6] - sync[6]) > 1e-5 * abs(sync[6]), (warm, sync)
    assert dpu[0] == sync[0] and dpu[1] != sync[1], (dpu, sync)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [0, 2])
def test_async_and_bounded_staleness_within_2_percent_of_sync(
    staleness, annealed_sync_loss, tmp_path
):
    args = ["--node.mode", "async", "--node.staleness", str(staleness)]
    with luwu.local_cluster(2, node_args=args) as c:
        res = run_training(dict(ANNEALED, mode="async"), c.addresses, tmp_path, timeout_s=240)
    for r in res:
        assert r["eval_loss"] <= annealed_sync_loss * 1.02, (r["evals"], annealed_sync_loss)


@pytest.mark.timeout(120)
def test_plain_torch_dpu_reference_is_sync_until_the_delay_starts():
    """benchmarks/dpu_reference.py (the plain-torch cost of a delayed update, against which
    cluster.md's delayed rows are read) on a tiny student: a delay that never starts is sync to the
    bit; a delay from step 1 trains differently."""
    ref = dpu_reference
    s = ref.Settings(
        dims=(32, 64, 10),
        batch=16,
        steps=8,
        warmup=2,
        eval_every=4,
        eval_samples=128,
        subspace=4,
        lr=3e-3,
    )
    sync = ref.train(s, 2, s.lr, None)
    never = ref.train(s, 2, s.lr, s.steps)
    late = ref.train(s, 2, s.lr, 1)
    assert never == sync
    assert (
        late["eval_loss"] != sync["eval_loss"]
        and late["train_loss_every_10"][0] == sync["train_loss_every_10"][0]
    )
    # partial delay: nothing named is sync to the bit; the first layer alone is neither sync nor full delay
    assert ref.train(s, 2, s.lr, 1, only=()) == sync
    first = ref.train(s, 2, s.lr, 1, only=("0.*",))
    assert first["eval_loss"] not in (sync["eval_loss"], late["eval_loss"])


def _partial_delay_reference(model, data, lr, delayed_prefix, warmup):
    """torch AdamW where, from step ``warmup`` + 1 on (the first forward after a step whose weights came
    late), the parameters named ``delayed_prefix*`` enter the forward with the weights one update old and the others with the current ones. Returns per-step
    losses and the weights after every update."""
    import copy

    master, net = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.01)
    before = [
        p.detach().clone() for p in master.parameters()
    ]  # the weights before the latest update
    losses = []
    for i, (x, y) in enumerate(data):
        with torch.no_grad():
            for (name, pn), pm, old in zip(net.named_parameters(), master.parameters(), before):
                pn.copy_(old if i > warmup and name.startswith(delayed_prefix) else pm)
        net.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for pm, pn, old in zip(master.parameters(), net.parameters(), before):
                pm.grad = pn.grad
                old.copy_(pm)
        opt.step()
    return losses, [p.detach().clone() for p in master.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warmup", [0, 3])
def test_partial_delay_delays_only_the_named_parameters(warmup):
    """``delayed_params=["0.*"]``: the first layer's weights land a step late (after the warm-up), the
    rest in sync; losses and final weights (after ``synchronize()``) equal torch AdamW fed exactly
    that to rounding, and the layer not delayed holds its new weights as soon as ``step()`` returns."""

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 6))
    g = torch.Generator().manual_seed(4)
    data = [
        (torch.randn(16, 24, generator=g), torch.randint(0, 6, (16,), generator=g))
        for _ in range(9)
    ]
    want_losses, want_final = _partial_delay_reference(model, data, 0.02, "0.", warmup)
    sync_losses, _ = _partial_delay_reference(model, data, 0.02, "-", 0)
    with luwu.local_cluster(2) as c:
        opt = luwu.RemoteOptimizer(
            model,
            "adamw",
            nodes=c.addresses,
            lr=0.02,
            weight_decay=0.01,
            bucket_bytes=1024,
            delayed_update=True,
            delayed_update_warmup=warmup,
            delayed_params=["0.*"],
            compression=False,
        )
        try:
            delayed = opt.worker.delayed
            assert delayed and delayed == {
                b.id for b in opt.layout.buckets if b.segments[0].name.startswith("0.")
            }
            losses = []
            for x, y in data:
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                losses.append(float(loss.detach()))
                opt.step()
            last = [p.detach().clone() for p in model.parameters()]
            opt.synchronize()
            got_final = [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=0), (losses, want_losses)
    assert losses[: warmup + 1] == pytest.approx(sync_losses[: warmup + 1], rel=1e-5, abs=0)
    assert abs(losses[warmup + 1] - sync_losses[warmup + 1]) > 1e-5 * sync_losses[warmup + 1], (
        "the delay never started"
    )
    for got, want in zip(got_final, want_final):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # before synchronize(): layer 2 (not delayed) was already final, layer 0 was a step behind
    torch.testing.assert_close(last[2], want_final[2], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(last[0], want_final[0], rtol=1e-5, atol=1e-6)


def test_partial_delay_settings_are_checked(cluster1):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(
        luwu.ConfigError, match=r"delayed_params=\['0\.\*'\] needs delayed_update=True"
    ):
        luwu.RemoteOptimizer(model, "adamw", nodes=cluster1.addresses, delayed_params="0.*")
    with pytest.raises(
        luwu.ConfigError,
        match=r"pattern 'enc\*' matches no parameter \(names: 0.weight, 0.bias, 1.weight, 1.bias\)",
    ):
        luwu.RemoteOptimizer(
            model, "adamw", nodes=cluster1.addresses, delayed_update=True, delayed_params=["enc*"]
        )

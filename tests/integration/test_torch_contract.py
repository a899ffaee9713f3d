"""RemoteOptimizer keeps the whole torch.optim contract, checked against local torch.optim on real nodes."""

import threading

import pytest
import torch
from harness import assert_params_close, run_training
from workers.train import reference

import luwu
from luwu import ConfigError

SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        o, T_0=3
    ),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=5),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ],
        milestones=[3],
    ),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(
        o, factor=0.5, patience=0
    ),
}


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    g = torch.Generator().manual_seed(seed + 1)
    data = [
        (torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g))
        for _ in range(12)
    ]
    return model, data


def clone_model(model):
    import copy

    return copy.deepcopy(model)


def train(model, opt, data, sched=None, steps=None, closure=False):
    traj = []
    for x, y in data[:steps]:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(float(loss.detach()) * 10)  # a rising metric: the plateau rule fires
            else:
                sched.step()
        traj.append([p.detach().clone() for p in model.parameters()])
    return traj


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_matches_local_adamw(name, cluster1):
    model, data = model_and_data()
    ref = clone_model(model)
    ropt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=cluster1.addresses,
        lr=0.02,
        weight_decay=0.01,
        bucket_bytes=1024,
        compression=False,
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.01)
    try:
        got = train(model, ropt, data, SCHEDULERS[name](ropt))
        want = train(ref, lopt, data, SCHEDULERS[name](lopt))
        for g, w in zip(got, want):
            assert_params_close(g, w)
        assert [g["lr"] for g in ropt.param_groups] == [g["lr"] for g in lopt.param_groups]
    finally:
        ropt.close()


@pytest.mark.timeout(60)
def test_tensor_lr_and_cycled_betas_travel(cluster1):
    model, data = model_and_data()
    ref = clone_model(model)
    ropt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=cluster1.addresses,
        lr=torch.tensor(0.01),
        bucket_bytes=1024,
        compression=False,
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(0.01))
    try:
        for opt in (ropt, lopt):
            opt.param_groups[0]["betas"] = (0.8, 0.99)
        for g, w in zip(train(model, ropt, data, steps=6), train(ref, lopt, data, steps=6)):
            assert_params_close(g, w)
    finally:
        ropt.close()


def grouped(model):
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 0.005},
    ]


@pytest.mark.timeout(60)
def test_param_groups_and_add_param_group(cluster2):
    model, data = model_and_data()
    ref = clone_model(model)
    extra, extra_ref = torch.nn.Parameter(torch.randn(4)), None
    extra_ref = torch.nn.Parameter(extra.detach().clone())
    ropt = luwu.RemoteOptimizer(
        grouped(model),
        "adamw",
        nodes=cluster2.addresses,
        lr=0.02,
        bucket_bytes=512,
        compression=False,
    )
    lopt = torch.optim.AdamW(grouped(ref), lr=0.02)
    try:
        for g, w in zip(train(model, ropt, data, steps=4), train(ref, lopt, data, steps=4)):
            assert_params_close(g, w)
        ropt.add_param_group({"params": [extra], "lr": 0.1, "weight_decay": 0.0})
        lopt.add_param_group({"params": [extra_ref], "lr": 0.1, "weight_decay": 0.0})
        for m, e, opt in ((model, extra, ropt), (ref, extra_ref, lopt)):
            for x, y in data[4:8]:
                opt.zero_grad()
                (torch.nn.functional.cross_entropy(m(x) + e, y)).backward()
                opt.step()
        assert_params_close([*model.parameters(), extra], [*ref.parameters(), extra_ref])
    finally:
        ropt.close()


def named_groups(model):
    """torch.optim's named form: groups of (name, tensor) pairs."""
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 0.005},
    ]


@pytest.mark.timeout(60)
def test_named_param_groups_keep_names_for_compression_rules(cluster1):
    """Param-group dicts of (name, tensor) pairs, as torch.optim takes them: the layout carries the model's
    names, so per-name rules match; training equals torch's AdamW on the same named groups."""
    from luwu.protocol.policy import CompressionConfig

    model, data = model_and_data()
    ref = clone_model(model)
    cc = CompressionConfig(rules=[("3.weight", "none"), ("0.*", "fp16")], warmup_steps=0)
    ropt = luwu.RemoteOptimizer(
        named_groups(model),
        "adamw",
        nodes=cluster1.addresses,
        lr=0.02,
        bucket_bytes=1024,
        compression=cc,
    )
    lopt = torch.optim.AdamW(named_groups(ref), lr=0.02)
    try:
        want_names = [n for g in named_groups(model) for n, _ in g["params"]]
        assert [p.name for p in ropt.layout.params] == want_names
        chosen = {
            s.name: ropt.worker.codecs.push(b, 5)[0]
            for b in ropt.layout.buckets
            for s in b.segments
        }
        assert chosen["3.weight"] == "none" and chosen["0.weight"] == "fp16", chosen
        assert ropt.param_groups[0]["param_names"] == ["0.weight", "3.weight"]
        # fp16 is lossy: compare with a loose bound; the uncompressed rule keeps 3.weight close
        for g, w in zip(train(model, ropt, data, steps=3), train(ref, lopt, data, steps=3)):
            assert_params_close(g, w, rtol=1e-2, atol=1e-3)
    finally:
        ropt.close()


@pytest.mark.timeout(60)
def test_variance_freeze_step_travels_in_the_param_groups(cluster1):
    """A param group's variance_freeze_step reaches the nodes: its exp_avg_sq stops after that step while
    exp_avg goes on; the other group's variance keeps moving (torch's AdamW until the freeze)."""
    model, data = model_and_data()
    ref = clone_model(model)
    groups = grouped(model)
    groups[0]["variance_freeze_step"] = 2
    ropt = luwu.RemoteOptimizer(
        groups, "adamw", nodes=cluster1.addresses, lr=0.02, bucket_bytes=1024, compression=False
    )
    lopt = torch.optim.AdamW(grouped(ref), lr=0.02)
    try:
        train(model, ropt, data, steps=2)
        train(ref, lopt, data, steps=2)
        at_freeze = ropt.state_dict()
        assert_state_close(at_freeze, lopt.state_dict())
        train(model, ropt, data[2:], steps=3)
        train(ref, lopt, data[2:], steps=3)
        later = ropt.state_dict()
        num_frozen = len(ropt.param_groups[0]["params"])
        for i in later["state"]:
            assert float(later["state"][i]["step"]) == 5
            assert not torch.equal(later["state"][i]["exp_avg"], at_freeze["state"][i]["exp_avg"])
            same_sq = torch.equal(
                later["state"][i]["exp_avg_sq"], at_freeze["state"][i]["exp_avg_sq"]
            )
            assert same_sq == (i < num_frozen), (
                f"parameter {i}: exp_avg_sq {'frozen' if same_sq else 'moved'}"
            )
        assert (
            later["param_groups"][0]["variance_freeze_step"] == 2
            and "variance_freeze_step" not in later["param_groups"][1]
        )
    finally:
        ropt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "group,match",
    [
        ({"lr": -1.0}, "param group 0: invalid learning rate: -1.0"),
        ({"betas": (0.9, 1.5)}, r"param group 0: invalid beta parameters"),
        ({"variance_freeze_step": 0}, "param group 0: invalid variance_freeze_step: 0"),
        ({"variance_freeze_step": True}, "param group 0: invalid variance_freeze_step: True"),
    ],
)
def test_bad_hyperparameters_fail_in_the_constructor_naming_the_group(group, match):
    """As torch.optim's constructors: a bad value is a ConfigError at once, not at the first push, and
    no node is contacted (nothing listens at the address). add_param_group checks its group alike and
    leaves the optimizer as it was."""
    model, _ = model_and_data()
    params = list(model.parameters())
    with pytest.raises(ConfigError, match=match):
        luwu.RemoteOptimizer(
            [dict(group, params=params)], "adamw", nodes=["tcp://127.0.0.1:9"], lr=0.01
        )
    with pytest.raises(
        ConfigError, match="variance_freeze_step applies to adam and adamw, not to sgd"
    ):
        luwu.RemoteOptimizer(
            [{"params": params, "variance_freeze_step": 3}],
            "sgd",
            nodes=["tcp://127.0.0.1:9"],
            lr=0.01,
        )


@pytest.mark.timeout(60)
def test_add_param_group_with_a_bad_value_leaves_the_optimizer_as_it_was(cluster1):
    model, _ = model_and_data()
    params = list(model.parameters())
    ropt = luwu.RemoteOptimizer(
        params[:-1], "adamw", nodes=cluster1.addresses, lr=0.01, compression=False
    )
    try:
        with pytest.raises(ConfigError, match="param group 1: invalid learning rate: -0.5"):
            ropt.add_param_group({"params": params[-1:], "lr": -0.5})
        assert len(ropt.param_groups) == 1
    finally:
        ropt.close()


def assert_state_close(a: dict, b: dict):
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        for k in a["state"][i]:
            torch.testing.assert_close(
                torch.as_tensor(a["state"][i][k]).float(),
                torch.as_tensor(b["state"][i][k]).float(),
                rtol=1e-6,
                atol=1e-7,
            )
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert ga["params"] == gb["params"]
        for k in ("lr", "betas", "eps", "weight_decay"):
            assert ga[k] == gb[k]


@pytest.mark.timeout(120)
def test_state_dict_roundtrip_with_torch_and_resharding(tmp_path):
    model, data = model_and_data()
    ref = clone_model(model)
    lopt = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.01)
    with luwu.local_cluster(2) as c2:
        ropt = luwu.RemoteOptimizer(
            model,
            "adamw",
            nodes=c2.addresses,
            lr=0.02,
            weight_decay=0.01,
            bucket_bytes=512,
            compression=False,
        )
        train(model, ropt, data, steps=5)
        train(ref, lopt, data, steps=5)
        sd = ropt.state_dict()
        assert set(sd) == {"state", "param_groups"}
        assert (
            set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
            and float(sd["state"][0]["step"]) == 5
        )
        assert_state_close(sd, lopt.state_dict())
        torch.save({"model": model.state_dict(), "opt": sd}, tmp_path / "ckpt.pt")
        ropt.close()
    ckpt = torch.load(tmp_path / "ckpt.pt")
    # RemoteOptimizer checkpoint -> torch.optim.AdamW continues identically
    m_torch, _ = model_and_data()
    m_torch.load_state_dict(ckpt["model"])
    t_opt = torch.optim.AdamW(m_torch.parameters(), lr=0.5)
    t_opt.load_state_dict(ckpt["opt"])
    # torch checkpoint -> RemoteOptimizer on 3 nodes (re-sharded) continues identically
    m_remote, _ = model_and_data(
        seed=5
    )  # other weights: load_state_dict must set the nodes' weights
    with luwu.local_cluster(3) as c3:
        r3 = luwu.RemoteOptimizer(
            m_remote, "adamw", nodes=c3.addresses, lr=0.5, bucket_bytes=512, compression=False
        )
        try:
            m_remote.load_state_dict(ref.state_dict())
            r3.load_state_dict(lopt.state_dict())
            want = train(ref, lopt, data[5:])
            got_torch = train(m_torch, t_opt, data[5:])
            got_remote = train(m_remote, r3, data[5:])
            for a, b, w in zip(got_torch, got_remote, want):
                assert_params_close(a, w)
                assert_params_close(b, w)
            assert_state_close(r3.state_dict(), lopt.state_dict())
        finally:
            r3.close()


@pytest.mark.timeout(60)
def test_sgd_momentum_state_dict_matches_torch(cluster1):
    model, data = model_and_data()
    ref = clone_model(model)
    ropt = luwu.RemoteOptimizer(
        model,
        "sgd",
        nodes=cluster1.addresses,
        lr=0.05,
        momentum=0.9,
        bucket_bytes=512,
        compression=False,
    )
    lopt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    try:
        train(model, ropt, data, steps=3)
        train(ref, lopt, data, steps=3)
        a, b = ropt.state_dict(), lopt.state_dict()
        for i in b["state"]:
            torch.testing.assert_close(
                a["state"][i]["momentum_buffer"],
                b["state"][i]["momentum_buffer"],
                rtol=1e-6,
                atol=1e-7,
            )
    finally:
        ropt.close()


@pytest.mark.timeout(60)
def test_grad_none_parameter_is_skipped_like_torch(cluster1):
    torch.manual_seed(0)
    trunk, side = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    model = torch.nn.ModuleDict({"trunk": trunk, "side": side})
    ref = clone_model(model)
    ropt = luwu.RemoteOptimizer(
        model, "adamw", nodes=cluster1.addresses, lr=0.05, bucket_bytes=64, compression=False
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    try:
        for step in range(6):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            for m, opt in ((model, ropt), (ref, lopt)):
                opt.zero_grad(set_to_none=True)
                out = m["trunk"](x) + (
                    m["side"](x) if step % 3 == 0 else 0
                )  # side has grad None 2 steps in 3
                out.square().mean().backward()
                opt.step()
            assert_params_close(list(model.parameters()), list(ref.parameters()))
        assert (
            float(ropt.state_dict()["state"][2]["step"])
            == float(lopt.state_dict()["state"][2]["step"])
            == 2
        )
    finally:
        ropt.close()


@pytest.mark.timeout(60)
def test_workers_disagreeing_on_grad_none_get_error_naming_parameter(cluster1):
    errors = {}

    def run(rank):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict(
            {"trunk": torch.nn.Linear(6, 3), "head_b": torch.nn.Linear(6, 3)}
        )
        opt = luwu.RemoteOptimizer(
            model,
            "adamw",
            nodes=cluster1.addresses,
            rank=rank,
            world_size=2,
            lr=0.05,
            bucket_bytes=1024,
            timeout_s=4,
        )
        try:
            x = torch.randn(4, 6)
            out = model["trunk"](x) + (model["head_b"](x) if rank == 1 else 0)
            out.sum().backward()
            opt.step()
            opt.synchronize()  # (per-layer waits: the error may come with the weights, at their next read)
        except luwu.LuwuError as exc:
            errors[rank] = exc
        finally:
            opt.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors, "a disagreement must not pass silently"
    mismatch = [e for e in errors.values() if isinstance(e, luwu.StepMismatchError)]
    assert mismatch and "head_b" in str(mismatch[0])


@pytest.mark.timeout(60)
def test_closure_returns_loss_and_hooks_fire(cluster1):
    model, data = model_and_data()
    opt = luwu.RemoteOptimizer(model, "adam", nodes=cluster1.addresses, lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x, y = data[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    try:
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0
        assert calls == ["pre", "post"]
    finally:
        opt.close()


@pytest.mark.timeout(180)
def test_global_norm_clipping_equals_local(cluster2, tmp_path):
    spec = {"optimizer": "adamw", "hyper": {"lr": 0.01}, "steps": 8, "max_grad_norm": 0.05}
    results = run_training(spec, cluster2.addresses, tmp_path)
    want, _ = reference(dict(spec, world_size=2))
    for r in results:
        assert_params_close(r["params"], want)


@pytest.mark.timeout(180)
def test_grad_scaler_overflow_decision_is_global(cluster2, tmp_path):
    spec = {
        "optimizer": "adamw",
        "hyper": {"lr": 0.01},
        "steps": 6,
        "amp": True,
        "inject_inf": [1, 3],
    }
    results = run_training(spec, cluster2.addresses, tmp_path)
    want, want_scales = reference(dict(spec, world_size=2))
    assert results[0]["scales"] == results[1]["scales"] == want_scales
    assert want_scales[3] == want_scales[2] / 2  # the step with inf backed off on both workers
    for r in results:
        assert_params_close(r["params"], want)


@pytest.mark.timeout(180)
def test_gradient_accumulation_pushes_once_per_step(cluster2, tmp_path):
    spec = {"optimizer": "sgd", "hyper": {"lr": 0.05, "momentum": 0.9}, "steps": 5, "accumulate": 3}
    results = run_training(spec, cluster2.addresses, tmp_path)
    want, _ = reference(dict(spec, world_size=2))
    for r in results:
        assert_params_close(r["params"], want)


@pytest.mark.timeout(60)
def test_bf16_autocast_on_cpu(cluster1):
    model, data = model_and_data()
    ref = clone_model(model)
    ropt = luwu.RemoteOptimizer(
        model, "adamw", nodes=cluster1.addresses, lr=0.01, compression=False
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    try:
        for x, y in data[:4]:
            for m, opt in ((model, ropt), (ref, lopt)):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        ropt.close()

"""The optimizers beyond Adam and SGD on real node processes: RemoteOptimizer against local torch.optim.

Parameters span buckets on two nodes (small buckets; Adafactor's stay whole, each in a bucket of its
own when larger than one); with ``compression=False`` every step matches the local optimizer, ``state_dict()`` matches torch's, and a fresh torch optimizer that loads it goes on
exactly as the local one. Optimizers a node cannot run are refused in the constructor, with the reason.
"""

import pytest
import torch
from harness import assert_params_close
from integration.test_torch_contract import clone_model, model_and_data, train

import luwu
from luwu import ConfigError

CASES = {
    "rmsprop-centered-momentum": (
        "rmsprop",
        torch.optim.RMSprop,
        {"lr": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.01},
    ),
    "adagrad": (
        "adagrad",
        torch.optim.Adagrad,
        {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
    ),
    "nadam-decoupled": (
        "nadam",
        torch.optim.NAdam,
        {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    "rprop": ("rprop", torch.optim.Rprop, {"lr": 0.01, "etas": (0.4, 1.3)}),
    "adamw-amsgrad": ("adamw", torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    "adafactor": ("adafactor", torch.optim.Adafactor, {"lr": 0.01, "weight_decay": 0.1, "d": 1.5}),
}


def assert_states_equal(a: dict, b: dict) -> None:
    """The same state keys for every parameter, the same tensors, the same param groups."""
    assert {i: sorted(s) for i, s in a["state"].items()} == {
        i: sorted(s) for i, s in b["state"].items()
    }
    for i, s in a["state"].items():
        for k, t in s.items():
            torch.testing.assert_close(
                torch.as_tensor(t).float(),
                torch.as_tensor(b["state"][i][k]).float(),
                rtol=1e-6,
                atol=1e-7,
            )
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert {k: v for k, v in ga.items() if k in gb} == {k: v for k, v in gb.items() if k in ga}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_remote_matches_local_and_its_state_dict_continues_in_torch(case, cluster2):
    name, cls, hyper = CASES[case]
    model, data = model_and_data()
    ref = clone_model(model)
    ropt = luwu.RemoteOptimizer(
        model, name, nodes=cluster2.addresses, bucket_bytes=512, compression=False, **hyper
    )
    lopt = cls(ref.parameters(), **hyper)
    try:
        for g, w in zip(train(model, ropt, data, steps=5), train(ref, lopt, data, steps=5)):
            assert_params_close(g, w)
        sd = ropt.state_dict()
        assert_states_equal(sd, lopt.state_dict())
    finally:
        ropt.close()
    resumed = clone_model(model)
    topt = cls(resumed.parameters(), **hyper)
    topt.load_state_dict(sd)
    for g, w in zip(train(resumed, topt, data[5:]), train(ref, lopt, data[5:])):
        assert_params_close(g, w)


LOADS = {
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "centered": True, "momentum": 0.5}),
    "adafactor": (torch.optim.Adafactor, {"lr": 0.02, "beta2_decay": -0.6}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(LOADS))
def test_torch_state_dict_loads_into_remote(name, cluster2):
    """A local optimizer's checkpoint scattered to the nodes (RMSprop's momentum_buffer and grad_avg;
    Adafactor's row_var / col_var of the matrices and variance of the vectors, each parameter whole in
    one bucket, the weight matrices larger than bucket_bytes) goes on as the local optimizer does, and
    gathers back in torch's shapes."""
    cls, hyper = LOADS[name]
    model, data = model_and_data()
    ref = clone_model(model)
    lopt = cls(ref.parameters(), **hyper)
    train(ref, lopt, data, steps=4)
    model.load_state_dict(ref.state_dict())
    ropt = luwu.RemoteOptimizer(
        model, name, nodes=cluster2.addresses, bucket_bytes=512, compression=False, **hyper
    )
    try:
        segs = [s for b in ropt.layout.buckets for s in b.segments]
        assert {s.whole for s in segs} == {name == "adafactor"}
        if name == "adafactor":
            assert (
                sorted(s.param for s in segs) == list(range(len(list(model.parameters()))))
                and max(b.nbytes for b in ropt.layout.buckets) > 512
            )
        ropt.load_state_dict(lopt.state_dict())
        for g, w in zip(train(model, ropt, data[4:]), train(ref, lopt, data[4:])):
            assert_params_close(g, w)
        assert_states_equal(ropt.state_dict(), lopt.state_dict())
    finally:
        ropt.close()


@pytest.mark.timeout(120)
def test_adafactor_state_comes_back_from_a_node_checkpoint(tmp_path):
    """A node checkpoints on SIGTERM and restores at restart: its buckets are rebuilt from the checkpoint's
    specs (each whole parameter's shape with them) and its shaped state from the flat form; training
    rolls back to that step and goes on exactly as the local Adafactor."""
    hyper = {"lr": 0.02}
    model, data = model_and_data()
    ref = clone_model(model)
    lopt = torch.optim.Adafactor(ref.parameters(), **hyper)
    with luwu.local_cluster(
        1, node_args=["--node.checkpoint_dir", str(tmp_path / "ckpt")]
    ) as cluster:
        ropt = luwu.RemoteOptimizer(
            model,
            "adafactor",
            nodes=cluster.addresses,
            bucket_bytes=512,
            compression=False,
            timeout_s=10,
            **hyper,
        )
        try:
            for g, w in zip(train(model, ropt, data, steps=3), train(ref, lopt, data, steps=3)):
                assert_params_close(g, w)
            cluster.procs[0].terminate()  # SIGTERM: the node checkpoints step 3, then exits
            assert cluster.procs[0].wait(30) == 0
            cluster.restart(0)
            ropt.zero_grad()
            torch.nn.functional.cross_entropy(model(data[3][0]), data[3][1]).backward()
            with pytest.raises(luwu.RollbackError):
                ropt.step()
                ropt.synchronize()  # (per-layer waits: the error may come with the weights, at their next read)
            assert ropt.recover() == 3
            for g, w in zip(train(model, ropt, data[3:]), train(ref, lopt, data[3:])):
                assert_params_close(g, w)
            assert_states_equal(ropt.state_dict(), lopt.state_dict())
        finally:
            ropt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name,why",
    [
        ("lbfgs", "closure"),
        ("sparseadam", "sparse gradients"),
        ("asgd", "eta, mu"),
        ("muon", "orthogonalises"),
    ],
)
def test_optimizers_the_nodes_cannot_run_are_refused_in_the_constructor(name, why):
    """No node is contacted (nothing listens at the address): the refusal comes first and says why."""
    model, _ = model_and_data()
    with pytest.raises(ConfigError, match=f"optimizer '{name}' cannot run on LuWu nodes: .*{why}"):
        luwu.RemoteOptimizer(model, name, nodes=["tcp://127.0.0.1:9"])


@pytest.mark.timeout(60)
def test_hyperparameters_are_the_optimizers_own():
    model, _ = model_and_data()
    with pytest.raises(
        ConfigError,
        match=r"momentum=0.9 is not a RemoteOptimizer keyword nor a hyperparameter of optimizer 'adagrad' \(its hyperparameters: lr, lr_decay",
    ):
        luwu.RemoteOptimizer(model, "adagrad", nodes=["tcp://127.0.0.1:9"], momentum=0.9)
    with pytest.raises(ConfigError, match="param group 0: invalid rho value: 2.0"):
        luwu.RemoteOptimizer(model, "adadelta", nodes=["tcp://127.0.0.1:9"], rho=2.0)
    with pytest.raises(ConfigError, match="differentiable=True"):
        luwu.RemoteOptimizer(model, "rmsprop", nodes=["tcp://127.0.0.1:9"], differentiable=True)


@pytest.mark.timeout(60)
def test_a_whole_parameter_over_the_message_limit_is_refused_before_any_push():
    """A parameter Adafactor keeps whole travels as one message: one over transport.max_message_bytes
    could never be pushed, so the constructor says so."""
    from luwu.gpu_workers.config import TransportConfig

    with pytest.raises(ConfigError, match="kept whole is over transport.max_message_bytes"):
        luwu.RemoteOptimizer(
            torch.nn.Linear(64, 64),
            "adafactor",
            nodes=["tcp://127.0.0.1:9"],
            transport=TransportConfig(bucket_bytes=1024, max_message_bytes=4096),
        )

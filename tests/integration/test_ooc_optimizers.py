"""Node-side optimizers whose state the out-of-core files leave out at first, real processes: the files
are laid out at the first seed, before any push names the hyperparameters, so they hold AdamW's two
moments and not amsgrad's maximum (Adafactor's factored statistics as they are, a few bytes a
parameter); the first step that turns amsgrad on lays them out again to hold it,
and the run equals the in-RAM node's bit for bit, restart included (centered RMSprop's grad_avg alike).
Turning it on after the first step is refused, naming the option and the fix. A param group added
after the first step appends its buckets to the files the same way."""

import json

import pytest
import torch
from harness import TRAIN, kill_node_after_step, start_workers, tanh_mlp, wait_all

import luwu
from luwu.switch_nodes.ooc import StateLayout

SLOT = 4 * 4096
BUDGET = 2 * SLOT
AMSGRAD = {"lr": 0.01, "amsgrad": True, "weight_decay": 0.05}
ADAFACTOR = {"lr": 0.02, "beta2_decay": -0.6, "weight_decay": 0.1}
SLOT5 = 5 * 4096  # an Adafactor bucket's slot: 5 tensors, each 4 KiB-aligned
ADAFACTOR_BUDGET = 20480 + 2 * SLOT5  # the pushes' share (the largest bucket's full set), 2 slots


def _args(state_dir, budget: int = BUDGET) -> list[str]:
    return ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(budget)]


def _run(spec: dict, tmp, node_args=None, kill_at: int | None = None) -> list[dict]:
    with luwu.local_cluster(1, node_args=node_args) as c:
        spec = dict(spec, nodes=c.addresses, world_size=2, out=str(tmp / f"res-{kill_at}"))
        procs = start_workers(TRAIN, spec, 2, tmp)
        if kill_at is not None:
            kill_node_after_step(c, procs[0], kill_at, node=0)
        wait_all(procs, 240)
    return [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]


def _assert_bitwise(got: list[dict], want: list[dict]) -> None:
    for rank in range(2):
        for i, (a, b) in enumerate(zip(got[rank]["params"], want[rank]["params"])):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")


@pytest.mark.timeout(400)
def test_amsgrad_out_of_core_trains_as_the_in_ram_node_and_restarts(tmp_path):
    """AdamW with amsgrad=True against a node with a quarter of its state in RAM: the first step lays
    the files out again with max_exp_avg_sq, and the weights equal the in-RAM node's bit for bit; a
    node SIGKILLed mid-run restarts from the re-laid files (its job.json names the state they hold)."""
    spec = {"optimizer": "adamw", "steps": 8, "bucket_bytes": 1024, "hyper": AMSGRAD}
    want = _run(spec, tmp_path)
    got = _run(spec, tmp_path, _args(tmp_path / "a"))
    _assert_bitwise(got, want)
    folder = tmp_path / "a" / "luwu-node0"
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    for b in layout.buckets:
        names = [t.name for t in b.tensors]
        assert names == ["params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "steps"], names
    assert sum(b.slot_bytes for b in layout.buckets) >= 4 * BUDGET
    meta = json.loads((folder / "job.json").read_text())
    assert meta["state_names"] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], meta
    assert not folder.with_name(folder.name + ".relay").exists()
    crash = dict(spec, steps=20, resilient=True, step_sleep=0.03, timeout_s=20.0)
    want = _run(dict(crash, resilient=False), tmp_path)
    got = _run(crash, tmp_path, _args(tmp_path / "b"), kill_at=9)
    assert all(r["recoveries"] >= 1 for r in got)
    _assert_bitwise(got, want)


@pytest.mark.timeout(400)
def test_adafactor_out_of_core_holds_its_factored_state_and_restarts(tmp_path):
    """Adafactor, whose state is a row and a column statistic per matrix (a variance per vector): the
    files hold each bucket's statistics one after another, a few bytes a parameter besides the
    weights, and the weights equal the in-RAM node's bit for bit; a node SIGKILLed mid-run restarts
    from its files and the run still equals the failure-free one."""
    spec = {"optimizer": "adafactor", "steps": 8, "bucket_bytes": 1024, "hyper": ADAFACTOR}
    want = _run(spec, tmp_path)
    got = _run(spec, tmp_path, _args(tmp_path / "a", ADAFACTOR_BUDGET))
    _assert_bitwise(got, want)
    folder = tmp_path / "a" / "luwu-node0"
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    sizes = {t.name: 0 for b in layout.buckets for t in b.tensors}
    for b in layout.buckets:
        for t in b.tensors:
            sizes[t.name] += t.numel
    # the mlp: Linear(20, 64), LayerNorm(64), Linear(64, 5): rows and columns of the two matrices,
    # the variances of the four vectors
    assert sizes == {
        "params": 1797,
        "row_var": 64 + 5,
        "col_var": 20 + 64,
        "variance": 64 * 3 + 5,
        "steps": 6,
    }
    assert sum(b.slot_bytes for b in layout.buckets) > 2 * SLOT5  # (more than the window holds)
    crash = dict(spec, steps=20, resilient=True, step_sleep=0.03, timeout_s=20.0)
    want = _run(dict(crash, resilient=False), tmp_path)
    got = _run(crash, tmp_path, _args(tmp_path / "b", ADAFACTOR_BUDGET), kill_at=9)
    assert all(r["recoveries"] >= 1 for r in got)
    _assert_bitwise(got, want)


@pytest.mark.timeout(200)
def test_centered_rmsprop_out_of_core_trains_as_the_in_ram_node(tmp_path):
    """RMSprop with centered=True (grad_avg, left out of the files at first) and momentum: the first step
    lays the files out again with grad_avg, and the weights equal the in-RAM node's bit for bit."""
    hyper = {"lr": 0.01, "centered": True, "momentum": 0.9}
    spec = {"optimizer": "rmsprop", "steps": 6, "bucket_bytes": 1024, "hyper": hyper}
    want = _run(spec, tmp_path)
    got = _run(spec, tmp_path, _args(tmp_path / "a"))
    _assert_bitwise(got, want)
    folder = tmp_path / "a" / "luwu-node0"
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    assert all("grad_avg" in [t.name for t in b.tensors] for b in layout.buckets)


def _step_once(opt, model, seed: int) -> None:
    opt.zero_grad()
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()


@pytest.mark.timeout(150)
def test_amsgrad_turned_on_after_the_first_step_is_refused(tmp_path):
    """The files were laid out without amsgrad's maximum and buckets have stepped: a step that turns
    amsgrad on then is refused, naming max_exp_avg_sq, amsgrad and the fix (the step fails on the node
    with a ConfigError, which reaches the worker as the step's error)."""
    with luwu.local_cluster(1, node_args=_args(tmp_path / "state")) as cluster:
        model = tanh_mlp()
        opt = luwu.RemoteOptimizer(
            model,
            nodes=cluster.addresses,
            optimizer="adamw",
            lr=0.05,
            compression=False,
            bucket_bytes=1088,
            rank=0,
            world_size=1,
            timeout_s=10,
        )
        try:
            for s in range(2):
                _step_once(opt, model, s)
            opt.synchronize()
            for g in opt.param_groups:
                g["amsgrad"] = True
            with pytest.raises(luwu.LuwuError) as refused:  # (the node's ConfigError, relayed)
                _step_once(opt, model, 2)
                opt.synchronize()
        finally:
            opt.close()
    said = str(refused.value)
    assert "max_exp_avg_sq" in said and "first step" in said and "node.state_dir" in said, said


def _amsgrad_steps(addresses, steps: range, model, state: dict | None = None) -> dict:
    """``steps`` of AMSGrad on ``model`` (rank 0 alone), after ``load_state_dict(state)`` if given;
    returns the optimizer's state_dict."""
    opt = luwu.RemoteOptimizer(
        model,
        nodes=addresses,
        optimizer="adamw",
        compression=False,
        bucket_bytes=1088,
        rank=0,
        world_size=1,
        timeout_s=10,
        **AMSGRAD,
    )
    try:
        if state is not None:
            opt.load_state_dict(state)
        for s in steps:
            _step_once(opt, model, s)
        opt.synchronize()
        return opt.state_dict()
    finally:
        opt.close()


@pytest.mark.timeout(200)
def test_amsgrad_state_loaded_before_the_first_step_out_of_core_resumes_exactly(tmp_path):
    """A job resumed from opt.state_dict() with amsgrad on: the loaded state carries max_exp_avg_sq,
    which an out-of-core node's files leave out at first; the files are laid out again to hold it
    (before, the load was refused), and the run equals 3 + 3 steps on one in-RAM node bit for bit."""
    model = tanh_mlp()
    with luwu.local_cluster(1) as c:
        _amsgrad_steps(c.addresses, range(6), model)
    want = [p.detach().clone() for p in model.parameters()]
    model = tanh_mlp()
    with luwu.local_cluster(1) as c:
        state = _amsgrad_steps(c.addresses, range(3), model)
    assert any(s.get("max_exp_avg_sq") is not None for s in state["state"].values())
    with luwu.local_cluster(1, node_args=_args(tmp_path / "state")) as c:
        _amsgrad_steps(c.addresses, range(3, 6), model, state)
    for i, (a, b) in enumerate(zip(model.parameters(), want)):
        torch.testing.assert_close(
            a.detach(), b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}"
        )
    folder = tmp_path / "state" / "luwu-node0"
    meta = json.loads((folder / "job.json").read_text())
    assert meta["state_names"] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], meta


def _train_with_added_group(addresses) -> list[torch.Tensor]:
    """3 steps of tanh_mlp's parameters, add_param_group of an extra vector, 3 steps of both."""
    model, extra = tanh_mlp(), torch.nn.Parameter(torch.linspace(-1, 1, 256))
    opt = luwu.RemoteOptimizer(
        model,
        nodes=addresses,
        optimizer="adamw",
        lr=0.05,
        compression=False,
        bucket_bytes=1088,
        rank=0,
        world_size=1,
        timeout_s=10,
    )
    try:
        for s in range(6):
            if s == 3:
                opt.add_param_group({"params": [extra], "lr": 0.1, "weight_decay": 0.0})
            opt.zero_grad()
            g = torch.Generator().manual_seed(s)
            out = model(torch.randn(8, 16, generator=g))
            (out.square().mean() + (extra * out.mean()).square().sum()).backward()
            opt.step()
        opt.synchronize()
        return [p.detach().clone() for p in [*model.parameters(), extra]]
    finally:
        opt.close()


@pytest.mark.timeout(200)
def test_add_param_group_after_the_first_step_out_of_core_trains_as_the_in_ram_node(tmp_path):
    """add_param_group after the state files are open: they are laid out again with the new bucket
    appended, and the weights equal the in-RAM node's bit for bit; the files hold every bucket."""
    with luwu.local_cluster(1) as c:
        want = _train_with_added_group(c.addresses)
    with luwu.local_cluster(1, node_args=_args(tmp_path / "state")) as c:
        got = _train_with_added_group(c.addresses)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")
    folder = tmp_path / "state" / "luwu-node0"
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    meta = json.loads((folder / "job.json").read_text())
    assert len(layout.buckets) == len(meta["buckets"]) == 5, layout.buckets
    assert sum(b.slot_bytes for b in layout.buckets) >= 2 * BUDGET

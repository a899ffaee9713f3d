"""The node's optimizers on flat segment views: torch.optim exactly, and the frozen-variance Adam mode."""

from __future__ import annotations

import pytest
import torch

from luwu.protocol.errors import ConfigError
from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.switch_nodes.optimizers import (
    ADAFACTOR,
    ADAM,
    ADAMW,
    RMSPROP,
    SGD,
    UNSUPPORTED,
    apply_,
    check_hyper,
    check_momentum_steps,
    get_kind,
)
from luwu.switch_nodes.store import BucketState, SegmentSpec

pytestmark = pytest.mark.timeout(60)

SHAPES = [(7, 5), (13,), (4, 3, 2)]


def segments(seed: int = 0):
    """One flat bucket holding three parameters, its state, and the matching torch tensors."""
    g = torch.Generator().manual_seed(seed)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    flat = torch.randn(numel, generator=g)
    views, off = [], 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        views.append((off, n))
        off += n
    return flat, views


def node_run(
    kind,
    hyper: dict,
    grads: list[torch.Tensor],
    flat: torch.Tensor,
    views,
    *,
    workers: int = 1,
    momentum_reset: int | None = None,
):
    """The node's path: the accumulator holds the sum of ``workers`` pushes, the kernel divides by it.
    ``momentum_reset``: the momentum buffer is zeroed before that (0-based) step."""
    params = flat.clone()
    state = {n: torch.zeros_like(params) for n in kind.state_names}
    steps = [torch.zeros(()) for _ in views]
    split = lambda t: [t.narrow(0, o, n) for o, n in views]  # noqa: E731
    for t, g in enumerate(grads):
        if t == momentum_reset:
            state[kind.state_names[0]].zero_()
        acc = g * workers
        apply_(
            kind,
            split(params),
            split(acc),
            {n: split(t) for n, t in state.items()},
            steps,
            dict(kind.defaults) | hyper,
            grad_scale=torch.tensor(float(workers)),
        )
    return params, state, steps


def torch_run(cls, hyper: dict, grads: list[torch.Tensor], flat: torch.Tensor, views):
    ps = [torch.nn.Parameter(flat[o : o + n].clone().view(s)) for (o, n), s in zip(views, SHAPES)]
    opt = cls(ps, **hyper)
    for g in grads:
        for p, (o, n) in zip(ps, views):
            p.grad = g[o : o + n].clone().view(p.shape)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in ps]), opt


def gradients(numel: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * (1.0 + 0.2 * t) for t in range(steps)]


@pytest.mark.parametrize(
    "kind,cls,hyper",
    [
        (ADAMW, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        (ADAM, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01, "betas": (0.8, 0.99)}),
        (
            SGD,
            torch.optim.SGD,
            {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        ),
    ],
)
def test_equal_to_torch_optim(kind, cls, hyper):
    flat, views = segments()
    grads = gradients(flat.numel(), 6)
    got, state, _ = node_run(kind, hyper, grads, flat, views, workers=2)
    want, opt = torch_run(cls, hyper, grads, flat, views)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if kind is not SGD:
        want_sq = torch.cat(
            [opt.state[p]["exp_avg_sq"].reshape(-1) for p in opt.param_groups[0]["params"]]
        )
        torch.testing.assert_close(state["exp_avg_sq"], want_sq, rtol=1e-6, atol=1e-7)


def reference_frozen_adam(
    flat, views, grads, *, lr, betas, eps, weight_decay, decoupled, freeze, maximize=False
):
    """The frozen-variance mode written out per element, in float64, independently of apply_."""
    b1, b2 = betas
    bound = max(1.0, (1 - b1) / (1 - b2) ** 0.5)
    p = flat.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double().clone()
        if maximize:
            g = -g
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        if t <= freeze:
            v = b2 * v + (1 - b2) * g * g
            u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        else:
            u = (m / (1 - b1**t)) / ((v / (1 - b2**freeze)).sqrt() + eps)
            u = u.clamp(-bound, bound)
        p = p - lr * u
    return p.float(), m.float(), v.float()


@pytest.mark.parametrize("kind", [ADAMW, ADAM])
@pytest.mark.parametrize("freeze", [1, 3, 20])
@pytest.mark.parametrize("maximize", [False, True])
def test_frozen_variance_matches_its_reference(kind, freeze, maximize):
    flat, views = segments()
    grads = gradients(flat.numel(), 8)
    hyper = {
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.05,
        "maximize": maximize,
        "variance_freeze_step": freeze,
    }
    got, state, steps = node_run(kind, hyper, grads, flat, views, workers=2)
    want, m, v = reference_frozen_adam(
        flat,
        views,
        grads,
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.05,
        decoupled=kind is ADAMW,
        freeze=freeze,
        maximize=maximize,
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state["exp_avg"], m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-6, atol=1e-9)
    assert [float(s) for s in steps] == [8.0] * len(views)


def test_frozen_variance_is_torch_until_the_freeze_and_then_stops_the_variance():
    flat, views = segments()
    grads = gradients(flat.numel(), 9)
    hyper = {"lr": 0.01, "weight_decay": 0.1}
    # steps 1..4: torch's fused kernel, bit for bit what the node does without the mode
    got, state, _ = node_run(ADAMW, hyper | {"variance_freeze_step": 4}, grads[:4], flat, views)
    plain, plain_state, _ = node_run(ADAMW, hyper, grads[:4], flat, views)
    assert torch.equal(got, plain) and torch.equal(state["exp_avg_sq"], plain_state["exp_avg_sq"])
    torch.testing.assert_close(
        got, torch_run(torch.optim.AdamW, hyper, grads[:4], flat, views)[0], rtol=1e-6, atol=1e-6
    )
    # beyond: exp_avg_sq is exactly what step 4 left, exp_avg still moves
    _, after, _ = node_run(ADAMW, hyper | {"variance_freeze_step": 4}, grads, flat, views)
    assert torch.equal(after["exp_avg_sq"], state["exp_avg_sq"])
    assert not torch.equal(after["exp_avg"], state["exp_avg"])
    # a freeze step past the run, or None: torch's AdamW all along
    plain, _, _ = node_run(ADAMW, hyper, grads, flat, views)
    torch.testing.assert_close(
        plain, torch_run(torch.optim.AdamW, hyper, grads, flat, views)[0], rtol=1e-6, atol=1e-6
    )
    for freeze in (9, None):
        got, _, _ = node_run(ADAMW, hyper | {"variance_freeze_step": freeze}, grads, flat, views)
        assert torch.equal(got, plain)


def test_frozen_variance_bounds_the_step_of_an_element_silent_during_the_warmup():
    """exp_avg_sq == 0 at the freeze (a dead ReLU unit): the step stays within Adam's bound, lr * 3.16."""
    flat, views = segments()
    grads = gradients(flat.numel(), 6)
    for g in grads[:3]:
        g[:5] = 0.0  # never seen before the freeze
    hyper = {"lr": 0.01, "weight_decay": 0.0, "variance_freeze_step": 3}
    before, _, _ = node_run(ADAMW, hyper, grads[:3], flat, views)
    after, _, _ = node_run(ADAMW, hyper, grads[:4], flat, views)
    step = (after - before)[:5].abs()
    assert torch.isfinite(after).all()
    assert torch.all(step <= 0.01 * (0.1 / 0.001**0.5) * (1 + 1e-6)) and torch.all(step > 0.01)


def test_frozen_segments_and_live_segments_in_one_bucket():
    """Segments count their own steps (a parameter group added later): each freezes at its own step K."""
    flat, views = segments()
    grads = gradients(flat.numel(), 5)
    hyper = dict(ADAMW.defaults) | {"lr": 0.01, "variance_freeze_step": 2}
    params = flat.clone()
    state = {n: torch.zeros_like(params) for n in ADAMW.state_names}
    steps = [
        torch.tensor(0.0),
        torch.tensor(3.0),
        torch.tensor(1.0),
    ]  # segment 1 already past the freeze
    split = lambda t: [t.narrow(0, o, n) for o, n in views]  # noqa: E731
    sq_before = state["exp_avg_sq"].clone()
    apply_(
        ADAMW,
        split(params),
        split(grads[0].clone()),
        {n: split(t) for n, t in state.items()},
        steps,
        hyper,
    )
    changed = [not torch.equal(a, b) for a, b in zip(split(state["exp_avg_sq"]), split(sq_before))]
    assert changed == [True, False, True]
    assert [float(s) for s in steps] == [1.0, 4.0, 2.0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_variance_freeze_step_is_validated(bad):
    with pytest.raises(ConfigError, match="variance_freeze_step"):
        check_hyper(ADAMW, dict(ADAMW.defaults) | {"variance_freeze_step": bad})
    check_hyper(ADAMW, dict(ADAMW.defaults) | {"variance_freeze_step": None})
    check_hyper(ADAM, dict(ADAM.defaults) | {"variance_freeze_step": 10})
    with pytest.raises(ConfigError, match="adam"):
        check_hyper(SGD, dict(SGD.defaults) | {"variance_freeze_step": 10})


# -- momentum correction: the workers send the momentum (luwu.protocol.feedback) ------------------


def handover_run(
    kind,
    hyper: dict,
    grads: list[torch.Tensor],
    flat,
    views,
    *,
    from_step: int,
    density: float = 1.0,
):
    """The node's path where pushes from ``from_step`` (0-based) on carry the workers' momentum
    ``u = beta u + alpha g`` of the same gradients from zero there, dense (what momentum correction
    sends at density 1 without masking): the update must be the node's own momentum update with the
    buffer reset at ``from_step``, to rounding."""
    params = flat.clone()
    state = {n: torch.zeros_like(params) for n in kind.state_names}
    steps = [torch.zeros(()) for _ in views]
    split = lambda t: [t.narrow(0, o, n) for o, n in views]  # noqa: E731
    full = dict(kind.defaults) | hyper
    beta, alpha = (
        (full["betas"][0], 1 - full["betas"][0])
        if kind is not SGD
        else (full["momentum"], 1 - full["dampening"])
    )
    u = torch.zeros_like(params)
    for t, g in enumerate(grads):
        h = full
        if t >= from_step:
            u = beta * u + alpha * g
            g, h = u, full | {WORKER_MOMENTUM: density}
            check_hyper(kind, h)
        apply_(
            kind,
            split(params),
            split(g.clone() * 2),
            {n: split(x) for n, x in state.items()},
            steps,
            h,
            grad_scale=torch.tensor(2.0),
        )
    return params


@pytest.mark.parametrize("freeze,from_step", [(4, 4), (4, 6), (6, 8)])
def test_worker_momentum_hands_over_to_the_frozen_adam_update(freeze, from_step):
    """Where no step bound binds (gradients at the scale the variance froze at): the bounds differ by
    design, B on the node's own momentum and B / density on the workers' (the tests below)."""
    flat, views = segments()
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(flat.numel(), generator=g) for _ in range(10)]
    hyper = {"lr": 0.01, "weight_decay": 0.05, "variance_freeze_step": freeze}
    plain, _, _ = node_run(ADAMW, hyper, grads, flat, views, workers=2, momentum_reset=from_step)
    got = handover_run(ADAMW, hyper, grads, flat, views, from_step=from_step)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    kept, _, _ = node_run(ADAMW, hyper, grads, flat, views, workers=2)
    assert (
        got - kept
    ).abs().max() > 1e-3  # the node's own momentum is not applied after the handover


def test_worker_momentum_hands_over_to_sgd_momentum():
    flat, views = segments()
    grads = gradients(flat.numel(), 8)
    hyper = {"lr": 0.05, "momentum": 0.9}
    torch.testing.assert_close(
        handover_run(SGD, hyper, grads, flat, views, from_step=0),
        torch_run(torch.optim.SGD, hyper, grads, flat, views)[0],
        rtol=1e-5,
        atol=1e-6,
    )
    # from step 4: torch's SGD with its momentum buffer zeroed there
    _, opt = torch_run(torch.optim.SGD, hyper, grads[:4], flat, views)
    for st in opt.state.values():
        st["momentum_buffer"].zero_()
    for g in grads[4:]:
        for p, (o, n) in zip(opt.param_groups[0]["params"], views):
            p.grad = g[o : o + n].clone().view(p.shape)
        opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in opt.param_groups[0]["params"]])
    torch.testing.assert_close(
        handover_run(SGD, hyper, grads, flat, views, from_step=4), want, rtol=1e-5, atol=1e-6
    )


def test_worker_momentum_bounds_a_burst_at_adams_bound_over_the_density():
    """A top-k burst carries ~1/density steps of momentum: bounded at B / density, not at B."""
    flat, views = segments()
    grads = gradients(flat.numel(), 4)
    hyper = {"lr": 0.01, "weight_decay": 0.0, "variance_freeze_step": 3}
    before, _, _ = node_run(ADAMW, hyper, grads[:3], flat, views)
    burst = grads[:4]
    burst[3] = grads[3] * 1e4  # far beyond the frozen scale
    for density in (0.01, 1.0):
        after = handover_run(ADAMW, hyper, burst, flat, views, from_step=3, density=density)
        step = (after - before).abs()
        bound = 0.01 * 3.1623 / density
        assert step.max() <= bound * (1 + 1e-4) and step.max() > 0.9 * bound


@pytest.mark.parametrize(
    "kind,hyper",
    [
        (ADAMW, {"lr": 0.01, "weight_decay": 0.0, "variance_freeze_step": 3}),
        (SGD, {"lr": 0.05, "momentum": 0.9}),
    ],
)
def test_worker_momentum_discards_the_nodes_own_momentum_at_the_handover(kind, hyper):
    """Elements with momentum in the node's buffer at the handover that the workers then send nothing
    for do not move (Adam: even with exp_avg_sq frozen at zero under them)."""
    flat, views = segments()
    grads = gradients(flat.numel(), 6)
    for g in grads[:3]:
        g[:5] = 0.0
    grads[3][:5] = 1.0  # seen first after the freeze: momentum but no variance
    for g in grads[4:]:
        g[:5] = 0.0  # from here on the workers send nothing for them
    before = handover_run(kind, hyper, grads[:5], flat, views, from_step=5)
    after = handover_run(kind, hyper, grads, flat, views, from_step=5, density=0.01)
    assert torch.equal(after[:5], before[:5]) and not torch.equal(after[5:], before[5:])


def test_worker_momentum_is_refused_where_the_update_is_not_linear_in_it():
    wm = {WORKER_MOMENTUM: 0.01}
    with pytest.raises(ConfigError, match="variance frozen"):
        check_hyper(ADAMW, dict(ADAMW.defaults) | wm)
    with pytest.raises(ConfigError, match="L2 weight_decay"):
        check_hyper(
            ADAM, dict(ADAM.defaults) | wm | {"weight_decay": 0.1, "variance_freeze_step": 5}
        )
    with pytest.raises(ConfigError, match="sgd without weight_decay or nesterov"):
        check_hyper(SGD, dict(SGD.defaults) | wm | {"momentum": 0.9, "weight_decay": 0.1})
    for bad in (0, 1.5, True, "0.01"):
        with pytest.raises(ConfigError, match=WORKER_MOMENTUM):
            check_hyper(SGD, dict(SGD.defaults) | {WORKER_MOMENTUM: bad})
    ok = dict(ADAMW.defaults) | wm | {"variance_freeze_step": 5}
    check_hyper(ADAMW, ok)
    check_hyper(SGD, dict(SGD.defaults) | wm | {"momentum": 0.9})
    # a push that would reach segments before their variance freezes, counting the steps still queued
    steps = [torch.tensor(3.0), torch.tensor(4.0)]
    with pytest.raises(ConfigError, match="after 3 steps.*variance_freeze_step = 5"):
        check_momentum_steps(ADAMW, ok, steps)
    check_momentum_steps(ADAMW, ok, steps, ahead=2)
    with pytest.raises(ValueError, match="not frozen"):
        flat, views = segments()
        apply_(
            ADAMW,
            [flat[:3]],
            [torch.ones(3)],
            {"exp_avg": [torch.zeros(3)], "exp_avg_sq": [torch.zeros(3)]},
            [torch.tensor(0.0)],
            ok,
        )


@pytest.mark.parametrize(
    "name,why",
    [
        ("lbfgs", "not elementwise: it needs a closure"),
        ("LBFGS", "line search"),
        ("sparseadam", "sparse gradients"),
        ("asgd", "per-parameter scalars"),
        ("muon", "orthogonalises each whole weight matrix"),
    ],
)
def test_optimizers_a_node_cannot_run_are_refused_with_the_reason(name, why):
    with pytest.raises(
        ConfigError,
        match=f"optimizer {name!r} cannot run on LuWu nodes: .*{why}.*supported: adamw, adam, sgd, adagrad",
    ):
        get_kind(name)
    assert set(UNSUPPORTED) == {"lbfgs", "sparseadam", "asgd", "muon"}
    with pytest.raises(ConfigError, match="unknown optimizer 'adamm'"):
        get_kind("adamm")


@pytest.mark.parametrize(
    "name,bad,match",
    [
        ("adagrad", {"lr_decay": -0.1}, "invalid lr_decay value: -0.1"),
        (
            "adagrad",
            {"initial_accumulator_value": -1.0},
            "invalid initial_accumulator_value value: -1.0",
        ),
        ("adagrad", {"eps": -1e-3}, "invalid eps value"),
        ("rmsprop", {"alpha": -0.5}, "invalid alpha value: -0.5"),
        ("rmsprop", {"momentum": -0.1}, "invalid momentum value: -0.1"),
        ("rmsprop", {"lr": -1.0}, "invalid learning rate: -1.0"),
        ("adamax", {"betas": (1.0, 0.9)}, "invalid beta parameters"),
        ("nadam", {"momentum_decay": -1.0}, "invalid momentum_decay value: -1.0"),
        ("radam", {"weight_decay": -0.1}, "invalid weight_decay value: -0.1"),
        ("adadelta", {"rho": 1.5}, "invalid rho value: 1.5"),
        ("rprop", {"etas": (1.2, 0.5)}, "invalid eta values: 1.2, 0.5"),
        ("adafactor", {"beta2_decay": 0.5}, "invalid beta2_decay value: 0.5"),
        ("adafactor", {"eps": (-1.0, 1e-3)}, "invalid epsilon1 value: -1.0"),
        ("adafactor", {"eps": (None, -1e-3)}, "invalid epsilon2 value: -0.001"),
        ("adafactor", {"d": 0.5}, "invalid clipping threshold d: 0.5"),
        ("adafactor", {"weight_decay": -0.1}, "invalid weight_decay value: -0.1"),
    ],
)
def test_new_optimizers_check_hyperparameters_as_torch_does(name, bad, match):
    """Each value torch's constructor refuses (ValueError) is a ConfigError naming the value."""
    kind = get_kind(name)
    with pytest.raises(ValueError):
        getattr(
            torch.optim,
            {
                "adagrad": "Adagrad",
                "rmsprop": "RMSprop",
                "adamax": "Adamax",
                "nadam": "NAdam",
                "radam": "RAdam",
                "adadelta": "Adadelta",
                "rprop": "Rprop",
                "adafactor": "Adafactor",
            }[name],
        )([torch.zeros(2, requires_grad=True)], **bad)
    with pytest.raises(ConfigError, match=match):
        check_hyper(kind, dict(kind.defaults) | bad)
    check_hyper(kind, dict(kind.defaults))
    with pytest.raises(
        ConfigError, match=f"variance_freeze_step applies to adam and adamw, not to {name}"
    ):
        check_hyper(kind, dict(kind.defaults) | {"variance_freeze_step": 3})


def test_amsgrad_runs_but_not_with_a_frozen_variance():
    check_hyper(ADAM, dict(ADAM.defaults) | {"amsgrad": True})
    with pytest.raises(ConfigError, match="variance_freeze_step and amsgrad=True do not combine"):
        check_hyper(ADAMW, dict(ADAMW.defaults) | {"amsgrad": True, "variance_freeze_step": 3})


def test_optional_state_costs_nothing_until_used():
    """RMSprop's momentum_buffer and grad_avg, amsgrad's max_exp_avg_sq, SGD's momentum_buffer: allocated
    when a step uses them; a state get reads zeros for them without allocating, a set of zeros leaves
    them unallocated, a set of values allocates them."""
    segs = [SegmentSpec(0, 0, 0, 6), SegmentSpec(1, 0, 6, 4)]
    b = BucketState(0, 0, 10, segs, RMSPROP)
    assert b.state.allocated() == () and len(b.state) == 3 and b.nbytes == 10 * 4, (
        "no state before the first step (torch makes it lazily)"
    )
    acc = b.accumulator(0, 2)
    b.buffer(acc).copy_(torch.arange(10.0))
    acc.hyper = dict(RMSPROP.defaults)
    b.apply(acc, 1.0)
    b.release(0)
    ts = b.tensors()
    assert b.state.allocated() == ("square_avg",) and b.nbytes == 10 * 4 * 2
    assert [float(t.abs().sum()) for t in ts[2:4]] == [0.0, 0.0]
    b.load(ts)
    assert b.state.allocated() == ("square_avg",)
    ts[2] = torch.ones(10)  # a loaded momentum_buffer
    b.load(ts)
    assert (
        b.state.allocated() == ("square_avg", "momentum_buffer")
        and float(b.state["momentum_buffer"].sum()) == 10.0
    )
    for kind, hyper, used in (
        (ADAM, {}, ("exp_avg", "exp_avg_sq")),
        (ADAM, {"amsgrad": True}, ADAM.state_names),
        (SGD, {}, ()),
        (SGD, {"momentum": 0.9}, ("momentum_buffer",)),
    ):
        assert kind.state_for(dict(kind.defaults) | hyper) == used
        assert BucketState(0, 0, 10, segs, kind).state.allocated() == ()


def _adafactor_bucket(seed: int = 0) -> BucketState:
    """A bucket of three whole parameters (a matrix, a vector, a 3-D tensor) after two Adafactor steps."""
    segs, off = [], 0
    for i, s in enumerate(SHAPES):
        n = torch.Size(s).numel()
        segs.append(SegmentSpec(i, 0, off, n, s, True))
        off += n
    b = BucketState(0, 0, off, segs, ADAFACTOR)
    g = torch.Generator().manual_seed(seed)
    b.params.copy_(torch.randn(off, generator=g))
    for t in range(2):
        acc = b.accumulator(t, 2)
        b.buffer(acc).copy_(torch.randn(off, generator=g))
        acc.hyper = dict(ADAFACTOR.defaults)
        b.apply(acc, 1.0)
        b.release(t)
        b.version += 1
    return b


def test_adafactor_state_is_shaped_per_parameter_and_round_trips_in_the_flat_form():
    """torch's shapes per whole parameter (row_var (..., R, 1), col_var (..., 1, C), a vector's variance),
    a fraction of the parameters' bytes; what a checkpoint or STATE carries loads into a fresh bucket
    unchanged, each segment's state at the start of its slot."""
    b = _adafactor_bucket()
    assert [None if t is None else tuple(t.shape) for t in b.state["row_var"]] == [
        (7, 1),
        None,
        (4, 3, 1),
    ]
    assert [None if t is None else tuple(t.shape) for t in b.state["col_var"]] == [
        (1, 5),
        None,
        (4, 1, 2),
    ]
    assert [None if t is None else tuple(t.shape) for t in b.state["variance"]] == [
        None,
        (13,),
        None,
    ]
    assert b.nbytes == b.numel * 4 + (7 + 4 * 3 + 5 + 4 * 2 + 13) * 4
    ts = b.tensors()
    assert [t.numel() for t in ts] == [b.numel] * 4 + [3]
    torch.testing.assert_close(
        ts[1][35 + 13 : 35 + 13 + 12], b.state["row_var"][2].reshape(-1), rtol=0, atol=0
    )
    fresh = BucketState(0, 0, b.numel, b.segments, ADAFACTOR)
    fresh.load(ts)
    for n in ADAFACTOR.state_names:
        for got, want in zip(fresh.state[n], b.state[n]):
            assert (got is None and want is None) or torch.equal(got, want)
    assert [float(s) for s in fresh.steps] == [2.0, 2.0, 2.0] and torch.equal(
        fresh.params, b.params
    )


def test_adafactor_needs_each_parameter_whole_in_its_bucket():
    with pytest.raises(
        ConfigError,
        match="'adafactor' needs each parameter whole in one bucket: parameter 1 is not",
    ):
        BucketState(
            0, 0, 10, [SegmentSpec(0, 0, 0, 6, (2, 3), True), SegmentSpec(1, 0, 6, 4)], ADAFACTOR
        )

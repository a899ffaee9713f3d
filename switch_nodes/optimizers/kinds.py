"""The optimizers a node runs: names, state, defaults and hyperparameter checks.

Torch-free, so the command line and the configuration can name and check
optimizers without loading torch. Each kind names the module of this package
that holds its update (``apply_``); adding an optimizer is one kind here and
one module beside this one.

Almost every kind is a ``torch.optim`` algorithm whose update is elementwise,
so it runs the same on a slice of a parameter as on the whole (a parameter may
span buckets and nodes). Adafactor's is factored by rows and columns and
scaled by whole-parameter norms: its kind has ``whole_params``, the layout keeps
each of its parameters whole in one bucket, and its state is shaped per
parameter (:meth:`OptimizerKind.state_shapes`). A segment's state matches
``torch.optim``'s per-parameter state (``exp_avg``, ``square_avg``,
``row_var``..., plus the step counter), so that ``state_dict()`` gathers into
torch's own format. The algorithms a node cannot run are refused by
:func:`get_kind`, which says why (:data:`UNSUPPORTED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from luwu.protocol.errors import ConfigError


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    name: str
    state_names: tuple[str, ...]
    """torch's state keys: flat state tensors per bucket (same numel as the parameters), or with
    ``shaped_state`` the names it may give."""
    defaults: dict
    """torch.optim's constructor defaults (less its implementation switches: foreach, fused...)."""
    hyper_keys: tuple[str, ...]
    """The param-group keys a worker sends with every push."""
    extra_hyper: tuple[str, ...]
    """Keys a node accepts beyond torch's (sent when a param group sets them; absent = torch's behaviour)."""
    module: str
    """The module of this package with the update: ``apply_(kind, params, grads, state, steps, hyper, grad_scale)``."""
    check: Callable[[OptimizerKind, dict], None]
    """Checks of this kind's own hyperparameters (see :func:`check_hyper`)."""
    optional_state: tuple[tuple[str, str], ...] = ()
    """(state name, hyperparameter): state torch creates only when that hyperparameter is set (nonzero or
    True), e.g. RMSprop's ``momentum_buffer``; a node allocates it on first use, so it costs nothing unused."""
    step_in_state: bool = True
    """Whether torch's per-parameter state holds ``step`` (SGD's does not)."""
    shaped_state: Callable[[tuple[int, ...]], dict[str, tuple[int, ...]]] | None = None
    """For a kind whose state is not elementwise (Adafactor's row and column statistics): a parameter's
    shape -> the shape of each state tensor torch keeps for it. Such a kind needs each parameter whole in
    one bucket (``whole_params``)."""

    @property
    def whole_params(self) -> bool:
        """Whether the update needs each parameter whole, in one bucket on one node (``ParamSpec.whole``)."""
        return self.shaped_state is not None

    def state_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """torch's shape of each state tensor of a parameter of ``shape`` (the parameter's own for
        elementwise kinds; each never has more elements than the parameter)."""
        shape = tuple(shape)
        return (
            self.shaped_state(shape)
            if self.shaped_state is not None
            else {n: shape for n in self.state_names}
        )

    def state_for(self, h: dict) -> tuple[str, ...]:
        """The state names torch's update keeps with hyperparameters ``h``."""
        off = {n for n, key in self.optional_state if not _truthy(h.get(key))}
        return tuple(n for n in self.state_names if n not in off)


def _truthy(v: Any) -> bool:
    return bool(v) if isinstance(v, bool) or v is None else float(v) != 0.0


def _worker_momentum(h: dict) -> Any:
    from luwu.protocol.feedback import WORKER_MOMENTUM  # the key lives with momentum correction

    return WORKER_MOMENTUM, h.get(WORKER_MOMENTUM)


def _at_least_zero(h: dict, *keys: str) -> None:
    """torch's ``if not 0.0 <= value: raise ValueError("Invalid <key> value: ...")``."""
    for key in keys:
        if not float(h[key]) >= 0.0:
            raise ConfigError(f"invalid {key} value: {h[key]}")


def _betas(h: dict) -> None:
    b1, b2 = h["betas"]
    if not 0.0 <= float(b1) < 1.0 or not 0.0 <= float(b2) < 1.0:
        raise ConfigError(f"invalid beta parameters: {h['betas']}")


def _no_luwu_extras(kind: OptimizerKind, h: dict) -> None:
    if h.get("variance_freeze_step") is not None:
        raise ConfigError(f"variance_freeze_step applies to adam and adamw, not to {kind.name}")
    if _worker_momentum(h)[1] is not None:
        raise ConfigError(
            f"{_MC} supports sgd and adam/adamw (with variance_freeze_step) only, not {kind.name}"
        )


def _check_adam(kind: OptimizerKind, h: dict) -> None:
    _betas(h)
    if not float(h["eps"]) >= 0.0:
        raise ConfigError(f"invalid epsilon value: {h['eps']}")
    freeze = h.get("variance_freeze_step")
    if freeze is not None and (
        isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 1
    ):
        raise ConfigError(
            f"invalid variance_freeze_step: {freeze!r} (None, or an int >= 1: the steps that update the variance)"
        )
    if freeze is not None and h.get("amsgrad"):
        raise ConfigError(
            "variance_freeze_step and amsgrad=True do not combine (amsgrad's maximum is a live variance)"
        )
    if _worker_momentum(h)[1] is None:
        return
    if freeze is None:
        raise ConfigError(
            f"{_MC} needs Adam's variance frozen: set variance_freeze_step (at most compression.warmup_steps) in the param groups"
        )
    if kind.name == "adam" and float(h["weight_decay"]) != 0.0:
        raise ConfigError(
            f"{_MC} does not support adam's L2 weight_decay (it would go through the workers' momentum): use adamw"
        )


def _check_sgd(kind: OptimizerKind, h: dict) -> None:
    if h.get("variance_freeze_step") is not None:
        raise ConfigError(f"variance_freeze_step applies to adam and adamw, not to {kind.name}")
    if not float(h["momentum"]) >= 0.0:
        raise ConfigError(f"invalid momentum value: {h['momentum']}")
    if h["nesterov"] and (float(h["momentum"]) <= 0 or float(h["dampening"]) != 0):
        raise ConfigError("nesterov momentum requires a momentum and zero dampening")
    if _worker_momentum(h)[1] is not None and (float(h["weight_decay"]) != 0.0 or h["nesterov"]):
        raise ConfigError(f"{_MC} supports sgd without weight_decay or nesterov only")


def _check_adagrad(kind: OptimizerKind, h: dict) -> None:
    _no_luwu_extras(kind, h)
    _at_least_zero(h, "lr_decay", "initial_accumulator_value", "eps")


def _check_rmsprop(kind: OptimizerKind, h: dict) -> None:
    _no_luwu_extras(kind, h)
    _at_least_zero(h, "eps", "momentum", "alpha")


def _check_adam_like(kind: OptimizerKind, h: dict) -> None:
    """Adamax, NAdam, RAdam: betas in [0, 1), eps (and NAdam's momentum_decay) >= 0."""
    _no_luwu_extras(kind, h)
    _betas(h)
    _at_least_zero(h, "eps", *(("momentum_decay",) if "momentum_decay" in h else ()))


def _check_adadelta(kind: OptimizerKind, h: dict) -> None:
    _no_luwu_extras(kind, h)
    if not 0.0 <= float(h["rho"]) <= 1.0:
        raise ConfigError(f"invalid rho value: {h['rho']}")
    _at_least_zero(h, "eps")


def _check_rprop(kind: OptimizerKind, h: dict) -> None:
    _no_luwu_extras(kind, h)
    minus, plus = h["etas"]
    if not 0.0 < float(minus) < 1.0 < float(plus):
        raise ConfigError(f"invalid eta values: {minus}, {plus}")
    lo, hi = h["step_sizes"]
    if not 0.0 <= float(lo) <= float(hi):
        raise ConfigError(f"invalid step_sizes: {lo}, {hi} (need 0 <= minimum <= maximum)")


def _check_adafactor(kind: OptimizerKind, h: dict) -> None:
    _no_luwu_extras(kind, h)
    if not float(h["beta2_decay"]) <= 0.0:
        raise ConfigError(f"invalid beta2_decay value: {h['beta2_decay']} (must be <= 0)")
    eps1, eps2 = h["eps"]
    if eps1 is not None and not float(eps1) >= 0.0:
        raise ConfigError(f"invalid epsilon1 value: {eps1}")
    if not float(eps2) >= 0.0:
        raise ConfigError(f"invalid epsilon2 value: {eps2}")
    if not float(h["d"]) >= 1.0:
        raise ConfigError(f"invalid clipping threshold d: {h['d']} (must be >= 1)")


def _adafactor_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """torch's Adafactor state: the row and column means of the squared gradient over the last two
    dimensions for a parameter of two or more, the full variance for a vector (or scalar)."""
    if len(shape) >= 2:
        return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
    return {"variance": shape}


_MC = "momentum correction (compression.momentum_correction)"
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
_ADAM_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_ADAM_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "amsgrad": False,
    "maximize": False,
}
_AMSGRAD = (("max_exp_avg_sq", "amsgrad"),)
_NO_EXTRA: tuple[str, ...] = ()


def _kind(
    name: str,
    state: tuple[str, ...],
    defaults: dict,
    check: Callable,
    module: str | None = None,
    **more: Any,
) -> OptimizerKind:
    """A kind whose worker sends every key of its defaults with each push."""
    return OptimizerKind(
        name, state, defaults, tuple(defaults), _NO_EXTRA, module or name, check, **more
    )


ADAMW = OptimizerKind(
    "adamw",
    _ADAM_STATE,
    _ADAM_DEFAULTS | {"weight_decay": 1e-2},
    _ADAM_KEYS,
    ("variance_freeze_step",),
    "adam",
    _check_adam,
    _AMSGRAD,
)
ADAM = OptimizerKind(
    "adam",
    _ADAM_STATE,
    _ADAM_DEFAULTS | {"weight_decay": 0.0},
    _ADAM_KEYS,
    ("variance_freeze_step",),
    "adam",
    _check_adam,
    _AMSGRAD,
)
SGD = OptimizerKind(
    "sgd",
    ("momentum_buffer",),
    {
        "lr": 1e-3,
        "momentum": 0.0,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
        "maximize": False,
    },
    ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    (),
    "sgd",
    _check_sgd,
    (("momentum_buffer", "momentum"),),
    step_in_state=False,
)
ADAGRAD = _kind(
    "adagrad",
    ("sum",),
    {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
        "maximize": False,
    },
    _check_adagrad,
)
RMSPROP = _kind(
    "rmsprop",
    ("square_avg", "momentum_buffer", "grad_avg"),
    {
        "lr": 1e-2,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
        "maximize": False,
    },
    _check_rmsprop,
    optional_state=(("momentum_buffer", "momentum"), ("grad_avg", "centered")),
)
ADAMAX = _kind(
    "adamax",
    ("exp_avg", "exp_inf"),
    {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "maximize": False},
    _check_adam_like,
)
NADAM = _kind(
    "nadam",
    ("exp_avg", "exp_avg_sq"),
    {
        "lr": 2e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum_decay": 4e-3,
        "decoupled_weight_decay": False,
        "maximize": False,
    },
    _check_adam_like,
)
RADAM = _kind(
    "radam",
    ("exp_avg", "exp_avg_sq"),
    {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "decoupled_weight_decay": False,
        "maximize": False,
    },
    _check_adam_like,
)
ADADELTA = _kind(
    "adadelta",
    ("square_avg", "acc_delta"),
    {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0, "maximize": False},
    _check_adadelta,
)
ADAFACTOR = _kind(
    "adafactor",
    ("row_var", "col_var", "variance"),
    {
        "lr": 1e-2,
        "beta2_decay": -0.8,
        "eps": (None, 1e-3),
        "d": 1.0,
        "weight_decay": 0.0,
        "maximize": False,
    },
    _check_adafactor,
    shaped_state=_adafactor_shapes,
)
RPROP = _kind(
    "rprop",
    ("prev", "step_size"),
    {"lr": 1e-2, "etas": (0.5, 1.2), "step_sizes": (1e-6, 50.0), "maximize": False},
    _check_rprop,
)

KINDS: dict[str, OptimizerKind] = {
    k.name: k
    for k in (ADAMW, ADAM, SGD, ADAGRAD, RMSPROP, ADAMAX, NADAM, RADAM, ADADELTA, RPROP, ADAFACTOR)
}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(KINDS)

#: The other torch.optim algorithms, and why a node cannot run them on its slices.
UNSUPPORTED: dict[str, str] = {
    "lbfgs": "its update is not elementwise: it needs a closure re-evaluating the loss and a line search over the whole model, "
    "and keeps a history of whole-model direction vectors",
    "sparseadam": "it updates only the rows present in sparse gradients, and LuWu streams dense gradients",
    "asgd": "it keeps per-parameter scalars (eta, mu) computed from the previous step's learning rate, which the nodes do not store",
    "muon": "its update is not elementwise: it orthogonalises each whole weight matrix (Newton-Schulz iterations)",
}

#: torch.optim's constructor switches that choose an implementation, not the update (a worker drops them;
#: ``differentiable=True`` asks for autograd through the step, which a node cannot give, and is refused).
IMPLEMENTATION_SWITCHES: tuple[str, ...] = ("foreach", "fused", "capturable", "differentiable")

#: Per optimizer name, the hyperparameters a node accepts beyond torch's.
EXTRA_HYPER: dict[str, tuple[str, ...]] = {k.name: k.extra_hyper for k in KINDS.values()}
#: Per optimizer name, the param-group keys a worker sends with every push.
HYPER_KEYS: dict[str, tuple[str, ...]] = {k.name: k.hyper_keys for k in KINDS.values()}


def get_kind(name: str) -> OptimizerKind:
    """The kind called ``name``; a ConfigError that says why for torch's algorithms a node cannot run."""
    kind = KINDS.get(name.lower())
    if kind is not None:
        return kind
    why = UNSUPPORTED.get(name.lower())
    if why is not None:
        raise ConfigError(
            f"optimizer {name!r} cannot run on LuWu nodes: {why}; supported: {', '.join(OPTIMIZER_NAMES)}"
        )
    raise ConfigError(f"unknown optimizer {name!r}: choose one of {sorted(KINDS)}")


def check_hyper(kind: OptimizerKind, h: dict) -> None:
    """Validate hyperparameters the way torch.optim's constructors do, plus LuWu's own keys
    (``variance_freeze_step``; the momentum-correction density, which needs an update linear in what
    the push carries)."""
    lr = float(h["lr"])
    if not lr >= 0.0:
        raise ConfigError(f"invalid learning rate: {lr}")
    if not float(h.get("weight_decay", 0.0)) >= 0.0:
        raise ConfigError(f"invalid weight_decay value: {h.get('weight_decay')}")
    key, density = _worker_momentum(h)
    if density is not None and (
        isinstance(density, bool)
        or not isinstance(density, (int, float))
        or not 0.0 < density <= 1.0
    ):
        raise ConfigError(
            f"invalid {key}: {density!r} (the top-k density of a momentum-corrected push, in (0, 1])"
        )
    kind.check(kind, h)


def check_momentum_steps(kind: OptimizerKind, h: dict, steps: list, ahead: int = 0) -> None:
    """A momentum-corrected push may only reach Adam segments whose variance is frozen already.
    ``steps``: the segments' step counters; ``ahead``: steps of the bucket still to be applied before
    the one pushed (sync pushes run up to two ahead of the node)."""
    if (
        _worker_momentum(h)[1] is None
        or "variance_freeze_step" not in kind.extra_hyper
        or not steps
    ):
        return
    freeze, taken = h["variance_freeze_step"], min(int(s) for s in steps) + ahead
    if taken < freeze:
        raise ConfigError(
            f"a momentum-corrected push came after {taken} steps, before the variance freezes at variance_freeze_step = {freeze}: "
            f"compression.warmup_steps must be >= variance_freeze_step"
        )

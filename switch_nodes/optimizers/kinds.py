"""The optimizers a node runs: names, state, defaults and hyperparameter checks.

Torch-free, so the command line and the configuration can name and check
optimizers without loading torch. Each kind names the module of this package
that holds its update (``apply_``); adding an optimizer is one kind here and
one module beside this one.

A segment's state matches ``torch.optim``'s per-parameter state
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, plus the step counter), so
that ``state_dict()`` gathers into torch's own format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from luwu.protocol.errors import ConfigError


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    name: str
    state_names: tuple[str, ...]
    """Flat state tensors per bucket (same numel as the parameters)."""
    defaults: dict
    """torch.optim's constructor defaults."""
    hyper_keys: tuple[str, ...]
    """The param-group keys a worker sends with every push."""
    extra_hyper: tuple[str, ...]
    """Keys a node accepts beyond torch's (sent when a param group sets them; absent = torch's behaviour)."""
    module: str
    """The module of this package with the update: ``apply_(kind, params, grads, state, steps, hyper, grad_scale)``."""
    check: Callable[[OptimizerKind, dict], None]
    """Checks of this kind's own hyperparameters (see :func:`check_hyper`)."""


def _worker_momentum(h: dict) -> Any:
    from luwu.protocol.feedback import WORKER_MOMENTUM  # the key lives with momentum correction

    return WORKER_MOMENTUM, h.get(WORKER_MOMENTUM)


def _check_adam(kind: OptimizerKind, h: dict) -> None:
    b1, b2 = h["betas"]
    if not 0.0 <= float(b1) < 1.0 or not 0.0 <= float(b2) < 1.0:
        raise ConfigError(f"invalid beta parameters: {h['betas']}")
    if not float(h["eps"]) >= 0.0:
        raise ConfigError(f"invalid epsilon value: {h['eps']}")
    if h.get("amsgrad"):
        raise ConfigError("amsgrad=True is not supported by LuWu nodes yet")
    freeze = h.get("variance_freeze_step")
    if freeze is not None and (isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 1):
        raise ConfigError(f"invalid variance_freeze_step: {freeze!r} (None, or an int >= 1: the steps that update the variance)")
    if _worker_momentum(h)[1] is None:
        return
    if freeze is None:
        raise ConfigError(f"{_MC} needs Adam's variance frozen: set variance_freeze_step (at most compression.warmup_steps) in the param groups")
    if kind.name == "adam" and float(h["weight_decay"]) != 0.0:
        raise ConfigError(f"{_MC} does not support adam's L2 weight_decay (it would go through the workers' momentum): use adamw")


def _check_sgd(kind: OptimizerKind, h: dict) -> None:
    if h.get("variance_freeze_step") is not None:
        raise ConfigError(f"variance_freeze_step applies to adam and adamw, not to {kind.name}")
    if not float(h["momentum"]) >= 0.0:
        raise ConfigError(f"invalid momentum value: {h['momentum']}")
    if h["nesterov"] and (float(h["momentum"]) <= 0 or float(h["dampening"]) != 0):
        raise ConfigError("nesterov momentum requires a momentum and zero dampening")
    if _worker_momentum(h)[1] is not None and (float(h["weight_decay"]) != 0.0 or h["nesterov"]):
        raise ConfigError(f"{_MC} supports sgd without weight_decay or nesterov only")


_MC = "momentum correction (compression.momentum_correction)"
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize")
_ADAM_STATE = ("exp_avg", "exp_avg_sq")
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "maximize": False}

ADAMW = OptimizerKind("adamw", _ADAM_STATE, _ADAM_DEFAULTS | {"weight_decay": 1e-2}, _ADAM_KEYS, ("variance_freeze_step",), "adam", _check_adam)
ADAM = OptimizerKind("adam", _ADAM_STATE, _ADAM_DEFAULTS | {"weight_decay": 0.0}, _ADAM_KEYS, ("variance_freeze_step",), "adam", _check_adam)
SGD = OptimizerKind(
    "sgd",
    ("momentum_buffer",),
    {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
    ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    (),
    "sgd",
    _check_sgd,
)
KINDS: dict[str, OptimizerKind] = {k.name: k for k in (ADAMW, ADAM, SGD)}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(KINDS)

#: Per optimizer name, the hyperparameters a node accepts beyond torch's.
EXTRA_HYPER: dict[str, tuple[str, ...]] = {k.name: k.extra_hyper for k in KINDS.values()}
#: Per optimizer name, the param-group keys a worker sends with every push.
HYPER_KEYS: dict[str, tuple[str, ...]] = {k.name: k.hyper_keys for k in KINDS.values()}


def get_kind(name: str) -> OptimizerKind:
    try:
        return KINDS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown optimizer {name!r}: choose one of {sorted(KINDS)}") from None


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
    if density is not None and (isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0):
        raise ConfigError(f"invalid {key}: {density!r} (the top-k density of a momentum-corrected push, in (0, 1])")
    kind.check(kind, h)


def check_momentum_steps(kind: OptimizerKind, h: dict, steps: list, ahead: int = 0) -> None:
    """A momentum-corrected push may only reach Adam segments whose variance is frozen already.
    ``steps``: the segments' step counters; ``ahead``: steps of the bucket still to be applied before
    the one pushed (sync pushes run up to two ahead of the node)."""
    if _worker_momentum(h)[1] is None or "variance_freeze_step" not in kind.extra_hyper or not steps:
        return
    freeze, taken = h["variance_freeze_step"], min(int(s) for s in steps) + ahead
    if taken < freeze:
        raise ConfigError(
            f"a momentum-corrected push came after {taken} steps, before the variance freezes at variance_freeze_step = {freeze}: "
            f"compression.warmup_steps must be >= variance_freeze_step"
        )

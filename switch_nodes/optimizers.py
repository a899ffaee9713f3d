"""Optimizers applied by a node to the flat slices of its shard.

Each bucket holds its parameters as one flat fp32 tensor; a segment (one
parameter's part of the bucket) is a view of it. The state of a segment
matches torch.optim's per-parameter state (``step``, ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``) so that ``state_dict()`` can be gathered
into torch's own format. The update is torch's own fused CPU kernel over the
list of segment views, so results match ``torch.optim`` to the last bits that
the fused kernel guarantees, at ~2 G params/s per thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim import adam as _adam
from torch.optim import sgd as _sgd

from luwu.protocol.errors import ConfigError


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    name: str
    state_names: tuple[str, ...]  # flat state tensors per bucket (same numel as params)
    defaults: dict


ADAMW = OptimizerKind("adamw", ("exp_avg", "exp_avg_sq"), {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False})
ADAM = OptimizerKind("adam", ("exp_avg", "exp_avg_sq"), {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False})
SGD = OptimizerKind("sgd", ("momentum_buffer",), {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False})
KINDS = {k.name: k for k in (ADAMW, ADAM, SGD)}


def get_kind(name: str) -> OptimizerKind:
    try:
        return KINDS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown optimizer {name!r}: choose one of {sorted(KINDS)}") from None


def check_hyper(kind: OptimizerKind, h: dict) -> None:
    """Validate hyperparameters the way torch.optim's constructors do."""
    lr = float(h["lr"])
    if not lr >= 0.0:
        raise ConfigError(f"invalid learning rate: {lr}")
    if not float(h.get("weight_decay", 0.0)) >= 0.0:
        raise ConfigError(f"invalid weight_decay value: {h.get('weight_decay')}")
    if kind.name in ("adam", "adamw"):
        b1, b2 = h["betas"]
        if not 0.0 <= float(b1) < 1.0 or not 0.0 <= float(b2) < 1.0:
            raise ConfigError(f"invalid beta parameters: {h['betas']}")
        if not float(h["eps"]) >= 0.0:
            raise ConfigError(f"invalid epsilon value: {h['eps']}")
        if h.get("amsgrad"):
            raise ConfigError("amsgrad=True is not supported by LuWu nodes yet")
    else:
        if not float(h["momentum"]) >= 0.0:
            raise ConfigError(f"invalid momentum value: {h['momentum']}")
        if h["nesterov"] and (float(h["momentum"]) <= 0 or float(h["dampening"]) != 0):
            raise ConfigError("nesterov momentum requires a momentum and zero dampening")


def apply_(
    kind: OptimizerKind,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: dict[str, list[torch.Tensor]],
    steps: list[torch.Tensor],
    hyper: dict,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One optimizer step over segment views. ``grad_scale``: grads are divided by it inside the kernel
    (how the node averages over workers and applies clipping / AMP unscaling without an extra pass)."""
    if not params:
        return
    if kind.name in ("adam", "adamw"):
        b1, b2 = hyper["betas"]
        _adam.adam(
            params,
            grads,
            state["exp_avg"],
            state["exp_avg_sq"],
            [],
            steps,
            fused=True,
            grad_scale=grad_scale,
            found_inf=None,
            decoupled_weight_decay=kind.name == "adamw",
            amsgrad=False,
            beta1=float(b1),
            beta2=float(b2),
            lr=float(hyper["lr"]),
            weight_decay=float(hyper["weight_decay"]),
            eps=float(hyper["eps"]),
            maximize=bool(hyper.get("maximize", False)),
        )
    else:
        momentum = float(hyper["momentum"])
        bufs = state["momentum_buffer"]
        first = [i for i, s in enumerate(steps) if momentum != 0.0 and float(s) == 0.0]
        if grad_scale is not None:
            for g in grads:
                g.div_(grad_scale)
        # torch creates a segment's buffer on its first step (from the decayed gradient); hand it
        # None there and keep what it made in our preallocated buffer.
        rest = [i for i in range(len(params)) if i not in set(first)]
        common = dict(
            weight_decay=float(hyper["weight_decay"]),
            momentum=momentum,
            lr=float(hyper["lr"]),
            dampening=float(hyper["dampening"]),
            nesterov=bool(hyper["nesterov"]),
            maximize=bool(hyper.get("maximize", False)),
        )
        if first:
            tmp: list = [None] * len(first)
            _sgd.sgd([params[i] for i in first], [grads[i] for i in first], tmp, foreach=False, **common)
            for j, i in enumerate(first):
                bufs[i].copy_(tmp[j])
        if rest:
            _sgd.sgd([params[i] for i in rest], [grads[i] for i in rest], [bufs[i] if momentum != 0.0 else None for i in rest], foreach=False, **common)
        for s in steps:
            s.add_(1)

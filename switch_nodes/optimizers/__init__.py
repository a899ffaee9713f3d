"""Optimizers applied by a node to the flat slices of its shard, one module per algorithm.

:mod:`.kinds` (torch-free) names every optimizer, its state, defaults and
hyperparameter checks; each kind names the module beside it that holds its
update, imported on first use, so importing this package does not load torch.
"""

from __future__ import annotations

import importlib
import math
from functools import cache
from typing import Any, Callable

from luwu.switch_nodes.optimizers.kinds import (
    ADADELTA,
    ADAFACTOR,
    ADAGRAD,
    ADAM,
    ADAMAX,
    ADAMW,
    EXTRA_HYPER,
    HYPER_KEYS,
    IMPLEMENTATION_SWITCHES,
    KINDS,
    NADAM,
    OPTIMIZER_NAMES,
    RADAM,
    RMSPROP,
    RPROP,
    SGD,
    UNSUPPORTED,
    OptimizerKind,
    check_hyper,
    check_momentum_steps,
    get_kind,
)

__all__ = [
    "ADADELTA",
    "ADAFACTOR",
    "ADAGRAD",
    "ADAM",
    "ADAMAX",
    "ADAMW",
    "EXTRA_HYPER",
    "HYPER_KEYS",
    "IMPLEMENTATION_SWITCHES",
    "KINDS",
    "NADAM",
    "OPTIMIZER_NAMES",
    "RADAM",
    "RMSPROP",
    "RPROP",
    "SGD",
    "UNSUPPORTED",
    "OptimizerKind",
    "apply_",
    "torch_scalars",
    "torch_state",
    "check_hyper",
    "check_momentum_steps",
    "get_kind",
]


@cache
def _module(module: str) -> Any:
    return importlib.import_module(f"{__name__}.{module}")


def _update(module: str) -> Callable[..., None]:
    return _module(module).apply_


def apply_(
    kind: OptimizerKind,
    params: list,
    grads: list,
    state: dict[str, list],
    steps: list,
    hyper: dict,
    grad_scale: Any = None,
) -> None:
    """One optimizer step of ``kind`` over segment views (flat slices of a bucket). ``grad_scale`` (a
    0-d tensor or None): grads are divided by it inside the update, how the node averages over workers
    and applies clipping / AMP unscaling without an extra pass."""
    if params:
        _update(kind.module)(kind, params, grads, state, steps, hyper, grad_scale=grad_scale)


def torch_scalars(kind: OptimizerKind, step: int, hyper: dict) -> dict:
    """The per-parameter scalars of torch's state that a node derives from the step instead of storing
    (NAdam's ``mu_product``), for ``state_dict``; empty for most kinds."""
    derive = getattr(_module(kind.module), "torch_scalars", None)
    return derive(step, hyper) if derive is not None else {}


def torch_state(flat: Any, shape: tuple[int, ...]) -> Any:
    """A parameter's state tensor in torch's ``shape``, from its slot of the flat form (a tensor of the
    parameter's numel): the slot itself for elementwise state; for a shaped state (Adafactor's, fewer
    elements, at the start of the slot) a copy of that start."""
    n = math.prod(shape)
    return flat.view(shape) if n == flat.numel() else flat[:n].clone().view(shape)

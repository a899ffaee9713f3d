"""Optimizers applied by a node to the flat slices of its shard, one module per algorithm.

:mod:`.kinds` (torch-free) names every optimizer, its state, defaults and
hyperparameter checks; each kind names the module beside it that holds its
update, imported on first use, so importing this package does not load torch.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any, Callable

from luwu.switch_nodes.optimizers.kinds import (
    ADAM,
    ADAMW,
    EXTRA_HYPER,
    HYPER_KEYS,
    KINDS,
    OPTIMIZER_NAMES,
    SGD,
    OptimizerKind,
    check_hyper,
    check_momentum_steps,
    get_kind,
)

__all__ = [
    "ADAM",
    "ADAMW",
    "EXTRA_HYPER",
    "HYPER_KEYS",
    "KINDS",
    "OPTIMIZER_NAMES",
    "SGD",
    "OptimizerKind",
    "apply_",
    "check_hyper",
    "check_momentum_steps",
    "get_kind",
]


@cache
def _update(module: str) -> Callable[..., None]:
    return importlib.import_module(f"{__name__}.{module}").apply_


def apply_(kind: OptimizerKind, params: list, grads: list, state: dict[str, list], steps: list, hyper: dict, grad_scale: Any = None) -> None:
    """One optimizer step of ``kind`` over segment views (flat slices of a bucket). ``grad_scale`` (a
    0-d tensor or None): grads are divided by it inside the update, how the node averages over workers
    and applies clipping / AMP unscaling without an extra pass."""
    if params:
        _update(kind.module)(kind, params, grads, state, steps, hyper, grad_scale=grad_scale)

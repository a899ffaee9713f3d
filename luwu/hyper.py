"""Hyperparameters as ``RemoteOptimizer`` takes them: torch's names and defaults, checked once in the
constructor (as torch's optimizers do), read from ``param_groups`` at every push.

A keyword that is neither one of ``RemoteOptimizer``'s own nor a hyperparameter of the optimizer is
refused with the closest name of either, so a misspelt ``stream_weight=True`` is not blamed on the
hyperparameters alone.
"""

from __future__ import annotations

import difflib
import inspect

import torch

from luwu.protocol.errors import ConfigError
from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.switch_nodes.optimizers import (
    EXTRA_HYPER,
    IMPLEMENTATION_SWITCHES,
    OptimizerKind,
    check_hyper,
)


def travelling(v):
    """A hyperparameter as it travels: tensors as floats, pairs (``betas``, ``etas``) as lists."""
    if isinstance(v, (tuple, list)):
        return [travelling(x) for x in v]
    return float(v.item()) if isinstance(v, torch.Tensor) else v


def defaults_of(kind: OptimizerKind, hyper: dict, constructor) -> dict:
    """The optimizer's defaults with ``hyper`` applied: torch's implementation switches (``foreach``,
    ``fused``, ``capturable``) and None are ignored; anything else unknown is a ConfigError naming the
    closest of ``constructor``'s keyword-only arguments (RemoteOptimizer's own) and the optimizer's
    hyperparameters."""
    params = inspect.signature(constructor).parameters.items()
    keywords = [n for n, p in params if p.kind is p.KEYWORD_ONLY]
    defaults = dict(kind.defaults)
    for k, v in hyper.items():
        if k == "differentiable" and v:
            raise ConfigError(
                "differentiable=True: a node's step runs outside autograd, nothing can differentiate through it"
            )
        if v is None or k in IMPLEMENTATION_SWITCHES:
            continue
        if k not in defaults:
            raise ConfigError(unknown_keyword(k, v, kind.name, list(defaults), keywords))
        defaults[k] = v
    return defaults


def unknown_keyword(key: str, value, optimizer: str, hyper: list[str], keywords: list[str]) -> str:
    """The refusal of ``key``, with the closest of ``keywords`` and ``hyper`` when one is close."""
    close = difflib.get_close_matches(key, keywords + hyper, n=1, cutoff=0.75)
    hint = ""
    if close:
        what = (
            "a RemoteOptimizer keyword"
            if close[0] in keywords
            else f"a hyperparameter of {optimizer!r}"
        )
        hint = f"; did you mean {close[0]!r} ({what})?"
    return (
        f"{key}={value!r} is not a RemoteOptimizer keyword nor a hyperparameter of optimizer {optimizer!r} "
        f"(its hyperparameters: {', '.join(hyper)}){hint}"
    )


def of_group(kind: OptimizerKind, group: dict) -> dict:
    """What a push of ``group``'s parameters carries: the optimizer's hyperparameters, plus the LuWu
    extensions the group sets (``variance_freeze_step``...)."""
    keys = kind.hyper_keys + tuple(k for k in EXTRA_HYPER[kind.name] if group.get(k) is not None)
    return {k: travelling(group[k]) for k in keys}


def check_momentum_correction(kind: OptimizerKind, hyper: dict, cc, mode: str) -> None:
    """What momentum correction asks of a param group (``hyper``, as pushed): sync mode and an update
    linear in the momentum the workers send (the node checks it again at every push), the variance
    frozen by the time the top-k steps start."""
    if mode != "sync":
        raise ConfigError(f"compression.momentum_correction needs mode='sync', not {mode!r}")
    h = hyper | {WORKER_MOMENTUM: cc.topk_density}
    check_hyper(kind, h)
    freeze = h.get("variance_freeze_step")
    if freeze is not None and freeze > cc.warmup_steps:
        raise ConfigError(
            f"variance_freeze_step = {freeze} is after compression.warmup_steps = {cc.warmup_steps}: with momentum "
            f"correction the variance must be frozen when the top-k steps start"
        )

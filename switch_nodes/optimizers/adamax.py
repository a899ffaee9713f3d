"""Adamax on a node: torch's ``torch.optim.adamax.adamax(foreach=True)`` over a bucket's segment views."""

from __future__ import annotations

import torch
from torch.optim import adamax as _adamax

from luwu.switch_nodes.optimizers.common import Tensors, pair, unscale_
from luwu.switch_nodes.optimizers.kinds import OptimizerKind


def apply_(kind: OptimizerKind, params: Tensors, grads: Tensors, state: dict[str, Tensors], steps: Tensors, hyper: dict, grad_scale: torch.Tensor | None = None) -> None:
    """One Adamax step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    beta1, beta2 = pair(hyper["betas"])
    _adamax.adamax(
        params,
        grads,
        state["exp_avg"],
        state["exp_inf"],
        steps,
        foreach=True,
        maximize=bool(hyper["maximize"]),
        eps=float(hyper["eps"]),
        beta1=beta1,
        beta2=beta2,
        lr=float(hyper["lr"]),
        weight_decay=float(hyper["weight_decay"]),
    )

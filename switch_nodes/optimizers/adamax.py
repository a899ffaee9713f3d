"""Adamax on a node: torch's ``torch.optim.adamax.adamax(foreach=True)`` over a bucket's segment views."""

from __future__ import annotations

import torch
from torch.optim import adamax as _adamax

from luwu.switch_nodes.optimizers.common import Tensors, adam_family, unscale_
from luwu.switch_nodes.optimizers.kinds import OptimizerKind


def apply_(
    kind: OptimizerKind,
    params: Tensors,
    grads: Tensors,
    state: dict[str, Tensors],
    steps: Tensors,
    hyper: dict,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adamax step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    _adamax.adamax(
        params,
        grads,
        state["exp_avg"],
        state["exp_inf"],
        steps,
        **adam_family(hyper),
    )

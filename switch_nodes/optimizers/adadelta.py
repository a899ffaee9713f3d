"""Adadelta on a node: torch's ``torch.optim.adadelta.adadelta(foreach=True)`` over a bucket's segment views."""

from __future__ import annotations

import torch
from torch.optim import adadelta as _adadelta

from luwu.switch_nodes.optimizers.common import Tensors, unscale_
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
    """One Adadelta step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    _adadelta.adadelta(
        params,
        grads,
        state["square_avg"],
        state["acc_delta"],
        steps,
        foreach=True,
        lr=float(hyper["lr"]),
        rho=float(hyper["rho"]),
        eps=float(hyper["eps"]),
        weight_decay=float(hyper["weight_decay"]),
        maximize=bool(hyper["maximize"]),
    )

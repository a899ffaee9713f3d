"""RMSprop on a node: torch's ``torch.optim.rmsprop.rmsprop(foreach=True)`` over a bucket's segment
views. ``momentum_buffer`` (momentum > 0) and ``grad_avg`` (centered) exist only when used, as in torch."""

from __future__ import annotations

import torch
from torch.optim import rmsprop as _rmsprop

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
    """One RMSprop step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    _rmsprop.rmsprop(
        params,
        grads,
        state["square_avg"],
        state.get("grad_avg", []),
        state.get("momentum_buffer", []),
        steps,
        foreach=True,
        maximize=bool(hyper["maximize"]),
        lr=float(hyper["lr"]),
        alpha=float(hyper["alpha"]),
        eps=float(hyper["eps"]),
        weight_decay=float(hyper["weight_decay"]),
        momentum=float(hyper["momentum"]),
        centered=bool(hyper["centered"]),
    )

"""Adagrad on a node: torch's fused CPU kernel (``torch.optim.adagrad.adagrad(fused=True)``) over a
bucket's segment views. ``sum`` starts at ``initial_accumulator_value`` on a segment's first step, as
torch's constructor fills it."""

from __future__ import annotations

import torch
from torch.optim import adagrad as _adagrad

from luwu.switch_nodes.optimizers.common import Tensors, fill_first_
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
    """One Adagrad step over segment views; the fused kernel divides the grads by ``grad_scale``."""
    fill_first_(state["sum"], steps, float(hyper["initial_accumulator_value"]))
    _adagrad.adagrad(
        params,
        grads,
        state["sum"],
        steps,
        fused=True,
        grad_scale=grad_scale,
        found_inf=None,
        lr=float(hyper["lr"]),
        weight_decay=float(hyper["weight_decay"]),
        lr_decay=float(hyper["lr_decay"]),
        eps=float(hyper["eps"]),
        maximize=bool(hyper["maximize"]),
    )

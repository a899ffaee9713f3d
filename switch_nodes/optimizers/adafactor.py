"""Adafactor on a node: torch's ``torch.optim._adafactor.adafactor(foreach=True)`` over whole parameters.

Each segment of an Adafactor bucket is one whole parameter (the layout never splits them), and its
state is shaped as torch's: ``row_var`` (..., R, 1) and ``col_var`` (..., 1, C) for a parameter of two
or more dimensions, ``variance`` for a vector. The parameter's shape follows from that state, so the
flat segment views are viewed back as the parameters before torch's update, which factors the squared
gradient over the last two dimensions and scales by the whole parameter's RMS and the whole update's.
"""

from __future__ import annotations

import torch
from torch.optim import _adafactor

from luwu.switch_nodes.optimizers.common import Tensors, unscale_
from luwu.switch_nodes.optimizers.kinds import OptimizerKind


def _shape(
    row_var: torch.Tensor | None, col_var: torch.Tensor | None, variance: torch.Tensor | None
) -> torch.Size:
    """The parameter's shape, from its state: (..., R, 1) and (..., 1, C) give (..., R, C)."""
    if variance is not None:
        return variance.shape
    return torch.Size((*row_var.shape[:-1], col_var.shape[-1]))


def apply_(
    kind: OptimizerKind,
    params: Tensors,
    grads: Tensors,
    state: dict[str, list],
    steps: Tensors,
    hyper: dict,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adafactor step over whole-parameter segment views; grads are divided by ``grad_scale``
    (in place) first, as torch's function takes none."""
    unscale_(grads, grad_scale)
    rows, cols, variances = state["row_var"], state["col_var"], state["variance"]
    shapes = [_shape(r, c, v) for r, c, v in zip(rows, cols, variances)]
    eps1, eps2 = hyper["eps"]
    _adafactor.adafactor(
        [p.view(s) for p, s in zip(params, shapes)],
        [g.view(s) for g, s in zip(grads, shapes)],
        rows,
        cols,
        variances,
        steps,
        foreach=True,
        d=float(hyper["d"]),
        lr=float(hyper["lr"]),
        beta2_decay=float(hyper["beta2_decay"]),
        weight_decay=float(hyper["weight_decay"]),
        eps1=None if eps1 is None else float(eps1),
        eps2=float(eps2),
        maximize=bool(hyper["maximize"]),
    )

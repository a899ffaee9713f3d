"""Rprop on a node: torch's ``torch.optim.rprop.rprop(foreach=True)`` over a bucket's segment views.
Its update uses only the sign of each element's gradient, so a slice steps as the whole does. A
segment's ``step_size`` starts at ``lr`` on its first step, as torch creates it; ``lr`` is not used
after that (as in torch)."""

from __future__ import annotations

import torch
from torch.optim import rprop as _rprop

from luwu.switch_nodes.optimizers.common import Tensors, fill_first_, pair, unscale_
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
    """One Rprop step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    fill_first_(state["step_size"], steps, float(hyper["lr"]))
    etaminus, etaplus = pair(hyper["etas"])
    step_size_min, step_size_max = pair(hyper["step_sizes"])
    _rprop.rprop(
        params,
        grads,
        state["prev"],
        state["step_size"],
        steps,
        foreach=True,
        maximize=bool(hyper["maximize"]),
        step_size_min=step_size_min,
        step_size_max=step_size_max,
        etaminus=etaminus,
        etaplus=etaplus,
    )

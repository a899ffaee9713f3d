"""RAdam on a node: torch's ``torch.optim.radam.radam(foreach=True)`` over a bucket's segment views
(the rectification term depends on the step only, so it is the same for a slice as for the whole)."""

from __future__ import annotations

import torch
from torch.optim import radam as _radam

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
    """One RAdam step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    _radam.radam(
        params,
        grads,
        state["exp_avg"],
        state["exp_avg_sq"],
        steps,
        **adam_family(hyper),
        decoupled_weight_decay=bool(hyper["decoupled_weight_decay"]),
    )

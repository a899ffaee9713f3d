"""What the update modules share: the gradient unscale and the state torch creates on a segment's first step."""

from __future__ import annotations

import torch

Tensors = list[torch.Tensor]


def unscale_(grads: Tensors, grad_scale: torch.Tensor | None) -> None:
    """Divide the grads by ``grad_scale`` in place (they are the node's accumulator, scratch after the
    step), for the updates whose torch kernel takes no ``grad_scale`` of its own."""
    if grad_scale is not None:
        torch._foreach_div_(grads, grad_scale)


def fill_first_(state: Tensors, steps: Tensors, value: float) -> None:
    """Set the state of the segments about to take their first step to ``value``: what torch's
    ``full_like(p, value)`` does when it creates the state (Adagrad's ``sum``, Rprop's ``step_size``)."""
    for t, s in zip(state, steps):
        if float(s) == 0.0:
            t.fill_(value)


def pair(v) -> tuple[float, float]:
    """A two-float hyperparameter (``betas``, ``etas``, ``step_sizes``) as floats."""
    a, b = v
    return float(a), float(b)


def adam_family(hyper: dict) -> dict:
    """The keyword arguments torch's Adamax, NAdam and RAdam functions share (``foreach=True``: one
    kernel launch per operation over all the segments)."""
    beta1, beta2 = pair(hyper["betas"])
    return dict(
        foreach=True,
        maximize=bool(hyper["maximize"]),
        beta1=beta1,
        beta2=beta2,
        lr=float(hyper["lr"]),
        weight_decay=float(hyper["weight_decay"]),
        eps=float(hyper["eps"]),
    )

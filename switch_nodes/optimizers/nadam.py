"""NAdam on a node: torch's ``torch.optim.nadam.nadam(foreach=True)`` over a bucket's segment views.

torch keeps one scalar per parameter beside the step, ``mu_product``: the product of the momentum
schedule ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`` over the steps taken. It depends on
the step count, ``beta1`` and ``momentum_decay`` only, so a node computes it from the segment's step
(:func:`mu_product`, the same float32 products torch forms, cached) instead of storing it; the result
is torch's as long as those two hyperparameters stay constant (schedulers change ``lr``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch.optim import nadam as _nadam

from luwu.switch_nodes.optimizers.common import Tensors, adam_family, pair, unscale_
from luwu.switch_nodes.optimizers.kinds import OptimizerKind


@lru_cache(maxsize=16)
def _products(beta1: float, momentum_decay: float) -> list[float]:
    return [1.0]


def mu_product(step: int, beta1: float, momentum_decay: float) -> float:
    """torch's ``state["mu_product"]`` after ``step`` steps: ``mu_product *= mu_t`` in float32, t = 1..step."""
    known = _products(beta1, momentum_decay)
    if len(known) <= step:
        t = torch.tensor(known[-1], dtype=torch.float32)
        for s in range(len(known), step + 1):
            t *= beta1 * (1.0 - 0.5 * (0.96 ** (float(s) * momentum_decay)))
            known.append(float(t))
    return known[step]


def torch_scalars(step: int, hyper: dict) -> dict[str, torch.Tensor]:
    """The per-parameter scalars of torch's NAdam state after ``step`` steps (for ``state_dict``)."""
    return {
        "mu_product": torch.tensor(
            mu_product(step, pair(hyper["betas"])[0], float(hyper["momentum_decay"])),
            dtype=torch.float32,
        )
    }


def apply_(
    kind: OptimizerKind,
    params: Tensors,
    grads: Tensors,
    state: dict[str, Tensors],
    steps: Tensors,
    hyper: dict,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One NAdam step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    unscale_(grads, grad_scale)
    beta1 = pair(hyper["betas"])[0]
    momentum_decay = float(hyper["momentum_decay"])
    mu_products = [
        torch.tensor(mu_product(int(s), beta1, momentum_decay), dtype=torch.float32) for s in steps
    ]
    _nadam.nadam(
        params,
        grads,
        state["exp_avg"],
        state["exp_avg_sq"],
        mu_products,
        steps,
        decoupled_weight_decay=bool(hyper["decoupled_weight_decay"]),
        momentum_decay=momentum_decay,
        **adam_family(hyper),
    )

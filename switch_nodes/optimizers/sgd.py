"""SGD (momentum, dampening, Nesterov, weight decay) on a node: torch's own ``sgd`` over a bucket's
segment views, with the momentum buffers in the bucket's flat state (allocated when momentum is set).

**Momentum from the workers** (``worker_momentum`` in a push's hyperparameters, momentum correction):
the pushed sum is the workers' momentum, applied as torch's ``p -= lr * buf`` with that sum as
``buf``; the node's own buffer stays at zero while the workers hold the momentum. Weight decay and
Nesterov would have to pass through the workers' momentum and are refused by ``check_hyper``.
"""

from __future__ import annotations

import torch
from torch.optim import sgd as _sgd

from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.switch_nodes.optimizers.kinds import OptimizerKind

Tensors = list[torch.Tensor]


def apply_(
    kind: OptimizerKind,
    params: Tensors,
    grads: Tensors,
    state: dict[str, Tensors],
    steps: Tensors,
    hyper: dict,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One SGD step over segment views; grads are divided by ``grad_scale`` (in place) first."""
    momentum = float(hyper["momentum"])
    bufs = state.get("momentum_buffer", [])  # allocated only with momentum (kind.optional_state)
    first = [i for i, s in enumerate(steps) if momentum != 0.0 and float(s) == 0.0]
    if grad_scale is not None:
        for g in grads:
            g.div_(grad_scale)
    # torch creates a segment's buffer on its first step (from the decayed gradient); hand it
    # None there and keep what it made in our preallocated buffer.
    rest = [i for i in range(len(params)) if i not in set(first)]
    common = dict(
        weight_decay=float(hyper["weight_decay"]),
        momentum=momentum,
        lr=float(hyper["lr"]),
        dampening=float(hyper["dampening"]),
        nesterov=bool(hyper["nesterov"]),
        maximize=bool(hyper.get("maximize", False)),
    )
    if hyper.get(WORKER_MOMENTUM) is not None:
        _sgd_worker_momentum_(params, grads, bufs, lr=common["lr"], maximize=common["maximize"])
        first = rest = []
    if first:
        tmp: list = [None] * len(first)
        _sgd.sgd(
            [params[i] for i in first], [grads[i] for i in first], tmp, foreach=False, **common
        )
        for j, i in enumerate(first):
            bufs[i].copy_(tmp[j])
    if rest:
        _sgd.sgd(
            [params[i] for i in rest],
            [grads[i] for i in rest],
            [bufs[i] if momentum != 0.0 else None for i in rest],
            foreach=False,
            **common,
        )
    for s in steps:
        s.add_(1)


def _sgd_worker_momentum_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    *,
    lr: float,
    maximize: bool,
) -> None:
    """SGD step of a momentum-corrected push: the grads are the workers' momentum, torch's
    ``p -= lr * buf`` with the workers' sum as ``buf``; the node's own buffer is dropped (zeroed)."""
    for buf in bufs:
        buf.zero_()
    for p, g in zip(params, grads):
        p.add_(g, alpha=lr if maximize else -lr)

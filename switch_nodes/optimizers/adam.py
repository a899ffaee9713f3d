"""Adam and AdamW (``amsgrad`` too) on a node: torch's fused CPU kernel over a bucket's segment views.

A bucket holds its parameters as one flat fp32 tensor; a segment (one
parameter's part of the bucket) is a view of it, and the update is
``torch.optim.adam.adam(fused=True)`` over the list of views, so results
match ``torch.optim`` to the bits the fused kernel guarantees.

One mode goes beyond torch: a **frozen variance** (the
``variance_freeze_step`` hyperparameter; absent or None, the update is
torch's to the bit). It is what 1-bit Adam (Tang et al. 2021) and 0/1 Adam do
to make Adam work with heavily compressed gradients: Adam's second moment is a
nonlinear function of the gradient it sees, and a sparse top-k gradient with
error feedback arrives in bursts (an element is sent about once every
1/density steps, carrying the sum of the steps it waited), so ``exp_avg_sq``
grows with the burst size and the step shrinks by about sqrt(1/density). With
the variance frozen after the dense warm-up, the update is momentum SGD with a
fixed per-element preconditioner: linear in the gradient again, so error
feedback only delays what it holds back.

**Momentum from the workers** (``worker_momentum`` in a push's
hyperparameters, set by momentum correction, luwu.protocol.feedback): the
pushed sum is the workers' momentum, already built, and the frozen-variance
update takes it as its momentum term. The momentum restarts there: the
workers' velocities start at zero at the first compressed step and the node
keeps its own buffer at zero while the workers hold the momentum. Adam's step
bound becomes B / density, because a burst carries the momentum of about
1/density steps. Live Adam (its variance would see the bursts) and Adam's L2
decay are refused by ``check_hyper`` (kinds.py).
"""

from __future__ import annotations

import torch
from torch.optim import adam as _adam

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
    """One Adam (``kind.name == "adam"``) or AdamW step over segment views. ``grad_scale``: grads are
    divided by it inside the kernel.

    With ``hyper["variance_freeze_step"] = K`` (an int >= 1): a segment's steps 1..K are torch's; from
    step K + 1 on, ``exp_avg_sq`` stays as step K left it and so does its bias correction
    (``1 - beta2**K``), while ``exp_avg``, its bias correction, weight decay and the weights go on as
    in torch, the per-element step kept within Adam's own bound::

        m = beta1 * m + (1 - beta1) * g          # g with L2 decay (adam) / maximize as torch's
        p = p * (1 - lr * wd)                    # adamw
        u = m / (1 - beta1**t) / (sqrt(v / (1 - beta2**K)) + eps)
        p = p - lr * clamp(u, -B, B)             # B = max(1, (1 - beta1) / sqrt(1 - beta2))

    B is the bound live Adam never exceeds (Kingma & Ba 2015, sec. 2.1: ``|step| <= lr * B``). With
    the variance frozen, an element whose gradient outgrows its frozen estimate would take an unbounded
    step instead (a ReLU unit silent during the warm-up has ``exp_avg_sq == 0``); the clamp keeps such
    elements to Adam's trust region and touches none whose gradient stays near its frozen scale.

    The step count is the segment's own (torch's ``state["step"]``), so the mode survives
    ``state_dict`` round trips and a parameter group added later counts from its own start. Grads of
    frozen segments are scaled in place (they are the node's accumulator, scratch after the step).
    """
    freeze = hyper.get("variance_freeze_step")
    # segments whose step about to be taken (state step + 1) is at most K update the variance
    live = [i for i, s in enumerate(steps) if freeze is None or float(s) < freeze]
    frozen = [i for i in range(len(params)) if freeze is not None and float(steps[i]) >= freeze]
    density = hyper.get(WORKER_MOMENTUM)
    if density is not None and live:
        raise ValueError(
            "a momentum-corrected push reached segments whose variance is not frozen yet (check_momentum_steps)"
        )
    common = dict(
        beta1=float(hyper["betas"][0]),
        beta2=float(hyper["betas"][1]),
        lr=float(hyper["lr"]),
        weight_decay=float(hyper["weight_decay"]),
        eps=float(hyper["eps"]),
        maximize=bool(hyper.get("maximize", False)),
    )
    decoupled = kind.name == "adamw"
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    amsgrad = bool(hyper.get("amsgrad", False))  # check_hyper: never with a frozen variance
    if live:
        _adam.adam(
            [params[i] for i in live],
            [grads[i] for i in live],
            [exp_avg[i] for i in live],
            [exp_avg_sq[i] for i in live],
            [state["max_exp_avg_sq"][i] for i in live] if amsgrad else [],
            [steps[i] for i in live],
            fused=True,
            grad_scale=grad_scale,
            found_inf=None,
            decoupled_weight_decay=decoupled,
            amsgrad=amsgrad,
            **common,
        )
    if frozen:
        _adam_frozen_variance_(
            [params[i] for i in frozen],
            [grads[i] for i in frozen],
            [exp_avg[i] for i in frozen],
            [exp_avg_sq[i] for i in frozen],
            [steps[i] for i in frozen],
            freeze_step=int(freeze),
            grad_scale=grad_scale,
            decoupled=decoupled,
            density=density,
            **common,
        )


def _adam_frozen_variance_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    freeze_step: int,
    grad_scale: torch.Tensor | None,
    decoupled: bool,
    density: float | None,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """The Adam step of segments past ``freeze_step`` (see :func:`apply_`): ``exp_avg_sq`` read only.

    ``density``: the grads are the workers' momentum (momentum correction at this top-k density), the
    whole momentum term: ``exp_avg`` is discarded (kept at zero) while they hold it. Bounded at
    B / density: an element held back ~1/density steps arrives with the momentum of all of them."""
    bc2_sqrt = (1.0 - beta2**freeze_step) ** 0.5
    bound = max(1.0, (1.0 - beta1) / (1.0 - beta2) ** 0.5)
    for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        s.add_(1)
        if grad_scale is not None:
            g.div_(grad_scale)
        if maximize:
            g.neg_()
        if weight_decay != 0.0:
            if decoupled:
                p.mul_(1.0 - lr * weight_decay)
            else:
                g.add_(p, alpha=weight_decay)
        bc1 = 1.0 - beta1 ** float(s)
        u = v.sqrt().div_(bc2_sqrt).add_(eps)  # the frozen denominator ...
        if density is None:
            m.lerp_(g, 1.0 - beta1)
            torch.div(m, u, out=u).clamp_(-bound * bc1, bound * bc1)  # ... then m / denom, bounded
        else:  # the workers' momentum, a burst: B / density; the node's own momentum is dropped
            m.zero_()
            torch.div(g, u, out=u).clamp_(-bound / density * bc1, bound / density * bc1)
        p.add_(u, alpha=-lr / bc1)

"""Optimizers applied by a node to the flat slices of its shard.

Each bucket holds its parameters as one flat fp32 tensor; a segment (one
parameter's part of the bucket) is a view of it. The state of a segment
matches torch.optim's per-parameter state (``step``, ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``) so that ``state_dict()`` can be gathered
into torch's own format. The update is torch's own fused CPU kernel over the
list of segment views, so results match ``torch.optim`` to the last bits that
the fused kernel guarantees, at ~2 G params/s per thread.

One documented mode goes beyond torch: Adam / AdamW with a **frozen
variance** (the ``variance_freeze_step`` hyperparameter, absent or None by
default, and then the update is torch's to the bit). It is what 1-bit Adam
(Tang et al. 2021) and 0/1 Adam do to make Adam work with heavily compressed
gradients: Adam's second moment is a nonlinear function of the gradient it
sees, and a sparse top-k gradient with error feedback arrives in bursts (an
element is sent about once every 1/density steps, carrying the sum of the
steps it waited), so ``exp_avg_sq`` grows with the burst size and the step
shrinks by about sqrt(1/density): top-k 1% + error feedback then lags the
uncompressed loss, while SGD + momentum, linear in the gradient, does not.
With the variance frozen after the dense warm-up, the update is momentum SGD
with a fixed per-element preconditioner: linear in the gradient again, so
error feedback only delays what it holds back. See :func:`apply_`.

What it buys (benchmarks/results/convergence.md, 300 steps, top-k 1% + EF
from step 10): on the digits MLP, from +43% against uncompressed AdamW to
-5.6% against the same frozen mode uncompressed; on the char LM, from +21% to
+16%. The rest of the LM's gap is top-k's own, not the variance's: under
Adam's normalised steps every element moves about ``lr`` per step whatever its
gradient's scale, so an element that error feedback holds back for ~1/density
steps lags by ~lr/density (0.2 at lr 2e-3 and 1%, the scale of the weights);
top-k at 10% still ends +6.6% there. Momentum SGD, whose steps scale with the
gradient, loses nothing to top-k 1% on digits. With momentum correction (below;
variance frozen after 5 steps) see benchmarks/results/convergence.md.

**Momentum from the workers** (``worker_momentum`` in a push's hyperparameters,
set by momentum correction, luwu.protocol.feedback): the pushed sum is the
workers' momentum, already built. The frozen-variance Adam and SGD take it as
their momentum term, and the momentum *restarts* there: the workers' velocities
start at zero at the first compressed step and the node discards its own
buffer (it stays zero while the workers hold the momentum). So dense momentum
from the workers gives the node's own update with the buffer reset at the
handover, to rounding (tests/unit/test_node_optimizers.py). Keeping the node's
warm-up momentum as a decaying tail applied it open loop to every element for
~1/(1 - beta1) steps while new gradient reached 1% of them per step: on the
char LM +12% against uncompressed AdamW in a single-process simulation, +6.6%
when the workers' velocities carry it from step 0 instead, +4.1% when it is
dropped (the real run, dropped: +2.9%). Adam's step
bound on what the workers send becomes B / density, because a burst carries
the momentum of about 1/density steps.
Live Adam (its variance would see the bursts), Adam's L2 decay and SGD's weight
decay or Nesterov (they would have to pass through the workers' momentum) are
refused by :func:`check_hyper`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim import adam as _adam
from torch.optim import sgd as _sgd

from luwu.protocol.errors import ConfigError
from luwu.protocol.feedback import WORKER_MOMENTUM


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    name: str
    state_names: tuple[str, ...]  # flat state tensors per bucket (same numel as params)
    defaults: dict


ADAMW = OptimizerKind("adamw", ("exp_avg", "exp_avg_sq"), {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False, "maximize": False})
ADAM = OptimizerKind("adam", ("exp_avg", "exp_avg_sq"), {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False})
SGD = OptimizerKind("sgd", ("momentum_buffer",), {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False})
KINDS = {k.name: k for k in (ADAMW, ADAM, SGD)}

#: Hyperparameters a node accepts beyond torch's (a param group may carry them; absent = torch's behaviour).
EXTRA_HYPER: dict[str, tuple[str, ...]] = {
    "adamw": ("variance_freeze_step",),
    "adam": ("variance_freeze_step",),
    "sgd": (),
}


def get_kind(name: str) -> OptimizerKind:
    try:
        return KINDS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown optimizer {name!r}: choose one of {sorted(KINDS)}") from None


def check_hyper(kind: OptimizerKind, h: dict) -> None:
    """Validate hyperparameters the way torch.optim's constructors do."""
    lr = float(h["lr"])
    if not lr >= 0.0:
        raise ConfigError(f"invalid learning rate: {lr}")
    if not float(h.get("weight_decay", 0.0)) >= 0.0:
        raise ConfigError(f"invalid weight_decay value: {h.get('weight_decay')}")
    if kind.name in ("adam", "adamw"):
        b1, b2 = h["betas"]
        if not 0.0 <= float(b1) < 1.0 or not 0.0 <= float(b2) < 1.0:
            raise ConfigError(f"invalid beta parameters: {h['betas']}")
        if not float(h["eps"]) >= 0.0:
            raise ConfigError(f"invalid epsilon value: {h['eps']}")
        if h.get("amsgrad"):
            raise ConfigError("amsgrad=True is not supported by LuWu nodes yet")
        freeze = h.get("variance_freeze_step")
        if freeze is not None and (isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 1):
            raise ConfigError(f"invalid variance_freeze_step: {freeze!r} (None, or an int >= 1: the steps that update the variance)")
    else:
        if h.get("variance_freeze_step") is not None:
            raise ConfigError(f"variance_freeze_step applies to adam and adamw, not to {kind.name}")
        if not float(h["momentum"]) >= 0.0:
            raise ConfigError(f"invalid momentum value: {h['momentum']}")
        if h["nesterov"] and (float(h["momentum"]) <= 0 or float(h["dampening"]) != 0):
            raise ConfigError("nesterov momentum requires a momentum and zero dampening")
    _check_worker_momentum(kind, h)


def _check_worker_momentum(kind: OptimizerKind, h: dict) -> None:
    """A momentum-corrected push (luwu.protocol.feedback) needs an update linear in what it carries."""
    density = h.get(WORKER_MOMENTUM)
    if density is None:
        return
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ConfigError(f"invalid {WORKER_MOMENTUM}: {density!r} (the top-k density of a momentum-corrected push, in (0, 1])")
    what = "momentum correction (compression.momentum_correction)"
    if kind.name in ("adam", "adamw"):
        if h.get("variance_freeze_step") is None:
            raise ConfigError(
                f"{what} needs Adam's variance frozen: set variance_freeze_step (at most compression.warmup_steps) in the param groups"
            )
        if kind.name == "adam" and float(h["weight_decay"]) != 0.0:
            raise ConfigError(f"{what} does not support adam's L2 weight_decay (it would go through the workers' momentum): use adamw")
    elif float(h["weight_decay"]) != 0.0 or h["nesterov"]:
        raise ConfigError(f"{what} supports sgd without weight_decay or nesterov only")


def check_momentum_steps(kind: OptimizerKind, h: dict, steps: list[torch.Tensor], ahead: int = 0) -> None:
    """A momentum-corrected push may only reach Adam segments whose variance is frozen already.
    ``ahead``: steps of the bucket still to be applied before the one pushed (sync pushes run up to
    two ahead of the node)."""
    if h.get(WORKER_MOMENTUM) is None or kind.name not in ("adam", "adamw") or not steps:
        return
    freeze, taken = h["variance_freeze_step"], min(int(s) for s in steps) + ahead
    if taken < freeze:
        raise ConfigError(
            f"a momentum-corrected push came after {taken} steps, before the variance freezes at variance_freeze_step = {freeze}: "
            f"compression.warmup_steps must be >= variance_freeze_step"
        )


def apply_(
    kind: OptimizerKind,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: dict[str, list[torch.Tensor]],
    steps: list[torch.Tensor],
    hyper: dict,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One optimizer step over segment views. ``grad_scale``: grads are divided by it inside the kernel
    (how the node averages over workers and applies clipping / AMP unscaling without an extra pass).

    Adam / AdamW with ``hyper["variance_freeze_step"] = K`` (an int >= 1): a segment's steps 1..K are
    torch's; from step K + 1 on, ``exp_avg_sq`` stays as step K left it and so does its bias
    correction (``1 - beta2**K``), while ``exp_avg``, its bias correction, weight decay and the
    weights go on as in torch, the per-element step kept within Adam's own bound::

        m = beta1 * m + (1 - beta1) * g          # g with L2 decay (adam) / maximize as torch's
        p = p * (1 - lr * wd)                    # adamw
        u = m / (1 - beta1**t) / (sqrt(v / (1 - beta2**K)) + eps)
        p = p - lr * clamp(u, -B, B)             # B = max(1, (1 - beta1) / sqrt(1 - beta2))

    B is the bound live Adam never exceeds (Kingma & Ba 2015, sec. 2.1: ``|step| <= lr * B``, 3.16 *
    lr for the default betas, met when a gradient appears after a long run of zeros). With the
    variance frozen, an element whose gradient outgrows its frozen estimate would take an unbounded
    step instead: a ReLU unit silent during the warm-up has ``exp_avg_sq == 0`` (8-23% of the hidden
    weights of the digits MLP of benchmarks/convergence.py after 10 steps), and without the bound that
    MLP reaches NaN two steps after the freeze. The clamp keeps those elements to Adam's trust region
    and touches none whose gradient stays near its frozen scale.

    The step count is the segment's own (torch's ``state["step"]``), so the mode survives
    ``state_dict`` round trips and a parameter group added later counts from its own start. Grads of
    frozen segments are scaled in place (they are the node's accumulator, scratch after the step).
    """
    if not params:
        return
    if kind.name in ("adam", "adamw"):
        freeze = hyper.get("variance_freeze_step")
        # segments whose step about to be taken (state step + 1) is at most K update the variance
        live = [i for i, s in enumerate(steps) if freeze is None or float(s) < freeze]
        frozen = [i for i in range(len(params)) if freeze is not None and float(steps[i]) >= freeze]
        density = hyper.get(WORKER_MOMENTUM)
        if density is not None and live:
            raise ValueError("a momentum-corrected push reached segments whose variance is not frozen yet (check_momentum_steps)")
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
        if live:
            _adam.adam(
                [params[i] for i in live],
                [grads[i] for i in live],
                [exp_avg[i] for i in live],
                [exp_avg_sq[i] for i in live],
                [],
                [steps[i] for i in live],
                fused=True,
                grad_scale=grad_scale,
                found_inf=None,
                decoupled_weight_decay=decoupled,
                amsgrad=False,
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
    else:
        momentum = float(hyper["momentum"])
        bufs = state["momentum_buffer"]
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
            _sgd_worker_momentum_(params, grads, bufs, momentum=momentum, lr=common["lr"], maximize=common["maximize"])
            first = rest = []
        if first:
            tmp: list = [None] * len(first)
            _sgd.sgd([params[i] for i in first], [grads[i] for i in first], tmp, foreach=False, **common)
            for j, i in enumerate(first):
                bufs[i].copy_(tmp[j])
        if rest:
            _sgd.sgd([params[i] for i in rest], [grads[i] for i in rest], [bufs[i] if momentum != 0.0 else None for i in rest], foreach=False, **common)
        for s in steps:
            s.add_(1)


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


def _sgd_worker_momentum_(
    params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor], *, momentum: float, lr: float, maximize: bool
) -> None:
    """SGD step of a momentum-corrected push: the grads are the workers' momentum, torch's
    ``p -= lr * buf`` with the workers' sum as ``buf``; the node's own buffer is dropped (zeroed)."""
    for p, g, buf in zip(params, grads, bufs):
        if momentum != 0.0:
            buf.zero_()
        p.add_(g, alpha=lr if maximize else -lr)

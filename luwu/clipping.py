"""When a step's update waits for the workers' global round, and what ``clip_grad_norm_`` may ask.

The nodes apply a (step, bucket) as soon as every worker pushed it, unless the pushes asked for the
global round (two-phase): then they report the squared norm and hold the summed gradient until the
workers COMMIT a coefficient (clipping, the GradScaler's unscale, or a skip). ``max_grad_norm`` and
``amp`` ask for it every step. ``opt.clip_grad_norm_`` is called after ``backward()``, when the
gradients have left, so the round must have been asked for already: the first step of workers that
start the job together asks for it in case the call comes, and once it came every step does. A
first call at a later step finds the update applied and is refused with the fix.
"""

from __future__ import annotations

import torch

from luwu.protocol.errors import ConfigError


class RoundPolicy:
    """Whether the next step's pushes ask for the global round, for one RemoteOptimizer."""

    def __init__(self, *, max_grad_norm: float | None, amp, mode: str, resume: bool):
        self.max_grad_norm, self.amp, self.mode, self.resume = max_grad_norm, amp, mode, resume
        self.clips = False  # clip_grad_norm_ was called: every step runs the round from then on
        self.stepped = False  # a step finished

    def wants_round(self, step: int) -> bool:
        """For the pushes of ``step`` (the worker's next): clipping, AMP, and, in sync mode, the first step
        of workers that start the job together (from step 0, or resuming it); a worker joining a live job
        pushes as the others do."""
        first = not self.stepped and self.mode == "sync" and (step == 0 or self.resume)
        return self.max_grad_norm is not None or bool(self.amp) or self.clips or first

    def inv_scale_for_clip(
        self, step: int, asked: bool, max_norm: float, norm_type: float
    ) -> float:
        """Check a ``clip_grad_norm_`` call at ``step`` whose pushes ``asked`` for the round; the inverse
        scale its norm is unscaled by (the GradScaler's when ``amp`` is one)."""
        if float(norm_type) != 2.0:
            raise ConfigError(
                f"clip_grad_norm_(norm_type={norm_type}): the nodes compute the 2-norm of the averaged gradient only"
            )
        if not asked:
            raise ConfigError(
                f"clip_grad_norm_ at step {step}: this step's gradients were applied on the nodes as they arrived (clipping "
                f"was not asked for at the steps before). Call opt.clip_grad_norm_ from the first step on, or construct "
                f"RemoteOptimizer(..., max_grad_norm={max_norm})"
            )
        scaler = self.amp if isinstance(self.amp, torch.amp.GradScaler) else None
        if self.amp and scaler is None:
            raise ConfigError(
                "clip_grad_norm_ with amp=True: pass the GradScaler itself, RemoteOptimizer(..., amp=scaler), so the "
                "norm is unscaled by its scale"
            )
        self.clips = True
        return 1.0 / float(scaler.get_scale()) if scaler is not None else 1.0


def inv_scale_of(grad_scaler, amp) -> float:
    """1 / the scale of the GradScaler driving ``step()`` (1.0 without one); the overflow decision
    is made globally only with ``amp``, so a scaler without it is refused."""
    if grad_scaler is None:
        return 1.0
    if not amp:
        raise ConfigError(
            "a GradScaler drives this optimizer: construct RemoteOptimizer(..., amp=True) so the "
            "overflow decision is made globally"
        )
    return 1.0 / float(grad_scaler.get_scale())


def tell_scaler(grad_scaler, optimizer, skipped: bool) -> None:
    """Every worker's scaler backs off alike: the decision is the nodes', not this worker's grads."""
    if grad_scaler is not None:
        state = grad_scaler._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {torch.device("cpu"): torch.full((), float(skipped))}


def nonfinite_norm_error(step: int) -> RuntimeError:
    """torch's error for ``clip_grad_norm_(error_if_nonfinite=True)`` on a non-finite norm."""
    return RuntimeError(
        f"The total norm of order 2.0 for gradients from `parameters` is non-finite at step "
        f"{step}, so it cannot be clipped (the nodes skip the step). To disable this error and "
        "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
    )

"""Gradients changed after they left: refused at ``step()``, never silently ignored.

A worker copies each parameter's gradient into its bucket as soon as backward produces it and
pushes the bucket while backward is still running, so the nodes step on the gradient as it was
then. An in-place change after that point (``torch.nn.utils.clip_grad_norm_`` after ``backward()``,
``GradScaler.unscale_``, ``p.grad.mul_(...)``) or a new ``.grad`` tensor would change what local
torch does but not what the nodes do. As torch refuses a tensor saved for backward that was modified
in place, the worker remembers each gradient it copied (the tensor and its version counter) and
``step()`` refuses the step when one differs, naming the parameters and the fix:
``opt.clip_grad_norm_(max_norm)``, which clips on the nodes with the global norm.
"""

from __future__ import annotations

import weakref

import torch

from luwu.gpu_workers.sent_grads import SentGradient
from luwu.protocol.errors import ConfigError

#: What to do instead, in every refusal.
FIX = (
    "LuWu sends each gradient to the nodes during backward(), so a change after backward() comes too "
    "late: clip with opt.clip_grad_norm_(max_norm) after backward() (it clips on the nodes with the "
    "global norm of the averaged gradient) or RemoteOptimizer(..., max_grad_norm=...); with a GradScaler "
    "construct RemoteOptimizer(..., amp=scaler) and do not call scaler.unscale_(opt) (the nodes "
    "unscale); zero gradients with opt.zero_grad()"
)


class GradMarks:
    """The gradients this step copied out, each with its version counter at the copy."""

    def __init__(self, worker):
        self.worker = worker
        self.marks: dict[int, tuple[weakref.ref, int]] = {}  # param index -> (its .grad, version)

    def note(self, param: int, grad: torch.Tensor | None) -> None:
        """``param``'s gradient ``grad`` (its ``.grad``) was copied into its bucket."""
        if grad is not None:
            self.marks[param] = (weakref.ref(grad), grad._version)

    def check(self, step: int) -> None:
        """Refuse the step if a gradient copied out since the last check changed in place or was
        replaced (streaming mode's stand-in after the push, or None, is not a change)."""
        changed = []
        for i, (ref, version) in self.marks.items():
            grad = self.worker.params[i].grad
            if grad is None or isinstance(grad, SentGradient):
                continue
            if grad is not ref() or grad._version != version:
                changed.append(self._name(i))
        if changed:
            raise ConfigError(
                f"step {step}: the gradient of {sorted(changed)} changed after it was sent to the "
                f"nodes, which step on the gradient as backward() produced it: {FIX}",
                step=step,
            )

    def clear(self) -> None:
        """Forget the step's gradients (the step ended, or was abandoned: recover())."""
        self.marks = {}

    def _name(self, param: int) -> str:
        bid, si = self.worker.where[param][0]
        return self.worker.bufs[bid].bucket.segments[si].name

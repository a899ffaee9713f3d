"""What a streamed parameter's ``.grad`` is once its unit's gradient has gone to the nodes.

A streaming worker pushes a unit's gradients as soon as its backward has made them and frees them:
the nodes sum them and step on them, and nothing is left on the worker. Code that reads
``p.grad`` between ``backward()`` and ``step()`` would then see ``None`` and go on as if the
parameter had no gradient: ``torch.nn.utils.clip_grad_norm_`` computes the norm of the resident
gradients alone and clips nothing it should (the nodes step on the unclipped sum), a gradient
logger reads nothing. That is training wrong without a word.

So until ``step()`` ends, such a parameter's ``.grad`` is a :class:`SentGradient`: a tensor of
the gradient's shape, dtype and device holding no memory, on which every operation raises a
:class:`~luwu.protocol.errors.ConfigError` that names the parameter and the fix (clip with
``opt.clip_grad_norm_(max_norm)`` or ``max_grad_norm=``, which the nodes apply to the global
norm; backward passes that add up run under ``opt.no_sync()``). ``p.grad is None`` is False and
metadata (shape, dtype) answers, so nothing fails before it reads a value. ``step()`` sets the
gradients back to ``None``; under ``opt.no_sync()`` they stay ``None`` (the next micro-batch's
backward makes fresh ones).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from luwu.protocol.errors import ConfigError

__all__ = ["SentGradient"]


class SentGradient(torch.Tensor):
    """The ``.grad`` of a streamed parameter whose gradient is on the nodes (see the module's doc)."""

    param_name: str
    rank: int

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, rank: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )
        t.param_name, t.rank = name, rank
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        sent = [t for t in tree_leaves((args, kwargs)) if isinstance(t, SentGradient)]
        names = sorted({t.param_name for t in sent})
        raise ConfigError(
            f"rank {sent[0].rank}: {func.__name__} on the gradient of {names}: in streaming mode "
            "it went to the nodes during backward() and is not kept on the worker, so nothing can "
            "read or change it before step(). Clip with opt.clip_grad_norm_(max_norm) or "
            "RemoteOptimizer(..., max_grad_norm=...) (the nodes apply the global norm); run backward "
            "passes that add up under opt.no_sync()"
        )

    def __repr__(self) -> str:
        return f"SentGradient({self.param_name!r}, shape={tuple(self.shape)}: on the nodes)"

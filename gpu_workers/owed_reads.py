"""Reads of owed weights outside a forward: they wait for the new weights first.

Between ``step()`` and the next forward, per-layer waits (:mod:`luwu.gpu_workers.layer_waits`)
leave a step's replies on the wire. A forward writes them in through the modules' pre-hooks, but
the weights are read in other places too: an EMA of the weights
(``torch.optim.swa_utils.AveragedModel``), ``p.detach()``, ``p.data``, ``copy.deepcopy``,
``torch.save``, printing. Such a read must never see the previous step's weights, or weights half
written by the I/O thread.

:class:`OwedReads` is a ``TorchFunctionMode`` on the training thread while replies are owed: every
torch operation on that thread passes through it, and one that names an owed parameter (as an
argument, or in a list or tuple of them: ``torch._foreach_*``) waits for the parameter's buckets
and writes them in before it runs. Metadata (``p.grad``, shapes, ``data_ptr()``) does not wait,
so ``zero_grad()`` leaves the replies on the wire. The parameters keep their class (no
``__class__`` swap): ``torch.compile`` sees the same tensors at every step. The model's forward
pre-hook takes the mode off the stack before the first module runs, so a forward (eager or
compiled) never passes through it; under ``torch.compile`` it lets every operation through.

Not seen: a view or ``.data`` taken before ``step()`` and read after it (take it again, or call
``opt.synchronize()``), raw memory (``data_ptr()``), and reads from another thread (the mode is the
training thread's own): those come after ``opt.synchronize()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OwedReads"]

#: Tensor attributes that read no values: a parameter owing its weights answers them without waiting.
_METADATA = {
    d
    for n in (
        "grad",
        "shape",
        "dtype",
        "device",
        "requires_grad",
        "is_leaf",
        "ndim",
        "layout",
        "grad_fn",
        "is_cuda",
        "is_sparse",
        "_version",
        "_post_accumulate_grad_hooks",
        "_backward_hooks",
    )
    if (d := torch._C.TensorBase.__dict__.get(n)) is not None
}
_METADATA_METHODS = {
    torch._C.TensorBase.size,
    torch._C.TensorBase.dim,
    torch._C.TensorBase.numel,
    torch._C.TensorBase.data_ptr,
    torch._C.TensorBase.element_size,
    torch._C.TensorBase.stride,
    torch._C.TensorBase.is_contiguous,
    torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.register_hook,
}


class OwedReads(TorchFunctionMode):
    """The training thread's guard while replies are owed (see the module's doc).

    ``buckets_of(p)`` names the owed buckets of a tensor (empty for any other tensor, or once its
    buckets are written); ``settle(bids)`` waits for them and writes them in. :meth:`on` puts the
    mode on the thread's stack (at the end of ``step()``), :meth:`off` takes it off (the model's
    forward pre-hook, ``synchronize()``, a rollback). It sits at the bottom of the stack, under
    the user's own modes (a ``with`` of theirs around ``step()`` pops its own mode when it ends:
    ``TorchFunctionMode.__exit__`` pops the top), and leaves from wherever it is."""

    def __init__(
        self, buckets_of: Callable[[torch.Tensor], list[int]], settle: Callable[[list[int]], None]
    ):
        super().__init__()
        self._buckets_of, self._settle = buckets_of, settle
        self.active = False  # owed replies to guard

    def on(self) -> None:
        self.active = True
        if not any(m is self for m in _stack()):
            _insert_low(self)

    def off(self) -> None:
        self.active = False
        _remove(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            self.active
            and not torch.compiler.is_compiling()
            and func not in _METADATA_METHODS
            and getattr(func, "__self__", None) not in _METADATA
        ):
            bids: set[int] = set()
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor):
                        bids.update(self._buckets_of(t))
            if bids:
                self._settle(sorted(bids))
        return func(*args, **kwargs)


def _stack() -> list:
    """This thread's torch function modes, bottom first."""
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _insert_low(mode: TorchFunctionMode) -> None:
    """Put ``mode`` at the bottom of this thread's stack: a ``with`` entered before ``step()`` and
    left after it (a mode of the user's, ``with torch.device(...)``) pops its own mode, not this
    one (they pop the top). Only ``torch.set_default_device``'s context stays below it: it must be
    the bottom when it is replaced."""
    stack = _stack()
    default = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    keep = 1 if stack and default is not None and stack[0] is default else 0
    above = [torch._C._pop_torch_function_stack() for _ in stack[keep:]][::-1]
    torch._C._push_on_torch_function_stack(mode)
    for m in above:
        torch._C._push_on_torch_function_stack(m)


def _remove(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's stack wherever it is (nothing if it is not there)."""
    stack = _stack()
    if not any(m is mode for m in stack):
        return
    above = []
    while (m := torch._C._pop_torch_function_stack()) is not mode:
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)

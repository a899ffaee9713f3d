"""A step's reply zero-copy from the state window: the window lends its memory to the reply's frames.

An fp32 reply (the ``none`` pull codec) is the bucket's new weights, a view of the window's memory,
which the window reuses once the bucket is released. Rather than copying the weights out (4 B a
parameter a step, on the optimizer thread), :class:`Lender` gives the reply a frame over an alias of
the bucket's extent (a numpy array over that memory, whose lifetime is the loan) and pins the
window's entry: a pinned slot is never evicted, so no read lands in that memory, until the last
reference to the frame is gone (the outbox and the socket let go of it once it is sent). What a
step writes in place is guarded as in the in-RAM shard: the bucket's next step waits for the trackers
of its replies (``Shard.before_write``). That is enough only where no step of a bucket can start
before its last reply was handed to the outbox: sync mode, whose workers push a bucket's next step
after they got its reply (the shard lends only there). At most half the window is lent at once, so
reads ahead always find room; past that, the caller copies. It works under the window's lock, with
the window's bookkeeping: part of :class:`~.window.StateWindow`, kept apart for the module's size.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from luwu.switch_nodes.ooc.window import HELD, StateWindow
from luwu.switch_nodes.replies import Payload

__all__ = ["Lender"]


class Lender:
    """Loans of ``window``'s memory to replies (see the module's doc)."""

    def __init__(self, window: StateWindow):
        self._window = window
        self.cap_bytes = window.budget_bytes // 2
        self.lent_bytes = 0  # the extents pinned by a loan

    def lend(self, bucket: int, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` (a contiguous view of held bucket ``bucket``'s slot) as a tensor over the same memory
        that pins the slot in the window while it is alive; None: copy it instead (the cap is
        reached, or ``t`` is not such a view)."""
        w = self._window
        with w._cond:
            e = w._entries.get(bucket)
            if e is None or e.state != HELD or not t.is_contiguous():
                return None
            start = t.data_ptr() - e.extent.data.data_ptr()
            nbytes = t.numel() * t.element_size()
            if start < 0 or start + nbytes > e.extent.nbytes or not nbytes:
                return None
            if not e.pins and self.lent_bytes + e.extent.nbytes > self.cap_bytes:
                return None
            arr = np.frombuffer(e.extent.view, dtype=np.uint8, count=nbytes, offset=start)
            if not e.pins:
                self.lent_bytes += e.extent.nbytes
            e.pins += 1
            weakref.finalize(arr, self._returned, e)
        return torch.from_numpy(arr).view(t.dtype).view(t.shape)

    def own(
        self, p: Payload, bucket: int | None, copy: Callable[[torch.Tensor], torch.Tensor]
    ) -> Payload:
        """``p`` with its frames that are views of the window lent from held bucket ``bucket``'s slot
        (None: none lent), or else copied by ``copy``; still borrowed where any frame is."""
        inside = [isinstance(f, torch.Tensor) and self._window.holds(f) for f in p.frames]
        if not any(inside):
            return p
        lent = [
            self.lend(bucket, f) if w and bucket is not None else None
            for f, w in zip(p.frames, inside)
        ]
        frames = [
            x if x is not None else copy(f) if w else f for f, w, x in zip(p.frames, inside, lent)
        ]
        kept = any(not w or x is not None for w, x in zip(inside, lent))
        return p._replace(frames=frames, borrowed=p.borrowed and kept)

    def _returned(self, e) -> None:
        """(Whichever thread let go of the loan's last reference, maybe one in the window's lock: the
        window's next scheduling uses the memory, not this call.)"""
        w = self._window
        with w._cond:
            e.pins -= 1
            if not e.pins:
                self.lent_bytes -= e.extent.nbytes
                w._cond.notify_all()

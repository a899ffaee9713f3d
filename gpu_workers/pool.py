"""Flat fp32 buffers lent to streamed buckets, within a byte budget, and reused.

A streaming worker holds no bucket buffer per bucket: a streamed bucket borrows
one when its first gradient arrives (or when its weights land and need a staging
area) and gives it back once the node has acknowledged the push that sent it
(the frame went out zero-copy from the buffer). Given-back buffers are kept
per size and lent again, so the steady state allocates nothing; repeated blocks
have buckets of equal sizes, so one block's buffers serve the next. When lending
would pass the budget, the pool asks its owner to reclaim (wait for an
acknowledgement, which gives a buffer back); a single bucket larger than the
budget is still lent, since nothing else could make room for it.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

FP32_BYTES = 4


def _gpu_in_use() -> bool:
    """Whether this process trains on a GPU (CUDA is initialized): then a buffer is page-locked, so
    the gradients of a GPU unit are copied out of the device by DMA, not staged by the driver."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class BufferPool:
    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.lent_bytes = 0
        self.held_bytes = 0  # lent + free: what the pool keeps alive
        self.peak_bytes = 0

    def take(self, numel: int, reclaim: Callable[[], bool] | None = None) -> torch.Tensor:
        """A flat fp32 buffer of ``numel`` elements (contents undefined). ``reclaim()`` is called while
        lending it would pass the budget: it gives buffers back and says whether it could."""
        need = numel * FP32_BYTES
        while reclaim is not None and self.lent_bytes + need > self.budget_bytes and reclaim():
            pass
        with self._lock:
            free = self._free.get(numel)
            if free:
                buf = free.pop()
            else:
                self._trim(self.budget_bytes - need)
                buf = torch.empty(numel, pin_memory=_gpu_in_use())
                self.held_bytes += need
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.lent_bytes += need
            return buf

    def give(self, buf: torch.Tensor) -> None:
        """Take back a lent buffer (the caller no longer touches it)."""
        with self._lock:
            self.lent_bytes -= buf.numel() * FP32_BYTES
            self._free.setdefault(buf.numel(), []).append(buf)

    def _trim(self, limit: int) -> None:
        """Drop free buffers (of other sizes) until the pool holds at most ``limit`` bytes."""
        for numel in list(self._free):
            bufs = self._free[numel]
            while bufs and self.held_bytes > limit:
                self.held_bytes -= bufs.pop().numel() * FP32_BYTES
            if not bufs:
                del self._free[numel]

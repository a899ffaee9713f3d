"""Large received frames' buffers kept for reuse on a node with a push budget.

A budgeted node gives freed memory back to the system (:mod:`.budget_memory`), so each push payload
read into a buffer of its own would fault in fresh pages (~10x slower to fill than reused memory:
measured as 0.78x the in-RAM node's step where the state fits its budget). The listener takes those
buffers from a :class:`KeptFrames` instead. A buffer is free again once nothing refers to it any more
(no frame, view or tensor of a message holds it: its reference count says so), whenever that is, on
whichever thread: a push held undecoded in a (step, bucket)'s sum keeps its buffer.

The budget bounds what is kept: the buffers in use belong to messages the push budget counts, and
whenever a ticket takes room, the free ones beyond the budget's room are let go (:meth:`fit`, with the
kept accumulators': :class:`Kept`), but for the new ticket's own share, which its push and sum take
next. So the pushes in flight and the kept buffers together stay within ``node.push_memory_bytes``,
plus at most one ticket's bytes while that ticket's buffers are not all reused ones.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

__all__ = ["Kept", "KeptFrames", "mapped"]


def mapped(nbytes: int) -> np.ndarray:
    """``nbytes`` of memory mapped on their own (page-aligned), unmapped once nothing refers to them:
    kept buffers never sit in a heap, whose freed memory the allocator would keep (see
    :mod:`.budget_memory`)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (mmap.mmap shares them by default: shmem)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)


def _free(buf: np.ndarray) -> bool:
    """Whether nothing but the pool refers to ``buf`` (a :func:`mapped` array): neither to it (a
    memoryview, a tensor over it) nor to its mapping (numpy's views of it refer to the mapping)."""
    # (counted: the pool's list, this call's argument, getrefcount's; the array's hold on its mapping)
    return sys.getrefcount(buf) == 3 and sys.getrefcount(buf.base) == 2


class KeptFrames:
    """Buffers of large frames by size: taken by the listener (event loop), freed by dropping them."""

    def __init__(self) -> None:
        self._bufs: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``: one nothing refers to, or a new one (kept from now on)."""
        with self._lock:
            bufs = self._bufs.setdefault(nbytes, [])
            for i in range(len(bufs)):
                if _free(bufs[i]):
                    return bufs[i]
            buf = mapped(nbytes)
            bufs.append(buf)
            return buf

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes()

    def _free_bytes(self) -> int:
        return sum(n for n, bufs in self._bufs.items() for i in range(len(bufs)) if _free(bufs[i]))

    def fit(self, room: int) -> None:
        """Let free buffers go until those left fit ``room`` bytes."""
        with self._lock:
            free = self._free_bytes()
            for n, bufs in self._bufs.items():
                i = len(bufs) - 1
                while free > room and i >= 0:
                    if _free(bufs[i]):
                        del bufs[i]
                        free -= n
                    i -= 1


class Kept:
    """What a budgeted node keeps for reuse (the accumulator pool, the frames' buffers): within the
    room the pushes in flight leave (and that of a ticket just taken, whose buffers are taken next from
    what is kept), each kind trimmed in proportion to what it keeps when a ticket needs the room."""

    def __init__(self, *pools) -> None:
        self.pools = pools

    def fit(self, room: int) -> None:
        """(``room`` < 0: a push let in past the budget; nothing is kept then.)"""
        free, room = [pool.free_bytes for pool in self.pools], max(0, room)
        total = sum(free)
        if total > room:
            for pool, mine in zip(self.pools, free):
                pool.fit(room * mine // total)

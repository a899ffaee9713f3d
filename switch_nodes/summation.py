"""The sum of a (step, bucket)'s pushes in one order, whatever order they arrive in.

Floating-point addition is not associative: summed as they arrive, the pushes of three or more
workers give bits that depend on the network's timing, and two runs of the same job differ. A node
sums them as a pairwise tree over the step's ranks instead: ranks 2i and 2i+1 first (one pass,
``Codec.decode_pair_``), then adjacent pairs of those, level by level; the blocks a count that is not
a power of two leaves over are added left to right at the end. The same pushes give the same bits on
every run, and an aligned group of a power of two of ranks is a subtree of it (what an aggregator in
front of such a group would sum).

The tree is folded from its left end: a push whose left neighbours are not all in waits as it was
received (its room is reserved by its (step, bucket), :mod:`.inflight`), and the partial sums form a
binary counter, so at most about log2(n) + 1 of them exist at once, each the size of the bucket.
With two workers the sum is the one pass over both pushes a node always made (addition commutes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["RankTree", "partial_sums"]

Push = tuple  # (codec, frames, meta): a push as received
Take = Callable[[], torch.Tensor]
Give = Callable[[torch.Tensor], None]


def partial_sums(n: int) -> int:
    """The most partial sums (each the bucket's size) a tree over ``n`` ranks holds at once."""
    return max(1, (n - 1).bit_length())


class RankTree:
    """The pushes of one (step, bucket) from ``ranks`` (sorted), each decoded times ``alpha``."""

    __slots__ = ("ranks", "alpha", "_leaves", "_front", "_stack")

    def __init__(self, ranks: tuple[int, ...], alpha: float):
        self.ranks, self.alpha = ranks, alpha
        self._leaves: dict[int, Push] = {}  # position -> a push not folded yet
        self._front = 0  # every position before it is folded into the stack
        self._stack: list[tuple[int, torch.Tensor]] = []  # (level, partial sum), levels decreasing

    @property
    def complete(self) -> bool:
        return self._front == len(self.ranks)

    def add(self, rank: int, push: Push, take: Take, give: Give) -> None:
        """Rank ``rank``'s push; folded with its left neighbours as soon as they are all in."""
        self._leaves[self.ranks.index(rank)] = push
        n, leaves = len(self.ranks), self._leaves
        while self._front < n:
            f = self._front
            if f + 1 < n:
                if f not in leaves or f + 1 not in leaves:
                    return
                buf, level = take(), 1
                _pair(buf, leaves.pop(f), leaves.pop(f + 1), self.alpha)
                self._front += 2
            else:  # the last of an odd count
                if f not in leaves:
                    return
                buf, level = take(), 0
                codec, frames, meta = leaves.pop(f)
                codec.decode_(buf, frames, meta, self.alpha)
                self._front += 1
            while self._stack and self._stack[-1][0] == level:  # aligned siblings: left + right
                _, left = self._stack.pop()
                left.add_(buf)
                give(buf)
                buf, level = left, level + 1
            self._stack.append((level, buf))

    def result(self, take: Take, give: Give) -> torch.Tensor | None:
        """The sum: the counter's blocks left to right, then (a step that goes on without some ranks,
        elastic mode) the pushes still waiting, in rank order. None when nothing was pushed. The tree
        is empty afterwards."""
        out = None
        for _, buf in self._stack:
            if out is None:
                out = buf
            else:
                out.add_(buf)
                give(buf)
        for pos in sorted(self._leaves):
            codec, frames, meta = self._leaves[pos]
            if out is None:
                out = take()
                codec.decode_(out, frames, meta, self.alpha)
            else:
                codec.decode_add_(out, frames, meta, self.alpha)
        self._stack, self._leaves, self._front = [], {}, len(self.ranks)
        return out

    def release(self, give: Give) -> None:
        """Give the partial sums back (the step is abandoned: a rollback)."""
        for _, buf in self._stack:
            give(buf)
        self._stack, self._leaves = [], {}


def _pair(buf: torch.Tensor, a: Push, b: Push, alpha: float) -> None:
    """``buf = alpha * (a + b)``, in one pass when both are of one codec."""
    if a[0] is b[0]:
        a[0].decode_pair_(buf, (a[1], a[2]), (b[1], b[2]), alpha)
    else:  # (a worker fell back to fp32 on a non-finite gradient)
        a[0].decode_(buf, a[1], a[2], alpha)
        b[0].decode_add_(buf, b[1], b[2], alpha)

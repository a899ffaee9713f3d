"""The sum of a (step, bucket)'s pushes in one order, whatever order they arrive in.

Floating-point addition is not associative: summed as they arrive, the pushes of three or more
workers give bits that depend on the network's timing, and two runs of the same job differ. A node
sums them as a pairwise tree over the step's ranks instead: ranks 2i and 2i+1 first (one pass,
``Codec.decode_pair_``), then adjacent pairs of those, level by level; the blocks a count that is not
a power of two leaves over are added left to right at the end. The same pushes give the same bits on
every run, and an aligned group of a power of two of ranks is a subtree of it (what an aggregator in
front of such a group would sum).

An aggregator (:mod:`luwu.switch_nodes.tier`) sums such a block of its group's ranks the same way and
sends the node the block's sum: :meth:`RankTree.add_block` folds it in where the tree would have built
it, so a job trained through aggregators has the bits of one trained without them.

The tree is folded from its left end: a push whose left neighbours are not all in waits as it was
received (its room is reserved by its (step, bucket), :mod:`.inflight`), and the partial sums form a
binary counter, so at most about log2(n) + 1 of them exist at once, each the size of the bucket.
With two workers the sum is the one pass over both pushes a node always made (addition commutes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["RankTree", "Summed", "aligned_blocks", "partial_sums"]

Push = tuple  # (codec, frames, meta): a push as received
Take = Callable[[], torch.Tensor]
Give = Callable[[torch.Tensor], None]


def partial_sums(n: int) -> int:
    """The most partial sums (each the bucket's size) a tree over ``n`` ranks holds at once."""
    return max(1, (n - 1).bit_length())


def aligned_blocks(ranks: tuple[int, ...], group: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``group`` (ranks, a contiguous run of ``ranks``) cut into the tree's aligned blocks: runs of a
    power of two of positions starting at a multiple of their length, each as long as it can be. A
    block of two or more is one subtree of the tree over ``ranks``; a block of one is a leaf."""
    first = ranks.index(group[0])
    if ranks[first : first + len(group)] != group:
        raise ValueError(f"ranks {group} are not a contiguous run of {ranks}")
    out, p, end = [], first, first + len(group)
    while p < end:
        size = p & -p if p else 1 << (end - p).bit_length()
        while size > end - p:
            size //= 2
        out.append(ranks[p : p + size])
        p += size
    return out


class Summed:
    """An aggregator's sum of a block, as a codec the tree decodes: its fp32 payload (``codec``, the
    ``none`` codec) times ``scale`` (1 when the aggregator scaled by the node's own ``1/n``: a copy)."""

    __slots__ = ("codec", "scale", "count")

    def __init__(self, codec, scale: float, count: int):
        self.codec, self.scale, self.count = codec, scale, count

    def decode_(self, buf: torch.Tensor, frames, meta, alpha: float) -> None:
        self.codec.decode_(buf, frames, meta, self.scale)

    def decode_add_(self, buf: torch.Tensor, frames, meta, alpha: float) -> None:
        self.codec.decode_add_(buf, frames, meta, self.scale)


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

    def fits(self, block: tuple[int, ...]) -> bool:
        """Whether ``block`` (ranks an aggregator summed) is one subtree of this tree: a power of two of
        its ranks, in order, starting at a multiple of that count, none of them in yet."""
        c = len(block)
        if c < 2 or c & (c - 1) or block[0] not in self.ranks:
            return False
        p = self.ranks.index(block[0])
        return (
            p % c == 0
            and self.ranks[p : p + c] == block
            and p >= self._front
            and not any(q in self._leaves for q in range(p, p + c))
        )

    def add_block(self, block: tuple[int, ...], push: Push, take: Take, give: Give) -> None:
        """An aggregator's sum of ``block`` (:meth:`fits`; ``push``'s codec a :class:`Summed`): it
        stands where the tree would have built that subtree."""
        self._leaves[self.ranks.index(block[0])] = push
        self._fold(take, give)

    def add(self, rank: int, push: Push, take: Take, give: Give) -> None:
        """Rank ``rank``'s push; folded with its left neighbours as soon as they are all in."""
        self._leaves[self.ranks.index(rank)] = push
        self._fold(take, give)

    def _fold(self, take: Take, give: Give) -> None:
        n, leaves = len(self.ranks), self._leaves
        while self._front < n:
            f = self._front
            summed = leaves[f][0] if f in leaves else None
            if isinstance(summed, Summed):  # an aggregator's subtree: it is that level's sum
                buf, level = take(), summed.count.bit_length() - 1
                _, frames, meta = leaves.pop(f)
                summed.decode_(buf, frames, meta, self.alpha)
                self._front += summed.count
            elif f + 1 < n:
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

    def folded(self, rank: int) -> bool:
        """Whether ``rank``'s push is folded into a partial sum (no longer waiting as received)."""
        return self.ranks.index(rank) < self._front

    def drain(self) -> tuple[list[tuple[tuple[int, ...], torch.Tensor]], list[int]]:
        """What the tree holds so far, as an aggregator sends it when a rank of its block is late:
        each partial sum with the ranks it covers (left to right: aligned subtrees of the tree), and
        the ranks whose pushes wait unfolded. The tree is empty afterwards."""
        sums, p = [], 0
        for level, buf in self._stack:
            sums.append((self.ranks[p : p + (1 << level)], buf))
            p += 1 << level
        waiting = [self.ranks[q] for q in sorted(self._leaves)]
        self._stack, self._leaves, self._front = [], {}, len(self.ranks)
        return sums, waiting

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

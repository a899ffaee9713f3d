"""Answers to weight fetches within ``node.push_memory_bytes``: a PULL's answer waits for room.

A streaming worker fetches every unit's weights before its forward and again before its backward
(PULL). Out of core each answer is a copy of the bucket's weights (the window reuses its memory once
the bucket is released), held until its last byte is in the kernel. Counted but never held back,
the fetches of two workers with prefetch hold several units at once: at 269M parameters in units of
34M, half a GiB of fp32 answers, more than a quarter-of-the-state budget leaves them.

So a fetch's answer is encoded only once its bytes fit the budget (:meth:`FetchRoom.admit`), in
arrival order; a ticket holds them until the answer is sent, and then the reply counts itself until
its last byte is out (:meth:`~.inflight.PushBudget.reply`). The PULL itself is read at once: the
worker's connection goes on (its pushes are never behind a waiting fetch), so the steps that release
memory go on. When nothing in flight can be released without another message (the optimizer idle,
no reply on its way), the first waiting fetch goes in past the budget, counted as an overdraft (the
rule of :mod:`.inflight` for pushes, rule 5).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luwu.switch_nodes.inflight import PushBudget, Ticket

__all__ = ["FetchRoom"]


class FetchRoom:
    """The fetches whose answers wait for room in a node's push budget (on the event loop)."""

    def __init__(self, budget: PushBudget) -> None:
        self.budget = budget
        self._waiting: deque[tuple[int, Callable[[Ticket | None], None], tuple]] = deque()
        self._since: float | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def ranks(self) -> set[int]:
        """The workers whose fetches wait (they push nothing until their weights are in)."""
        return {r for _, _, ranks in self._waiting for r in ranks}

    def admit(self, nbytes: int, go: Callable[[Ticket | None], None], ranks=()) -> None:
        """``go(ticket)`` once an answer of ``nbytes`` to the workers ``ranks`` fits (now, if it does and
        none waits before it); the caller releases the ticket once the answer is sent (None: nothing
        to release)."""
        b = self.budget
        if not b.limit or not nbytes:
            go(None)
            return
        if not self._waiting and self._fits(nbytes):
            go(b.hold(nbytes))
            return
        if not self._waiting:
            self._since = time.monotonic()
        self._waiting.append((nbytes, go, tuple(ranks)))
        b.arm()

    def _fits(self, nbytes: int) -> bool:
        return self.budget.fits(nbytes) or not self.budget.used

    def wake(self) -> None:
        """Memory was released: the waiting answers that fit now go, in arrival order."""
        while self._waiting and self._fits(self._waiting[0][0]):
            nbytes, go, _ = self._waiting.popleft()
            go(self.budget.hold(nbytes))
        self._done_waiting()

    def overdraw(self) -> bool:
        """Nothing in flight can be released without another message: the first waiting answer goes
        past the budget (counted). False when none waits."""
        if not self._waiting:
            return False
        nbytes, go, _ = self._waiting.popleft()
        self.budget.ctx.metrics.inflight_overdrafts.labels("fetch").inc()
        go(self.budget.hold(nbytes))
        self._done_waiting()
        return True

    def _done_waiting(self) -> None:
        if not self._waiting and self._since is not None:
            self.budget.ctx.metrics.inflight_blocked.inc(time.monotonic() - self._since)
            self._since = None

    def reset(self) -> None:
        """A rollback: the waiting answers are of buckets that are gone (their PULLs are asked again)."""
        self._waiting.clear()
        self._done_waiting()

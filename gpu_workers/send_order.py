"""The order a worker's queued messages leave in, per node.

A push carries a priority (P3: the first layers' gradients first, :meth:`Worker._priority`); where a
node's queue backed up, the lowest priority of a run of prioritized messages goes out first, and a
message without one (a request) keeps its place. A node that bounds its pushes in flight
(``node.push_memory_bytes``) says so in its WELCOME (``in_order``): it gets every worker's pushes in
the order they were made, the same on every worker (backward's). Reordered only where one worker's
queue backed up, they would reach it in a different order from each worker, and it would have to open
every bucket of a step before any completes, past its budget.
"""

from __future__ import annotations

import collections
import itertools


class SendOrder:
    """Per node: whether pushes keep the order they were made; which queued message goes next."""

    def __init__(self, num_nodes: int):
        self.in_order = [False] * num_nodes  # set from each node's WELCOME
        self._made = itertools.count()

    def priority(self, node: int, priority: int | None) -> int | None:
        """The priority a message to ``node`` is queued with: a push's own, or, to a node that takes
        pushes in order, when it was made (a release's -1 still overtakes them)."""
        if priority is not None and priority >= 0 and self.in_order[node]:
            return next(self._made)
        return priority

    @staticmethod
    def next_out(q: collections.deque) -> int:
        """Which queued (priority, frames) goes out next: the first, or, when it has a priority, the
        lowest priority of the run of prioritized messages it starts (the earliest of equals)."""
        best = 0
        if q[0][0] is not None:
            for j in range(1, len(q)):
                pj = q[j][0]
                if pj is None:
                    break
                if pj < q[best][0]:
                    best = j
        return best

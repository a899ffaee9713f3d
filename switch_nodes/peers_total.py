"""What all connections of the node's ZMTP listener (:mod:`.zmtp`) hold together: ``node.peers_total_bytes``.

Each connection's own budget (``node.peer_bytes``, ``node.stranger_bytes``) bounds what it holds; this
bounds their sum. A frame that would pass it is not read: its connection waits (paused, TCP pushes back)
until room is given back by a message served or a connection gone. Waiting is only right while
something gives room back: when no message is being served or waiting to be, the node acts at once,
and again every ``IDLE_S`` while connections wait:

- a connection holding an unfinished message that sent nothing for ``IDLE_S`` (it is not waiting for
  room: it holds and idles) is disconnected, the largest such holder first, named in the log;
- with none, the waiting connection with the largest unfinished message alone reads on past the total
  until its message is whole (by at most one message of one connection: a worker's push completes and
  is served, and gives its room back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luwu.switch_nodes.zmtp_peer import Peer

__all__ = ["IDLE_S", "PeersTotal"]

log = logging.getLogger("luwu.switch_nodes.zmtp")  # the listener's lines

IDLE_S = 1.0
"""How long a holder of an unfinished message may send nothing while others wait for room."""


class PeersTotal:
    """The bytes all connections hold, within ``limit`` (see the module's doc). ``peers``: the listener's
    connections by id; ``busy()``: a message is being served or waits to be; ``refuse(peer, why)``:
    disconnect a connection, naming it in the log."""

    def __init__(
        self, limit: int, peers: dict, busy: Callable[[], bool], refuse: Callable[[Peer, str], None]
    ) -> None:
        self.limit, self.held = limit, 0
        self.waiters: dict[bytes, Peer] = {}  # connections whose read waits for room, in order
        self.overdraft: Peer | None = (
            None  # the one connection reading past the limit until its message is whole
        )
        self._peers, self._busy, self._refuse = peers, busy, refuse
        self._waking = False
        self._timer: asyncio.TimerHandle | None = None
        self._told = False

    def changed(self, delta: int) -> None:
        """A connection holds ``delta`` bytes more, or fewer (then the waiting ones read on)."""
        self.held += delta
        if delta < 0 and self.waiters and not self._waking:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._wake)

    def room(self, peer: Peer, need: int) -> bool:
        """Whether ``peer`` may hold ``need`` bytes more now; if not, it waits (the caller pauses it)."""
        if self.held + need <= self.limit or self.overdraft is peer:
            self.waiters.pop(peer.ident, None)
            return True
        self.waiters[peer.ident] = peer
        if not self._busy():
            self._relieve(peer)
        if self.overdraft is peer:
            del self.waiters[peer.ident]
            return True
        self._arm()
        return False

    def delivered(self, peer: Peer) -> None:
        """``peer``'s message is whole."""
        if self.overdraft is peer:
            self.overdraft = None

    def gone(self, peer: Peer) -> None:
        self.waiters.pop(peer.ident, None)
        if self.overdraft is peer:
            self.overdraft = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _wake(self) -> None:
        self._waking = False
        for ident in list(self.waiters):
            if self.held >= self.limit:
                break
            peer = self.waiters.pop(ident, None)
            if peer is not None:
                peer.resume()
        if self.waiters and not self._busy():
            self._relieve()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(IDLE_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.waiters and not self._busy():
            self._relieve()
        if self.waiters:
            self._arm()

    @staticmethod
    def _ended(p: Peer, now: float) -> bool:
        """Whether the connection going on past the limit no longer does: gone, cut, or holding nothing and
        sending nothing."""
        return (
            p.refused
            or p.closed
            or (p.held == p.waiting and not p.paused and now - p.read_at >= IDLE_S)
        )

    def _relieve(self, caller: Peer | None = None) -> None:
        """Nothing gives room back: disconnect the largest idle holder, or let the largest waiting message on."""
        if not self._told:
            self._told = True
            log.warning(
                "connections together hold node.peers_total_bytes = %d with nothing to serve: reads wait, a holder of an unfinished "
                "message idle for %g s is disconnected, else the largest message goes on alone (said once)",
                self.limit,
                IDLE_S,
            )
        now = time.monotonic()
        idle = [  # (a paused connection waits for the node: it is not idle)
            p
            for p in self._peers.values()
            if p.held > p.waiting
            and not p.refused
            and not p.paused
            and p.ident not in self.waiters
            and now - p.read_at >= IDLE_S
        ]
        if idle:
            victim = max(idle, key=lambda p: p.held - p.waiting)
            self._refuse(
                victim,
                f"it holds {victim.held - victim.waiting} bytes of an unfinished message and sent nothing for {now - victim.read_at:.1f} s, "
                f"the most while all connections together hold node.peers_total_bytes = {self.limit}",
            )
            return
        if self.overdraft is not None and self._ended(self.overdraft, now):
            self.overdraft = None
        if self.overdraft is not None or not self.waiters:
            return  # one at a time: it gives room back once its message is served
        first = max(self.waiters.values(), key=lambda p: p.held - p.waiting)
        self.overdraft = first
        if first is not caller:
            del self.waiters[first.ident]
            asyncio.get_running_loop().call_soon(first.resume)

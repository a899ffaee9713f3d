"""The node's own ZMTP 3 listener (NULL mechanism): ZeroMQ's wire protocol, spoken by the node itself,
so that what one peer may hold is bounded before anything is allocated.

libzmq assembles a whole multipart message in its pipe before the application sees a frame of it. It
bounds one frame (``MAXMSGSIZE``) and whole messages (``RCVHWM``), so a peer's unfinished message of
many large frames, or of millions of empty ones, grows without limit and costs the event loop a
message as long as the flood. Here the node reads each frame's header itself (asyncio
``BufferedProtocol`` on uvloop; a large frame is read straight into its own buffer) and checks, before
the frame's buffer exists:

- a message has at most ``max_frames`` frames, a header of at most ``MAX_HEADER_BYTES`` and a payload
  of at most ``max_message_bytes``;
- what one peer holds (its unfinished message and its complete ones the node has not served yet) is
  at most ``budget(ident)`` bytes: ``node.peer_bytes`` for a worker, ``node.stranger_bytes`` for a
  connection that has not said HELLO. A worker's message that cannot fit is refused by disconnecting
  the peer; a stranger's payload that cannot fit is read and dropped, and its header alone reaches
  the node (answered as any stranger's: what it says does not depend on the payload). Otherwise the
  node stops reading from the peer (TCP pushes back) until its messages are served;
- what all peers hold together is at most ``total_bytes`` (``node.peers_total_bytes``): past it a
  peer's read waits for room, and when nothing is being served (nothing would give room back) the
  largest holder of an unfinished message is disconnected;
- every reply without payload (a PONG, the handshake's commands, an ERROR or STATS answer) counts
  against the peer's ``reply_budget`` until it is sent: a peer that asks and does not read is cut off;
  a worker whose replies stay unsent ``stuck_s`` is named to the node (``on_stuck``), whatever reads
  for it;
- with ``gate`` (:mod:`.inflight`), a message whose header is read is asked about before its payload
  is: a push that does not fit the node's memory for pushes in flight leaves its connection paused,
  its payload unread, until the gate wakes it;
- with CURVE, an exclusive key (a worker's) holds one connection: a newer one replaces it;
- a connection finishes the greeting within ``handshake_s``; at most ``max_connections`` are open.

A peer past a limit is disconnected and named in the log once. The event loop parses at most one
read (16 KiB) per callback (:mod:`.zmtp_peer`: one connection). Workers keep their libzmq DEALER sockets: this is their
protocol (ZMTP 3.1, https://rfc.zeromq.org/spec/37/). The handshake (:mod:`.zmtp_handshake`) is NULL,
or CURVE with the node's keys (:mod:`.curve`): then every frame is a MESSAGE opened here, and the
same bounds hold for an authenticated worker, checked on the frame's size before it is read.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
from collections.abc import Callable

from luwu.switch_nodes.curve import CurveKeys
from luwu.switch_nodes.listener import Listener, SendQueueFull, listening_socket
from luwu.switch_nodes.peers_total import PeersTotal
from luwu.switch_nodes.sender import Sender
from luwu.switch_nodes.zmtp_frames import Refused
from luwu.switch_nodes.zmtp_handshake import StrangerLog
from luwu.switch_nodes.zmtp_peer import FRAME_COST, Peer

__all__ = ["FRAME_COST", "ZmtpListener"]

log = logging.getLogger(__name__)


class ZmtpListener(Listener):
    """A node's listening socket and its peers (see the module's doc). The callbacks say who a connection
    is: ``budget`` / ``reply_budget``: what it may hold / leave unread; ``member``: said HELLO or holds a
    worker key (a payload past its budget refuses it; a stranger's is dropped unread); ``who``: its name in
    the log; ``exclusive(key)``: a CURVE key that holds one connection at a time (a newer one replaces it,
    and ``replaced(old, new)`` is told); ``on_stuck(ident)``: its replies stayed unsent ``stuck_s``."""

    def __init__(
        self,
        bind: str,
        *,
        max_message_bytes: int,
        max_frames: int,
        budget: Callable[[bytes], int],
        who: Callable[[bytes], str],
        max_connections: int,
        sndhwm: int,
        handshake_s: float = 10.0,
        join_secret: str = "",
        member: Callable[[bytes], bool] = lambda ident: True,
        curve: CurveKeys | None = None,
        reply_budget: Callable[[bytes], int] = lambda ident: 1 << 20,
        total_bytes: int = 1 << 62,
        exclusive: Callable[[str], bool] = lambda key: False,
        replaced: Callable[[bytes, bytes], None] = lambda old, new: None,
        stuck_s: float = 15.0,
        on_stuck: Callable[[bytes], None] | None = None,
        gate: Callable | None = None,
    ) -> None:
        self.max_message_bytes, self.max_frames, self.budget, self.who, self.member = (
            max_message_bytes,
            max_frames,
            budget,
            who,
            member,
        )
        self.reply_budget, self.exclusive, self.replaced = reply_budget, exclusive, replaced
        self.stuck_s, self.on_stuck, self.gate = stuck_s, on_stuck, gate
        self.join_secret, self.curve = join_secret.encode(), curve
        self._told = StrangerLog()
        self.max_connections, self.sndhwm, self.handshake_s = max_connections, sndhwm, handshake_s
        self.idents = itertools.count(1)
        self.sender = Sender()
        self.discard = memoryview(bytearray(64 * 1024))
        self.frames = None  # large frames' buffers kept for reuse (a budgeted node: .kept_frames)
        self.peers: dict[bytes, Peer] = {}
        self._ready: collections.deque[Peer] = (
            collections.deque()
        )  # peers with complete messages, taken in turn
        self._arrived: asyncio.Event | None = None
        self._last: tuple[Peer, int] | None = None
        self._server = None
        self._full_told = False
        self.total = PeersTotal(
            total_bytes,
            self.peers,
            lambda: bool(self._ready) or self._last is not None,
            self.refuse,
        )
        self.by_key: dict[str, Peer] = {}  # an exclusive key's connection
        self._keys_told: set[str] = set()
        self._stuck_told: set[bytes] = set()
        self._watch: asyncio.Task | None = None
        self._sock, self.address = listening_socket(bind)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        if self._sock.family == socket.AF_UNIX:
            self._server = await self.loop.create_unix_server(lambda: Peer(self), sock=self._sock)
        else:
            self._server = await self.loop.create_server(lambda: Peer(self), sock=self._sock)
        if self.on_stuck is not None:
            self._watch = self.loop.create_task(self._watch_stuck())

    # ---------------------------------------------------------------- peers
    def admit(self, peer: Peer) -> bool:
        if len(self.peers) >= self.max_connections:
            if not self._full_told:
                self._full_told = True
                log.warning(
                    "node refuses connections past node.max_connections = %d (first: %s)",
                    self.max_connections,
                    peer.name,
                )
            peer.transport.abort()
            return False
        self.peers[peer.ident] = peer
        return True

    def gone(self, peer: Peer) -> None:
        if self.peers.get(peer.ident) is peer:
            del self.peers[peer.ident]
            self._full_told = False
        self.total.gone(peer)
        self._stuck_told.discard(peer.ident)
        key = peer.curve.client_key if peer.curve is not None else None
        if key and self.by_key.get(key) is peer:
            del self.by_key[key]

    def authenticated(self, peer: Peer) -> None:
        """``peer`` is through the CURVE handshake: an exclusive key's older connection is replaced by it (a
        worker that reconnects before the node saw its old connection end), said in the log once per key."""
        key = peer.curve.client_key
        if not self.exclusive(key):
            return
        old, self.by_key[key] = self.by_key.get(key), peer
        if old is None or old.closed:
            return
        if key not in self._keys_told:
            self._keys_told.add(key)
            log.warning(
                "CURVE key %s: a new connection (%s) replaces its connection from %s (a worker key holds one connection at a time: "
                "node.curve_keys_by_rank); said once per key",
                key,
                peer.name,
                old.name,
            )
        self.replaced(old.ident, peer.ident)
        old.cut()

    def refuse(self, peer: Peer, why: str | Refused, at_once: bool = False) -> None:
        """Disconnect ``peer`` for breaking a limit, naming it in the log once (strangers: at most
        ``StrangerLog.LINES`` lines a minute, then one line counting the rest). ``at_once``: without
        answering what it sent before (it does not read them)."""
        if peer.closed or peer.refused:
            return
        if isinstance(why, Refused) and why.answer is not None:
            peer.put([why.answer], counted=False)
        who = self.who(peer.ident)
        if who.startswith("worker") or self._told.may():
            log.warning("disconnecting %s (%s): %s", who, peer.name, why)
        peer.cut() if at_once else peer.stop()

    def unread(self, peer: Peer) -> None:
        """``peer``'s replies without payload wait unsent past its reply budget: it asks and does not read."""
        n, budget = self.sender.unsent(peer.ident), self.reply_budget(peer.ident)
        self.refuse(
            peer,
            f"{n} bytes of replies left unread, more than it may leave ({budget}: node.control_reply_bytes, node.stranger_reply_bytes before HELLO)",
            at_once=True,
        )

    def deliver(self, peer: Peer, frames: list, nbytes: int, dropped: bool, ticket=None) -> None:
        self.total.delivered(peer)
        peer.inbox.append((frames, nbytes, dropped, ticket))
        if len(peer.inbox) == 1:
            self._ready.append(peer)
            self._arrived.set()

    def serving(self) -> bool:
        """A message is being served or waits to be."""
        return bool(self._ready) or self._last is not None

    def held(self, ident: bytes) -> int:
        """Bytes ``ident``'s connection holds now (its unfinished message and the unserved ones)."""
        p = self.peers.get(ident)
        return 0 if p is None else p.held

    # ---------------------------------------------------------------- the node-wide total (:mod:`.peers_total`)
    def total_changed(self, delta: int) -> None:
        """A connection holds ``delta`` bytes more (or fewer)."""
        self.total.changed(delta)

    def room(self, peer: Peer, need: int) -> bool:
        """Whether ``peer`` may hold ``need`` bytes more within the node-wide total (else it waits)."""
        return self.total.room(peer, need)

    # ---------------------------------------------------------------- workers that do not read
    async def _watch_stuck(self) -> None:
        """Name once each connection whose replies have stayed unsent ``stuck_s`` (whatever reads for it: a
        libzmq peer's own queue fills, then the kernel's, then the node's); it is named again only after
        its queue moved."""
        while True:
            await asyncio.sleep(min(1.0, self.stuck_s / 4))
            for ident in list(self.peers):
                if self.sender.stalled_s(ident) < self.stuck_s:
                    self._stuck_told.discard(ident)
                elif ident not in self._stuck_told:
                    self._stuck_told.add(ident)
                    self.on_stuck(ident)

    # ---------------------------------------------------------------- the Listener contract
    async def recv(self) -> tuple[bytes, list, bool]:
        if self._last is not None:
            peer, n = self._last
            self._last = None
            peer.served(n)
        if self.ticket is not None:  # (kept by an accumulator the message opened, else given back)
            self.ticket, ticket = None, self.ticket
            ticket.free()
        await asyncio.sleep(
            0
        )  # the loop reads the sockets between two messages: a busy peer starves no other's I/O
        while (
            not self._ready
        ):  # one message per peer in turn: a peer with many queued delays no other by them
            self._arrived.clear()
            await self._arrived.wait()
        peer = self._ready.popleft()
        frames, n, dropped, self.ticket = peer.inbox.popleft()
        if peer.inbox:
            self._ready.append(peer)
        self._last = (peer, n)
        return peer.ident, frames, dropped

    def connected(self, ident: bytes) -> bool:
        peer = self.peers.get(ident)
        return peer is not None and not peer.closed

    def peer_key(self, ident: bytes) -> str | None:
        peer = self.peers.get(ident)
        return peer.curve.client_key if peer is not None and peer.curve is not None else None

    def send(self, ident: bytes, frames: list, track: bool = False, priority=None):
        peer = self.peers.get(ident)
        if peer is None or peer.closed or not peer.ready:
            return None  # gone: what libzmq's ROUTER does with a message to an unknown peer
        if (
            self.sender.queued(ident) >= self.sndhwm
        ):  # sends never wait on a peer: its queue is bounded by messages
            raise SendQueueFull(ident)
        return peer.send(frames, track, priority)

    def close(self) -> None:
        self.total.close()
        if self._watch is not None:
            self._watch.cancel()
        if self._server is not None:
            self._server.close()
        for p in list(self.peers.values()):
            p.transport.abort()
        self._sock.close()
        self.sender.close()

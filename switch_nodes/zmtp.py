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
- a connection finishes the greeting within ``handshake_s``; at most ``max_connections`` are open.

A peer past a limit is disconnected and named in the log once. The event loop parses at most one
read (``_STAGING`` bytes) per callback. Workers keep their libzmq DEALER sockets: this is their
protocol (ZMTP 3.1, https://rfc.zeromq.org/spec/37/). The handshake (:mod:`.zmtp_handshake`) is NULL,
or CURVE with the node's keys (:mod:`.curve`): then every frame is a MESSAGE opened here, and the
same bounds hold for an authenticated worker, checked on the frame's size before it is read.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import socket
import struct
from collections.abc import Callable

import numpy as np

from luwu.protocol.messages import MAX_HEADER_BYTES
from luwu.switch_nodes.curve import OVERHEAD, CurveKeys
from luwu.switch_nodes.listener import Listener, SendQueueFull, listening_socket
from luwu.switch_nodes.sender import Sender, Sent
from luwu.switch_nodes.zmtp_frames import COMMAND, GREETING_BYTES, LONG, MORE, Refused, command, frame_head
from luwu.switch_nodes.zmtp_handshake import BUFFER_BYTES, Handshake, StrangerLog, command_at

__all__ = ["FRAME_COST", "ZmtpListener"]

log = logging.getLogger(__name__)

_STAGING = 16 * 1024  # a frame up to this size is parsed out of the staging buffer; larger ones are read in place
FRAME_COST = 64  # what a frame counts against its peer's budget beyond its bytes: empty frames count too
_MAX_COMMAND = 4096


class _Peer(asyncio.BufferedProtocol):
    """One connection: greeting, READY, then frames, within the listener's limits."""

    def __init__(self, owner: ZmtpListener) -> None:
        self.owner = owner
        self.ident = b"\x00" + next(owner.idents).to_bytes(4, "big")
        self.name = "?"
        self.transport: asyncio.Transport | None = None
        self.ready = False
        self.hs = Handshake(owner.curve, owner.join_secret)
        self.curve = None  # the CURVE session once the handshake is through (None: NULL)
        self.buf = bytearray(BUFFER_BYTES)  # the handshake; the staging buffer once it is through
        self.view = memoryview(self.buf)
        self.fill = self.at = 0
        self.greeted = False
        self.timer: asyncio.TimerHandle | None = None
        self.frames: list = []  # the message being read
        self.inbox: collections.deque = collections.deque()  # complete messages the node has not taken yet
        self.held = 0  # what this peer holds: the message being read and the complete ones not served yet
        self.waiting = 0  # of which the complete ones
        self.direct: np.ndarray | None = None  # a large frame read in place
        self.direct_at = 0
        self.direct_more = False
        self.skipped = 0  # frames of the message being read that were dropped unread (a stranger's payload)
        self.skip_left = 0  # bytes of the frame being dropped still to come
        self.skip_more = False
        self.paused = False
        self.refused = False  # past a limit: what it sent before is served and answered, then it is closed
        self.closed = False

    # ---------------------------------------------------------------- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "local")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.owner.admit(self):
            return
        self.owner.sender.add(self.ident, sock.fileno())  # every write goes through the sending thread
        self.owner.sender.put(self.ident, [self.hs.greeting()])
        self.timer = self.owner.loop.call_later(self.owner.handshake_s, self._handshake_timeout)

    def connection_lost(self, exc) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.owner.gone(self)
        self.owner.sender.drop(self.ident)
        self.direct = None
        self.frames = []

    def get_buffer(self, sizehint: int):
        if self.refused:
            return self.owner.discard  # what a refused peer still sends is read and dropped
        if self.skip_left:
            return self.owner.discard[: self.skip_left]
        if self.direct is not None:
            return memoryview(self.direct)[self.direct_at :]
        if self.fill == len(self.buf):  # compact: move the unparsed tail to the front
            tail = self.fill - self.at
            self.buf[:tail] = self.buf[self.at : self.fill]
            self.fill, self.at = tail, 0
        return self.view[self.fill :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.refused:
            return
        try:
            if self.skip_left:
                self.skip_left -= nbytes
                if not self.skip_left:
                    self._skipped(self.skip_more)
            elif self.direct is not None:
                self.direct_at += nbytes
                if self.direct_at == len(self.direct):
                    self._direct_done()
            else:
                self.fill += nbytes
            self._parse()
        except Refused as exc:
            self.owner.refuse(self, exc)

    # ---------------------------------------------------------------- parsing
    def _handshake_timeout(self) -> None:
        if not self.ready and not self.closed:
            self.owner.refuse(self, f"no ZMTP handshake within {self.owner.handshake_s:g} s")

    def _parse(self) -> None:
        while not self.paused and self.direct is None and not self.skip_left and not self.closed:
            if not self.ready:
                if not self._handshake():
                    return
                continue
            avail = self.fill - self.at
            if avail < 2:
                return
            flags = self.buf[self.at]
            if flags & ~(MORE | LONG | COMMAND):
                raise Refused(f"frame flags 0x{flags:02x} are not ZMTP 3")
            if flags & LONG:
                if avail < 9:
                    return
                (size,) = struct.unpack_from(">Q", self.buf, self.at + 1)
                head = 9
            else:
                size, head = self.buf[self.at + 1], 2
            if flags & COMMAND and self.curve is None:
                if size > _MAX_COMMAND or flags & MORE:
                    raise Refused(f"a command frame of {size} bytes")
                if avail < head + size:
                    return
                self._on_command(bytes(self.view[self.at + head : self.at + head + size]))
                self.at += head + size
                continue
            plain = size
            if self.curve is not None:  # a MESSAGE: the frame it carries is OVERHEAD bytes smaller
                if size < OVERHEAD:
                    raise Refused(f"a CURVE frame of {size} bytes")
                plain = size - OVERHEAD
            elif self.skipped or self.frames and self._drops(size):
                self._skip(head, size, bool(flags & MORE))
                continue
            self._check(plain)
            if not self._fits(plain):
                self._pause()
                return
            self.at += head
            inside = min(size, self.fill - self.at)
            if size <= _STAGING and inside < size:
                self.at -= head
                return  # the rest of a small frame is still on its way: wait for it in staging
            if size <= _STAGING:
                frame = self.view[self.at : self.at + size]
                self.at += size
                self._small(frame, bool(flags & MORE))
                continue
            self.held += plain + FRAME_COST
            self.direct = self._buffer(size)  # only now: after every limit said yes
            self.direct[:inside] = np.frombuffer(self.view[self.at : self.at + inside], dtype=np.uint8)
            self.direct_at, self.direct_more = inside, bool(flags & MORE)
            self.at += inside
            if self.at == self.fill:
                self.at = self.fill = 0
            if inside == size:  # all of it was staged already (a frame just over _STAGING)
                self._direct_done()

    def _buffer(self, size: int) -> np.ndarray:
        """A large frame's own buffer. With CURVE the frame is opened in place and what it carries starts
        OVERHEAD bytes in: the buffer is placed so that this is 64-byte aligned (tensors are read from it)."""
        if self.curve is None:
            return np.empty(size, dtype=np.uint8)
        raw = np.empty(size + 63, dtype=np.uint8)
        at = -(raw.ctypes.data + OVERHEAD) % 64
        return raw[at : at + size]

    def _small(self, frame: memoryview, more: bool) -> None:
        """A frame read from the staging buffer (copied out of it)."""
        if self.curve is not None:
            out = bytearray(len(frame) - 32)
            more, cmd = self.curve.open(frame, memoryview(out))
            if cmd:
                return self._on_command(bytes(out[1:]))
            frame = memoryview(out)[1:]
        self.held += len(frame) + FRAME_COST
        self._frame(bytes(frame), more)

    def _direct_done(self) -> None:
        """A large frame is read whole."""
        frame, self.direct = memoryview(self.direct), None
        more = self.direct_more
        if self.curve is not None:
            more, cmd = self.curve.open(frame, frame[32:])
            if cmd:
                raise Refused(f"a command of {len(frame) - OVERHEAD} bytes")
            frame = frame[OVERHEAD:]
        self._frame(frame, more)


    def _drops(self, size: int) -> bool:
        """A payload frame of a peer that did not say HELLO, past its budget: read and dropped, so that its
        header is answered as any stranger's is (a worker reconnected after a node restart is told to
        roll back, whatever it was sending)."""
        o = self.owner
        return not o.member(self.ident) and self._message_bytes() + size + FRAME_COST > o.budget(self.ident)

    def _count_frame(self) -> None:
        """One more frame of the message being read, kept or dropped."""
        if len(self.frames) + self.skipped >= self.owner.max_frames:
            raise Refused(f"a message of more than {self.owner.max_frames} frames")

    def _skip(self, head: int, size: int, more: bool) -> None:
        self._count_frame()
        self.at += head
        take = min(size, self.fill - self.at)
        self.at += take
        if self.at == self.fill:
            self.at = self.fill = 0
        self.skipped += 1
        self.skip_left, self.skip_more = size - take, more
        if not self.skip_left:
            self._skipped(more)

    def _skipped(self, more: bool) -> None:
        """A dropped frame is through: at the message's end its header goes to the node, marked."""
        if not more:
            self.skipped = 0
            self._frame(None, False)

    def _check(self, size: int) -> None:
        """The limits that do not depend on what is queued: a frame past them can never be served."""
        o, first = self.owner, not self.frames
        self._count_frame()
        if first and size > MAX_HEADER_BYTES:
            raise Refused(f"a header frame of {size} bytes (at most {MAX_HEADER_BYTES})")
        payload = sum(len(f) for f in self.frames[1:]) + (0 if first else size)
        if payload > o.max_message_bytes:
            raise Refused(f"a message payload of {payload} bytes or more (at most {o.max_message_bytes})")
        need = self._message_bytes() + size + FRAME_COST
        if need > o.budget(self.ident):
            raise Refused(f"a message of {need} bytes or more: more than this peer may hold ({o.budget(self.ident)})")

    def _message_bytes(self) -> int:
        return self.held - self.waiting

    def _fits(self, size: int) -> bool:
        """Whether a frame of ``size`` may be read now: within the budget, or nothing else is waiting (the
        message alone fits: :meth:`_check`)."""
        return self.waiting == 0 or self.held + size + FRAME_COST <= self.owner.budget(self.ident)

    def _frame(self, frame, more: bool) -> None:
        """A frame is through (None: the end of a message whose payload was dropped)."""
        if frame is not None:
            self.frames.append(frame)
        if not more:
            frames, self.frames = self.frames, []
            n = self._message_bytes()
            self.waiting += n
            self.owner.deliver(self, frames, n, frame is None)

    def _pause(self) -> None:
        self.paused = True
        self.transport.pause_reading()

    def stop(self) -> None:
        """Past a limit: drop the message being read and whatever comes after it (read and discarded: a
        socket closed with unread bytes resets the connection, which would lose the answers on their
        way), then end the connection once the complete messages before it are answered (``_finish``);
        at most ``handshake_s`` later it is cut whatever the peer does."""
        self.refused = True
        self.direct, self.frames = None, []
        self.held = self.waiting
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if not self.waiting:
            self._finish()
        self.owner.loop.call_later(self.owner.handshake_s, self.transport.abort)

    def served(self, nbytes: int) -> None:
        """A message of ``nbytes`` was served: read on if this peer waited for it."""
        self.held -= nbytes
        self.waiting -= nbytes
        if self.refused:
            if not self.waiting:
                self._finish()
            return
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
            try:
                self._parse()
            except Refused as exc:
                self.owner.refuse(self, exc)

    def _finish(self) -> None:
        """Our side of the connection ends after the answers (the peer's libzmq closes it on the EOF)."""
        self.owner.sender.end(self.ident)

    def _handshake(self) -> bool:
        """The peer's greeting, then the mechanism's commands (:class:`Handshake`); True once through."""
        if not self.greeted:
            if self.fill - self.at < GREETING_BYTES:
                self.hs.check_start(bytes(self.buf[: self.fill]))
                return False
            self.hs.on_greeting(bytes(self.buf[:GREETING_BYTES]))
            self.at, self.greeted = GREETING_BYTES, True
        while True:
            body, used = command_at(self.buf, self.at, self.fill)
            if body is None:
                return False
            self.at += used
            answer, done = self.hs.on_command(body)
            self.owner.sender.put(self.ident, [answer])
            if done:
                break
        self.curve = self.hs.curve
        rest = bytes(self.buf[self.at : self.fill])
        self.buf = bytearray(_STAGING + 64)  # a small frame and its header always fit
        self.view = memoryview(self.buf)
        self.buf[: len(rest)] = rest
        self.at, self.fill, self.ready = 0, len(rest), True
        self.timer.cancel()
        return True

    def _on_command(self, body: bytes) -> None:
        n = body[0] if body else 0
        name = body[1 : 1 + n]
        if name == b"PING":  # heartbeats (ZMTP 3.1): answer with the ping's context
            context = body[1 + n + 2 :][:16]
            if self.curve is None:
                self.owner.sender.put(self.ident, [command(b"PONG", context)])
            else:
                self.owner.sender.put(self.ident, [b"\x04PONG" + context], seal=functools.partial(self.curve.seal, command=True))
        elif name not in (b"PONG", b"ERROR"):
            raise Refused(f"unexpected command {name.decode('ascii', 'replace')!r}")

    # ---------------------------------------------------------------- sending
    def send(self, frames: list, track: bool, priority=None) -> Sent | None:
        sent = Sent() if track else None
        if self.curve is not None:  # sealed on the sending thread, in the order they go out
            self.owner.sender.put(self.ident, list(frames), sent, seal=self.curve.seal, priority=priority)
            return sent
        parts: list = []
        last = len(frames) - 1
        for i, f in enumerate(frames):
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            parts += [frame_head(n, i < last), f]
        self.owner.sender.put(self.ident, parts, sent, priority=priority)
        return sent


class ZmtpListener(Listener):
    """A node's listening socket and its peers (see the module's doc)."""

    def __init__(self, bind: str, *, max_message_bytes: int, max_frames: int, budget: Callable[[bytes], int], who: Callable[[bytes], str], max_connections: int, sndhwm: int, handshake_s: float = 10.0, join_secret: str = "", member: Callable[[bytes], bool] = lambda ident: True, curve: CurveKeys | None = None) -> None:
        self.max_message_bytes, self.max_frames, self.budget, self.who, self.member = max_message_bytes, max_frames, budget, who, member
        self.join_secret, self.curve = join_secret.encode(), curve
        self._told = StrangerLog()
        self.max_connections, self.sndhwm, self.handshake_s = max_connections, sndhwm, handshake_s
        self.idents = itertools.count(1)
        self.sender = Sender()
        self.discard = memoryview(bytearray(64 * 1024))
        self.peers: dict[bytes, _Peer] = {}
        self._ready: collections.deque[_Peer] = collections.deque()  # peers with complete messages, taken in turn
        self._arrived: asyncio.Event | None = None
        self._last: tuple[_Peer, int] | None = None
        self._server = None
        self._full_told = False
        self._sock, self.address = listening_socket(bind)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        if self._sock.family == socket.AF_UNIX:
            self._server = await self.loop.create_unix_server(lambda: _Peer(self), sock=self._sock)
        else:
            self._server = await self.loop.create_server(lambda: _Peer(self), sock=self._sock)

    # ---------------------------------------------------------------- peers
    def admit(self, peer: _Peer) -> bool:
        if len(self.peers) >= self.max_connections:
            if not self._full_told:
                self._full_told = True
                log.warning("node refuses connections past node.max_connections = %d (first: %s)", self.max_connections, peer.name)
            peer.transport.abort()
            return False
        self.peers[peer.ident] = peer
        return True

    def gone(self, peer: _Peer) -> None:
        if self.peers.get(peer.ident) is peer:
            del self.peers[peer.ident]
            self._full_told = False

    def refuse(self, peer: _Peer, why: str | Refused) -> None:
        """Disconnect ``peer`` for breaking a limit, naming it in the log once (strangers: at most
        ``StrangerLog.LINES`` lines a minute, then one line counting the rest)."""
        if peer.closed or peer.refused:
            return
        if isinstance(why, Refused) and why.answer is not None:
            self.sender.put(peer.ident, [why.answer])
        who = self.who(peer.ident)
        if who.startswith("worker") or self._told.may():
            log.warning("disconnecting %s (%s): %s", who, peer.name, why)
        peer.stop()

    def deliver(self, peer: _Peer, frames: list, nbytes: int, dropped: bool) -> None:
        peer.inbox.append((frames, nbytes, dropped))
        if len(peer.inbox) == 1:
            self._ready.append(peer)
            self._arrived.set()

    def held(self, ident: bytes) -> int:
        """Bytes ``ident``'s connection holds now (its unfinished message and the unserved ones)."""
        p = self.peers.get(ident)
        return 0 if p is None else p.held

    # ---------------------------------------------------------------- the Listener contract
    async def recv(self) -> tuple[bytes, list, bool]:
        if self._last is not None:
            peer, n = self._last
            self._last = None
            peer.served(n)
        await asyncio.sleep(0)  # the loop reads the sockets between two messages: a busy peer starves no other's I/O
        while not self._ready:  # one message per peer in turn: a peer with many queued delays no other by them
            self._arrived.clear()
            await self._arrived.wait()
        peer = self._ready.popleft()
        frames, n, dropped = peer.inbox.popleft()
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
        if self.sender.queued(ident) >= self.sndhwm:  # sends never wait on a peer: its queue is bounded by messages
            raise SendQueueFull(ident)
        return peer.send(frames, track, priority)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for p in list(self.peers.values()):
            p.transport.abort()
        self._sock.close()
        self.sender.close()

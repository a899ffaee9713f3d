"""One connection of the node's ZMTP listener (:mod:`.zmtp`): its greeting and handshake, its frames read
within the listener's limits, and its replies queued for the sending thread.

What the connection holds (:attr:`Peer.held`: the message being read and the complete ones not served
yet) is counted against its own budget and the listener's node-wide total before a frame's buffer
exists. Every reply queued for it that carries no payload (PONGs, the handshake's commands, header-only
answers) counts against its reply budget until sent: a peer that does not read them is disconnected.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

from luwu.protocol.messages import MAX_HEADER_BYTES
from luwu.switch_nodes.curve import OVERHEAD
from luwu.switch_nodes.sender import Sent
from luwu.switch_nodes.zmtp_frames import (
    COMMAND,
    GREETING_BYTES,
    LONG,
    MORE,
    Refused,
    command,
    frame_head,
)
from luwu.switch_nodes.zmtp_handshake import BUFFER_BYTES, Handshake, command_at

if TYPE_CHECKING:
    from luwu.switch_nodes.zmtp import ZmtpListener

__all__ = ["FRAME_COST", "REPLY_COST", "Peer"]

_STAGING = (
    16 * 1024
)  # a frame up to this size is parsed out of the staging buffer; larger ones are read in place
FRAME_COST = (
    64  # what a frame counts against its peer's budget beyond its bytes: empty frames count too
)
REPLY_COST = 256  # what a queued reply counts against its peer's reply budget beyond its bytes (its queue entry)
_MAX_COMMAND = 4096


class Peer(asyncio.BufferedProtocol):
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
        self.inbox: collections.deque = (
            collections.deque()
        )  # complete messages the node has not taken yet
        self._held = (
            0  # what this peer holds: the message being read and the complete ones not served yet
        )
        self.waiting = 0  # of which the complete ones
        self.direct: np.ndarray | None = None  # a large frame read in place
        self.direct_at = 0
        self.direct_more = False
        self.skipped = (
            0  # frames of the message being read that were dropped unread (a stranger's payload)
        )
        self.skip_left = 0  # bytes of the frame being dropped still to come
        self.skip_more = False
        self.paused = False
        self.ticket = None  # what the message being read counts in flight (the listener's gate)
        self.read_at = time.monotonic()  # when bytes last came
        self.refused = (
            False  # past a limit: what it sent before is served and answered, then it is closed
        )
        self.closed = False

    @property
    def held(self) -> int:
        """Bytes this connection holds (its unfinished message and its complete ones not served yet), as
        counted against its budget and the listener's node-wide total."""
        return self._held

    @held.setter
    def held(self, n: int) -> None:
        self.owner.total_changed(n - self._held)
        self._held = n

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
        self.owner.sender.add(
            self.ident, sock.fileno()
        )  # every write goes through the sending thread
        self.put([self.hs.greeting()])
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
        self._drop_ticket()
        self.held = (
            self.waiting
        )  # the unfinished message is gone; the complete ones still wait to be served

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
        self.read_at = time.monotonic()
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
        while (
            not self.paused
            and self.direct is None
            and not self.skip_left
            and not self.closed
            and not self.refused
        ):
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
            if len(self.frames) == 1 and self.ticket is None and self.owner.gate is not None:
                self.ticket = self.owner.gate(self, self.frames[0])  # (the header is read)
                if self.ticket is None:  # its payload stays unread until the gate wakes it
                    self._pause()
                    return
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
            self.direct[:inside] = np.frombuffer(
                self.view[self.at : self.at + inside], dtype=np.uint8
            )
            self.direct_at, self.direct_more = inside, bool(flags & MORE)
            self.at += inside
            if self.at == self.fill:
                self.at = self.fill = 0
            if inside == size:  # all of it was staged already (a frame just over _STAGING)
                self._direct_done()

    def _buffer(self, size: int) -> np.ndarray:
        """A large frame's own buffer. With CURVE the frame is opened in place and what it carries starts
        OVERHEAD bytes in: the buffer is placed so that this is 64-byte aligned (tensors are read from it)."""
        kept = self.owner.frames  # (a budgeted node's buffers kept for reuse: :mod:`.kept_frames`)
        if self.curve is None:
            return np.empty(size, dtype=np.uint8) if kept is None else kept.take(size)
        raw = np.empty(size + 63, dtype=np.uint8) if kept is None else kept.take(size + 63)
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
        return not o.member(self.ident) and self._message_bytes() + size + FRAME_COST > o.budget(
            self.ident
        )

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
            raise Refused(
                f"a message payload of {payload} bytes or more (at most {o.max_message_bytes})"
            )
        need = self._message_bytes() + size + FRAME_COST
        if need > o.budget(self.ident):
            raise Refused(
                f"a message of {need} bytes or more: more than this peer may hold ({o.budget(self.ident)})"
            )

    def _message_bytes(self) -> int:
        return self.held - self.waiting

    def _fits(self, size: int) -> bool:
        """Whether a frame of ``size`` may be read now: within the budget, or nothing else is waiting (the
        message alone fits: :meth:`_check`), and within the node-wide total (the listener's ``room``)."""
        need = size + FRAME_COST
        mine = self.waiting == 0 or self.held + need <= self.owner.budget(self.ident)
        return mine and self.owner.room(self, need)

    def _frame(self, frame, more: bool) -> None:
        """A frame is through (None: the end of a message whose payload was dropped)."""
        if frame is not None:
            self.frames.append(frame)
        if not more:
            frames, self.frames = self.frames, []
            n = self._message_bytes()
            self.waiting += n
            self.owner.deliver(self, frames, n, frame is None, self.ticket)
            self.ticket = None

    def _pause(self) -> None:
        if self.refused or self.closed:
            return  # (cut while asking for room: what it still sends is read and dropped)
        self.paused = True
        self.transport.pause_reading()

    def resume(self) -> None:
        """Read on after a pause (its messages were served, or the node-wide total has room again)."""
        if not self.paused or self.closed or self.refused:
            return
        self.paused = False
        self.read_at = time.monotonic()  # (it waited for the node, not idled)
        self.transport.resume_reading()
        try:
            self._parse()
        except Refused as exc:
            self.owner.refuse(self, exc)

    def stop(self) -> None:
        """Past a limit: drop the message being read and whatever comes after it (read and discarded: a
        socket closed with unread bytes resets the connection, which would lose the answers on their
        way), then end the connection once the complete messages before it are answered (``_finish``);
        at most ``handshake_s`` later it is cut whatever the peer does."""
        self.refused = True
        self.direct, self.frames = None, []
        self._drop_ticket()
        self.held = self.waiting
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if not self.waiting:
            self._finish()
        self.owner.loop.call_later(self.owner.handshake_s, self.transport.abort)

    def cut(self) -> None:
        """Past a limit where waiting serves nothing (it does not read, or another connection replaced it):
        what it holds unfinished is dropped and the connection ends now, its queued replies with it."""
        self.refused = True
        self.direct, self.frames = None, []
        self._drop_ticket()
        self.held = self.waiting
        self.transport.abort()

    def _drop_ticket(self) -> None:
        """The unfinished message is dropped: what it counted in flight is given back."""
        if self.ticket is not None:
            self.ticket, ticket = None, self.ticket
            ticket.free()

    def served(self, nbytes: int) -> None:
        """A message of ``nbytes`` was served: read on if this peer waited for it."""
        self.held -= nbytes
        self.waiting -= nbytes
        if self.refused:
            if not self.waiting and not self.closed:
                self._finish()
            return
        self.resume()

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
            self.put([answer])
            if done:
                break
        self.curve = self.hs.curve
        if self.curve is not None and not self.refused:
            self.owner.authenticated(self)
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
                self.put([command(b"PONG", context)])
            else:
                self.put(
                    [b"\x04PONG" + context], seal=functools.partial(self.curve.seal, command=True)
                )
        elif name not in (b"PONG", b"ERROR"):
            raise Refused(f"unexpected command {name.decode('ascii', 'replace')!r}")

    # ---------------------------------------------------------------- sending
    def put(
        self, parts: list, sent: Sent | None = None, seal=None, priority=None, counted: bool = True
    ) -> None:
        """Queue a reply for the sending thread. ``counted``: it counts against this peer's reply budget
        (its bytes and REPLY_COST) until sent whole; past the budget the peer does not read what it asks
        for, and is cut off."""
        o, cost = self.owner, 0
        if counted:
            cost = REPLY_COST + sum(
                p.nbytes if isinstance(p, memoryview) else len(p) for p in parts
            )
        o.sender.put(self.ident, parts, sent, seal=seal, priority=priority, cost=cost)
        if cost and not self.refused and o.sender.unsent(self.ident) > o.reply_budget(self.ident):
            o.unread(self)

    def send(self, frames: list, track: bool, priority=None) -> Sent | None:
        """A message of the node's: one with payload frames (weights) is bounded by the node's queue limit and
        the watch for workers that do not read; one without counts against the reply budget."""
        sent = Sent() if track else None
        counted = len(frames) == 1
        if self.curve is not None:  # sealed on the sending thread, in the order they go out
            self.put(list(frames), sent, seal=self.curve.seal, priority=priority, counted=counted)
            return sent
        parts: list = []
        last = len(frames) - 1
        for i, f in enumerate(frames):
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            parts += [frame_head(n, i < last), f]
        self.put(parts, sent, priority=priority, counted=counted)
        return sent

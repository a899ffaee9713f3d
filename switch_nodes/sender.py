"""The node's sending thread: every peer's outgoing bytes, written in order off the event loop.

The event loop (uvloop) would write holding the GIL, and one thread would then receive, dispatch and
send in turn. Here one thread owns the writes (what libzmq's I/O thread does for its sockets): the
``sendmsg`` calls release the GIL, so the loop goes on reading and dispatching meanwhile. Each peer's
socket is a duplicate of the loop's (the loop only reads it); a message is done once its last byte is in
the kernel, and its frames may be reused from then on.

Each peer's queue keeps two accounts the event loop reads without a lock: what its unsent messages cost
(:meth:`Sender.unsent`: a reply budget bounds it, so a peer that does not read cannot grow the queue) and
how long its queue has made no progress (:meth:`Sender.stalled_s`: a worker whose replies stay unsent is
not reading, whatever reads for it).
"""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["Sender", "Sent"]

_IOV = 1024  # buffers per sendmsg (Linux's IOV_MAX)
_BATCH = 256  # messages per sendmsg at most
_AHEAD = (
    8 << 20
)  # bytes per sendmsg at most (more than a socket buffer takes): what is not in it may still be reordered


def _views(parts: list) -> list:
    return [memoryview(p).cast("B") for p in parts if len(p)]


class Sent:
    """A message queued for a peer; ``done`` once its last byte went to the kernel (or the peer is gone)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self, timeout: float | None = None) -> None:
        import zmq

        if not self.event.wait(timeout):
            raise zmq.NotDone  # what libzmq's MessageTracker raises: ReplyBuffers handles both alike


class _Out:
    """One peer's socket and queue: [parts still to send, Sent or None, seal or None, priority or None, fixed,
    cost], or ``None`` for the end of writing. ``fixed``: its bytes (or, sealed, its nonces) are on their way:
    it keeps its place. ``unsorted``: a message with a priority came since the queue was last ordered.
    ``owed`` (written by the loop's thread only) and ``paid`` (by the sending thread only): the costs of the
    messages queued and of those sent whole. ``moved_at``: when the queue last made progress, or got a
    message while empty."""

    __slots__ = ("sock", "queue", "blocked", "dead", "unsorted", "owed", "paid", "moved_at")

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=os.dup(fd))
        self.queue: collections.deque = collections.deque()
        self.blocked = self.dead = self.unsorted = False
        self.owed = self.paid = 0
        self.moved_at = time.monotonic()


class Sender:
    """Writes queued frames to peers on a thread of its own (see the module's doc)."""

    def __init__(self) -> None:
        self._outs: dict[bytes, _Out] = {}
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already holds a wake-up
        self._poll = select.poll()
        self._poll.register(self._wake_r, select.POLLIN)
        self._by_fd: dict[int, bytes] = {}
        self._closing: list[bytes] = []
        self._running = True
        self._thread = threading.Thread(target=self._run, name="luwu-send", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- from the event loop
    def add(self, key: bytes, fd: int) -> None:
        with self._lock:
            self._outs[key] = _Out(fd)

    def put(
        self,
        key: bytes,
        parts: list,
        sent: Sent | None = None,
        seal: Callable[[list], list] | None = None,
        priority=None,
        cost: int = 0,
    ) -> bool:
        """Queue ``parts`` (bytes / memoryviews, untouched until ``sent`` is done) for ``key``; False if gone.
        ``seal``: ``parts`` are a message's frames, turned into what goes out by ``seal(parts)`` on this
        thread, right before they are sent (CURVE: nonces in the order of the wire). ``priority``: among
        the messages with one queued one after another and not yet on their way, the lowest goes first
        (a message without one keeps its place: nothing overtakes it or falls behind it). ``cost``: what
        the message counts in :meth:`unsent` until it is sent whole."""
        with self._lock:
            out = self._outs.get(key)
            if out is None or out.dead:
                if sent is not None:
                    sent.event.set()
                return False
            if not out.queue:
                out.moved_at = time.monotonic()
            out.queue.append([parts if seal else _views(parts), sent, seal, priority, False, cost])
            out.owed += cost
            out.unsorted |= priority is not None
        self._wake()
        return True

    def end(self, key: bytes) -> None:
        """After what is queued: end writing (the peer reads EOF; the connection stays open for reading)."""
        with self._lock:
            out = self._outs.get(key)
            if out is not None:
                out.queue.append(None)
        self._wake()

    def queued(self, key: bytes) -> int:
        out = self._outs.get(key)
        return 0 if out is None else len(out.queue)

    def unsent(self, key: bytes) -> int:
        """The cost (``put``'s) of ``key``'s messages not yet sent whole (0 once it is gone)."""
        out = self._outs.get(key)
        return 0 if out is None or out.dead else out.owed - out.paid

    def stalled_s(self, key: bytes) -> float:
        """How long ``key`` has had messages queued with none of their bytes taken by the kernel (0: none
        queued, or it is gone)."""
        out = self._outs.get(key)
        if out is None or out.dead or not out.queue:
            return 0.0
        return time.monotonic() - out.moved_at

    def drop(self, key: bytes) -> None:
        """The loop closed its side: close ours once the thread is not writing to it."""
        with self._lock:
            self._closing.append(key)
        self._wake()

    def _wake(self) -> None:
        if self._running:  # (after close the pipe's descriptors may be someone else's)
            self._kick()

    def _kick(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._running = False
        self._kick()
        self._thread.join(5)
        for out in self._outs.values():
            self._fail(out)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        while self._running:
            with self._lock:
                closing, self._closing = self._closing, []
                for key in closing:
                    out = self._outs.pop(key, None)
                    if out is not None:
                        self._fail(out)
                ready = [(k, o) for k, o in self._outs.items() if o.queue and not o.blocked]
            for key, out in ready:
                self._drain(key, out)
            busy = any(o.queue and not o.blocked for o in list(self._outs.values()))
            for fd, _ in self._poll.poll(0 if busy else None):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 1 << 16)
                    except BlockingIOError:
                        pass
                    continue
                key = self._by_fd.pop(fd, None)
                self._poll.unregister(fd)
                out = self._outs.get(key)
                if out is not None:
                    out.blocked = False

    def _drain(self, key: bytes, out: _Out) -> None:
        """Write what ``out`` has queued until the kernel takes no more. One ``sendmsg`` carries the frames of
        up to ``_BATCH`` messages: each call gives the GIL back, and getting it back can take the loop's
        switch interval (5 ms) when the loop is busy in Python, so calls, not bytes, are what costs."""
        q = out.queue
        if out.unsorted:
            self._order(out)
        while q:
            if q[0] is None:
                try:
                    out.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                q.popleft()
                continue
            bufs: list = []
            ahead = 0
            for i in range(min(len(q), _BATCH)):
                item = q[i]
                if item is None or ahead > _AHEAD:
                    break
                if item[2] is not None:
                    item[0], item[2], item[4] = _views(item[2](item[0])), None, True
                if bufs and len(bufs) + len(item[0]) > _IOV:
                    break
                bufs += item[0]
                ahead += sum(len(b) for b in item[0])
            try:
                n = out.sock.sendmsg(bufs[:_IOV]) if bufs else 0
            except BlockingIOError:
                out.blocked = True
                fd = out.sock.fileno()
                self._by_fd[fd] = key
                self._poll.register(fd, select.POLLOUT)
                return
            except OSError:
                self._fail(out)
                return
            if n:
                out.moved_at = time.monotonic()
            while q and q[0] is not None:  # what went out: whole messages are done, a part is cut
                parts, sent = q[0][0], q[0][1]
                while n and parts:
                    q[0][4] = True
                    if n >= len(parts[0]):
                        n -= len(parts.pop(0))
                    else:
                        parts[0], n = parts[0][n:], 0
                if parts:
                    break
                out.paid += q.popleft()[5]
                if sent is not None:
                    sent.event.set()

    def _order(self, out: _Out) -> None:
        """Sort each run of messages with a priority that are not on their way yet (stable: equals keep their order)."""
        with self._lock:
            out.unsorted = False
            items, q = list(out.queue), out.queue
            at = 0
            while at < len(items) and items[at] is not None and items[at][4]:
                at += 1
            done, run = items[:at], []
            for item in items[at:]:
                if item is not None and item[3] is not None:
                    run.append(item)
                    continue
                done += sorted(run, key=lambda m: m[3]) + [item]
                run = []
            q.clear()
            q.extend(done + sorted(run, key=lambda m: m[3]))

    def _fail(self, out: _Out) -> None:
        """The peer is gone: nothing more is sent, and every queued message is done (its frames are free)."""
        with self._lock:
            out.dead = True
            for item in out.queue:
                if item is not None and item[1] is not None:
                    item[1].event.set()
            out.queue.clear()
            fd = out.sock.fileno()
            if fd in self._by_fd:
                self._by_fd.pop(fd)
                self._poll.unregister(fd)
            out.sock.close()

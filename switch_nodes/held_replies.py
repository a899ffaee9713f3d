"""Replies held at the node until their worker may write them.

A resident worker's weights may change only in its ``step()``. On a fast link the node answers the
last layers' buckets while the worker's backward is still running; a reply that lands before
``step()`` had to be kept by the worker, a second copy of those weights (4 bytes a parameter with fp32
pulls). So a worker says when it reached ``step()`` of step s (a HEARTBEAT with ``seq`` = s, sent
first thing in ``step()``: ``optimizer.hold_replies``), and from its first such word on, the node holds
the replies to its pushes of a later step until it says so. What a held reply holds is its encoded
frames, shared by the workers it goes to (2 bytes a parameter with the bf16 pulls of a fast link; fp32
points at the shard itself, zero-copy): the copy moves from the worker to the node, where it is in
flight anyway. Once released they go out first layers first (the layout lists buckets in backward
order: the next forward's order is the reverse).

Held only in sync mode (there the next step of a bucket waits for this worker's push, which comes
after its ``step()``, so the weights a held fp32 reply points to cannot change under it), and only
replies that carry weights (an ack lets a streaming worker reuse a buffer during backward). At most
``limit`` replies per worker are held; past it they go at once, so a release never bursts past the
send queue. While a push waits for node.push_memory_bytes (:mod:`.inflight`) everything held goes at
once (the word that releases them may be behind the waiting push). A rank that says HELLO again, is
dropped, or a rollback forgets what was held; a reply held for a connection that closed counts as sent
(as a send to a gone peer is dropped).
"""

from __future__ import annotations

import threading
import time

import zmq

__all__ = ["HeldReplies", "Later"]


class Later:
    """The send tracker of a held reply: done once it was sent and its bytes left (or it was forgotten, or
    its worker's connection closed: ``alive()`` says False)."""

    __slots__ = ("event", "real", "alive")

    def __init__(self, alive=lambda: True) -> None:
        self.event = threading.Event()
        self.real = None  # the tracker of the send, once released
        self.alive = alive

    def wait(self, timeout: float | None = None) -> None:
        t0 = time.monotonic()
        while not self.event.wait(
            0.25 if timeout is None else min(0.25, max(0.0, timeout - (time.monotonic() - t0)))
        ):
            if not self.alive():
                return
            if timeout is not None and time.monotonic() - t0 >= timeout:
                raise zmq.NotDone
        if self.real is not None:
            self.real.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))


class HeldReplies:
    """Per worker: the last step it reached ``step()`` of, and its replies held until it does (see the module's doc)."""

    def __init__(self, send_to, sync: bool, limit: int, alive=lambda worker: True) -> None:
        self.send_to, self.sync, self.limit, self.alive = send_to, sync, limit, alive
        self.released: dict[int, int] = {}  # worker -> the last step it said it reached step() of
        self.held: dict[int, list] = {}  # worker -> [(bucket, step, frames, priority, Later)]

    def hold(self, worker: int, step: int, bucket: int, frames: list, priority) -> Later | None:
        """Keep the reply to ``worker``'s push of ``step`` if it has not reached that step's ``step()``; its
        tracker. None: send it now."""
        r = self.released.get(worker)
        if not self.sync or r is None or step <= r or self.count(worker) >= self.limit:
            return None
        later = Later(lambda: self.alive(worker))
        self.held.setdefault(worker, []).append((bucket, step, frames, priority, later))
        return later

    def release(self, worker: int, step: int) -> None:
        """``worker`` reached ``step()`` of ``step``: its replies up to that step go, first layers first."""
        self.released[worker] = max(self.released.get(worker, step), step)
        held = self.held.get(worker)
        if not held:
            return
        now = [h for h in held if h[1] <= step]
        self.held[worker] = [h for h in held if h[1] > step]
        for _, _, frames, priority, later in sorted(now, key=lambda h: (h[1], -h[0])):
            later.real = self.send_to(worker, frames, True, priority)
            later.event.set()

    def flush(self) -> None:
        """Send every held reply now (a push waits for memory: what releases them may be behind it)."""
        for w in list(self.held):
            held = sorted(self.held.pop(w), key=lambda h: (h[1], -h[0]))
            for _, _, frames, priority, later in held:
                later.real = self.send_to(w, frames, True, priority)
                later.event.set()

    def forget(self, worker: int | None = None) -> None:
        """Drop what is held for ``worker`` (None: everyone), and when it reached ``step()``."""
        for w in list(self.held) if worker is None else [worker]:
            for *_, later in self.held.pop(w, []):
                later.event.set()
            self.released.pop(w, None)

    def count(self, worker: int) -> int:
        return len(self.held.get(worker, ()))

"""How the threads that send wake the worker's I/O thread: a pipe, written once per batch of sends.

The I/O thread sleeps in ``poll`` on its sockets and the read end of a pipe. A thread that queued
a message writes a byte, unless a wake-up is already on its way (the I/O thread has not drained
the pipe yet). Each wake-up costs: the I/O thread takes the interpreter lock (the sending thread,
still busy with its hook, waits for it back) and makes a pass over every socket. Inside
:meth:`Wake.batched` a thread's sends wake the I/O thread once, as the block ends, so a hook that
pushes several buckets (or asks for a unit's weights) hands over all of them in one wake-up. A wait
inside a batch first wakes the I/O thread for the sends before it (:meth:`Wake.flush`).
"""

from __future__ import annotations

import contextlib
import os
import threading


class Wake:
    def __init__(self):
        self.fd, self._w = os.pipe()  # (the I/O thread polls self.fd)
        os.set_blocking(self.fd, False)
        self._woken = (
            False  # a wake-up is on its way: sends until the I/O thread takes it need none
        )
        self._batch = threading.local()  # per thread: depth of batched(), whether a send waits
        self.writes = 0  # wake-ups written

    def queued(self) -> None:
        """A message was queued: wake the I/O thread (at the end of the batch, inside one)."""
        if getattr(self._batch, "depth", 0):
            self._batch.waiting = True
        else:
            self.now()

    def now(self) -> None:
        if not self._woken:
            self._woken = True
            self.writes += 1
            os.write(self._w, b"x")

    @contextlib.contextmanager
    def batched(self):
        """This thread's sends inside the block wake the I/O thread once, as it ends."""
        depth = getattr(self._batch, "depth", 0)
        self._batch.depth = depth + 1
        try:
            yield
        finally:
            self._batch.depth = depth
            if not depth and getattr(self._batch, "waiting", False):
                self._batch.waiting = False
                self.now()

    def flush(self) -> None:
        """Wake the I/O thread now for this thread's sends waiting in a batch (a wait inside
        :meth:`batched` must not wait for an answer to a message nobody has sent yet)."""
        if getattr(self._batch, "waiting", False):
            self._batch.waiting = False
            self.now()

    def drain(self) -> None:
        """(I/O thread) Take the wake-ups written so far. After draining the pipe (a wake-up
        written meanwhile is not lost: its message was queued before, and the queues are read
        next) and before reading the queues (a send after this writes a new wake-up)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        self._woken = False

    def stop(self) -> None:
        """Wake the I/O thread whatever the state (it is stopping)."""
        try:
            os.write(self._w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)

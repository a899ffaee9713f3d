"""Summed gradients that wait for COMMIT, kept in a scratch file instead of RAM.

A two-phase step (global-norm clipping, AMP, every job's first step) keeps each (step, bucket)'s fp32
sum until the workers' COMMIT, which needs the norms of all the step's buckets: 4 B a parameter of
the shard at once, whatever ``node.push_memory_bytes`` says. On an out-of-core node with a push
budget, a sum that is complete (every member pushed, its norm computed) may leave RAM: while a push
waits for room in the budget, every such sum is written to a slot of
``<state_dir>/<job>-node<index>/pushes.scratch`` and its RAM given back, so the listener lets the
waiting pushes in (:mod:`..inflight`). A step whose pushes fit the budget costs no disk. At COMMIT
a written sum is read back, the buckets in the order the COMMIT steps them, a few ahead as the
budget has room, and the step goes on exactly as if it had stayed (the bytes are the same). The file
is scratch: nothing in it survives the process (a node that restarts has the workers push the step
again, as for any state in flight).

One slot per bucket (a bucket has at most one step in its norm round: a step's norm comes after
the step before is applied). Writes and reads go through the shard's :class:`~.io.IOEngine`,
``O_DIRECT`` from and into the accumulators themselves, which :class:`AlignedPool` allocates
page-aligned. A sum whose buffer is asked for before it is out (COMMIT came first) stays in RAM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from luwu.switch_nodes.kept_frames import mapped
from luwu.switch_nodes.ooc.io import ALIGN, FileHandle, IOEngine, Transfer, align_up
from luwu.switch_nodes.store import Accumulator, AccumulatorPool

__all__ = ["AlignedPool", "Spill"]

log = logging.getLogger(__name__)

SCRATCH_FILE = "pushes.scratch"
READ_AHEAD = 4
"""Spilled sums read back ahead of the bucket the optimizer steps (within the push budget)."""
ROOM_WAIT_S = 0.5
"""How long a sum the optimizer needs now waits for the budget to have room before it is read anyway."""


class AlignedPool(AccumulatorPool):
    """Accumulators whose buffers start on a page and span whole pages (``O_DIRECT`` writes and reads
    them in place); a spilled buffer is given back from an I/O thread (the pool is thread-safe)."""

    def _new(self, numel: int) -> torch.Tensor:
        if self.mapped:  # (a mapping starts on a page)
            return torch.frombuffer(mapped(align_up(numel * 4)), dtype=torch.float32)[:numel]
        raw = torch.empty(align_up(numel * 4) + ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % ALIGN
        return raw[skip : skip + align_up(numel * 4)].view(torch.float32)[:numel]


def _pages(buf: torch.Tensor) -> memoryview:
    """The whole pages ``buf`` (from :class:`AlignedPool`) spans, as bytes (no copy)."""
    n = align_up(buf.numel() * 4)
    storage = buf.untyped_storage()
    if buf.data_ptr() % ALIGN or buf.data_ptr() + n > storage.data_ptr() + storage.nbytes():
        raise AssertionError("a spilled accumulator must come from an AlignedPool")
    return memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")


KEPT, WRITING, OUT, READING, IN = "kept", "writing", "out", "reading", "in"


class _Spilled:
    """One sum in the scratch file (or on its way there or back)."""

    __slots__ = ("bucket", "acc", "offset", "state", "buf", "transfer", "need")

    def __init__(self, bucket, acc: Accumulator, offset: int) -> None:
        self.bucket, self.acc, self.offset = bucket, acc, offset
        self.state, self.buf, self.transfer = KEPT, acc.buf, None
        # what it holds once read back: the sum and room for its reply (as the push budget counts)
        self.need = bucket.numel * 4 * (1 if acc.pull == "ack" else 2)


class Spill:
    """The scratch file of a node's two-phase sums (see the module's doc). Inactive until
    :meth:`open`; :meth:`put` from the optimizer thread, :meth:`load` from wherever the buffer is
    asked for, :meth:`prefetch` and :meth:`drop` from the event loop."""

    def __init__(self, ctx, pool: AlignedPool, buckets: Callable[[], Iterable]) -> None:
        self.ctx, self.pool, self._buckets = ctx, pool, buckets
        self._engine: IOEngine | None = None
        self._own = False  # the engine is its own (closed with it)
        self._fh: FileHandle | None = None
        self._path: Path | None = None
        self._slots: dict[int, int] = {}  # bucket -> byte offset of its slot
        self._end = 0
        self._recs: dict[int, _Spilled] = {}  # id(acc) -> its record
        self._ahead: deque[_Spilled] = deque()  # to read back, in the order they step
        self._busy = 0  # transfers in flight
        self._reading = 0  # sums being read back (READING)
        self._lock = threading.RLock()
        self._warned = False

    @property
    def active(self) -> bool:
        return self._engine is not None

    def open(self, folder: Path, engine: IOEngine | None) -> None:
        """Spill into ``folder`` through ``engine`` (None: an engine of its own) from now on; the file
        is made at the first spill."""
        self.reset()
        if self._engine is not None:
            return  # (a rollback's new window: the same folder and engine)
        self._own = engine is None
        self._engine = IOEngine(num_threads=2) if engine is None else engine
        self._path = Path(folder) / SCRATCH_FILE

    def busy(self) -> bool:
        """Whether a write or read is in flight (memory is on its way back to the budget)."""
        return self._busy > 0

    # ----------------------------------------------------------------- out
    def put(self, bucket, acc: Accumulator) -> None:
        """``acc``'s sum is complete and waits for COMMIT (on the optimizer thread): it may go to the
        scratch file from now on, at once if a push waits for room (:meth:`relieve`)."""
        if not self.active or acc.buf is None or acc.ticket is None or id(acc) in self._recs:
            return
        with self._lock:
            self._recs[id(acc)] = _Spilled(bucket, acc, self._slot(bucket))
        if self.ctx.inflight.pressed():
            self.relieve()

    def relieve(self) -> None:
        """A push waits for room: write out every complete sum still in RAM, and give its RAM back
        once written."""
        with self._lock:
            for rec in self._recs.values():
                if rec.state == KEPT:
                    self._write(rec)

    def _write(self, rec: _Spilled) -> None:
        rec.state = WRITING
        self._busy += 1
        rec.transfer = self._engine.write(self._fh, rec.offset, _pages(rec.buf), checksum=False)
        rec.transfer.add_done_callback(lambda t: self._written(rec, t))

    def _slot(self, bucket) -> int:
        if self._fh is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            size = sum(align_up(b.numel * 4) for b in self._buckets())
            self._fh = self._engine.open(str(self._path), size)
        off = self._slots.get(bucket.id)
        if off is None:
            off = self._slots[bucket.id] = self._end
            self._end += align_up(bucket.numel * 4)
        return off

    def _written(self, rec: _Spilled, t: Transfer) -> None:
        """(An I/O thread.) The sum is on disk: its RAM goes back, unless it was asked for meanwhile."""
        with self._lock:
            self._busy -= 1
            if t.error is not None:
                if rec.state == WRITING:
                    rec.state, rec.buf = IN, None  # stays in RAM
                self._warn(t.error)
                return
            self.ctx.metrics.spill_written.inc(t.nbytes)
            if rec.state != WRITING:
                return  # asked for while written (load), or dropped: it stays in RAM
            rec.state, buf, rec.buf, rec.acc.buf = OUT, rec.buf, None, None
            self.pool.give(buf)
            self.ctx.inflight.resize(rec.acc.ticket, 0)

    def _warn(self, error: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "node %s: a two-phase step's gradient sum could not be spilled to %s (%s): kept in RAM, "
                "past node.push_memory_bytes (said once)",
                self.ctx.index,
                self._path,
                error,
            )

    # ----------------------------------------------------------------- back
    def is_out(self, acc: Accumulator) -> bool:
        """Whether ``acc``'s sum left RAM (or is leaving): it must be read back before it steps."""
        rec = self._recs.get(id(acc))
        return rec is not None and rec.state in (WRITING, OUT)

    def prefetch(self, pairs: list) -> None:
        """COMMIT: the (bucket, accumulator)s about to step, in that order; read the spilled ones ahead."""
        with self._lock:
            for _, acc in pairs:
                rec = self._recs.get(id(acc))
                if rec is not None and rec.state in (KEPT, WRITING):
                    rec.state, rec.buf = IN, None  # still in RAM: it stays (a write is wasted)
                elif rec is not None and rec.state == OUT:
                    self._ahead.append(rec)
        self.pump()

    def pump(self) -> None:
        """Start reading the next sums back while the push budget has room for them."""
        if not self._ahead:
            return
        with self._lock:
            while self._ahead and self._reading < READ_AHEAD:
                rec = self._ahead[0]
                if rec.state != OUT:
                    self._ahead.popleft()
                    continue
                if not self.ctx.inflight.fits(rec.need):
                    break
                self._ahead.popleft()
                self._read(rec)

    def _read(self, rec: _Spilled) -> None:
        rec.buf, rec.state = self.pool.take(rec.bucket.numel), READING
        self._reading += 1
        self.ctx.inflight.resize(rec.acc.ticket, rec.need)
        self._busy += 1
        rec.transfer = self._engine.read(self._fh, rec.offset, _pages(rec.buf))
        rec.transfer.add_done_callback(self._read_done)

    def _read_done(self, t: Transfer) -> None:
        with self._lock:
            self._busy -= 1
            if t.error is None:
                self.ctx.metrics.spill_read.inc(t.nbytes)

    def load(self, acc: Accumulator) -> torch.Tensor | None:
        """The sum of ``acc`` in RAM (read back now if it is not on its way); None if not spilled."""
        rec = self._recs.get(id(acc))
        if rec is None or rec.state == IN:
            return None
        if rec.state == OUT:
            self._wait_for_room(rec)
        with self._lock:
            if rec.state in (KEPT, WRITING):  # asked for before it was out: it stays
                rec.state, rec.buf = IN, None
                return acc.buf
            if rec.state == OUT:
                if rec in self._ahead:
                    self._ahead.remove(rec)
                self._read(rec)
            t = rec.transfer
        t.wait(max(60.0, self.ctx.cfg.worker_timeout_s))
        with self._lock:
            if rec.state == READING:
                rec.state, acc.buf, rec.buf = IN, rec.buf, None
                self._reading -= 1
        self.pump()
        return acc.buf

    def _wait_for_room(self, rec: _Spilled) -> None:
        """A sum needed now waits a little for room (replies leaving, the read ahead started it)."""
        budget = self.ctx.inflight
        deadline = time.monotonic() + ROOM_WAIT_S
        budget.urgent += rec.need  # (no fetch answer or new push takes the room it waits for)
        try:
            while rec.state == OUT and not budget.fits(rec.need, urgent=True):
                if time.monotonic() > deadline:  # read past the budget: the step needs it (counted)
                    self.ctx.metrics.inflight_overdrafts.labels("sum").inc()
                    return
                time.sleep(0.002)
        finally:
            budget.urgent -= rec.need

    def drop(self, acc: Accumulator) -> None:
        """``acc`` is given back (its step applied or skipped): forget its slot's contents."""
        with self._lock:
            rec = self._recs.pop(id(acc), None)
            if rec is None:
                return
            if rec in self._ahead:
                self._ahead.remove(rec)
            t = rec.transfer
        if t is not None:
            _settled(t)  # (the slot is reused by the bucket's next step; its buffer is given back)
        with self._lock:
            if rec.buf is not None and rec.buf is not acc.buf:
                self.pool.give(rec.buf)
            self._reading -= rec.state == READING
            rec.buf, rec.state = None, IN
        self.pump()

    # ----------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Forget every spilled sum (a rollback replaced the buckets and their accumulators)."""
        with self._lock:
            recs, self._recs = list(self._recs.values()), {}
            self._ahead.clear()
            self._reading = 0
        for rec in recs:
            if rec.transfer is not None:
                _settled(rec.transfer)

    def close(self) -> None:
        """Stop spilling; the scratch file goes (after the engine's requests in flight)."""
        self.reset()
        if self._fh is not None:
            os.close(self._fh.fd)
            self._fh = None
            self._path.unlink(missing_ok=True)
        if self._own and self._engine is not None:
            self._engine.close()
        self._engine, self._slots, self._end = None, {}, 0


def _settled(t: Transfer) -> None:
    try:
        t.wait(60.0)
    except Exception:  # noqa: BLE001 -- a failed transfer of a sum no longer needed
        pass

"""Memory as a window over a shard's state files: read ahead, step, write back, commit.

The node knows the order in which its buckets will step (layout, push priority, the units' fetch
order in streaming mode). :class:`StateWindow` keeps at most ``budget_bytes`` of bucket slots in
RAM, all of it in one :class:`BufferPool` allocated once: while the caller steps bucket k, the
slots of k+1..k+d are being read (as far ahead as the budget allows, or ``readahead`` buckets) and
the slot of k-1 written back, by the :class:`IOEngine`'s threads, so the disk works while the
caller computes.

``acquire(b)`` returns bucket b's tensors (views into the pool) once they are read; ``release(b,
version)`` starts writing them into the slot that does not hold b's committed version; when the
write completes, a committer thread makes it durable (``StateFile.commit``: data synced, then the
journal record), at most every ``commit_interval_s``, so that the buckets written meanwhile share
the two syncs; ``flush`` commits at once. A bucket's next write waits for its previous commit, so
one of its two slots always holds a committed version (with ``keep_step``, also until its other
slot does not hold the step all buckets hold: StateFile.may_overwrite). A slot whose write
completed stays in RAM as a clean copy until its memory is needed by a bucket that will step sooner
(the one needed furthest ahead goes first), so a shard that fits the budget is read once; a slot
whose memory is lent to a reply in flight (:mod:`.lend`) stays until the reply lets go of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from luwu.protocol.errors import ConfigError, CorruptCheckpointError, LuwuError, NodeTimeoutError
from luwu.switch_nodes.ooc.io import ALIGN, BufferPool, Extent, Transfer
from luwu.switch_nodes.ooc.layout import DTYPES
from luwu.switch_nodes.ooc.state_file import Commit, StateFile

log = logging.getLogger(__name__)

READING, READY, HELD, WRITING, FAILED = "reading", "ready", "held", "writing", "failed"
MOVING = (READING, WRITING)
#: group commit: at most one journal commit (a data sync, then a journal sync) per interval, shared by
#: every bucket written meanwhile; each sync flushes the device's cache, which stalls the writes in
#: flight, so fewer of them stream faster, and a step is durable this much later at most
DEFAULT_COMMIT_INTERVAL_S = 0.05
VERIFY_MODES = ("first", "always", "never")


@dataclass(slots=True)
class BucketView:
    """A bucket's state in RAM between ``acquire`` and ``release``: ``version`` is the newest version
    written (None: never committed, the tensors are zeros), ``tensors`` its slot's tensors by name (views
    into the window's memory: valid until the bucket is released)."""

    bucket: int
    version: int | None
    tensors: dict[str, torch.Tensor]


@dataclass(slots=True)
class WindowStats:
    """Counters of a window's work: what was read and written, how often an acquire found its bucket
    already read or being read (``hits``) or had to start the read itself (``misses``), and how long
    acquires waited for the disk (``stall_s``)."""

    reads: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    stall_s: float = 0.0
    commits: int = 0
    commit_batches: int = 0
    evictions: int = 0


@dataclass(slots=True, eq=False)
class _Entry:
    bucket: int
    extent: Extent
    state: str
    error: BaseException | None = None
    write_version: int = -1
    deferred: bool = False  # released while its previous commit is not durable: written after it
    pins: int = 0  # its memory lent to replies in flight (:mod:`.lend`): not evicted meanwhile


class StateWindow:
    """At most ``budget_bytes`` of ``state``'s bucket slots in RAM, read ahead in ``order``.

    ``verify``: check a slot's data against its checksum when it is read for the first time since the
    state was opened (``"first"``: a restart verifies what it loads), on every read (``"always"``), or
    never. ``timeout_s`` bounds every wait on the disk; ``commit_interval_s`` spaces the commits
    (group commit, see :data:`DEFAULT_COMMIT_INTERVAL_S`); ``keep_step``: see the module's doc (buckets
    that step in lockstep: one stepping twice alone would wait). Called from the node's optimizer thread
    (and the event loop's seeds, never of the same bucket); the I/O and commit threads report back
    through a lock of its own."""

    def __init__(
        self,
        state: StateFile,
        order: Sequence[int],
        budget_bytes: int,
        *,
        readahead: int = 0,
        verify: str = "first",
        timeout_s: float = 60.0,
        commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S,
        keep_step: bool = False,
    ):
        biggest = max((b.slot_bytes for b in state.layout.buckets), default=ALIGN)
        if budget_bytes < biggest:
            raise ConfigError(
                f"the state window ({budget_bytes} B: node.state_memory_bytes less node.push_memory_bytes) is less than one bucket's state ({biggest} B): raise node.state_memory_bytes (3 buckets or more let reads, steps and writes overlap)"
            )
        if verify not in VERIFY_MODES:
            raise ConfigError(f"state window verify={verify!r}: one of {VERIFY_MODES}")
        if commit_interval_s < 0:
            raise ConfigError(f"state window commit_interval_s={commit_interval_s}: 0 or more")
        if readahead < 0:
            raise ConfigError(
                f"state window readahead={readahead}: 0 (as far as the budget allows) or more"
            )
        self.state, self.readahead, self.verify = state, readahead, verify
        self.keep_step = keep_step
        self.timeout_s, self.commit_interval_s = timeout_s, commit_interval_s
        self.stats = WindowStats()
        self._pool = BufferPool(budget_bytes // ALIGN * ALIGN)
        self._latest: dict[int, Commit | None] = dict(state.committed)  # committed or written
        self._entries: dict[int, _Entry] = {}
        self._pending: set[int] = set()  # written, commit not durable yet
        self._verified: set[int] = set()
        self._failure: BaseException | None = None
        self._cond = threading.Condition(threading.RLock())
        self._order: list[int] = []
        self._pos: dict[int, int] = {}
        self._cursor = -1
        self._wanted: dict[int, int] = {}  # buckets acquires wait for (how many): never evicted
        self._commits: queue.SimpleQueue = queue.SimpleQueue()
        self._commit_now = threading.Event()  # flush and close: commit without waiting the interval
        self._committer = threading.Thread(
            target=self._commit_loop, name="luwu-ooc-commit", daemon=True
        )
        self._committer.start()
        self.set_order(order)

    # ------------------------------------------------------------------------ the caller's side
    @property
    def budget_bytes(self) -> int:
        return self._pool.capacity

    @property
    def resident_bytes(self) -> int:
        return self._pool.used_bytes

    @property
    def peak_resident_bytes(self) -> int:
        return self._pool.peak_bytes

    def committed_version(self, bucket: int) -> int | None:
        """The version of ``bucket`` that survives a crash now (None: none)."""
        c = self.state.committed[bucket]
        return None if c is None else c.version

    def set_order(self, order: Sequence[int]) -> None:
        """The order in which buckets will step from now on (cyclic); read-ahead follows it."""
        order = list(order)
        for b in order:
            self.state.layout.index(b)
        if len(set(order)) != len(order):
            raise ValueError(f"state window order names a bucket twice: {order}")
        with self._cond:
            cur = self._order[self._cursor] if 0 <= self._cursor < len(self._order) else None
            self._order, self._pos = order, {b: i for i, b in enumerate(order)}
            self._cursor = self._pos.get(cur, -1)
            self._pump()

    def acquire(self, bucket: int) -> BucketView:
        """Bucket ``bucket``'s state in RAM, once read (at once when read ahead)."""
        spec = self.state.layout.bucket(bucket)
        t0 = time.monotonic()
        with self._cond:
            self._check_failure()
            if bucket in self._pos:
                self._cursor = self._pos[bucket]
            e = self._entries.get(bucket)
            if e is not None and e.state == HELD:
                raise RuntimeError(f"out-of-core state: bucket {bucket} is acquired already")
            if e is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            self._wanted[bucket] = self._wanted.get(bucket, 0) + 1
            try:
                e = self._wait_ready(bucket, t0 + self.timeout_s)
            finally:
                if self._wanted[bucket] == 1:
                    del self._wanted[bucket]
                else:
                    self._wanted[bucket] -= 1
            e.state = HELD
            self._pump()
            self.stats.stall_s += time.monotonic() - t0
            latest = self._latest[bucket]
        ts = {
            t.name: e.extent.tensor(off, t.numel, DTYPES[t.dtype])
            for t, off in zip(spec.tensors, spec.offsets())
        }
        return BucketView(bucket, None if latest is None else latest.version, ts)

    def release(self, bucket: int, version: int | None = None) -> None:
        """Give bucket ``bucket`` back. With ``version`` (greater than its last), its tensors were stepped:
        they are written back and committed as that version. Without, they are unchanged."""
        with self._cond:
            self._check_failure()
            e = self._entries.get(bucket)
            if e is None or e.state != HELD:
                raise RuntimeError(
                    f"out-of-core state: bucket {bucket} released without being acquired"
                )
            if version is None:
                e.state = READY
            else:
                latest = self._latest[bucket]
                if latest is not None and version <= latest.version:
                    e.state = READY
                    raise ValueError(
                        f"out-of-core state: bucket {bucket} released as version {version}, not past its version {latest.version}"
                    )
                e.state, e.write_version = WRITING, version
                e.deferred = True
                self._start_deferred()
            self._cond.notify_all()
            self._pump()

    def discard(self, bucket: int) -> None:
        """Give bucket ``bucket`` back without keeping its tensors in RAM: they may be half changed (a step
        that failed); the next acquire reads its newest written version again."""
        with self._cond:
            e = self._entries.pop(bucket)
            assert e.state == HELD, f"out-of-core state: bucket {bucket} discarded, not acquired"
            self._pool.free(e.extent)
            self._cond.notify_all()
            self._pump()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether tensor ``t`` lies in the window's memory (it changes once its bucket is released)."""
        return t.untyped_storage().data_ptr() == self._pool.storage_ptr

    def flush(self) -> None:
        """Wait until every write-back is committed (durable)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._pending or any(e.state == WRITING for e in self._entries.values()):
                self._check_failure()
                self._commit_now.set()
                self._wait(deadline, None, "write-backs to be committed")
            self._check_failure()

    def close(self) -> None:
        """Commit what was written, stop the committer and unmap the memory (the state and engine stay open)."""
        try:
            if self._failure is None:
                self.flush()
        finally:
            self._commits.put(None)
            self._commit_now.set()
            self._committer.join(self.timeout_s)
            with self._cond:
                self._entries.clear()
            self._pool.close()

    def stats_dict(self) -> dict:
        return asdict(self.stats) | {
            "peak_resident_bytes": self.peak_resident_bytes,
            "budget_bytes": self.budget_bytes,
        }

    # ------------------------------------------------------------------------ scheduling (under the lock)
    def _wait_ready(self, bucket: int, deadline: float) -> _Entry:
        while True:
            self._check_failure()
            e = self._entries.get(bucket)
            if e is None:
                e = self._start_read(bucket, evict_beyond=-1)
                if e is None:
                    if not any(x.state in MOVING or x.pins for x in self._entries.values()):
                        held = sorted(b for b, x in self._entries.items() if x.state == HELD)
                        raise ConfigError(
                            f"out-of-core state: bucket {bucket} ({self.state.layout.bucket(bucket).slot_bytes} B) does not fit node.state_memory_bytes="
                            f"{self.budget_bytes} beside the buckets held ({held}): raise it or release buckets first"
                        )
                    self._wait(deadline, bucket, "memory to read it into")
                    continue
            if e.state == READY:
                return e
            if e.state == FAILED:
                del self._entries[bucket]
                self._pool.free(e.extent)
                raise e.error
            self._wait(deadline, bucket, f"its slot ({e.state})")

    def _wait(self, deadline: float, bucket: int | None, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not self._cond.wait(left) and time.monotonic() >= deadline:
            raise NodeTimeoutError(
                f"out-of-core state in {self.state.folder}: bucket {bucket}: waited {self.timeout_s} s for {what} (disk stalled?)",
                bucket=bucket,
            )

    def _distance(self, bucket: int) -> int:
        """How many steps ahead ``bucket`` is needed next (the bucket just stepped: a whole cycle)."""
        p = self._pos.get(bucket)
        if p is None:
            return len(self._order) + 1
        return (p - self._cursor) % len(self._order) or len(self._order)

    def _alloc(self, nbytes: int, evict_beyond: int) -> Extent | None:
        """Memory for a slot, evicting clean slots needed later than ``evict_beyond`` steps ahead; None
        when even evicting them all would not make room now (then none is evicted). One whose eviction
        alone makes room goes first (the one needed furthest ahead of those); otherwise the furthest."""
        ext = self._pool.alloc(nbytes)
        if ext is not None:
            return ext
        clean = [
            e
            for e in self._entries.values()
            if e.state == READY
            and e.bucket not in self._wanted
            and not e.pins
            and self._distance(e.bucket) > evict_beyond
        ]
        if not self._pool.fits_after_freeing(nbytes, [e.extent for e in clean]):
            return None
        clean.sort(key=lambda e: self._distance(e.bucket), reverse=True)
        while ext is None:
            victim = next(
                (e for e in clean if self._pool.fits_after_freeing(nbytes, [e.extent])), clean[0]
            )
            clean.remove(victim)
            del self._entries[victim.bucket]
            self._pool.free(victim.extent)
            self.stats.evictions += 1
            ext = self._pool.alloc(nbytes)
        return ext

    def _start_read(self, bucket: int, evict_beyond: int) -> _Entry | None:
        spec = self.state.layout.bucket(bucket)
        ext = self._alloc(spec.slot_bytes, evict_beyond)
        if ext is None:
            return None
        latest = self._latest[bucket]
        if latest is None:  # never committed: zeros, no read
            ext.data.zero_()
            e = self._entries[bucket] = _Entry(bucket, ext, READY)
            return e
        e = self._entries[bucket] = _Entry(bucket, ext, READING)
        check = self.verify == "always" or (self.verify == "first" and bucket not in self._verified)
        self.stats.reads += 1
        self.stats.bytes_read += spec.slot_bytes
        t = self.state.read_slot(bucket, latest.slot, ext.view, checksum=check)
        t.add_done_callback(lambda t: self._on_read(e, latest, check, t))
        return e

    def _pump(self) -> None:
        """Start reading the buckets acquires wait for (the event loop may seed one while the optimizer
        thread steps another), then the next buckets of the order that are not in RAM, while memory
        allows (read-ahead never takes memory a waiting acquire needs)."""
        if self._failure is not None:
            return
        for w in list(self._wanted):
            if w not in self._entries and self._start_read(w, evict_beyond=-1) is None:
                return
        n = len(self._order)
        if not n:
            return
        ahead = n if self._cursor < 0 else n - 1
        if self.readahead:
            ahead = min(ahead, self.readahead)
        for j in range(1, ahead + 1):
            b = self._order[(self._cursor + j) % n]
            if b not in self._entries and self._start_read(b, evict_beyond=j) is None:
                break

    def _start_write(self, e: _Entry) -> None:
        latest = self._latest[e.bucket]
        slot = 0 if latest is None else 1 - latest.slot
        self.stats.writes += 1
        self.stats.bytes_written += e.extent.nbytes
        t = self.state.write_slot(e.bucket, slot, e.extent.view)
        t.add_done_callback(lambda t: self._on_written(e, slot, t))

    # ------------------------------------------------------------------------ I/O and commit threads
    def _on_read(self, e: _Entry, c: Commit, checked: bool, t: Transfer) -> None:
        with self._cond:
            if t.error is not None:
                e.state, e.error = (
                    FAILED,
                    LuwuError(
                        f"out-of-core state: reading bucket {e.bucket} (slot {c.slot}, version {c.version}) from {t.fh.path} failed: {t.error}",
                        bucket=e.bucket,
                    ),
                )
            elif checked and t.checksum != c.checksum:
                e.state = FAILED
                e.error = CorruptCheckpointError(
                    f"out-of-core state {t.fh.path}: bucket {e.bucket} slot {c.slot} (version {c.version}) holds data of checksum {t.checksum:#010x}, "
                    f"its journal record says {c.checksum:#010x}: the disk corrupted it; restore the state folder from a copy",
                    bucket=e.bucket,
                )
            else:
                e.state = READY
                if checked:
                    self._verified.add(e.bucket)
            self._cond.notify_all()
            self._pump_from_io()

    def _on_written(self, e: _Entry, slot: int, t: Transfer) -> None:
        with self._cond:
            if t.error is not None:
                self._failure = self._failure or t.error
                e.state, e.error = FAILED, t.error
            else:
                c = Commit(e.bucket, slot, e.write_version, t.checksum)
                self._latest[e.bucket] = c
                self._pending.add(e.bucket)
                self._verified.add(e.bucket)
                e.state = READY
                self._commits.put(c)
            self._cond.notify_all()
            self._pump_from_io()

    def _pump_from_io(self) -> None:
        """:meth:`_pump` in an I/O thread: an error (the engine closed under the window) goes to the
        caller's thread, not to the thread pool, where it would be lost and the caller left waiting."""
        try:
            self._pump()
        except Exception as exc:  # noqa: BLE001 -- handed to the caller's thread
            self._failure = self._failure or exc
            self._cond.notify_all()

    def _commit_loop(self) -> None:
        """Commit what was written, every ``commit_interval_s`` at most, all of it in one batch. A
        failure is sticky: every later call of the window raises it."""
        try:
            last = -float("inf")
            while True:
                c = self._commits.get()
                if c is None:
                    return
                wait = last + self.commit_interval_s - time.monotonic()
                if wait > 0:
                    self._commit_now.wait(wait)
                self._commit_now.clear()
                batch, stop = self._drain(c)
                last = time.monotonic()
                self.state.commit(batch)
                self._committed(batch)
                if stop:
                    return
        except Exception as exc:  # noqa: BLE001 -- handed to the caller's thread
            with self._cond:
                self._failure = self._failure or exc
                self._cond.notify_all()

    def _drain(self, first: Commit) -> tuple[list[Commit], bool]:
        """``first`` and every commit queued after it; whether the stop sign came too."""
        batch = [first]
        while True:
            try:
                c = self._commits.get_nowait()
            except queue.Empty:
                return batch, False
            if c is None:
                return batch, True
            batch.append(c)

    def _committed(self, batch: list[Commit]) -> None:
        with self._cond:
            for c in batch:
                self._pending.discard(c.bucket)
            self._start_deferred()
            self.stats.commits += len(batch)
            self.stats.commit_batches += 1
            self._cond.notify_all()

    def _start_deferred(self) -> None:
        """Start the deferred writes that may go now (see the module's doc)."""
        for e in list(self._entries.values()):
            go = e.deferred and e.bucket not in self._pending
            if go and (not self.keep_step or self.state.may_overwrite(e.bucket)):
                e.deferred = False
                self._start_write(e)

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise LuwuError(
                f"out-of-core state in {self.state.folder}: a write-back or commit failed ({self._failure}); restart the node from its state files"
            ) from self._failure

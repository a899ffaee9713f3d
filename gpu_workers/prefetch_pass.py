"""One pass of a Prefetcher over its source: the producer threads and the batches held ahead.

A pass owns the source iterator of one epoch. Its threads fetch batches under a
lock (iterators are not thread-safe), number them in fetch order, run the
transfer (pinning, device copy) outside the lock, and post them; the training
loop takes them by number, so order is the source's whatever the number of
threads. At most ``depth`` batches are held and no new fetch starts while the
ready ones total ``max_bytes``. A loader's exception is posted in place of its
batch and raised in the training loop.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from luwu.gpu_workers.batches import CudaCopy, HostCopy, batch_nbytes
from luwu.gpu_workers.config import PrefetchConfig

log = logging.getLogger(__name__)


class Item:
    """A fetched batch (or the error that took its place), with its size, copy event and source state."""

    __slots__ = ("batch", "error", "nbytes", "event", "source_state")

    def __init__(self, batch=None, error=None, nbytes=0, event=None, source_state=None):
        self.batch, self.error, self.nbytes, self.event, self.source_state = (
            batch,
            error,
            nbytes,
            event,
            source_state,
        )


_LIVE: weakref.WeakSet[PrefetchPass] = weakref.WeakSet()


class PrefetchPass:
    """One pass over the source: its producer threads and the batches they hold ahead.

    The threads reference this object only, never the Prefetcher or the
    iterator handed to the training loop, so dropping that iterator (``break``,
    an exception unwinding the loop, ``del``) lets it be collected, which closes
    the pass. Batches are numbered in fetch order under the source lock; the
    consumer takes them by number, so several threads never reorder them.
    """

    def __init__(
        self,
        it: Iterator,
        *,
        skip: int,
        owned: bool,
        stop_workers: bool,
        cfg: PrefetchConfig,
        transfer: CudaCopy | HostCopy | None,
        snapshot: Callable[[], Any] | None,
        metrics: types.SimpleNamespace,
    ):
        self._it: Iterator | None = it
        self._owned = owned  # we called iter() and got a new object: ours to close
        self._stop_workers = (
            stop_workers  # a DataLoader iterator whose worker processes die with the pass
        )
        self._to_skip = skip
        self._cfg = cfg
        self._transfer = transfer
        self._snapshot = snapshot  # source.state_dict, or None
        self._m = metrics
        self._cond = threading.Condition()
        self._source_lock = threading.Lock()
        self._ready: dict[int, Item] = {}
        self._held = 0  # batches being fetched or ready: bounded by depth
        self._bytes = 0  # bytes of the ready batches: bounded by max_bytes
        self._next_fetch = 0
        self._next_take = 0
        self._end: int | None = None  # number of the first batch that does not exist
        self.end_state: Any = None  # source state after its last batch
        self._fatal: BaseException | None = None
        self.closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"luwu-prefetch-{cfg.name}-{i}", daemon=True)
            for i in range(cfg.num_threads)
        ]

    def start(self) -> None:
        _LIVE.add(self)
        for t in self._threads:
            t.start()

    @property
    def finished(self) -> bool:
        """The source ran out (or failed) and every batch before that was taken."""
        return self._end is not None and self._next_take >= self._end

    # -- producer side

    def _stopping(self) -> bool:
        return self.closed or self._end is not None

    def _run(self) -> None:
        try:
            while self._fetch_one():
                pass
        except (
            BaseException
        ) as exc:  # a bug here, not in the source: surface it, never hang the consumer
            log.exception("prefetch %s: producer thread failed", self._cfg.name)
            with self._cond:
                self._fatal = exc
                self._cond.notify_all()

    def _fetch_one(self) -> bool:
        cfg = self._cfg
        with self._cond:
            while not self._stopping() and (
                self._held >= cfg.depth or (self._held > 0 and self._bytes >= cfg.max_bytes)
            ):
                self._cond.wait()
            if self._stopping():
                return False
            self._held += 1
        with self._source_lock:
            if self._stopping():
                self._give_back_slot()
                return False
            try:
                while (
                    self._to_skip > 0 and not self.closed
                ):  # resuming: drop what was consumed before
                    next(self._it)
                    self._to_skip -= 1
                index = self._next_fetch
                batch = next(self._it)
                state = self._snapshot() if self._snapshot is not None else None
                self._next_fetch += 1
            except StopIteration:
                try:
                    self.end_state = self._snapshot() if self._snapshot is not None else None
                except BaseException as exc:
                    self._post(self._next_fetch, Item(error=exc))
                    return False
                with self._cond:
                    self._end = self._next_fetch
                    self._held -= 1
                    self._cond.notify_all()
                return False
            except BaseException as exc:  # the loader's error, raised in the training loop
                self._post(self._next_fetch, Item(error=exc))
                return False
        try:
            if self._transfer is not None:
                batch, event = self._transfer(batch)
            else:
                event = None
        except BaseException as exc:
            self._post(index, Item(error=exc))
            return False
        return self._post(index, Item(batch, None, batch_nbytes(batch), event, state))

    def _give_back_slot(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    def _post(self, index: int, item: Item) -> bool:
        with self._cond:
            if self.closed:
                self._held -= 1
                return False
            if item.error is not None:
                self._end = index + 1 if self._end is None else min(self._end, index + 1)
            self._ready[index] = item
            self._bytes += item.nbytes
            if item.error is None:
                self._m.produced.inc()
            self._m.depth.set(len(self._ready))
            self._m.bytes.set(self._bytes)
            self._cond.notify_all()
            return item.error is None

    # -- consumer side

    def take(self) -> Item | None:
        """The next batch in order; None when the pass is over (source ran out, or closed)."""
        timeout_s = self._cfg.timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                item = self._ready.pop(self._next_take, None)
                if item is not None:
                    break
                if self.closed or self.finished:
                    return None
                if self._fatal is not None:
                    raise self._fatal
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"prefetch {self._cfg.name}: no batch {self._next_take} of this pass after "
                            f"{timeout_s} s (prefetch.timeout_s); the loader is stuck or slower than that"
                        )
                    self._cond.wait(remaining)
            self._next_take += 1
            self._held -= 1
            self._bytes -= item.nbytes
            self._m.depth.set(len(self._ready))
            self._m.bytes.set(self._bytes)
            self._cond.notify_all()
        return item

    def hand_over(self, item: Item) -> None:
        if item.event is not None:
            self._transfer.hand_over(item.batch, item.event)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the threads and let go of the source iterator (a DataLoader's then shuts its workers)."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._ready.clear()
            self._bytes = 0
            self._cond.notify_all()
        self._m.depth.set(0)
        self._m.bytes.set(0)
        _LIVE.discard(self)
        me = threading.current_thread()
        deadline = time.monotonic() + (
            self._cfg.shutdown_timeout_s if timeout_s is None else timeout_s
        )
        for t in self._threads:
            if t is not me and t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._threads if t.is_alive()]
        it, self._it = self._it, None
        if busy:
            # A thread is inside the source's next() (or close ran on one of ours,
            # from gc): it holds its own reference and exits once next() returns.
            if me not in self._threads:
                log.warning(
                    "prefetch %s: threads %s still inside the source's next(); left to finish",
                    self._cfg.name,
                    busy,
                )
        elif self._owned and isinstance(it, types.GeneratorType):
            it.close()  # run the generator's finally blocks now, not at some later gc
        elif self._stop_workers:
            # Stop the DataLoader's workers now, as Lightning does. Left to gc, an
            # iterator kept alive by a loader error's traceback (a reference cycle)
            # waits 5 s per worker in its __del__ before terminating them.
            it._shutdown_workers()  # type: ignore[union-attr]


@atexit.register
def _close_all_at_exit() -> None:
    for p in list(_LIVE):
        p.close(timeout_s=1.0)

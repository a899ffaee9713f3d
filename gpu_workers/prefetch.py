"""Async data prefetch: the training loop should never wait for the loader.

Background threads pull batches from any iterable (a ``DataLoader`` with
worker processes, a generator, a list) while the training step runs, holding at
most ``depth`` batches and about ``max_bytes`` of tensors ahead of it. With a
CUDA device the threads also pin the batch and copy it on a side stream, so the
copy of batch t+1 overlaps the compute on batch t. Order is exactly the
source's order, whatever the number of threads.

Fitting it with ``RemoteOptimizer``: with ``delayed_update=True`` the
optimizer's ``step()`` returns at once and the new weights land before the next
forward; the Prefetcher has the next batch ready (and already on the device) by
then, so neither the node round trip nor the loader sits on the critical path.
The optimizer's per-step breakdown reads ``prefetcher.last_wait_s`` (seconds the
last ``next()`` waited) as "waiting for data".

Resuming: ``state_dict()`` records the batches *consumed* in the current epoch
(not those fetched ahead) and the epoch number. A plain re-iterable source is
resumed by skipping the consumed batches on the next pass, which is exact when
the source yields the same order for the same epoch (no shuffle, or a sampler
seeded per epoch: call ``sampler.set_epoch(prefetcher.epoch)`` before each
pass). A source with its own ``state_dict``/``load_state_dict`` (a
sampler-aware loader such as torchdata's ``StatefulDataLoader``) is asked for
its state right after each batch is fetched; the state saved is the one taken
after the last *consumed* batch, and loading restores the source from it
instead of skipping.
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import DataLoader

from luwu.protocol.errors import ConfigError
from luwu.protocol.metrics import MetricsFactory

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30


@dataclass(kw_only=True, slots=True)
class PrefetchConfig:
    depth: int = 2
    """Batches held ahead of the training loop (being fetched or ready). Two hide one
    slow batch behind one step; more only help when load times vary."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Budget for the tensors held ahead: no new fetch starts while the ready batches
    total this much, so at most max_bytes plus one batch is held. Batches a
    DataLoader keeps in its own workers (its prefetch_factor) are not counted."""
    num_threads: int = 1
    """Threads pulling from the source. Its next() is serialised (iterators are not
    thread-safe); extra threads overlap the pinning and device copy of one batch
    with the fetch of the next."""
    pin_memory: bool | None = None
    """Copy batches into pinned host memory (needed for a copy that does not block the
    host). None: on when the device is CUDA."""
    device: str | None = None
    """Where batches go ('cuda', 'cuda:1'); None leaves them where the loader put them."""
    timeout_s: float | None = None
    """Longest a next() waits for a batch before raising TimeoutError; None waits as
    long as the loader takes (like DataLoader's timeout=0)."""
    shutdown_timeout_s: float = 10.0
    """How long close() waits for a thread stuck inside the source's next(); past it
    the (daemon) thread is left to finish on its own and a warning is logged."""
    name: str = "train"
    """Value of the ``loader`` label of the metrics, telling loaders that share a
    registry apart (train, val)."""

    def __post_init__(self) -> None:
        for field in ("depth", "max_bytes", "num_threads"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"prefetch.{field} must be an int >= 1, got {value!r}")
        if self.num_threads > self.depth:
            raise ConfigError(
                f"prefetch.num_threads must be <= depth ({self.depth}), got {self.num_threads!r}: "
                "a thread beyond depth never gets a slot"
            )
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ConfigError(f"prefetch.pin_memory must be true, false or unset, got {self.pin_memory!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"prefetch.device must name a torch device, got {self.device!r}") from exc
        if self.timeout_s is not None and not _positive_finite(self.timeout_s):
            raise ConfigError(f"prefetch.timeout_s must be > 0 and finite, or unset, got {self.timeout_s!r}")
        if not (_positive_finite(self.shutdown_timeout_s) or self.shutdown_timeout_s == 0):
            raise ConfigError(f"prefetch.shutdown_timeout_s must be >= 0 and finite, got {self.shutdown_timeout_s!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"prefetch.name must be a non-empty string, got {self.name!r}")


def _positive_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# ---------------------------------------------------------------- batch trees


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch: a tensor, or nested dicts/lists/tuples of them."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def batch_nbytes(batch: Any) -> int:
    """Bytes of the tensors (and numpy arrays) in a batch; other leaves count 0."""
    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, (Mapping, list, tuple)):
        values = batch.values() if isinstance(batch, Mapping) else batch
        return sum(batch_nbytes(v) for v in values)
    if isinstance(batch, torch.Tensor):
        return batch.nelement() * batch.element_size()
    return 0


def _map_tensors(batch: Any, fn) -> Any:
    """The batch with ``fn`` applied to every tensor, containers rebuilt with their own type."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, MutableMapping):
        out = copy.copy(batch)  # keeps the type and e.g. a defaultdict's factory
        out.update({k: _map_tensors(v, fn) for k, v in batch.items()})
        return out
    if isinstance(batch, Mapping):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


# ---------------------------------------------------------------- transfers


class _CudaCopy:
    """Pins a batch and copies it to a CUDA device on a side stream, in a producer thread.

    The consumer's stream waits on an event recorded after the copy (no host
    sync), and ``record_stream`` tells the caching allocator that the consumer's
    stream uses the memory, which was allocated on the side stream: without it
    the allocator could hand the block to the next batch's copy while the
    training step still reads it. The pinned source buffers are safe to drop
    after a non-blocking copy: the caching host allocator keeps them until the
    copy's event completes.
    """

    def __init__(self, device: torch.device, pin: bool):
        assert device.type == "cuda" and device.index is not None
        self.device = device
        self.pin = pin
        self._local = threading.local()  # one side stream per producer thread

    def __call__(self, batch: Any) -> tuple[Any, Any]:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)
        # The current device is per host thread: name it, never inherit device 0.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            out = _map_tensors(batch, self._copy)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def hand_over(self, batch: Any, event: Any) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for t in _tensors(batch):
            if t.device == self.device:
                t.record_stream(stream)


class _HostCopy:
    """Pins (for a later copy by the caller) and/or moves batches to a non-CUDA device."""

    def __init__(self, device: torch.device | None, pin: bool):
        self.device = device
        self.pin = pin

    def __call__(self, batch: Any) -> tuple[Any, None]:
        return _map_tensors(batch, self._copy), None

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t if self.device is None else t.to(self.device)

    def hand_over(self, batch: Any, event: None) -> None:
        pass


# ---------------------------------------------------------------- metrics


class _Metrics:
    """The prefetch metrics of one registry; loaders sharing it differ by the ``loader`` label."""

    def __init__(self, registry: CollectorRegistry):
        f = MetricsFactory("prefetch", registry)
        label = ("loader",)
        self.wait = f.histogram("data_wait_seconds", "Seconds the training loop waited in next() for a batch.", label)
        self.stall = f.gauge(
            "stall_fraction", "Share of the step time spent waiting for data, over the current epoch.", label
        )
        self.depth = f.gauge("queue_depth_batches", "Batches fetched ahead and ready.", label)
        self.bytes = f.gauge("queue_bytes", "Bytes of the batches fetched ahead and ready.", label)
        self.produced = f.counter("batches_produced_total", "Batches fetched from the source.", label)
        self.consumed = f.counter("batches_consumed_total", "Batches handed to the training loop.", label)

    def child(self, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(**{k: getattr(self, k).labels(loader=name) for k in vars(self)})


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


def _metrics_for(registry: CollectorRegistry, name: str) -> types.SimpleNamespace:
    with _METRICS_LOCK:
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = _METRICS[registry] = _Metrics(registry)
    return metrics.child(name)


# ---------------------------------------------------------------- one pass


class _Item:
    __slots__ = ("batch", "error", "nbytes", "event", "source_state")

    def __init__(self, batch=None, error=None, nbytes=0, event=None, source_state=None):
        self.batch, self.error, self.nbytes, self.event, self.source_state = batch, error, nbytes, event, source_state


_LIVE: weakref.WeakSet[_Pass] = weakref.WeakSet()


class _Pass:
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
        transfer: _CudaCopy | _HostCopy | None,
        snapshot: Callable[[], Any] | None,
        metrics: types.SimpleNamespace,
    ):
        self._it: Iterator | None = it
        self._owned = owned  # we called iter() and got a new object: ours to close
        self._stop_workers = stop_workers  # a DataLoader iterator whose worker processes die with the pass
        self._to_skip = skip
        self._cfg = cfg
        self._transfer = transfer
        self._snapshot = snapshot  # source.state_dict, or None
        self._m = metrics
        self._cond = threading.Condition()
        self._source_lock = threading.Lock()
        self._ready: dict[int, _Item] = {}
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
        except BaseException as exc:  # a bug here, not in the source: surface it, never hang the consumer
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
                while self._to_skip > 0 and not self.closed:  # resuming: drop what was consumed before
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
                    self._post(self._next_fetch, _Item(error=exc))
                    return False
                with self._cond:
                    self._end = self._next_fetch
                    self._held -= 1
                    self._cond.notify_all()
                return False
            except BaseException as exc:  # the loader's error, raised in the training loop
                self._post(self._next_fetch, _Item(error=exc))
                return False
        try:
            if self._transfer is not None:
                batch, event = self._transfer(batch)
            else:
                event = None
        except BaseException as exc:
            self._post(index, _Item(error=exc))
            return False
        return self._post(index, _Item(batch, None, batch_nbytes(batch), event, state))

    def _give_back_slot(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    def _post(self, index: int, item: _Item) -> bool:
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

    def take(self) -> _Item | None:
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

    def hand_over(self, item: _Item) -> None:
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
        deadline = time.monotonic() + (self._cfg.shutdown_timeout_s if timeout_s is None else timeout_s)
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
                    "prefetch %s: threads %s still inside the source's next(); left to finish", self._cfg.name, busy
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


# ---------------------------------------------------------------- the face


class Prefetcher:
    """Iterates ``iterable`` with batches fetched ahead in background threads.

    ``for batch in prefetcher`` is one epoch of the wrapped iterable; iterating
    again starts the next. ``len()`` is the wrapped iterable's. Leaving the loop
    early (``break``, an exception) or dropping the iterator stops the threads;
    so do ``close()`` and leaving a ``with`` block. A loader exception is raised
    in the training loop as the same object, with its original traceback.

    The arguments are the fields of :class:`PrefetchConfig` (documented there);
    ``registry`` receives the metrics (default: a private one, ``self.registry``)::

        batches = Prefetcher(loader, device="cuda", registry=registry)
        batches.load_state_dict(checkpoint["data"])      # on restart
        for epoch in range(batches.epoch, num_epochs):
            for batch in batches:
                ...
                checkpoint["data"] = batches.state_dict()
    """

    def __init__(
        self,
        iterable: Iterable,
        depth: int = 2,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        registry: CollectorRegistry | None = None,
        *,
        num_threads: int = 1,
        timeout_s: float | None = None,
        shutdown_timeout_s: float = 10.0,
        name: str = "train",
    ):
        cfg = PrefetchConfig(
            depth=depth,
            max_bytes=max_bytes,
            num_threads=num_threads,
            pin_memory=pin_memory,
            device=None if device is None else str(device),
            timeout_s=timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
            name=name,
        )
        self._setup(iterable, cfg, registry)

    @classmethod
    def from_config(
        cls, iterable: Iterable, cfg: PrefetchConfig, registry: CollectorRegistry | None = None
    ) -> Prefetcher:
        self = cls.__new__(cls)
        self._setup(iterable, cfg, registry)
        return self

    def _setup(self, iterable: Iterable, cfg: PrefetchConfig, registry: CollectorRegistry | None) -> None:
        if not isinstance(iterable, Iterable):
            raise TypeError(f"Prefetcher needs an iterable, got {type(iterable).__name__}")
        self.config = cfg
        self._source = iterable
        self._transfer = _make_transfer(cfg)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._m = _metrics_for(self.registry, cfg.name)
        self._stateful = callable(getattr(iterable, "state_dict", None)) and callable(
            getattr(iterable, "load_state_dict", None)
        )
        self._pass: _Pass | None = None
        self._epoch = 0
        self._consumed = 0  # batches taken by the training loop in this epoch
        self._skip = 0  # batches the next pass drops from a plain source
        self._resume = True  # the next pass begins epoch self._epoch (else: a new epoch)
        self._source_state: Any = None  # the source's own state after the last batch taken
        self._last_return: float | None = None
        self._wait_sum = 0.0
        self._step_sum = 0.0
        self.last_wait_s = 0.0
        """Seconds the last next() waited for its batch (RemoteOptimizer reports it as data wait)."""

    # -- iteration

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]

    def __iter__(self) -> _PrefetchIterator:
        self.close()
        it = iter(self._source)
        if not self._resume:  # the last pass was left early: like a DataLoader, start the next epoch
            self._epoch += 1
            self._consumed = self._skip = 0
        self._resume = False
        skip, self._skip = self._skip, 0
        if self._stateful:
            self._source_state = self._source.state_dict()  # type: ignore[attr-defined]
        self._pass = _Pass(
            it,
            skip=skip,
            owned=it is not self._source,
            stop_workers=_stops_workers(self._source, it),
            cfg=self.config,
            transfer=self._transfer,
            snapshot=self._source.state_dict if self._stateful else None,  # type: ignore[attr-defined]
            metrics=self._m,
        )
        self._last_return = None
        self._wait_sum = self._step_sum = 0.0
        self._pass.start()
        return _PrefetchIterator(self, self._pass)

    def _next(self, run: _Pass) -> Any:
        start = time.perf_counter()
        item = run.take() if run is self._pass else None
        if item is None:
            if run is self._pass and run.finished:  # the source ran out: the next pass is a new epoch
                self._source_state = run.end_state
                self._epoch += 1
                self._consumed = self._skip = 0
                self._resume = True
            run.close()
            raise StopIteration
        if item.error is not None:
            run.close()
            error, item = item.error, None
            try:
                raise error
            finally:
                error = None  # no cycle through this frame
        run.hand_over(item)
        now = time.perf_counter()
        wait = now - start
        self.last_wait_s = wait
        self._consumed += 1
        if self._stateful:
            self._source_state = item.source_state
        self._m.wait.observe(wait)
        self._m.consumed.inc()
        if self._last_return is not None:  # step time: from the last batch handed over to this one
            self._wait_sum += wait
            self._step_sum += now - self._last_return
            if self._step_sum > 0:
                self._m.stall.set(self._wait_sum / self._step_sum)
        self._last_return = now
        return item.batch

    @property
    def stall_fraction(self) -> float:
        """Share of this epoch's step time spent waiting for data (from the second batch on)."""
        return self._wait_sum / self._step_sum if self._step_sum > 0 else 0.0

    @property
    def epoch(self) -> int:
        """The epoch of the current pass; between passes, the one the next pass resumes
        (after a pass left early, the next pass starts a new epoch, epoch + 1)."""
        return self._epoch

    # -- shutdown

    def close(self) -> None:
        """Stop the background threads of the current pass; iterating again starts a new one."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- resume

    def state_dict(self) -> dict[str, Any]:
        """Position in the data: the epoch and the batches the training loop has taken in it.

        With a stateful source, also its own state as it was after the last batch
        taken (under ``"source"``).
        """
        state: dict[str, Any] = {"epoch": self._epoch, "batches_consumed": self._consumed}
        if self._stateful:
            source_state = self._source_state
            if source_state is None:  # never iterated: nothing was fetched ahead
                source_state = self._source.state_dict()  # type: ignore[attr-defined]
            state["source"] = source_state
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` on the next pass: its first batch is the first one not consumed."""
        unknown = set(state) - {"epoch", "batches_consumed", "source"}
        if unknown:
            raise ValueError(f"prefetch state has unknown keys {sorted(unknown)}")
        for key in ("epoch", "batches_consumed"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"prefetch state {key!r} must be an int >= 0, got {value!r}")
        self.close()
        if "source" in state:
            if not self._stateful:
                raise ValueError(
                    f"prefetch state holds the source's own state, but {type(self._source).__name__} "
                    "has no load_state_dict"
                )
            self._source.load_state_dict(state["source"])  # type: ignore[attr-defined]
            self._source_state = state["source"]
            self._skip = 0
        else:
            self._skip = state["batches_consumed"]
        self._epoch = state["epoch"]
        self._consumed = state["batches_consumed"]
        self._resume = True


class _PrefetchIterator:
    """The iterator of one pass; when it is dropped or closed, the pass's threads stop."""

    def __init__(self, owner: Prefetcher, run: _Pass):
        self._owner = owner
        self._run = run

    def __iter__(self) -> _PrefetchIterator:
        return self

    def __next__(self) -> Any:
        return self._owner._next(self._run)

    def close(self) -> None:
        self._run.close()

    def __del__(self) -> None:
        run = getattr(self, "_run", None)
        if run is not None:
            run.close()


def _stops_workers(source: Iterable, it: Iterator) -> bool:
    """Whether closing a pass should stop the worker processes of the DataLoader iterator ``it``.

    Not with persistent workers: the DataLoader reuses them for its next epoch.
    """
    return (
        isinstance(source, DataLoader)
        and not source.persistent_workers
        and callable(getattr(it, "_shutdown_workers", None))
    )


def _make_transfer(cfg: PrefetchConfig) -> _CudaCopy | _HostCopy | None:
    device = None if cfg.device is None else torch.device(cfg.device)
    cuda = device is not None and device.type == "cuda"
    pin = cuda if cfg.pin_memory is None else cfg.pin_memory
    if (cuda or pin) and not torch.cuda.is_available():
        what = f"prefetch.device={cfg.device!r}" if cuda else "prefetch.pin_memory=True"
        raise ConfigError(f"{what} needs CUDA, and torch.cuda.is_available() is False")
    if cuda:
        if device.index is None:  # the threads' current device is 0: pin the caller's now
            device = torch.device("cuda", torch.cuda.current_device())
        return _CudaCopy(device, pin)
    if device is not None and device.type == "cpu":
        device = None
    if device is None and not pin:
        return None
    return _HostCopy(device, pin)

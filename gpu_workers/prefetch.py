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

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import DataLoader

from luwu.gpu_workers.batches import batch_nbytes, make_transfer
from luwu.gpu_workers.config import DEFAULT_MAX_BYTES, PrefetchConfig
from luwu.gpu_workers.metrics import prefetch_metrics_for
from luwu.gpu_workers.prefetch_pass import PrefetchPass

__all__ = ["Prefetcher", "PrefetchConfig", "batch_nbytes"]


class Prefetcher:
    """Iterates ``iterable`` with batches fetched ahead in background threads.

    ``for batch in prefetcher`` is one epoch of the wrapped iterable; iterating
    again starts the next. ``len()`` is the wrapped iterable's. Leaving the loop
    early (``break``, an exception) or dropping the iterator stops the threads;
    so do ``close()`` and leaving a ``with`` block. A loader exception is raised
    in the training loop as the same object, with its original traceback.

    The arguments are the fields of :class:`PrefetchConfig` (documented there);
    ``registry`` receives the metrics (default: a private one, ``self.registry``).

    ```python
    batches = Prefetcher(loader, device="cuda", registry=registry)
    batches.load_state_dict(checkpoint["data"])      # on restart
    for epoch in range(batches.epoch, num_epochs):
        for batch in batches:
            ...
            checkpoint["data"] = batches.state_dict()
    ```
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

    def _setup(
        self, iterable: Iterable, cfg: PrefetchConfig, registry: CollectorRegistry | None
    ) -> None:
        if not isinstance(iterable, Iterable):
            raise TypeError(f"Prefetcher needs an iterable, got {type(iterable).__name__}")
        self.config = cfg
        self._source = iterable
        self._transfer = make_transfer(cfg)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._m = prefetch_metrics_for(self.registry, cfg.name)
        self._stateful = callable(getattr(iterable, "state_dict", None)) and callable(
            getattr(iterable, "load_state_dict", None)
        )
        self._pass: PrefetchPass | None = None
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
        if (
            not self._resume
        ):  # the last pass was left early: like a DataLoader, start the next epoch
            self._epoch += 1
            self._consumed = self._skip = 0
        self._resume = False
        skip, self._skip = self._skip, 0
        if self._stateful:
            self._source_state = self._source.state_dict()  # type: ignore[attr-defined]
        self._pass = PrefetchPass(
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

    def _next(self, run: PrefetchPass) -> Any:
        start = time.perf_counter()
        item = run.take() if run is self._pass else None
        if item is None:
            if (
                run is self._pass and run.finished
            ):  # the source ran out: the next pass is a new epoch
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

    def __init__(self, owner: Prefetcher, run: PrefetchPass):
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

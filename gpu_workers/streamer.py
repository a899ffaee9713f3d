"""One streamed unit's lifecycle on a worker: fetch, use, keep, release, push.

A :class:`UnitState` holds everything about one unit (as FSDP2's ``FSDPParamGroup`` does): where
its weights are (:class:`Phase`), the replies its weights were or will be written from, how much
of them it keeps for its backward, and how many of its buckets were pushed this step. The
:class:`Streamer` runs the units of one worker from the hooks (see
:mod:`luwu.gpu_workers.streaming` for the whole story); the worker owns it and tells it when a
streamed bucket was pushed and when a push's answer brought weights.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten

from luwu.gpu_workers.metrics import StepReport, WorkerMetrics
from luwu.gpu_workers.pool import FP32_BYTES
from luwu.gpu_workers.sent_grads import SentGradient
from luwu.gpu_workers.unit_memory import UnitMemory, heap_free_bytes
from luwu.gpu_workers.units import Unit
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import Bucket
from luwu.protocol.memory import retain_freed_memory, trim_heap
from luwu.protocol.messages import PULL_ACK

if TYPE_CHECKING:
    from luwu.gpu_workers.worker import Worker

#: Streaming mode maps blocks from this size up on their own, so freed ones go back to the system at
#: once instead of fragmenting the heap between the activations that outlive them (kept in the heap,
#: the transient blocks of the first step alone grow it past a memory limit the worker otherwise
#: keeps); the units' weights are recycled instead (:class:`UnitMemory`).
STREAM_MMAP_THRESHOLD = 1 << 17


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """What the optimizer section says of streaming: the units, how many are fetched ahead, whether
    a unit's weights stay from its forward to its backward, and how many bytes of fetched weights
    may be kept for the backward (-1: ``max(1, prefetch)`` of the largest unit in fp32)."""

    units: list[Unit]
    prefetch: int
    keep: bool = False
    hold_bytes: int = -1


class Phase(enum.Enum):
    RELEASED = (
        0  # no storage; replies here came with the answers to its pushes (the next forward's)
    )
    REQUESTED = 1  # the PULLs are out (or the weights came with the answers), not yet written
    RESIDENT = 2  # written; replies here are what they were written from, kept for a later HELD
    HELD = 3  # released after its forward, the fetched weights kept as they travelled


@dataclass(slots=True, eq=False)
class UnitState:
    unit: Unit
    params: list[torch.Tensor]  # its trainable parameters (those the optimizer streams)
    buckets: list[int]
    names: list[str]  # its parameters' names (errors name them)
    phase: Phase = Phase.RELEASED
    replies: dict = field(default_factory=dict)  # bucket -> the reply of its weights (see Phase)
    pushed: int = 0  # buckets pushed this step
    held: int = 0  # bytes of fetched weights kept for its backward (HELD)
    reply_bytes: int = 0  # bytes of the last reply its weights were written from (as it travelled)
    with_reply: bool = False  # its pushes ask for its new weights with the answer (next forward's)


def _nbytes(replies) -> int:
    """Bytes of the payload frames of these received messages."""
    return sum(memoryview(getattr(f, "buffer", f)).nbytes for m in replies for f in m.payload)


def _check_releasable(worker: Worker, u: Unit, params: list[torch.Tensor], mine: list[int]) -> None:
    for i in mine:
        p = params[i]
        if p.storage_offset() != 0 or p.untyped_storage().size() not in (0, p.numel() * p.itemsize):
            name = worker.layout.params[i].name
            raise ConfigError(
                f"parameter {name} of unit {u.name!r} shares its storage with other tensors: it "
                "cannot be released"
            )


class Streamer:
    """Fetches, releases and pushes the streamed units of one worker (see the module docstring)."""

    def __init__(
        self,
        worker: Worker,
        params: list[torch.Tensor],
        settings: StreamSettings,
        metrics: WorkerMetrics | None = None,
    ):
        if settings.prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {settings.prefetch}")
        self.worker, self.prefetch, self.metrics = worker, settings.prefetch, metrics
        self.keep = settings.keep  # weights kept from forward to backward (one fetch a step)
        layout, by_unit = worker.layout, worker.layout.unit_buckets()
        largest = max(
            (sum(layout.buckets[b].numel for b in v) for v in by_unit.values()), default=0
        )
        # fetched weights kept, as they travelled, from a unit's forward to its backward: this many
        default_hold = max(1, self.prefetch) * FP32_BYTES * largest
        self.hold_bytes = settings.hold_bytes if settings.hold_bytes >= 0 else default_hold
        self.units: list[UnitState] = []
        for u in settings.units:
            bids = by_unit.get(u.index, [])
            mine = sorted({s.param for bid in bids for s in layout.buckets[bid].segments})
            _check_releasable(worker, u, params, mine)
            names = [layout.params[i].name for i in mine]
            self.units.append(UnitState(u, [params[i] for i in mine], bids, names))
        self._of_bucket = {bid: u for u in self.units for bid in u.buckets}
        # storage kept for reuse: one unit's. Capped at the units resident at once (prefetch + 1),
        # the kept storage sat beside backward's activations at the step's peak: +0.37 B/param of
        # worker memory (bench_memory, 56.7M parameters), for no CPU measured (profile_worker)
        unit_bytes = max((sum(p.nbytes for p in u.params) for u in self.units), default=0)
        self.memory = UnitMemory(unit_bytes)
        self.order = [u.unit.index for u in self.units if u.buckets]  # forward order, per step
        self._turn = self._last_units()
        self._seen: dict[int, None] = {}  # this step's forward order (first use of each unit)
        self.fetch_wait_s, self.fetches, self.heap_trims = 0.0, 0, 0
        self._hooks = []
        for u in self.units:
            if u.buckets:
                module = u.unit.module
                self._hooks.append(module.register_forward_pre_hook(self._hook(u, pre=True)))
                self._hooks.append(module.register_forward_hook(self._hook(u, pre=False)))
        self._choose_reply_units()
        for u in self.units:
            self._release(u)
        self.memory.clear()  # (the model was built whole: its storage is not kept)
        #: freed memory the heap (blocks under STREAM_MMAP_THRESHOLD) may keep from step to step for
        #: the next step's allocations; past it, given back to the system after the step
        self.heap_keep_bytes = max(2 * self.memory.cap_bytes, STREAM_MMAP_THRESHOLD)
        retain_freed_memory(STREAM_MMAP_THRESHOLD, self.heap_keep_bytes)
        trim_heap()  # the model was built whole: give its pages back

    def _hook(self, u: UnitState, pre: bool):
        if pre:
            return lambda m, a: self._pre_forward(u)
        return lambda m, a, out: self._post_forward(u, out)

    # ----------------------------------------------------------------- fetch and release
    def _request(self, u: UnitState, exact: bool = False) -> None:
        if u.phase is Phase.RELEASED:
            self.worker.request_weights(u.buckets, exact=exact)
            u.phase = Phase.REQUESTED

    def _ensure(self, u: UnitState, may_hold: bool = True) -> None:
        """Make the unit's weights resident (asking for them now if no prefetch did, writing them
        from what its forward fetched if that was kept); ``may_hold``: the unit's reply may be kept
        for its backward (else it is freed once written, as for the last units of the forward and
        when keeping weights)."""
        if u.phase is Phase.RESIDENT:
            return
        fetch = u.phase is not Phase.HELD
        if fetch:
            self._request(u)
        u.held = 0  # (HELD: the weights its forward was written from, nothing to fetch)
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in u.params:
                self.memory.alloc(p)
        have, u.replies = u.replies, {}
        got = self.worker.receive_weights(
            u.buckets, what=f"weights of unit {u.unit.name!r}", have=have
        )
        u.reply_bytes = _nbytes(got.values())
        if may_hold and not self.keep and u.unit.index not in self._turn:
            u.replies = got
        waited = time.perf_counter() - t0
        self.fetch_wait_s += waited
        self.fetches += fetch
        if self.metrics is not None:
            self.metrics.unit_fetch_wait.labels(u.unit.name).inc(waited)
            self.metrics.unit_fetches.labels(u.unit.name).inc(fetch)
        u.phase = Phase.RESIDENT

    def _release(self, u: UnitState, hold: bool = False) -> None:
        """Free the unit's weights; ``hold``: keep what they were written from for its backward,
        if it fits. The replies of a released unit (the answers to its pushes) stay."""
        if u.phase is Phase.REQUESTED:
            self.worker.discard_weights([b for b in u.buckets if b not in u.replies])
        resident = u.phase is Phase.RESIDENT
        got = u.replies if resident else {}
        if u.phase is not Phase.RELEASED:
            u.replies = {}
        u.held = 0
        if (
            hold
            and resident
            and len(got) == len(u.buckets)
            and self.held_bytes() + u.reply_bytes <= self.hold_bytes
        ):
            u.replies, u.held = got, u.reply_bytes
        with torch.no_grad():
            for p in u.params:
                self.memory.release(p)
        u.phase = Phase.HELD if u.held else Phase.RELEASED

    def held_bytes(self) -> int:
        """Bytes of fetched weights kept now for the units' backward."""
        return sum(u.held for u in self.units)

    def reply_bytes_kept(self) -> int:
        """Bytes of received replies this worker keeps now: for the units' backward, and of resident
        units whose reply may be kept at their release."""
        resident = [u.replies.values() for u in self.units if u.phase is Phase.RESIDENT]
        return self.held_bytes() + sum(_nbytes(r) for r in resident)

    def _prefetch(self, order: list[int], index: int) -> None:
        """Ask for the weights of the ``prefetch`` units after ``index`` in ``order``."""
        try:
            pos = order.index(index)
        except ValueError:
            return
        for j in order[pos + 1 : pos + 1 + self.prefetch]:
            self._request(self.units[j])

    # ----------------------------------------------------------------- hooks
    def _pre_forward(self, u: UnitState) -> None:
        # (a forward recomputed in backward: backward's order prefetches)
        with self.worker.client.wake.batched():  # (the requests go out together, before the wait)
            if torch._C._current_graph_task_id() == -1:
                self._seen.setdefault(u.unit.index)
                self._prefetch(self.order, u.unit.index)
            self._request(u)
        self._ensure(u)

    def _post_forward(self, u: UnitState, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside backward (activation checkpointing)
        if not torch.is_grad_enabled():
            self._release(u)
            return
        if not self.keep and u.unit.index not in self._turn:
            self._release(u, hold=True)
        tensors = [
            t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        fired = []

        def pre_backward(grad):
            if not fired:
                fired.append(True)
                self._pre_backward(u)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)

    def _pre_backward(self, u: UnitState) -> None:
        with self.worker.client.wake.batched():
            self._prefetch(list(reversed(self._seen or self.order)), u.unit.index)
            self._request(u)
        self._ensure(u)

    # ----------------------------------------------------------------- what the worker tells
    def reply_codec(self, b: Bucket, step: int) -> str:
        """The reply codec a push of streamed bucket ``b`` names: the fetch codec when the nodes
        are to send the new weights with the answer (:meth:`_choose_reply_units`), else an ack."""
        with_reply = self._of_bucket[b.id].with_reply
        return self.worker.codecs.fetch(b, step + 1) if with_reply else PULL_ACK

    def pushed(self, bucket: Bucket) -> None:
        """A streamed bucket went out: once all of its unit's have, free the unit's gradients and
        weights."""
        u = self._of_bucket[bucket.id]
        u.pushed += 1
        if u.pushed == len(u.buckets):
            w = self.worker  # (under no_sync() the next micro-batch's backward makes fresh ones)
            for p, name in zip(u.params, u.names):
                p.grad = None if w.accumulating else SentGradient(p, name, w.rank)
            self._release(u)
            u.pushed = 0  # (under no_sync() the next micro-batch pushes the unit again)

    def came_with_ack(self, bid: int, msg) -> None:
        """The answer to bucket ``bid``'s push brought its new weights: kept as received for the
        unit's next use."""
        self._of_bucket[bid].replies[bid] = msg

    # ----------------------------------------------------------------- steps and whole-model access
    def end_step(self, report: StepReport) -> None:
        """After ``step()`` (every push acknowledged): release every unit still held, forget unused
        prefetches (their weights are a step old), keep this step's forward order for the next."""
        for u in self.units:
            for p in u.params:
                p.grad = None
            self._release(u)
            u.pushed = 0
        if self._seen:
            self.order = list(self._seen)
            self._seen = {}
            self._turn = self._last_units()
        self._take_pushed_weights()
        report.fetch_wait_s, self.fetch_wait_s = self.fetch_wait_s, 0.0
        if self.metrics is not None:
            self.metrics.fetch_wait.observe(report.fetch_wait_s)
        self._bound_heap()

    def _bound_heap(self) -> None:
        """Give the heap's freed memory back to the system once it passes :attr:`heap_keep_bytes`
        (every step where the heap cannot say how much it keeps): below that it serves the next
        step's allocations without a page fault."""
        free = heap_free_bytes()
        if free is None or free > self.heap_keep_bytes:
            trim_heap()
            self.heap_trims += 1

    def _last_units(self) -> frozenset[int]:
        """The last ``max(1, prefetch)`` units of the forward order: kept from their forward to
        their backward, which comes right after."""
        return frozenset(self.order[-max(1, self.prefetch) :])

    def _choose_reply_units(self) -> None:
        """The units whose pushes ask the nodes to send the new weights with the answer: the first
        ``prefetch`` units of the forward order, so the next forward starts without a round trip,
        and the units after them while their replies (as large as their last) fit ``hold_bytes``:
        those are never asked for, and their weights cross the node's link while backward still
        runs."""
        room = self.hold_bytes
        for u in self.units:
            u.with_reply = False
        for k, i in enumerate(self.order):
            u = self.units[i]
            if k >= self.prefetch:
                if not 0 < u.reply_bytes <= room:
                    break
                room -= u.reply_bytes
            u.with_reply = True

    def _take_pushed_weights(self) -> None:
        """After a step: the new weights that came with the answers to the pushes are the next
        forward's; a unit whose buckets all came counts as requested (the first ``prefetch`` units
        always: a bucket of theirs answered without weights, e.g. when the workers disagreed on
        the order, is asked for now), any other weights that came are dropped (their unit is
        fetched when needed)."""
        for k, i in enumerate(self.order):
            u = self.units[i]
            missing = [b for b in u.buckets if b not in u.replies]
            if k < self.prefetch and missing:
                with self.worker.client.wake.batched():
                    self.worker.request_weights(missing)
            if k < self.prefetch or not missing:
                u.phase = Phase.REQUESTED
        for u in self.units:
            if u.phase is not Phase.REQUESTED:
                u.replies = {}
        self._choose_reply_units()

    def forget(self) -> None:
        """The worker abandoned the step (recover()): its outstanding fetches will not be answered."""
        for u in self.units:
            u.phase = Phase.RELEASED  # not REQUESTED: the replies were dropped with the step
            u.replies, u.pushed, u.held = {}, 0, 0
            for p in u.params:
                p.grad = None
                self.memory.release(p)
        self.memory.clear()
        self._seen = {}

    @contextlib.contextmanager
    def gathered(self):
        """Every streamed unit resident for the duration (for models that fit: state dicts)."""
        try:
            for u in self.units:
                self._release(u)  # a prefetch may be in the fetch codec: these are fp32
                self._request(u, exact=True)
            for u in self.units:
                self._ensure(u, may_hold=False)
            yield
        finally:
            for u in self.units:
                self._release(u)

    def resident_bytes(self) -> int:
        """Bytes of storage the streamed parameters hold now (0 between steps)."""
        return sum(p.untyped_storage().nbytes() for u in self.units for p in u.params)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.memory.clear()

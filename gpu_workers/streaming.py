"""Streaming mode: a worker that borrows each unit's weights from the nodes just before it needs them.

Between uses a streamed unit's parameters hold no storage: as FSDP2 does, the
``nn.Parameter`` objects stay (modules keep working as modules, and the
references autograd saves stay valid) and their storage is resized to zero
after use and back just before the next (:func:`alloc_storage`,
:func:`free_storage`). The fetched weights are written straight into that
storage: fp32 with compression off (exact parity), else in the policy's fetch
codec (``compression.stream_codec``, int8 blocks by default) and widened to fp32
when their unit runs; the fp32 master stays on the nodes.

- **Forward**: a forward pre-hook asks the nodes for the next ``prefetch``
  units' weights (PULL, in the order the last forward ran them) and waits for
  its own unit's; the forward post-hook releases them, except for the last
  ``max(1, prefetch)`` units of the forward, whose backward comes right after
  (the turn: releasing them would only fetch them again, with a round trip
  the backward waits on; FSDP2 keeps its root unsharded for the same reason).
  Under ``no_grad`` (evaluation) every unit is released: nothing is pushed.
- **Backward**: the forward post-hook puts a hook on the unit's outputs; when
  their gradient is computed (the unit's backward is next) it asks for the
  weights of the ``prefetch`` units backward reaches next and waits for its own.
  What a unit's forward was written from (the reply as it travelled: int8 with
  compression on, 1 byte per parameter) is kept for its backward while the kept
  replies fit ``optimizer.stream_hold_bytes`` (by default as much as
  ``max(1, prefetch)`` of the largest unit in fp32): such a unit's backward writes
  its weights again without a fetch, which halves its weight traffic.
  Each parameter's gradient goes to its buckets as usual (post-accumulate-grad
  hooks; a unit's buckets hold only its parameters); when the last bucket of
  the unit has been pushed, the unit's gradients and weights are released.
- **Activation checkpointing** (``torch.utils.checkpoint``, non-reentrant)
  re-runs a unit's forward inside backward: the post-hook then keeps the
  weights, which the unit's backward needs right after.
- **Gradient accumulation** (``no_sync()``): a worker cannot keep every unit's gradient
  until the last micro-batch, so each micro-batch pushes its units' gradients as they
  complete, flagged ``partial``; the nodes add them into the step's sum and answer
  nothing, and the last micro-batch's pushes (outside ``no_sync()``) complete the step.
- **Step**: the pushes of streamed buckets are answered by an ``ack`` without
  weights; ``step()`` waits for every ack (so the next fetch sees the new
  weights), then :meth:`Streamer.end_step` releases what is still held and
  forgets unused prefetches. The root (parameters outside every unit) stays
  resident and is updated by ``step()`` as in resident mode.

Memory: gradient buffers of streamed buckets come from a bounded
:class:`~luwu.gpu_workers.pool.BufferPool`. A streaming worker maps blocks of
:data:`STREAM_MMAP_THRESHOLD` bytes and up on their own (instead of keeping
freed memory in the heap, as resident workers do) and trims the heap after each
step (:func:`~luwu.protocol.memory.trim_heap`): released weights would
otherwise stay mapped between the activations that outlive them, until the
worker held as much as the model. The price is that each fetch writes into
fresh pages.

Who sends what: after one step the worker knows the forward order. The pushes of
the first ``prefetch`` units in that order name the fetch codec as their reply
codec, so the nodes send those units' new weights as they apply the step, without
a request: the next forward starts on weights already there. So do the pushes of
the units after them while their replies fit ``optimizer.stream_hold_bytes``
(those units' weights then cross the node's link while backward still runs, as a
resident worker's replies do, and wait as they travelled until the next forward:
at most ``stream_hold_bytes`` of them, and as much again of the replies kept for
backward). Each other unit is requested ``prefetch`` units ahead, while the units
before it compute, so in steady state no forward waits on a round trip. Fetched weights wait as they arrived (int8
with compression on: 1 byte per parameter and a scale per 256) and are widened into
the parameters' fp32 storage only when their unit runs.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from luwu.gpu_workers import materialize
from luwu.gpu_workers.metrics import StepReport, WorkerMetrics
from luwu.gpu_workers.pool import FP32_BYTES, BufferPool
from luwu.gpu_workers.units import (
    Unit,
    Units,
    alloc_storage,
    free_storage,
    select_units,
    unit_of_params,
)
from luwu.gpu_workers.worker import Worker
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import Bucket, Layout
from luwu.protocol.memory import retain_freed_memory, trim_heap

#: Streaming mode maps blocks from this size up on their own, so a released unit's pages go back to the
#: system at once instead of fragmenting the heap between the activations that outlive them.
STREAM_MMAP_THRESHOLD = 1 << 17


class _State(enum.Enum):
    RELEASED = 0
    REQUESTED = 1  # the PULLs are out, the weights not yet written
    RESIDENT = 2
    HELD = (
        3  # released after its forward, the fetched weights kept as they travelled for its backward
    )


@dataclass(slots=True, eq=False)
class _Unit:
    unit: Unit
    params: list[torch.Tensor]  # its trainable parameters (those the optimizer streams)
    buckets: list[int]
    state: _State = _State.RELEASED
    pushed: int = 0  # buckets pushed this step
    held: int = 0  # bytes of fetched weights kept for its backward (HELD)
    reply_bytes: int = 0  # bytes of the last reply its weights were written from (as it travelled)


def _nbytes(replies) -> int:
    """Bytes of the payload frames of these received messages."""
    return sum(memoryview(getattr(f, "buffer", f)).nbytes for m in replies for f in m.payload)


def pool_budget_bytes(layout: Layout, prefetch: int) -> int:
    """Gradient buffers for ``prefetch + 2`` of the largest units: the unit in backward, the ones whose
    pushes are in flight, and staging for the weights being fetched."""
    sizes: dict[int, int] = {}
    for unit, bids in layout.unit_buckets().items():
        sizes[unit] = sum(layout.buckets[b].numel for b in bids) * FP32_BYTES
    return (prefetch + 2) * max(sizes.values(), default=FP32_BYTES)


# ----------------------------------------------------------------- what RemoteOptimizer calls
def patterns_of(spec) -> list[str] | None:
    """The part of a ``stream_units`` argument the configuration can hold: fnmatch patterns (None when
    it names module classes, which stay with the optimizer, or when it is not given)."""
    spec = [spec] if isinstance(spec, str) else spec
    return list(spec) if spec is not None and all(isinstance(s, str) for s in spec) else None


def plan_units(model, spec, cfg, apart: bool = False) -> tuple[Units | None, dict[int, int]]:
    """Streaming mode's units of ``model`` and ``id(parameter)`` -> unit, from the ``stream_units``
    argument or else ``cfg.stream_units`` (``cfg``: the optimizer section); (None, {}) when not streaming.
    ``apart``: the optimizer's parameters were given apart from the model (param groups)."""
    if not cfg.stream_weights:
        if apart:
            raise ConfigError(
                "RemoteOptimizer(model=...) names the module whose units stream: it needs stream_weights"
            )
        return None, {}
    units = Units(
        select_units(model, spec if spec is not None else (cfg.stream_units or None)), model
    )
    if apart and materialize.on_meta(model):
        raise ConfigError(
            "a model built on the meta device gets new parameters unit by unit: pass the model itself as params, not param groups"
        )
    if materialize.on_meta(
        model
    ):  # new parameter objects, released unit by unit: before anyone holds them
        units.initializer = materialize.Initializer(
            model, units, materialize.open_weights(cfg.init_weights)
        )  # (checked first)
        materialize.empty_model(model, units)
    elif cfg.init_weights:
        raise ConfigError(
            "optimizer.init_weights seeds a model built on the meta device; a model built whole: load_state_dict() it before"
        )
    return units, unit_of_params(units)


def worker_arguments(layout: Layout, units: list[Unit] | None, cfg, fetch_codec_for=None) -> dict:
    """The :class:`Worker` keyword arguments of streaming mode (none when ``units`` is None): the streamed
    buckets, their buffer pool, a meta-device start's initializer, and ``fetch_codec_for(bucket, step)``,
    the codec units' weights are fetched in (:func:`~luwu.protocol.policy.choose_fetch_codec` per node
    link: :meth:`luwu.gpu_workers.links.LinkSpeeds.codec_functions`; None: compression off, fp32). ``cfg``:
    the optimizer section; a unit over ``stream_budget_bytes`` is refused here, before any connection."""
    if units is None:
        return {}
    check_budget(layout, units, cfg.stream_budget_bytes)
    out = {
        "streamed": layout.streamed_buckets(),
        "pool": BufferPool(pool_budget_bytes(layout, cfg.stream_prefetch)),
    }
    if (
        getattr(units, "initializer", None) is not None
    ):  # a meta-device start: initialized at connect, once
        out["initialize"] = units.initializer.for_layout(layout)
    if fetch_codec_for is not None:
        out["fetch_codec_for"] = fetch_codec_for
    return out


def restart(
    old: Streamer | None,
    worker: Worker,
    params: list[torch.Tensor],
    units: list[Unit] | None,
    cfg,
    metrics: WorkerMetrics | None = None,
) -> Streamer | None:
    """The streamer of a (re)built worker, the old one's hooks removed (None when not streaming); ``cfg``:
    the optimizer section; ``metrics``: where the fetch waits are recorded."""
    stop(old)
    return (
        None
        if units is None
        else Streamer(
            worker,
            params,
            units,
            cfg.stream_prefetch,
            metrics,
            keep=cfg.stream_keep_for_backward,
            hold_bytes=cfg.stream_hold_bytes,
        )
    )


def stop(streamer: Streamer | None) -> None:
    """Remove the streamer's hooks (returns None, the optimizer's streamer from then on)."""
    if streamer is not None:
        streamer.close()


def gathered(streamer: Streamer | None):
    """Every streamed unit resident for the duration (a no-op context in resident mode)."""
    return streamer.gathered() if streamer is not None else contextlib.nullcontext()


def end_step(streamer: Streamer | None, report: StepReport) -> None:
    if streamer is not None:
        streamer.end_step(report)


def check_budget(layout: Layout, units: list[Unit], budget_bytes: int) -> None:
    """Refuse a unit whose fp32 weights and gradient (8 B per parameter) exceed ``budget_bytes`` (0: none)."""
    if not budget_bytes:
        return

    def size(n: int) -> str:
        return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"

    for unit, bids in sorted(layout.unit_buckets().items()):
        numel = sum(layout.buckets[b].numel for b in bids)
        if 2 * FP32_BYTES * numel > budget_bytes:
            u = units[unit]
            raise ConfigError(
                f"streaming unit {u.name!r} ({type(u.module).__name__}) has {numel:,} parameters: its fp32 weights and gradient take "
                f"{size(2 * FP32_BYTES * numel)}, over optimizer.stream_budget_bytes = {size(budget_bytes)} "
                "(choose smaller units with stream_units, or raise the budget)"
            )


class Streamer:
    """Fetches, releases and pushes the streamed units of one worker (see the module docstring)."""

    def __init__(
        self,
        worker: Worker,
        params: list[torch.Tensor],
        units: list[Unit],
        prefetch: int,
        metrics: WorkerMetrics | None = None,
        *,
        keep: bool = False,
        hold_bytes: int = -1,
    ):
        if prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {prefetch}")
        self.worker, self.prefetch, self.metrics = worker, prefetch, metrics
        self.keep = keep  # a unit's weights stay from its forward to its backward (one fetch a step, not two)
        # the fetched weights kept, as they travelled, from a unit's forward to its backward: up to this many bytes
        self.hold_bytes = (
            hold_bytes
            if hold_bytes >= 0
            else max(1, prefetch)
            * FP32_BYTES
            * max(
                (
                    sum(worker.layout.buckets[b].numel for b in bids)
                    for bids in worker.layout.unit_buckets().values()
                ),
                default=0,
            )
        )
        self._got: dict[int, object] = {}  # bucket -> the reply last written into its resident unit
        self._held: dict[
            int, object
        ] = {}  # bucket -> that reply, kept since its unit's forward (HELD)
        by_unit = worker.layout.unit_buckets()
        self.units: list[_Unit] = []
        for u in units:
            mine = sorted(
                {
                    s.param
                    for bid in by_unit.get(u.index, ())
                    for s in worker.layout.buckets[bid].segments
                }
            )
            for i in mine:
                p = params[i]
                if p.storage_offset() != 0 or p.untyped_storage().size() not in (
                    0,
                    p.numel() * p.itemsize,
                ):
                    name = worker.layout.params[i].name
                    raise ConfigError(
                        f"parameter {name} of unit {u.name!r} shares its storage with other tensors: it cannot be released"
                    )
            self.units.append(_Unit(u, [params[i] for i in mine], by_unit.get(u.index, [])))
        self._of_bucket = {bid: u for u in self.units for bid in u.buckets}
        self.order = [
            u.unit.index for u in self.units if u.buckets
        ]  # forward order, learned from each step
        self._turn = self._last_units()
        self._seen: dict[int, None] = {}  # this step's forward order (first use of each unit)
        self.fetch_wait_s = 0.0
        self.fetches = 0
        self._hooks = []
        for u in self.units:
            if u.buckets:
                self._hooks.append(
                    u.unit.module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
                )
                self._hooks.append(
                    u.unit.module.register_forward_hook(
                        lambda m, a, out, u=u: self._post_forward(u, out)
                    )
                )
        worker.on_pushed, worker.on_reset = self._on_pushed, self._forget
        worker.fetch_with_reply = self._reply_buckets()
        for u in self.units:
            self._release(u)
        retain_freed_memory(STREAM_MMAP_THRESHOLD, STREAM_MMAP_THRESHOLD)
        trim_heap()  # the model was built whole: give its pages back

    # ----------------------------------------------------------------- fetch and release
    def _request(self, u: _Unit, exact: bool = False) -> None:
        if u.state is _State.RELEASED:
            self.worker.request_weights(u.buckets, exact=exact)
            u.state = _State.REQUESTED

    def _ensure(self, u: _Unit, may_hold: bool = True) -> None:
        """Make the unit's weights resident (asking for them now if no prefetch did, writing them from what
        its forward fetched if that was kept); ``may_hold``: the unit's reply may be kept for its backward
        (else it is freed once written, as for the last units of the forward and when keeping weights)."""
        if u.state is _State.RESIDENT:
            return
        fetch = u.state is not _State.HELD
        if fetch:
            self._request(u)
        else:  # (the weights its forward was written from: nothing to fetch)
            self.worker.prefetched.update((b, self._held.pop(b)) for b in u.buckets)
            u.held = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in u.params:
                alloc_storage(p)
        got: dict[int, object] = {}
        self.worker.receive_weights(u.buckets, what=f"weights of unit {u.unit.name!r}", kept=got)
        u.reply_bytes = _nbytes(got.values())
        if may_hold and not self.keep and u.unit.index not in self._turn:
            self._got.update(got)
        waited = time.perf_counter() - t0
        self.fetch_wait_s += waited
        self.fetches += fetch
        if self.metrics is not None:
            self.metrics.unit_fetch_wait.labels(u.unit.name).inc(waited)
            self.metrics.unit_fetches.labels(u.unit.name).inc(fetch)
        u.state = _State.RESIDENT

    def _release(self, u: _Unit, hold: bool = False) -> None:
        """Free the unit's weights; ``hold``: keep what they were written from for its backward, if it fits."""
        if u.state is _State.REQUESTED:
            self.worker.discard_weights(u.buckets)
        got = {b: m for b in u.buckets if (m := self._got.pop(b, None)) is not None}
        for b in u.buckets:
            self._held.pop(b, None)
        u.held = 0
        if (
            hold
            and u.state is _State.RESIDENT
            and len(got) == len(u.buckets)
            and self.held_bytes() + u.reply_bytes <= self.hold_bytes
        ):
            self._held.update(got)
            u.held = u.reply_bytes
        with torch.no_grad():
            for p in u.params:
                free_storage(p)
        u.state = _State.HELD if u.held else _State.RELEASED

    def held_bytes(self) -> int:
        """Bytes of fetched weights kept now for the units' backward."""
        return sum(u.held for u in self.units)

    def reply_bytes_kept(self) -> int:
        """Bytes of received replies this worker keeps now: for the units' backward, and of resident units whose
        reply may be kept at their release."""
        return self.held_bytes() + _nbytes(self._got.values())

    def _prefetch(self, order: list[int], index: int) -> None:
        """Ask for the weights of the ``prefetch`` units after ``index`` in ``order``."""
        try:
            pos = order.index(index)
        except ValueError:
            return
        for j in order[pos + 1 : pos + 1 + self.prefetch]:
            self._request(self.units[j])

    # ----------------------------------------------------------------- hooks
    def _pre_forward(self, u: _Unit) -> None:
        if (
            torch._C._current_graph_task_id() == -1
        ):  # (a forward recomputed in backward: backward's order prefetches)
            self._seen.setdefault(u.unit.index)
            self._prefetch(self.order, u.unit.index)
        self._ensure(u)

    def _post_forward(self, u: _Unit, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside backward (activation checkpointing): its backward is next
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

    def _pre_backward(self, u: _Unit) -> None:
        self._prefetch(list(reversed(self._seen or self.order)), u.unit.index)
        self._ensure(u)

    def _on_pushed(self, bucket: Bucket) -> None:
        """A streamed bucket went out: once all of its unit's have, free the unit's gradients and weights."""
        u = self._of_bucket[bucket.id]
        u.pushed += 1
        if u.pushed == len(u.buckets):
            for p in u.params:
                p.grad = None
            self._release(u)
            u.pushed = 0  # (under no_sync() the next micro-batch pushes the unit again)

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
        trim_heap()

    def _last_units(self) -> frozenset[int]:
        """The last ``max(1, prefetch)`` units of the forward order: kept from their forward to their
        backward, which comes right after."""
        return frozenset(self.order[-max(1, self.prefetch) :])

    def _reply_buckets(self) -> frozenset[int]:
        """The buckets whose pushes ask the nodes to send the new weights with the answer: those of the first
        ``prefetch`` units of the forward order, so the next forward starts without a round trip, and of the
        units after them while their replies (as large as their last) fit ``hold_bytes``: those are never
        asked for, and their weights cross the node's link while backward still runs."""
        out, room = [], self.hold_bytes
        for k, i in enumerate(self.order):
            u = self.units[i]
            if k >= self.prefetch:
                if not 0 < u.reply_bytes <= room:
                    break
                room -= u.reply_bytes
            out += u.buckets
        return frozenset(out)

    def _take_pushed_weights(self) -> None:
        """After a step: the new weights that came with the answers to the pushes are the next forward's; a unit
        whose buckets all came counts as requested (the first ``prefetch`` units always: a bucket of theirs
        answered without weights, e.g. when the workers disagreed on the order, is asked for now), any other
        weights that came are dropped (their unit is fetched when needed)."""
        got = set(self.worker.prefetched)
        for k, i in enumerate(self.order):
            u = self.units[i]
            missing = [b for b in u.buckets if b not in got]
            if k < self.prefetch and missing:
                self.worker.request_weights(missing)
            if k < self.prefetch or not missing:
                u.state = _State.REQUESTED
        for b in got - {b for u in self.units if u.state is _State.REQUESTED for b in u.buckets}:
            del self.worker.prefetched[b]
        self.worker.fetch_with_reply = self._reply_buckets()

    def _forget(self) -> None:
        """The worker abandoned the step (recover()): its outstanding fetches will not be answered."""
        self._got, self._held = {}, {}
        for u in self.units:
            u.state = _State.RELEASED  # not REQUESTED: the replies were dropped with the step
            u.pushed = u.held = 0
            for p in u.params:
                p.grad = None
                free_storage(p)
        self._seen = {}

    @contextlib.contextmanager
    def gathered(self):
        """Every streamed unit resident for the duration (for models that fit: state dicts, checks)."""
        try:
            for u in self.units:
                self._release(u)  # a prefetch may be in the fetch codec: these are the fp32 weights
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
        if self.worker.on_pushed == self._on_pushed:
            self.worker.on_pushed = self.worker.on_reset = None

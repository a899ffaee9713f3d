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
  weights), then :meth:`~luwu.gpu_workers.streamer.Streamer.end_step` releases what is still held and
  forgets unused prefetches. The root (parameters outside every unit) stays
  resident and is updated by ``step()`` as in resident mode.

Memory: gradient buffers of streamed buckets come from a bounded
:class:`~luwu.gpu_workers.pool.BufferPool`; the units' weights from a
:class:`~luwu.gpu_workers.unit_memory.UnitMemory`, which keeps a released unit's storage for the
next unit of the same sizes while the storage lent and kept fits the units resident at once, so
fetched weights are written into memory already mapped instead of fresh pages. Other blocks of
:data:`~luwu.gpu_workers.streamer.STREAM_MMAP_THRESHOLD` bytes and up (autograd's gradients,
received replies) are mapped on their own and go back to the system when freed: kept in the heap,
they would fragment it between the activations that outlive them until the worker held far more
than its units in flight. The heap is trimmed after a step when the freed memory it keeps passes
``Streamer.heap_keep_bytes`` (:func:`~luwu.protocol.memory.trim_heap`).

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

from luwu.gpu_workers import materialize
from luwu.gpu_workers.pool import FP32_BYTES, BufferPool
from luwu.gpu_workers.streamer import Streamer, StreamSettings
from luwu.gpu_workers.units import Unit, Units, select_units, unit_of_params
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import Layout


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


def worker_arguments(layout: Layout, units: list[Unit] | None, cfg) -> dict:
    """The :class:`~luwu.gpu_workers.worker.Worker` keyword arguments of streaming mode (none when
    ``units`` is None): the streamed buckets, their buffer pool, the units and how they stream
    (:class:`StreamSettings`), and a meta-device start's initializer. ``cfg``: the optimizer
    section; a unit over ``stream_budget_bytes`` is refused here, before any connection."""
    if units is None:
        return {}
    check_budget(layout, units, cfg.stream_budget_bytes)
    out = {
        "streamed": layout.streamed_buckets(),
        "pool": BufferPool(pool_budget_bytes(layout, cfg.stream_prefetch)),
        "stream": StreamSettings(
            list(units),
            cfg.stream_prefetch,
            keep=cfg.stream_keep_for_backward,
            hold_bytes=cfg.stream_hold_bytes,
        ),
    }
    if getattr(units, "initializer", None) is not None:  # a meta-device start: at connect, once
        out["initialize"] = units.initializer.for_layout(layout)
    return out


def stop(streamer: Streamer | None) -> None:
    """Remove the streamer's hooks (None, in resident mode: nothing to remove)."""
    if streamer is not None:
        streamer.close()


def gathered(streamer: Streamer | None):
    """Every streamed unit resident for the duration (a no-op context in resident mode)."""
    return streamer.gathered() if streamer is not None else contextlib.nullcontext()


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

"""The one place a landed reply is written into the weights.

A reply carries a bucket's new weights in its pull codec: whole (``none``, ``bf16``, ``int8``...)
or as a delta from the weights this worker holds (``int8_delta``, ``bf16_steps``). A bucket of one
contiguous segment is decoded straight into its parameter; a bucket of several segments (or a
non-contiguous parameter) through a staging buffer that is scattered into the parameters. The
writer is called from the training thread (a wait in ``step()``, a module's pre-hook, a unit's
fetch) and from the I/O thread (a per-layer wait's reply written as it lands): one lock orders
them, and resident buckets share one staging buffer under it.
"""

from __future__ import annotations

import threading

import torch

from luwu.gpu_workers.pool import BufferPool
from luwu.gpu_workers.segments import gather, scatter
from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import StepMismatchError
from luwu.protocol.layout import Layout

#: A reply header's mark: its weights were written as it landed (the frames are gone)
WRITTEN = "written_on_arrival"


class WeightWriter:
    """Writes replies into the parameters, bucket by bucket, and remembers each bucket's version
    (a delta reply must step from the version written last). ``streamed``: buckets without a
    staging buffer of their own (they borrow one from ``pool``, ``reclaim`` making room)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        layout: Layout,
        nodes: list[str],
        streamed: frozenset[int] = frozenset(),
        pool: BufferPool | None = None,
        reclaim=None,
    ):
        self.params, self.layout, self.nodes, self.pool = params, layout, nodes, pool
        self.reclaim = reclaim  # how the pool gets a buffer back when none is free
        self.multi = [
            len(b.segments) > 1 or not params[b.segments[0].param].is_contiguous()
            for b in layout.buckets
        ]
        # one staging buffer serves every resident bucket (they are written one at a time)
        size = max(
            (b.numel for b, m in zip(layout.buckets, self.multi) if m and b.id not in streamed),
            default=0,
        )
        staging = torch.zeros(size)
        self.staging = [
            staging[: b.numel] if m and b.id not in streamed else None
            for b, m in zip(layout.buckets, self.multi)
        ]
        # a multi-segment bucket of contiguous parameters: a delta codec that can step each segment where it
        # is (bf16_steps) skips the staging buffer (gathered from them, scattered back)
        self.in_place = [
            m and all(params[s.param].is_contiguous() for s in b.segments)
            for b, m in zip(layout.buckets, self.multi)
        ]
        self.versions = [-1] * len(layout.buckets)
        self.lock = threading.Lock()

    def write(self, bid: int, msg: wire.Message) -> None:
        """Decode ``msg`` (bucket ``bid``'s new weights) into the parameters; a reply already
        written as it landed (:data:`WRITTEN`) is skipped."""
        if msg.header.get(WRITTEN):
            return
        with self.lock:
            self._write_locked(bid, msg)

    def _write_locked(self, bid: int, msg: wire.Message) -> None:
        b, h = self.layout.buckets[bid], msg.header
        codec = get_codec(h["codec"])
        codec.validate(b.numel, h.get("nbytes", []), h["cmeta"])
        delta = h.get("delta", False)  # int8 deltas / bf16 steps from the weights this worker holds
        if delta and self.versions[bid] != h["step"] - 1:
            # (a reply of an abandoned timeline, one missed): nothing changes
            node = self.nodes[b.node]
            raise StepMismatchError(
                f"node {node} sent bucket {b.id}'s weights of step {h['step']} as {h['codec']} "
                f"from those of step {h['step'] - 1}, this worker holds step "
                f"{self.versions[bid]}'s: nothing written (recover() pulls them whole)",
                node=node,
                step=h["step"],
                bucket=b.id,
            )
        frames = msg.tensors()
        with torch.no_grad():
            if not self.multi[bid]:
                s = b.segments[0]
                target = self.params[s.param].data.view(-1).narrow(0, s.param_offset, s.numel)
                (codec.decode_add_ if delta else codec.decode_)(target, frames, h["cmeta"])
            elif not (delta and self._step_in_place(bid, codec, frames, h["cmeta"])):
                self._write_staged(bid, codec, frames, h["cmeta"], delta)
        self.versions[bid] = h["step"]

    def _step_in_place(self, bid: int, codec, frames, cmeta) -> bool:
        """A delta written into each segment's parameter slice where it is, if the codec can
        (``decode_add_segments_``); False: nothing written, stage it."""
        step = getattr(codec, "decode_add_segments_", None)
        if step is None or not self.in_place[bid]:
            return False
        segs = self.layout.buckets[bid].segments
        targets = [
            self.params[s.param].data.view(-1).narrow(0, s.param_offset, s.numel) for s in segs
        ]
        return step(targets, frames, cmeta)

    def _write_staged(self, bid: int, codec, frames, cmeta, delta: bool) -> None:
        b, staging = self.layout.buckets[bid], self.staging[bid]
        borrowed = staging is None
        if borrowed:
            staging = self.pool.take(b.numel, self.reclaim)
        try:
            if delta:
                gather(b, self.params, staging)
                codec.decode_add_(staging, frames, cmeta)
            else:
                codec.decode_(staging, frames, cmeta)
            scatter(b, self.params, staging)
        finally:
            if borrowed:
                self.pool.give(staging)

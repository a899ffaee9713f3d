"""The outbox: everything a node sends, and the replies it holds before sending.

Sends never block: a connection whose send queue is full loses the message (counted, and named in
the log once). An UPDATE to a worker that asked to have its replies held until its ``step()``
(:mod:`.held_replies`) waits here, its encoded frames shared by the workers it goes to; the
others go at once, a step's weights in the order the next forward reads the buckets. ERROR
replies echo what can be read of the refused header.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError
from luwu.protocol.messages import Op
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.held_replies import HeldReplies
from luwu.switch_nodes.listener import SendQueueFull
from luwu.switch_nodes.replies import Payload, update_message
from luwu.switch_nodes.store import BucketState

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """Sending for one node: to a connection, to a worker rank, and UPDATEs held or sent."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        #: replies held until their worker's step() (sync mode)
        self.held = HeldReplies(self.send_to, cfg.mode == "sync", cfg.rcvhwm // 2, ctx.connected)
        self._full_told: set[bytes] = set()  # connections named in the log for not reading

    def send(self, ident: bytes, frames: list, track: bool = False, priority=None):
        """Send without blocking; returns the send tracker when ``track`` (see
        :meth:`Listener.send`). A full queue drops the message."""
        try:
            return self.ctx.listener.send(ident, frames, track, priority)
        except SendQueueFull:
            self.ctx.metrics.errors.labels("send_queue_full").inc()
            if ident not in self._full_told:  # once per connection: a peer that does not read
                if len(self._full_told) > 4096:
                    self._full_told.clear()
                self._full_told.add(ident)
                log.warning(
                    "send queue full for %s (%r): it does not read; its replies are dropped "
                    '(luwu_node_errors_total{code="send_queue_full"} counts them)',
                    self.ctx.who(ident),
                    ident,
                )
            return None

    def send_to(self, worker: int, frames: list, track: bool = False, priority=None):
        """:meth:`send` to a connected worker rank (nothing if it is not connected); through an
        aggregator, the header names the rank (``ranks``) so that it reaches that worker."""
        ident = self.ctx.peers.get(worker)
        if ident is None:
            return None
        if ident in self.ctx.relays:
            frames = addressed(frames, [worker])
        return self.send(ident, frames, track, priority)

    def answer(self, ident: bytes, op: Op, worker: int, step: int, **fields: Any) -> None:
        """A header-only reply carrying the node's step."""
        header = {"op": op, "job": self.ctx.job, "step": step, "worker": worker, **fields}
        self.send(ident, wire.encode(header))

    def tell(
        self, worker: int, code: str, text: str, *, step: int, bucket: int, detail=None
    ) -> None:
        """An ERROR to ``worker`` that answers no message of its own (a lost peer, a failed step)."""
        frames = wire.error_message(
            self.ctx.job, code, text, step=step, worker=worker, bucket=bucket, detail=detail
        )
        self.send_to(worker, frames)

    def refuse(self, ident: bytes, body, exc: LuwuError) -> None:
        """Answer ERROR, echoing what can be read of the refused header (step, worker, bucket, op)."""
        code = getattr(exc, "code", "luwu")
        self.ctx.metrics.errors.labels(code).inc()
        hdr: dict = {}
        try:
            raw = getattr(body[0], "bytes", body[0]) if body else None
            h = msgpack.unpackb(raw, raw=False, strict_map_key=False) if body else {}
            hdr = h if isinstance(h, dict) else {}
        except Exception:
            pass

        def num(k, d):
            v = hdr.get(k, d)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else d

        step = exc.step if exc.step is not None else num("step", 0)
        detail = {"boot": exc.boot} if exc.boot is not None else None
        bucket = num("bucket", -1) if "bucket" in hdr else -1
        frames = wire.error_message(
            self.ctx.job,
            code,
            str(exc),
            ref_op=num("op", 0),
            step=step,
            worker=num("worker", 0),
            bucket=bucket,
            detail=detail,
        )
        self.send(ident, frames)

    def send_update(
        self,
        b: BucketState,
        workers: list[int],
        payload: Payload,
        *,
        skipped: bool = False,
        seq: int | None = None,
    ) -> list:
        """An UPDATE with ``payload`` to ``workers``, held for those not yet at ``step()`` of ``seq``;
        returns the (worker, tracker) pairs of the sends (for frames borrowed from the shard)."""
        data = update_message(self.ctx.job, b, payload, skipped=skipped, seq=seq)
        nbytes = sum(f.nbytes for f in data[1:])
        metrics, trackers = self.ctx.metrics, []
        # a step's weights: the next forward reads the buckets from the highest id down, so a
        # worker's queued replies go in that order (a PULL's answer, a streaming fetch, keeps its place)
        priority = (b.version, -b.id) if payload.frames and seq is not None else None
        relayed: dict[bytes, list[int]] = {}  # an aggregator's ranks get one message, once
        for w in workers:
            ident = self.ctx.peers.get(w)
            if ident is None:
                continue
            if ident in self.ctx.relays:
                relayed.setdefault(ident, []).append(w)
                continue
            later = (
                self.held.hold(w, seq, b.id, data, priority)
                if seq is not None and payload.frames
                else None
            )
            trackers.append((w, later or self.send_to(w, data, True, priority)))
            metrics.bytes_out.labels("update").inc(nbytes)
            if payload.frames:  # (an ack carries no weights)
                metrics.raw_out.labels("update").inc(b.numel * 4)
        for ident, ranks in relayed.items():
            tracker = self.send(ident, addressed(data, ranks), True, priority)
            trackers += [(w, tracker) for w in ranks]
            metrics.bytes_out.labels("update").inc(nbytes)
            if payload.frames:
                metrics.raw_out.labels("update").inc(b.numel * 4)
        return trackers


def addressed(frames: list, ranks: list[int]) -> list:
    """``frames`` with ``ranks`` in the header: the workers an aggregator passes a reply on to."""
    header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    header["ranks"] = ranks
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]

"""What a node sends back: a bucket's weights, encoded for the pull direction.

A reply is the bucket's weights after a step (to every worker that pushed
it), after INIT (to the workers that asked before the seed came) or on PULL
(full weights, to a joiner). The pull direction has its own codec, chosen by
the worker per push: a plain codec of the weights (``none`` = fp32 zero-copy
from the shard, ``bf16``...) or ``int8_delta``, int8 deltas against a shadow
copy of what the workers hold, with periodic full resync. Each is a
:class:`PullCodec`; a full resend (a PULL, a retried push) goes the plain way, and the bucket's
next reply is whole for everyone (the workers it went to hold other weights than the rest).
A streaming worker holds no weights between uses: it names ``ack`` as the pull
codec of its streamed buckets' pushes, and the reply is an UPDATE without
payload that says the step was applied (or skipped); it fetches the weights
with PULL just before it needs them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import zmq

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.feedback import DeltaEncoder
from luwu.protocol.messages import PULL_ACK as ACK
from luwu.protocol.messages import Op
from luwu.switch_nodes.held_replies import HeldReplies
from luwu.switch_nodes.store import BucketState

if TYPE_CHECKING:
    from luwu.switch_nodes.server import NodeServer

log = logging.getLogger(__name__)

#: The pull codec of int8 deltas against the workers' copy, and that of steps on the bf16 grid (every other
#: name is a plain codec).
INT8_DELTA, STEPS = "int8_delta", "bf16_steps"


class ReplyBuffers:
    """A bucket's replies in flight. An encoded reply gets frames of its own, freed once sent: a node holds
    the replies on their way (and those held for a worker's step()), not buffers per bucket; with
    ``node.retain_freed_memory`` the next reply reuses the freed memory without faulting it in. Borrowed
    frames (an fp32 reply goes zero-copy from the shard; ``int8_delta`` reuses its encoder's) are
    tracked, and whatever changes them first waits for those replies to leave (:meth:`wait_all`).

    A worker that does not read its replies never holds the optimizer thread for more than
    ``stuck_s``: its zero-copy replies are given up on (they may go out torn) and ``on_stuck`` is told
    its rank."""

    def __init__(
        self, on_stuck: Callable[[set[int]], None] | None = None, stuck_s: float = 15.0
    ) -> None:
        self._trackers: list = []  # (worker, MessageTracker) of the zero-copy replies in flight
        self.on_stuck, self.stuck_s = on_stuck, stuck_s

    def wait_all(self) -> None:
        """Before the weights change under replies sent zero-copy (a stuck worker's may be torn: it is lost)."""
        pairs, self._trackers = self._trackers, []
        deadline, stuck = time.monotonic() + self.stuck_s, set()
        for w, t in pairs:
            if w in stuck:
                continue
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                stuck.add(w)
        if stuck and self.on_stuck is not None:
            self.on_stuck(stuck)

    def sent(self, trackers: list) -> None:
        """``trackers``: (worker, MessageTracker) of replies just sent from borrowed frames."""
        self._trackers.extend((w, t) for w, t in trackers if t is not None)


class Payload(NamedTuple):
    """An encoded reply: the codec it went through, whether it is a delta, the codec's meta, the frames, and
    whether those are borrowed (the shard itself, or an encoder's buffers: they change after the reply)."""

    codec: str
    delta: bool
    meta: dict
    frames: list
    borrowed: bool = False


class PullCodec:
    """A plain pull codec: the weights themselves, through ``name``'s codec."""

    def __init__(self, name: str):
        self.name = name
        self.codec = get_codec(name)  # validates the name

    def encode(self, b: BucketState, buffers: ReplyBuffers) -> Payload:
        """The reply payload of the bucket's weights now (on the optimizer thread): fp32 zero-copy (the frame is
        the shard itself), any other codec into new frames."""
        enc = self.codec.encode(b.params)
        return Payload(self.name, False, enc.meta, enc.frames, self.name == "none")

    @property
    def full(self) -> PullCodec:
        """The codec of a full resend (a joiner, a retried push)."""
        return self

    def resync(self, bucket: int | None = None) -> None:
        """The weights changed outside a step (a restore, a state load): nothing to forget here."""

    def before_step(self, b: BucketState) -> None:
        """On the optimizer thread, just before the bucket's weights change in a step (or are skipped)."""


class AckPullCodec(PullCodec):
    """``ack``: a reply without weights (a streaming worker fetches them with PULL when it needs them)."""

    def __init__(self) -> None:
        self.name = ACK

    def encode(self, b: BucketState, buffers: ReplyBuffers) -> Payload:
        return Payload(ACK, False, {}, [])


class StepsPullCodec(PullCodec):
    """``bf16_steps``: the bf16 rounding of the weights as one-byte steps from the last one sent
    (:mod:`luwu.protocol.codecs.steps`). The old bits are taken just before the step
    (:meth:`before_step`, per-thread scratch of one bucket); a full ``bf16`` reply goes instead whenever
    the workers may not hold the rounding of the weights before the step: a bucket's first reply, after a
    resync, or when the last reply was not a step of this codec."""

    def __init__(self) -> None:
        self.name = STEPS
        self.codec = get_codec(STEPS)
        self._plain = PullCodec("bf16")
        self._synced: dict[
            int, int
        ] = {}  # bucket -> the version whose bf16 rounding the workers hold
        self._local = threading.local()  # (bucket, version, its bits) of the step being applied

    def before_step(self, b: BucketState) -> None:
        self._local.old = (b.id, b.version, self.codec.snapshot(b.params))

    def encode(self, b: BucketState, buffers: ReplyBuffers) -> Payload:
        bid, version, old = getattr(self._local, "old", (None, None, None))
        self._local.old = None
        held = self._synced.get(b.id)
        self._synced[b.id] = b.version
        if bid != b.id or held is None or held != version:
            return self._plain.encode(b, buffers)
        enc = self.codec.encode_steps(b.params, old)
        return Payload(self.name, True, enc.meta, enc.frames)

    @property
    def full(self) -> PullCodec:
        return self._plain

    def resync(self, bucket: int | None = None) -> None:
        if bucket is None:
            self._synced.clear()
        else:
            self._synced.pop(bucket, None)


class DeltaPullCodec(PullCodec):
    """``int8_delta``: int8 deltas against a shadow of what the workers hold, full weights (fp32) on the
    first reply, every ``resync_every`` steps, and after :meth:`resync`. One shadow per bucket serves
    every worker, since they all receive the same replies."""

    def __init__(self) -> None:
        self.name = INT8_DELTA
        self._plain = PullCodec("none")
        self._encoder = DeltaEncoder("int8")

    def encode(self, b: BucketState, buffers: ReplyBuffers) -> Payload:
        buffers.wait_all()  # the encoder reuses its buffers (a full reply is its shadow, zero-copy)
        enc = self._encoder.encode(b.id, b.params, b.version)
        return Payload(enc.codec, enc.delta, enc.encoded.meta, enc.encoded.frames, True)

    @property
    def full(self) -> PullCodec:
        return self._plain

    def resync(self, bucket: int | None = None) -> None:
        self._encoder.force_resync(bucket)


class Replies:
    """The reply room: pull codecs, per-bucket trackers of replies sent from borrowed frames, PULL, and sending
    weights to workers."""

    def __init__(self, node: NodeServer):
        self.node = node
        self.buffers: dict[int, ReplyBuffers] = {}
        self._delta: DeltaPullCodec | None = None  # made on first use: it holds a shadow per bucket
        self._steps: StepsPullCodec | None = (
            None  # made on first use: it knows which versions the workers hold
        )
        self._pending: dict[
            int, list[tuple[int, str]]
        ] = {}  # PULLs that came before the bucket's INIT
        self.held = HeldReplies(
            node.send_to, node.cfg.mode == "sync", node.cfg.rcvhwm // 2, node.connected
        )  # until the worker's step()

    def codec(self, name: str) -> PullCodec:
        """The pull codec named by a worker (raises on an unknown name)."""
        if name == ACK:
            return AckPullCodec()
        if name == STEPS:
            if self._steps is None:
                self._steps = StepsPullCodec()
            return self._steps
        if name != INT8_DELTA:
            return PullCodec(name)
        if self._delta is None:
            self._delta = DeltaPullCodec()
        return self._delta

    def add(self, bid: int) -> None:
        self.buffers[bid] = ReplyBuffers(self.node.not_reading, self.node.cfg.worker_timeout_s / 4)

    def reset(self) -> None:
        """Forget every bucket's buffers and pending PULLs (a restore replaced the buckets)."""
        self.buffers, self._pending = {}, {}
        self.held.forget()
        self.resync()

    def resync(self, bid: int | None = None) -> None:
        """The next delta reply of ``bid`` (or of every bucket) is full weights."""
        for codec in (self._delta, self._steps):
            if codec is not None:
                codec.resync(bid)

    def wait_sent(self, bid: int) -> None:
        """Wait until the replies leaving from the bucket's weights are out (before changing them)."""
        self.buffers[bid].wait_all()

    def encode(self, b: BucketState, codec: PullCodec) -> Payload:
        """On the optimizer thread."""
        return codec.encode(b, self.buffers[b.id])

    def on_pull(self, ident: bytes, msg: wire.Message) -> None:
        """Full weights to one worker, behind the queued steps (or once rank 0 has seeded the bucket)."""
        h = msg.header
        b = self.node.bucket(h)
        codec = self.codec(h["codec"]).full
        if not b.initialized:
            self._pending.setdefault(b.id, []).append((h["worker"], codec.name))
            return
        self.node.submit(lambda: self.send_current(b, [h["worker"]], codec))

    def initialized(self, b: BucketState) -> None:
        """Answer the PULLs that waited for the bucket's INIT."""
        for w, name in self._pending.pop(b.id, []):
            self.send(b, [w], self.encode(b, PullCodec(name)))

    async def send_current(
        self, b: BucketState, workers: list[int], codec: PullCodec, seq: int | None = None
    ) -> None:
        """Encode the bucket's weights on the optimizer thread (behind the queued steps) and send them."""
        gen = self.node.gen
        payload = await self.node.run(self._encode_for_some, b, codec)
        if gen == self.node.gen:
            self.send(b, workers, payload, seq=seq)

    def _encode_for_some(self, b: BucketState, codec: PullCodec) -> Payload:
        """The weights whole, for some workers (a PULL, a retried push): they will hold them as sent, the
        others what the last replies gave them (the bf16 rounding, int8_delta's shadow), so the next reply
        of the bucket goes whole to everyone (a step from either would be one from weights someone lacks)."""
        payload = self.encode(b, codec)
        self.resync(b.id)
        return payload

    def send(
        self,
        b: BucketState,
        workers: list[int],
        payload: Payload,
        *,
        skipped: bool = False,
        seq: int | None = None,
    ) -> None:
        """Send an UPDATE with ``payload`` to ``workers``. ``seq``: the step it answers (absent for a PULL)."""
        header = {
            "op": Op.UPDATE,
            "job": self.node.job,
            "step": b.version,
            "worker": 0,
            "bucket": b.id,
            "codec": payload.codec,
            "cmeta": payload.meta,
            "skipped": skipped,
        }
        if payload.delta:
            header["delta"] = True
        if seq is not None:
            header["seq"] = seq
        data = wire.encode(header, payload.frames)
        nbytes = sum(f.nbytes for f in data[1:])
        metrics, trackers = self.node.metrics, []
        # a step's weights: the next forward reads the buckets from the highest id down, so a worker's queued
        # replies go in that order (a PULL's answer, a streaming fetch, keeps its place)
        priority = (b.version, -b.id) if payload.frames and seq is not None else None
        for w in workers:
            if w in self.node.peers:
                later = (
                    self.held.hold(w, seq, b.id, data, priority)
                    if seq is not None and payload.frames
                    else None
                )
                trackers.append((w, later or self.node.send_to(w, data, True, priority)))
                metrics.bytes_out.labels("update").inc(nbytes)
                if payload.frames:  # (an ack carries no weights)
                    metrics.raw_out.labels("update").inc(b.numel * 4)
        if payload.borrowed:
            self.buffers[b.id].sent(trackers)

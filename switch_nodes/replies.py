"""The reply encoder: a bucket's weights, encoded for the pull direction.

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

:func:`encode_reply` turns a bucket and what the workers hold of it (the state of its pull codec:
the version whose bf16 rounding they hold, int8_delta's shadow) into a payload, and
:func:`update_message` into the UPDATE's frames; sending them is the outbox's (:mod:`.outbox`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.feedback import DeltaEncoder
from luwu.protocol.messages import PULL_ACK as ACK
from luwu.protocol.messages import Op
from luwu.switch_nodes.store import BucketState

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


def full_codec(name: str) -> PullCodec:
    """The codec of a full resend for the pull codec ``name`` (a PULL, a retried push): the weights
    whole, through a codec that keeps no state. Raises on an unknown name (it validates a push's
    pull codec)."""
    if name == ACK:
        return AckPullCodec()
    if name == STEPS:
        return PullCodec("bf16")
    if name == INT8_DELTA:
        return PullCodec("none")
    return PullCodec(name)


class PullCodecs:
    """The pull codecs the workers name, made on first use. The stateful ones are one per node:
    ``int8_delta`` holds a shadow per bucket, ``bf16_steps`` knows which version's rounding the
    workers hold."""

    def __init__(self) -> None:
        self._delta: DeltaPullCodec | None = None
        self._steps: StepsPullCodec | None = None

    def get(self, name: str) -> PullCodec:
        """The pull codec named by a worker (raises on an unknown name)."""
        if name == STEPS:
            if self._steps is None:
                self._steps = StepsPullCodec()
            return self._steps
        if name == INT8_DELTA:
            if self._delta is None:
                self._delta = DeltaPullCodec()
            return self._delta
        return full_codec(name)

    def resync(self, bid: int | None = None) -> None:
        """The next reply of ``bid`` (or of every bucket) is full weights: they changed outside a step,
        or some workers got them whole."""
        for codec in (self._delta, self._steps):
            if codec is not None:
                codec.resync(bid)


def encode_reply(b: BucketState, codec: PullCodec, lent: ReplyBuffers) -> Payload:
    """The reply payload of bucket ``b``'s weights now, for workers that hold what ``codec`` last sent
    of it (on the optimizer thread: it reads the weights). ``lent``: the replies borrowing the
    bucket's frames (an encoder that reuses its buffers waits for them)."""
    return codec.encode(b, lent)


def update_message(
    job: str, b: BucketState, payload: Payload, *, skipped: bool = False, seq: int | None = None
) -> list:
    """The UPDATE frames that carry ``payload`` of bucket ``b``. ``seq``: the step it answers (absent
    for a PULL)."""
    header = {
        "op": Op.UPDATE,
        "job": job,
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
    return wire.encode(header, payload.frames)

"""What a room of the node asks to happen elsewhere: effects, returned by its handlers.

A room decides; the server (:mod:`.server`) alone dispatches what it decided, by type, to the room
or the thread that does it. So no room holds another, and one gradient's walk reads as the effects
it turns into: a PUSH that completes a step gives :class:`Ready`, which (past a due checkpoint)
becomes :class:`ApplyStep`: the shard steps, the encoder encodes the weights, the outbox sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from luwu.protocol.messages import Op
from luwu.switch_nodes.replies import PullCodec
from luwu.switch_nodes.store import Accumulator, BucketState

__all__ = [
    "Answer",
    "ApplyPush",
    "ApplyStep",
    "Drop",
    "Effect",
    "GetState",
    "Norm",
    "Ready",
    "Recheck",
    "Release",
    "Reply",
    "Reset",
    "Seeded",
    "SendCurrent",
    "SendWeights",
    "Tell",
]


@dataclass(frozen=True, slots=True)
class Reply:
    """Frames to the connection ``ident``."""

    ident: bytes
    frames: list


@dataclass(frozen=True, slots=True)
class Answer:
    """A header-only reply to ``ident`` with the node's step (WELCOME, HEARTBEAT, BYE...)."""

    ident: bytes
    op: Op
    worker: int
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Tell:
    """An ERROR to worker ``worker`` that answers no message of its own (a lost peer, a failed step)."""

    worker: int
    code: str
    text: str
    step: int
    bucket: int
    detail: dict | None = None  # (``dropped``: the rank left the step's members, elastic mode)


@dataclass(frozen=True, slots=True)
class Ready:
    """All the pushes of (``bucket``, ``step``) are in: ``then`` goes on unless a due checkpoint
    holds it until every bucket has reached ``step``."""

    bucket: BucketState
    step: int
    then: Any  # ApplyStep | Norm


@dataclass(frozen=True, slots=True)
class ApplyStep:
    """Queue the optimizer step of (``bucket``, ``step``) with the gradient sum / ``divisor``, and
    reply with the new weights to the workers that pushed it."""

    bucket: BucketState
    step: int
    acc: Accumulator
    divisor: float
    skip: bool = False


@dataclass(frozen=True, slots=True)
class Norm:
    """Two-phase step: queue the squared norm of (``bucket``, ``step``)'s gradient / ``divisor`` and
    send it to the workers (NORM); they answer COMMIT."""

    bucket: BucketState
    step: int
    acc: Accumulator
    divisor: float


@dataclass(frozen=True, slots=True)
class ApplyPush:
    """Async mode: apply one worker's push now, then send the replies its staleness lets go."""

    bucket: BucketState
    acc: Accumulator


@dataclass(frozen=True, slots=True)
class SendWeights:
    """The bucket's weights as they are, through ``codec``, to ``workers`` (encoded now)."""

    bucket: BucketState
    workers: list[int]
    codec: PullCodec
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class SendCurrent:
    """The bucket's weights whole, through ``codec``, to ``workers``, encoded behind the queued steps;
    the next reply of the bucket then goes whole to everyone."""

    bucket: BucketState
    workers: list[int]
    codec: PullCodec
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class GetState:
    """STATE get: a snapshot of the bucket's tensors behind the queued steps, sent to ``ident``."""

    ident: bytes
    bucket: BucketState
    header: dict


@dataclass(frozen=True, slots=True)
class Seeded:
    """The bucket got its weights (INIT, IMPORT): the PULLs that waited for them are answered."""

    bucket: BucketState


@dataclass(frozen=True, slots=True)
class Drop:
    """Forget what is held for ``worker`` (a new connection, BYE, dropped from the job)."""

    worker: int


@dataclass(frozen=True, slots=True)
class Release:
    """``worker`` reached ``step()`` of ``step``: its held replies up to that step go."""

    worker: int
    step: int


@dataclass(frozen=True, slots=True)
class Recheck:
    """The members shrank: every open step that now has all its workers goes on."""


@dataclass(frozen=True, slots=True)
class Reset:
    """The buckets were replaced (a rollback): forget held replies, pending PULLs and what the
    workers hold of each bucket."""


Effect = (
    Reply
    | Answer
    | Tell
    | Ready
    | ApplyStep
    | Norm
    | ApplyPush
    | SendWeights
    | SendCurrent
    | GetState
    | Seeded
    | Drop
    | Release
    | Recheck
    | Reset
)

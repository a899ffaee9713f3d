"""Message kinds, the header schema and the frame codec of the LuWu wire.

A message is a list of ZeroMQ frames: frame 0 is a msgpack map (the header),
frames 1..n are raw payload bytes (codec output). Tensors never pass through
msgpack. :func:`decode` validates every header field against the schema of the
op before anything is allocated or written; the byte length of each payload
frame must equal the header's ``nbytes`` list. See PROTOCOL.md.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import msgpack

from luwu.protocol.errors import JobMismatchError, ProtocolError

if TYPE_CHECKING:
    import torch

VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
JOIN_PROPERTY = "X-Luwu-Join"
"""The ZMTP handshake property (READY metadata, ZeroMQ's ZMQ_METADATA) that carries a job's join secret."""


def join_metadata(secret: str) -> bytes:
    """The ZMQ_METADATA value that shows ``secret`` to a node in the handshake."""
    return f"{JOIN_PROPERTY}:{secret}".encode()


class Op(enum.IntEnum):
    HELLO = 1  # worker -> node: identity, layout hash, this node's buckets
    WELCOME = 2  # node -> worker: accepted; node step, initialized buckets
    INIT = 3  # worker 0 -> node: initial fp32 weights of a bucket
    PUSH = 4  # worker -> node: gradient of (step, bucket) + hyperparameters
    UPDATE = 5  # node -> worker: new weights of a bucket (the reply to PUSH, PULL)
    PULL = 6  # worker -> node: send me the weights of a bucket
    STATE = 7  # worker <-> node: get or set optimizer state of a bucket
    CHECKPOINT = 8  # worker -> node: write a checkpoint now
    STATS = 9  # anyone -> node: counters, step, workers (for `luwu status`)
    HEARTBEAT = 10  # both ways: liveness
    ERROR = 11  # node -> worker: refusal with a code
    NORM = 12  # node -> worker: partial squared norm / non-finite flag of an aggregated bucket
    COMMIT = 13  # worker -> node: apply step with this clip/unscale coefficient, or skip it
    ROLLBACK = 14  # worker -> node: roll this node back to a checkpointed step
    EXPORT = 15  # worker -> node: write your shard of the weights into a DCP folder; node -> worker: what was written
    BYE = 16  # worker -> node: this rank leaves the job (a clean close); node -> worker: its rank is free
    IMPORT = 17  # worker -> node: read your shard of a training checkpoint (a DCP folder); node -> worker: done


#: The ``pull`` of a PUSH whose reply carries no weights, only that the step was applied (streaming mode).
PULL_ACK = "ack"

I, F, S, B, L, D, N = int, float, str, bool, list, dict, type(None)  # noqa: E741

# Fields every message carries, then the fields of each op: name -> allowed types.
COMMON: dict[str, tuple] = {"v": (I,), "op": (I,), "job": (S,), "step": (I,), "worker": (I,)}
SCHEMA: dict[Op, dict[str, tuple]] = {
    Op.HELLO: {
        "world_size": (I,),
        "layout": (S,),
        "node_index": (I,),
        "buckets": (L,),
        "optimizer": (S,),
        "mode": (S,),
    },
    Op.WELCOME: {"layout": (S,), "versions": (D,), "initialized": (L,)},
    Op.INIT: {"bucket": (I,), "codec": (S,), "cmeta": (D,), "nbytes": (L,)},
    Op.PUSH: {
        "bucket": (I,),
        "codec": (S,),
        "cmeta": (D,),
        "nbytes": (L,),
        "hyper": (D,),
        "nograd": (L,),
        "two_phase": (B,),
        "pull": (S,),
    },
    Op.UPDATE: {"bucket": (I,), "codec": (S,), "cmeta": (D,), "nbytes": (L,), "skipped": (B,)},
    Op.PULL: {"bucket": (I,), "codec": (S,)},
    Op.STATE: {"bucket": (I,), "action": (S,), "names": (L,), "nbytes": (L,)},
    Op.CHECKPOINT: {},
    Op.STATS: {},
    Op.HEARTBEAT: {},
    Op.ERROR: {"code": (S,), "message": (S,), "ref_op": (I,), "bucket": (I,)},
    Op.NORM: {"bucket": (I,), "sqnorm": (F,), "nonfinite": (B,)},
    Op.COMMIT: {"coef": (F,), "skip": (B,), "buckets": (L,)},
    Op.ROLLBACK: {},
    Op.EXPORT: {"path": (S,)},
    Op.BYE: {},
    Op.IMPORT: {"path": (S,)},
}
# Optional fields (checked when present).
OPTIONAL: dict[str, tuple] = {
    "seq": (I,),
    "detail": (D,),
    "ahead": (I,),
    "delta": (B,),
    "param_names": (D,),
    "partial": (B,),
    "resume": (B,),
    "in_order": (B,),
    "relay": (B,),
    "ranks": (L,),
    "prescaled": (I,),
    "micro": (I,),
    "retry": (B,),
    "pulls": (D,),
    "wait_s": (F, I),
    "streamed": (B,),
}
"""``partial`` (PUSH): a micro-batch's gradient under ``no_sync()`` in streaming mode; the node adds it
to the step's sum and answers nothing; the worker's last push of the step comes without it. ``resume``
(HELLO): the worker continues the job from the step the nodes hold (``RemoteOptimizer(resume=True)``, or
``recover()``); without it, nodes holding the job at a step past 0 with no live worker refuse the HELLO.
``in_order`` (WELCOME): the node bounds its pushes in flight (``node.push_memory_bytes``); the worker sends
it its pushes in the order it made them, the same order on every worker, so the node opens a step's
buckets one after another instead of all of them at once. The switch tier (``luwu aggregator``):
``relay`` (HELLO) says the connection is an aggregator's, standing for every rank that says HELLO
through it; ``ranks`` (PUSH) names the ranks whose pushes an aggregator summed into this one, an aligned
block of the step's ranks, each decoded times ``1 / prescaled`` (the job's world size) as the node would;
``ranks`` (UPDATE, NORM) names the ranks a relayed reply answers, sent once to their aggregator;
``streamed`` (PUSH) marks a streamed unit's bucket, pushed without error feedback (the worker keeps
nothing of it between uses): an aggregator's sum of it goes up without feedback too; ``wait_s``
(WELCOME to a ``relay``) is the node's ``worker_timeout_s``: an aggregator sends a block up as
it is, without a late rank's push, well before it (``detail.dropped`` of an ERROR: the node dropped the
rank, elastic mode; the aggregator stops waiting for it there). A worker
whose aggregator died sends its unanswered requests again to the nodes (:mod:`luwu.gpu_workers.fallback`):
``micro`` (a ``partial`` PUSH) is the micro-batch's index in its step, so a node counts each once;
``retry`` (COMMIT) asks for the weights of each bucket named in ``pulls`` (bucket -> reply codec) that
the node stepped already, whole."""


@dataclass(slots=True)
class Message:
    header: dict[str, Any]
    payload: list  # buffers (zmq.Frame / memoryview / bytes), one per payload frame

    @property
    def op(self) -> Op:
        return Op(self.header["op"])

    def tensors(self) -> list[torch.Tensor]:
        """The payload frames as 1-D uint8 tensors, without copying."""
        return [as_uint8(p) for p in self.payload]


def as_uint8(buf) -> torch.Tensor:
    """A zero-copy uint8 tensor over a received frame (read-only: never written)."""
    import torch  # here, not at the top: headers alone (STATS for `luwu status`) need no torch

    mv = memoryview(getattr(buf, "buffer", buf))
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers are fine: decoders only read
        return torch.frombuffer(mv, dtype=torch.uint8)


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor, for ``send_multipart(copy=False)``."""
    import torch

    if not t.is_contiguous():
        raise ValueError("payload tensors must be contiguous")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode(header: dict[str, Any], payload: Sequence[torch.Tensor] = ()) -> list:
    """Frames for ``header`` (op, job, step, worker... filled by the caller) and tensors."""
    frames = [tensor_frame(t) for t in payload]
    header["nbytes"] = [f.nbytes for f in frames]
    header["v"] = VERSION
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _where(h: dict) -> str:
    """Which message, for an error: its op, job, worker, step and bucket as received. A value that is
    not a scalar is named by its type (a peer's nested list would otherwise recurse in ``repr`` and
    fill the log line), a long one cut."""
    parts = [f"{k}={_short(h[k])}" for k in ("op", "job", "worker", "step", "bucket") if k in h]
    return ", ".join(parts)


def _short(value, limit: int = 80) -> str:
    if not isinstance(value, (str, bytes, int, float, bool, type(None))):
        return f"<{type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def decode(
    frames: Sequence,
    *,
    job: str | None = None,
    max_message_bytes: int = 1 << 31,
    header_only: bool = False,
) -> Message:
    """Validate and decode received frames; raises ProtocolError naming the fault. ``header_only``: the
    payload was dropped unread by the receiver; only the header is checked, and the message has none."""
    if not frames:
        raise ProtocolError("empty message")
    header = _header(frames[0])
    _check_fields(header)
    if job is not None and header["job"] != job:
        raise JobMismatchError(
            f"message of job {header['job']!r} refused: this node serves job {job!r} ({_where(header)})"
        )
    if header_only:
        return Message(header, [])
    payload = list(frames[1:])
    _check_payload(header, payload, max_message_bytes)
    return Message(header, payload)


def _header(raw) -> dict:
    """The header frame as a map of our protocol version, its op an :class:`Op`."""
    raw = getattr(raw, "bytes", raw)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types on garbage
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    v = header.get("v")
    if v != VERSION:
        raise ProtocolError(f"protocol version {v!r} not supported (this side speaks {VERSION})")
    try:
        raw_op = header.get("op")
        if type(raw_op) is not int:  # a float or bool is not an op
            raise TypeError
        op = Op(raw_op)
    except (ValueError, TypeError):
        raise ProtocolError(f"unknown op {header.get('op')!r}") from None
    header["op"] = op
    return header


def _check_fields(header: dict) -> None:
    """Every field the op needs, of its type; optional ones typed; nothing unknown."""
    op = header["op"]
    for name, types in (*COMMON.items(), *SCHEMA[op].items()):
        if name not in header:
            raise ProtocolError(f"{op.name} header lacks field {name!r} ({_where(header)})")
        val = header[name]
        if not isinstance(val, types) or (isinstance(val, bool) and bool not in types):
            raise ProtocolError(
                f"{op.name} field {name!r} has type {type(val).__name__}, expected {'/'.join(t.__name__ for t in types)} ({_where(header)})"
            )
    for name, types in OPTIONAL.items():
        val = header.get(name)
        if name in header and (
            not isinstance(val, types) or (isinstance(val, bool) and bool not in types)
        ):
            raise ProtocolError(
                f"{op.name} field {name!r} has type {type(header[name]).__name__} ({_where(header)})"
            )
    unknown = set(header) - set(COMMON) - set(SCHEMA[op]) - set(OPTIONAL) - {"nbytes"}
    if unknown:
        raise ProtocolError(
            f"{op.name} header has unknown fields {sorted(map(repr, unknown))} ({_where(header)})"
        )
    if header["step"] < 0 or header["worker"] < 0:
        raise ProtocolError(f"negative step or worker ({_where(header)})")


def _check_payload(header: dict, payload: list, max_message_bytes: int) -> None:
    """The payload frames are the ones the header's ``nbytes`` announces, within the maximum."""
    nbytes = header.get("nbytes", [])
    if not isinstance(nbytes, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nbytes
    ):
        raise ProtocolError(f"nbytes must be a list of non-negative ints ({_where(header)})")
    if len(nbytes) != len(payload):
        raise ProtocolError(
            f"header announces {len(nbytes)} payload frames, message has {len(payload)} ({_where(header)})"
        )
    total = 0
    for i, (n, p) in enumerate(zip(nbytes, payload)):
        got = len(getattr(p, "buffer", p)) if not isinstance(p, memoryview) else p.nbytes
        if got != n:
            raise ProtocolError(
                f"payload frame {i} has {got} bytes, header says {n} ({_where(header)})"
            )
        total += n
    if total > max_message_bytes:
        raise ProtocolError(
            f"payload of {total} bytes exceeds the maximum of {max_message_bytes} ({_where(header)})"
        )


def error_message(
    job: str,
    code: str,
    message: str,
    *,
    ref_op: int = 0,
    step: int = 0,
    worker: int = 0,
    bucket: int = -1,
    detail: dict | None = None,
) -> list:
    header = {
        "op": Op.ERROR,
        "job": job,
        "step": max(step, 0),
        "worker": max(worker, 0),
        "code": code,
        "message": message,
        "ref_op": int(ref_op),
        "bucket": bucket,
    }
    if detail:
        header["detail"] = detail
    return encode(header)

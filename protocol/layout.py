"""The layout: which parameter elements form which bucket, and which node owns it.

A pure function of (parameter names, shapes and groups, bucket_bytes, node
capacities): every worker and node computes it alike, and its hash travels in
HELLO so that a worker with another model is refused.

Buckets are built per parameter group (a bucket never mixes groups, so one
set of hyperparameters applies to it) and, inside a group, per **class**: the
*dense* class (1-D parameters and those under :data:`SMALL_NUMEL` elements:
biases, norms, small embeddings) and the *matrix* class (everything else) never
share a bucket. The compression policy picks one codec per bucket and must keep
small and 1-D tensors at bf16 at most, so one bias in a bucket of large
matrices would turn the whole bucket bf16; kept apart, the matrices get their
int8. Each class is packed in reverse registration order, the order in
which backward produces gradients, and a group's buckets are numbered in the
order backward completes them (by the last parameter each waits for), so
pushes still stream during backward. Parameters marked ``delayed`` (their
weights may land a step late: ``RemoteOptimizer(delayed_params=...)``) form
classes of their own too, so a bucket is delayed whole or not at all; so do the
parameters of each streaming **unit** (``RemoteOptimizer(stream_weights=True)``),
so a unit's weights are fetched and its gradient pushed in buckets of its own. Small
parameters are never split; a parameter larger than a bucket spans several, unless it is
marked ``whole`` (an optimizer whose update needs the whole parameter, Adafactor): then
it gets a bucket of its own, larger than ``bucket_bytes``. Buckets of later groups come
after earlier ones, so ``add_param_group`` only appends buckets. Owners are
chosen greedily, each bucket to the node with the least bytes per unit of
capacity so far.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from luwu.protocol.errors import ConfigError, ProtocolError

FP32_BYTES = 4

#: Parameters under this many elements (and every 1-D one) form the dense class, bucketed apart from
#: the matrices. The compression policy's default ``small_numel`` is this same line.
SMALL_NUMEL = 65536


def is_dense_class(shape: tuple[int, ...]) -> bool:
    """1-D (or scalar) or under :data:`SMALL_NUMEL` elements: bucketed apart from the large matrices."""
    return len(shape) <= 1 or math.prod(shape) < SMALL_NUMEL


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the layout needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    group: int = 0
    delayed: bool = False
    """Its weights may land a step late (partial delayed update): never in a bucket with others."""
    unit: int = -1
    """The streaming unit it belongs to (-1: none, resident): a bucket never spans two units, so a
    unit's weights are fetched and its gradient pushed bucket by bucket, with no other unit's elements."""
    whole: bool = False
    """Never split across buckets, even when larger than one: the optimizer's update needs the whole
    parameter on one node (Adafactor's row and column statistics and whole-parameter norms)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of one parameter's (flattened) elements inside a bucket."""

    param: int  # index of the parameter in the flat list of all parameters
    name: str
    shape: tuple[int, ...]  # shape of the whole parameter
    param_offset: int  # first element of the parameter covered
    offset: int  # where it starts inside the bucket
    numel: int
    whole: bool = (
        False  # the whole parameter, never split (ParamSpec.whole): its shape travels with it
    )


@dataclass(frozen=True, slots=True)
class Bucket:
    id: int
    node: int
    group: int
    numel: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * FP32_BYTES

    def to_wire(self) -> list:
        """The bucket as HELLO carries it and a node checkpoints it:
        ``[id, group, numel, [[param, param_offset, offset, numel], ...]]`` (positions only: names and
        shapes stay with the workers, except that a ``whole`` segment carries its parameter's shape as a
        fifth item, for the optimizer). Compared by nodes when a layout is extended."""
        return [
            self.id,
            self.group,
            self.numel,
            [
                [s.param, s.param_offset, s.offset, s.numel, *([list(s.shape)] if s.whole else [])]
                for s in self.segments
            ],
        ]

    @classmethod
    def from_wire(cls, spec: Any, *, node: int = -1) -> Bucket:
        """Parse and validate what :meth:`to_wire` wrote (from an untrusted peer: every field checked).
        The segments carry positions only (empty name and shape; the shape of a whole one). Raises
        :class:`ProtocolError`."""
        if (
            not isinstance(spec, list)
            or len(spec) != 4
            or not _ints(spec[:3], 3)
            or not isinstance(spec[3], list)
        ):
            raise ProtocolError(
                f"malformed bucket spec {str(spec)[:200]}: expected [id, group, numel, [[param, param_offset, offset, numel], ...]]"
            )
        bid, group, numel, segs = spec
        if not all(_segment_ok(x) for x in segs):
            raise ProtocolError(
                f"bucket {bid}: each segment must be 4 ints [param, param_offset, offset, numel] (and a whole one's shape)"
            )
        if numel <= 0 or bid < 0 or group < 0 or not segs:
            raise ProtocolError(f"bad bucket spec header {spec[:3]!r}")
        segments, off = [], 0
        for param, param_offset, offset, n, *shape in segs:
            if offset != off or n <= 0 or param < 0 or param_offset < 0:
                raise ProtocolError(f"bucket {bid}: segments are not contiguous and positive")
            if shape and (
                param_offset != 0 or any(d < 0 for d in shape[0]) or math.prod(shape[0]) != n
            ):
                raise ProtocolError(
                    f"bucket {bid}: a whole segment of {n} elements at {param_offset} with shape {shape[0]}"
                )
            segments.append(
                Segment(
                    param,
                    "",
                    tuple(shape[0]) if shape else (),
                    param_offset,
                    offset,
                    n,
                    bool(shape),
                )
            )
            off += n
        if off != numel:
            raise ProtocolError(f"bucket {bid}: segments cover {off} elements, spec says {numel}")
        return cls(bid, node, group, numel, tuple(segments))


def _ints(xs: Any, n: int) -> bool:
    return isinstance(xs, list) and len(xs) == n and all(type(x) is int for x in xs)


def _segment_ok(x: Any) -> bool:
    """4 ints, or (a whole segment) 4 ints and a list of ints, its parameter's shape."""
    return _ints(x, 4) or (
        isinstance(x, list)
        and len(x) == 5
        and _ints(x[:4], 4)
        and isinstance(x[4], list)
        and _ints(x[4], len(x[4]))
    )


@dataclass(frozen=True, slots=True)
class Layout:
    params: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    num_nodes: int
    bucket_bytes: int
    capacities: tuple[float, ...]
    hash: str

    def buckets_of(self, node: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.node == node)

    def node_bytes(self) -> list[int]:
        out = [0] * self.num_nodes
        for b in self.buckets:
            out[b.node] += b.nbytes
        return out

    def windows(self, bids: list[int], nbytes: int) -> list[list[int]]:
        """``bids`` in order, cut into runs of at most ``nbytes`` (fp32) each (a larger bucket alone)."""
        out: list[list[int]] = []
        size = nbytes
        for bid in bids:
            b = self.buckets[bid]
            if size + b.nbytes > nbytes:
                out.append([])
                size = 0
            out[-1].append(bid)
            size += b.nbytes
        return out

    def unit_buckets(self) -> dict[int, list[int]]:
        """Streaming unit -> ids of its buckets (a bucket holds one unit's parameters only, or none's)."""
        out: dict[int, list[int]] = {}
        for b in self.buckets:
            unit = self.params[b.segments[0].param].unit
            if unit >= 0:
                out.setdefault(unit, []).append(b.id)
        return out

    def streamed_buckets(self) -> frozenset[int]:
        """Ids of the buckets of streaming units."""
        return frozenset(b for bids in self.unit_buckets().values() for b in bids)

    def delayed_buckets(self) -> frozenset[int]:
        """Ids of the buckets of delayed parameters (a bucket holds delayed parameters only, or none)."""
        return frozenset(
            b.id for b in self.buckets if b.segments and self.params[b.segments[0].param].delayed
        )


def _split_group(
    indices: list[int], params: tuple[ParamSpec, ...], cap: int
) -> list[list[tuple[int, int, int]]]:
    """Pack parameters (reverse order) into buckets of at most ``cap`` elements.

    Returns, per bucket, (param index, param_offset, numel) triples.
    """
    buckets: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for idx in reversed(indices):
        n, whole = params[idx].numel, params[idx].whole
        if n == 0:
            continue
        # A parameter that fits in one bucket is not split across two; a whole one is never split.
        if used and (n <= cap or whole) and used + n > cap:
            buckets.append(cur)
            cur, used = [], 0
        start = 0
        while start < n:
            take = n - start if whole else min(n - start, cap - used)
            cur.append((idx, start, take))
            used += take
            start += take
            if used >= cap:
                buckets.append(cur)
                cur, used = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def build_layout(
    params: list[ParamSpec] | tuple[ParamSpec, ...],
    bucket_bytes: int,
    capacities: list[float] | tuple[float, ...],
) -> Layout:
    """Compute the layout; ``capacities`` has one positive weight per node."""
    params = tuple(params)
    if bucket_bytes < FP32_BYTES:
        raise ConfigError(f"bucket_bytes must be >= {FP32_BYTES}, got {bucket_bytes}")
    if not capacities:
        raise ConfigError("the node list is empty: a layout needs at least one node")
    if any(not (c > 0 and math.isfinite(c)) for c in capacities):
        raise ConfigError(f"node capacities must be positive and finite, got {list(capacities)}")
    cap = bucket_bytes // FP32_BYTES
    groups = sorted({p.group for p in params})
    loads = [0.0] * len(capacities)
    buckets: list[Bucket] = []
    for g in groups:
        idxs = [i for i, p in enumerate(params) if p.group == g]
        parts_of_group = []
        for unit in sorted({params[i].unit for i in idxs}):
            for delayed in (False, True):
                for dense in (False, True):
                    cls = [
                        i
                        for i in idxs
                        if is_dense_class(params[i].shape) == dense
                        and params[i].delayed == delayed
                        and params[i].unit == unit
                    ]
                    parts_of_group += _split_group(cls, params, cap)
        # in the order backward completes them: a bucket is full when its first-registered
        # parameter's gradient arrives (stable: a parameter spanning buckets keeps its order)
        parts_of_group.sort(key=lambda parts: -min(idx for idx, _, _ in parts))
        for parts in parts_of_group:
            segs, off = [], 0
            for idx, poff, n in parts:
                p = params[idx]
                segs.append(Segment(idx, p.name, tuple(p.shape), poff, off, n, p.whole))
                off += n
            # least loaded per unit of capacity after adding; ties go to the lower index
            node = min(range(len(capacities)), key=lambda k: ((loads[k] + off) / capacities[k], k))
            loads[node] += off
            buckets.append(Bucket(len(buckets), node, g, off, tuple(segs)))
    described = {
        "params": [[p.name, list(p.shape), p.group] for p in params],
        "bucket_bytes": bucket_bytes,
        "classes": ["dense-apart", SMALL_NUMEL],
        "capacities": [float(c) for c in capacities],
    }
    if any(
        p.delayed for p in params
    ):  # (absent otherwise: layouts without delayed parameters keep their hash)
        described["delayed"] = [i for i, p in enumerate(params) if p.delayed]
    if any(p.unit >= 0 for p in params):  # (likewise: resident layouts keep their hash)
        described["units"] = [p.unit for p in params]
    if any(p.whole for p in params):  # (likewise)
        described["whole"] = [i for i, p in enumerate(params) if p.whole]
    digest = hashlib.sha256(
        json.dumps(
            described,
            separators=(",", ":"),
        ).encode()
    ).hexdigest()[:16]
    return Layout(
        params,
        tuple(buckets),
        len(capacities),
        bucket_bytes,
        tuple(float(c) for c in capacities),
        digest,
    )

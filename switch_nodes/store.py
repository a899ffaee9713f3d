"""The shard store: a node's buckets as flat fp32 tensors with optimizer state.

One :class:`BucketState` per owned bucket: the master weights, the optimizer
state (same numel), one step counter per segment (torch keeps one per
parameter), and the gradient accumulators of steps in flight. Those come from
the node's :class:`AccumulatorPool`, shared by every bucket: taken when a step's
pushes of a bucket are first decoded (the first push of several is held as
received) and given back when the step is applied, so a node holds accumulators
for the (step, bucket) pairs in flight, not one per bucket, and reuses them. State
that torch creates only with some hyperparameters (RMSprop's
``momentum_buffer``, amsgrad's ``max_exp_avg_sq``) is allocated when first used
(:class:`FlatState`). A kind whose state is shaped per parameter (Adafactor's
row and column statistics) keeps it per segment instead (:class:`SegmentState`),
each segment then being one whole parameter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from luwu.protocol.errors import ConfigError, StepMismatchError
from luwu.protocol.layout import Bucket
from luwu.switch_nodes.kept_frames import mapped
from luwu.switch_nodes.optimizers import OptimizerKind, apply_
from luwu.switch_nodes.summation import RankTree, Summed


@dataclass(slots=True)
class SegmentSpec:
    """Where a segment lies: its parameter, the first element of it covered, its offset in the bucket and
    its length (the positions of a :class:`luwu.protocol.layout.Segment`; either serves a bucket); for a
    parameter kept whole (``whole``), its shape."""

    param: int
    param_offset: int
    offset: int
    numel: int
    shape: tuple[int, ...] = ()
    whole: bool = False


@dataclass(slots=True)
class Accumulator:
    """Sum of the pushes of one (step, bucket) received so far."""

    buf: torch.Tensor | None = None  # taken from the pool at the first decode (BucketState.buffer)
    workers: set = field(default_factory=set)
    nograd: tuple = ()
    hyper: dict | None = None
    two_phase: bool = False
    first_at: float = 0.0
    norm_sent: bool = False
    started: bool = False  # handed to the optimizer queue (or its norm round): never twice
    pull: str = "none"  # codec of the weights in the reply
    prescale: float = (
        1.0  # the pushes were decoded times 1 / prescale (the 1/n of the average, folded in)
    )
    tree: RankTree | None = None  # the pushes summed in rank order (see add_push)
    partial: dict = field(
        default_factory=dict
    )  # worker -> micro-batch pushes summed so far (no_sync on the nodes)
    ticket: object = None  # what it counts in flight until given back (:class:`.inflight.Ticket`)


class AccumulatorPool:
    """Gradient accumulators shared by a node's buckets. Given-back buffers are kept for reuse (a write
    into fresh pages costs ~10x a reused one), up to ``keep_bytes`` (``node.inflight_bytes``); more than
    that in flight at once is allocated and freed again. ``peak_bytes``: the most ever taken at once.
    With a push budget, the budget lets kept buffers go when a ticket needs their room (:meth:`fit`)."""

    def __init__(self, keep_bytes: int = 1 << 62):
        self.keep_bytes = keep_bytes
        self.mapped = False  # (a budgeted node: buffers mapped on their own, off the heaps)
        self._free: dict[int, list[torch.Tensor]] = {}
        # (taken on the event loop, given back on the optimizer thread and the spill's I/O threads)
        self._lock = threading.Lock()
        self.free_bytes = self.taken_bytes = self.peak_bytes = 0

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(numel)
            buf = free.pop() if free else None
            if buf is not None:
                self.free_bytes -= numel * 4
            self.taken_bytes += numel * 4
            self.peak_bytes = max(self.peak_bytes, self.taken_bytes)
        return buf if buf is not None else self._new(numel)

    def _new(self, numel: int) -> torch.Tensor:
        if self.mapped:
            return torch.frombuffer(mapped(numel * 4), dtype=torch.float32)
        return torch.empty(numel, dtype=torch.float32)

    def give(self, buf: torch.Tensor) -> None:
        n = buf.numel() * 4
        with self._lock:
            self.taken_bytes -= n
            if self.free_bytes + n <= self.keep_bytes:
                self._free.setdefault(buf.numel(), []).append(buf)
                self.free_bytes += n

    def zeros(self, numel: int) -> torch.Tensor:
        """A zeroed tensor of ``numel`` that leaves the pool for good (a bucket's optimizer state, made
        at its first step): a kept free buffer if there is one, else a new one. A first step whose
        sums waited for the global round gives each bucket's sum back just before the next bucket's
        state is made, so that state takes the sums' memory instead of growing the node by it."""
        with self._lock:
            free = self._free.get(numel)
            buf = free.pop() if free else None
            if buf is not None:
                self.free_bytes -= numel * 4
        return buf.zero_() if buf is not None else torch.zeros(numel, dtype=torch.float32)

    def fit(self, room: int) -> None:
        """Keep no more than ``room`` bytes (the budget's room after a new ticket)."""
        with self._lock:
            for bufs in self._free.values():
                while bufs and self.free_bytes > room:
                    self.free_bytes -= bufs.pop().numel() * 4


class FlatState(Mapping):
    """A bucket's flat optimizer state by name: every name the kind declares, each a zero-initialised fp32
    tensor of the bucket's numel, allocated when first read (``zeros``: where from). The optimizer step
    reads only the names its hyperparameters use (``kind.state_for``), so state costs no memory before
    the bucket's first step (as torch creates it lazily), and optional state none while unused."""

    def __init__(
        self,
        names: tuple[str, ...],
        numel: int,
        allocate: tuple[str, ...] = (),
        zeros: Callable[[int], torch.Tensor] | None = None,
    ):
        self._names, self._numel = names, numel
        self._zeros = zeros or (lambda n: torch.zeros(n, dtype=torch.float32))
        self._tensors: dict[str, torch.Tensor] = {}
        for n in allocate:
            self[n]

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            if name not in self._names:
                raise KeyError(name)
            t = self._tensors[name] = self._zeros(self._numel)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def allocated(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def read(self, name: str) -> torch.Tensor:
        """The tensor of ``name``, without allocating it when unused (a zero tensor then, not kept)."""
        t = self._tensors.get(name)
        return t if t is not None else torch.zeros(self._numel, dtype=torch.float32)

    def write(self, name: str, value: torch.Tensor) -> None:
        """Set ``name`` to ``value``; an all-zero value for a state not allocated stays unallocated."""
        if name in self._tensors or bool(value.any()):
            self[name].copy_(value)

    @property
    def nbytes(self) -> int:
        return self._numel * 4 * len(self._tensors)


class SegmentState(Mapping):
    """A bucket's optimizer state shaped per segment, for a kind with ``shaped_state`` (Adafactor): by
    name, one tensor per segment of torch's shape for that whole parameter (``kind.state_shapes``), None
    where torch keeps no such state (``variance`` of a matrix). It is a fraction of the parameters' size,
    allocated whole.

    :meth:`read` and :meth:`write` use the flat form of :class:`FlatState`, which checkpoints and STATE
    carry: per name a tensor of the bucket's numel, each segment's state flattened at the start of the
    segment's slot (it never has more elements than the parameter), zeros elsewhere."""

    def __init__(
        self,
        kind: OptimizerKind,
        segments: list,
        numel: int,
        flats: Mapping[str, torch.Tensor] | None = None,
    ):
        """``flats``: storage to view instead of tensors of its own, per name the segments' state one
        after another, as :meth:`sizes` counts it (an out-of-core bucket's slot)."""
        self._names, self._numel, self._offsets = (
            kind.state_names,
            numel,
            [s.offset for s in segments],
        )
        shapes = self._shapes(kind, segments)
        if flats is None:
            self._tensors = {
                n: [torch.zeros(sh[n], dtype=torch.float32) if n in sh else None for sh in shapes]
                for n in self._names
            }
            return
        self._tensors = {n: [] for n in self._names}
        for n, views in self._tensors.items():
            pos = 0
            for sh in shapes:
                k = torch.Size(sh[n]).numel() if n in sh else 0
                views.append(flats[n].narrow(0, pos, k).view(sh[n]) if n in sh else None)
                pos += k

    @staticmethod
    def _shapes(kind: OptimizerKind, segments: list) -> list[dict[str, tuple[int, ...]]]:
        for s in segments:
            if not s.whole or s.param_offset != 0 or torch.Size(s.shape).numel() != s.numel:
                raise ConfigError(
                    f"optimizer {kind.name!r} needs each parameter whole in one bucket: parameter {s.param} is not (a layout built without ParamSpec.whole)"
                )
        return [kind.state_shapes(s.shape) for s in segments]

    @classmethod
    def sizes(cls, kind: OptimizerKind, segments: list) -> dict[str, int]:
        """Per name, the elements of the segments' state together (what ``flats`` must hold)."""
        shapes = cls._shapes(kind, segments)
        return {
            n: sum(torch.Size(sh[n]).numel() for sh in shapes if n in sh) for n in kind.state_names
        }

    def __getitem__(self, name: str) -> list[torch.Tensor | None]:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def allocated(self) -> tuple[str, ...]:
        return tuple(n for n, ts in self._tensors.items() if any(t is not None for t in ts))

    def read(self, name: str) -> torch.Tensor:
        out = torch.zeros(self._numel, dtype=torch.float32)
        for off, t in zip(self._offsets, self._tensors[name]):
            if t is not None:
                out.narrow(0, off, t.numel()).copy_(t.reshape(-1))
        return out

    def write(self, name: str, value: torch.Tensor) -> None:
        for off, t in zip(self._offsets, self._tensors[name]):
            if t is not None:
                t.copy_(value.narrow(0, off, t.numel()).view(t.shape))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for ts in self._tensors.values() for t in ts if t is not None)


class BucketState:
    """One owned bucket: master weights, optimizer state, step counters, accumulators of steps in flight."""

    def __init__(
        self,
        bid: int,
        group: int,
        numel: int,
        segments: list[SegmentSpec],
        kind: OptimizerKind,
        pool: AccumulatorPool | None = None,
    ):
        self.id, self.group, self.numel, self.segments, self.kind = (
            bid,
            group,
            numel,
            segments,
            kind,
        )
        self._pool = pool if pool is not None else AccumulatorPool()
        self.params = torch.zeros(numel, dtype=torch.float32)
        self.state = (
            SegmentState(kind, segments, numel)
            if kind.whole_params
            else FlatState(kind.state_names, numel, zeros=self._pool.zeros)
        )
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in segments]
        self.version = 0  # steps processed (applied or skipped)
        self.initialized = False
        self.accs: dict[int, Accumulator] = {}
        #: (step, squared norm, nonfinite) of the last two-phase step's NORM: a retried push gets it again
        self.last_norm: tuple | None = None
        self.worker_steps: dict[int, int] = {}  # async mode: the last step each worker pushed
        self.held: list[
            tuple[int, int, str]
        ] = []  # async mode: replies waiting for the slowest worker
        self.pviews = self._views(self.params)
        self._sviews: dict[str, list[torch.Tensor]] = {}

    def to_wire(self) -> list:
        """The bucket as HELLO described it (:meth:`luwu.protocol.layout.Bucket.to_wire`)."""
        return Bucket(self.id, -1, self.group, self.numel, tuple(self.segments)).to_wire()

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat.narrow(0, s.offset, s.numel) for s in self.segments]

    def state_views(self, name: str) -> list[torch.Tensor]:
        """The segment views of state ``name`` (allocating it on first use); with a :class:`SegmentState`
        its tensors, shaped as torch's (None for segments without that state)."""
        views = self._sviews.get(name)
        if views is None:
            views = self._sviews[name] = (
                self.state[name]
                if isinstance(self.state, SegmentState)
                else self._views(self.state[name])
            )
        return views

    def tensors(self) -> list[torch.Tensor]:
        """The weights, every state tensor (``kind.state_names`` order; zeros for state never used, not
        allocated for it) and the step counters: what a checkpoint or a STATE get holds."""
        return [
            self.params,
            *(self.state.read(n) for n in self.kind.state_names),
            torch.stack(self.steps) if self.steps else torch.zeros(0),
        ]

    def load(self, ts: list[torch.Tensor]) -> None:
        """Copy what :meth:`tensors` gave back into the bucket (all-zero unused state stays unallocated)."""
        self.params.copy_(ts[0])
        for n, t in zip(self.kind.state_names, ts[1:-1]):
            self.state.write(n, t)
        for s, v in zip(self.steps, ts[-1]):
            s.fill_(v)

    @property
    def nbytes(self) -> int:
        return self.numel * 4 + self.state.nbytes

    def accumulator(self, step: int, max_ahead: int) -> Accumulator:
        acc = self.accs.get(step)
        if acc is not None:
            return acc
        if step < self.version:
            raise StepMismatchError(
                f"bucket {self.id}: push for step {step}, already applied (node is at step {self.version})"
            )
        if step > self.version + max_ahead:
            raise StepMismatchError(
                f"bucket {self.id}: push for step {step} is too far ahead of step {self.version}"
            )
        acc = self.accs[step] = Accumulator(first_at=time.monotonic())
        return acc

    def buffer(self, acc: Accumulator) -> torch.Tensor:
        """The accumulator's buffer, taken from the pool at its first use."""
        if acc.buf is None:
            acc.buf = self._pool.take(self.numel)
        return acc.buf

    def add_push(
        self,
        acc: Accumulator,
        codec,
        frames: list[torch.Tensor],
        meta: dict,
        ranks: tuple[int, ...],
        rank: int,
        *,
        partial: bool = False,
        block: tuple[int, ...] | None = None,
        scaled_by: int = 0,
    ) -> None:
        """Sum rank ``rank``'s push into the accumulator, times 1/n, n = len(``ranks``) (the workers
        the step waits for): the average costs no pass of its own, and :meth:`apply` needs no
        ``grad_scale``.

        The pushes are summed as a pairwise tree over ``ranks`` (:class:`.summation.RankTree`): the
        same bits whatever order they arrive in; a push waits as received (its frames stay alive)
        until its left neighbours are in. A ``partial`` push (a micro-batch's gradient under
        ``no_sync()``, more of that worker's to come), or one of a rank the step's first push did not
        count, is added at once, in arrival order: its frames belong to a message the worker does not
        wait an answer for.

        A ``block`` push is an aggregator's sum of those ranks' pushes, each decoded times
        ``1 / scaled_by``: where it is one of the tree's subtrees it stands in for them (bit for bit
        the sum without the aggregator); else (a step that waits for other ranks than the
        aggregator's count, elastic mode) it is added as it comes, rescaled."""
        if not acc.workers and not acc.partial and acc.tree is None:
            acc.prescale = float(len(ranks))
            if not partial and (block or (rank,))[0] in ranks:
                acc.tree = RankTree(ranks, 1.0 / acc.prescale)
        tree = acc.tree
        if block is not None:
            codec = Summed(codec, scaled_by / acc.prescale, len(block))
            if tree is not None and codec.scale == 1.0 and tree.fits(block):
                tree.add_block(block, (codec, frames, meta), self._take, self._pool.give)
                if tree.complete:
                    self.settle(acc)
                return
            rank = -1  # (added as it comes, below)
        if tree is not None and not partial and rank in tree.ranks:
            tree.add(rank, (codec, frames, meta), self._take, self._pool.give)
            if tree.complete:
                self.settle(acc)
            return
        self.settle(acc)
        if acc.buf is None:
            codec.decode_(self.buffer(acc), frames, meta, 1.0 / acc.prescale)
        else:
            codec.decode_add_(self.buffer(acc), frames, meta, 1.0 / acc.prescale)

    def _take(self) -> torch.Tensor:
        return self._pool.take(self.numel)

    def settle(self, acc: Accumulator) -> None:
        """The tree's sum into the accumulator (complete, or the step goes on without some ranks: a
        worker was dropped)."""
        if acc.tree is not None:
            tree, acc.tree = acc.tree, None
            out = tree.result(self._take, self._pool.give)
            if out is not None:
                acc.buf = out

    def release(self, step: int) -> Accumulator:
        acc = self.accs.pop(step)
        self.give_back(acc)
        return acc

    def drop_sum(self, acc: Accumulator) -> None:
        """The step's sum was applied: its buffer back to the pool at once, on the optimizer thread, so
        the next bucket's first step makes its state in it (:meth:`AccumulatorPool.zeros`) rather than
        in new memory while the event loop has not yet released this step."""
        if acc.buf is not None:
            buf, acc.buf = acc.buf, None
            self._pool.give(buf)

    def give_back(self, acc: Accumulator) -> None:
        """Return the accumulator's buffer to the pool (its step is applied), and what it counted in
        flight."""
        if acc.buf is not None:
            self._pool.give(acc.buf)
            acc.buf = None
        if acc.tree is not None:
            acc.tree.release(self._pool.give)
            acc.tree = None
        if acc.ticket is not None:
            acc.ticket.release()
            acc.ticket = None

    def _kept(self, acc: Accumulator) -> list[int]:
        """The segments with a gradient this step."""
        return [i for i in range(len(self.segments)) if i not in acc.nograd]

    def grad_views(self, acc: Accumulator) -> tuple[list, list, dict, list]:
        keep = self._kept(acc)
        g = self._views(self.buffer(acc))
        sv = {n: self.state_views(n) for n in self.kind.state_for(acc.hyper or {})}
        return (
            [self.pviews[i] for i in keep],
            [g[i] for i in keep],
            {n: [v[i] for i in keep] for n, v in sv.items()},
            [self.steps[i] for i in keep],
        )

    def sqnorm(self, acc: Accumulator, divisor: float) -> tuple[float, bool]:
        """Squared L2 norm of the gradient sum / ``divisor`` (segments with a gradient) and whether any
        is non-finite. It reads the sum alone: a first step's state is made only when it is applied."""
        self.settle(acc)
        g = self._views(self.buffer(acc))
        total = 0.0
        for i in self._kept(acc):
            total += float(torch.dot(g[i], g[i]))
        finite = total == total and total != float("inf")
        k = acc.prescale / divisor
        return total * k * k, not finite

    def apply(self, acc: Accumulator, divisor: float) -> None:
        """Optimizer step with grads = (sum of the pushes) / ``divisor``. The pushes were decoded times
        1 / ``acc.prescale`` already (the expected worker count): when that is the divisor, the kernel
        runs without ``grad_scale``, which would cost it a write of the gradient back."""
        self.settle(acc)
        params, grads, state, steps = self.grad_views(acc)
        scale = divisor / acc.prescale
        grad_scale = None if scale == 1.0 else torch.tensor(scale, dtype=torch.float32)
        apply_(self.kind, params, grads, state, steps, acc.hyper or {}, grad_scale=grad_scale)

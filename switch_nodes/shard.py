"""The shard: a node's buckets, their versions and optimizer state, and the optimizer step.

:class:`Shard` is the seam the node's state goes through, with the interface a second,
out-of-core implementation needs (state files under ``node.state_dir`` and a
:class:`luwu.switch_nodes.ooc.StateWindow` in RAM): the buckets in the order they will step
(:meth:`Shard.set_order`, :meth:`Shard.in_step_order`), :meth:`Shard.load` a bucket's tensors
(the window's ``acquire``), :meth:`Shard.store` them back, as a new version when stepped
(``release``), and :meth:`Shard.commit` (``flush``: durable). :class:`ResidentShard` holds
everything in RAM: load and store cost nothing, and checkpoints make it durable.

The shard also knows which of its tensors are lent: an fp32 reply goes zero-copy from the weights
(``int8_delta``'s from its encoder's buffers), and nothing writes a bucket before those replies
left (:meth:`Shard.before_write`). A worker that leaves its replies unread holds the optimizer
thread for no longer than ``worker_timeout_s / 4``: ``on_stuck`` is told its rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from luwu.protocol.errors import ProtocolError
from luwu.protocol.layout import Bucket
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.optimizers import OptimizerKind
from luwu.switch_nodes.replies import Payload, PullCodec, ReplyBuffers, encode_reply
from luwu.switch_nodes.store import Accumulator, AccumulatorPool, BucketState

__all__ = ["ResidentShard", "Shard"]


class Shard:
    """A node's buckets (see the module's doc). Everything that reads or writes their tensors runs
    on the optimizer thread."""

    #: whether every bucket's tensors are in RAM for good (a reply may be encoded anywhere)
    in_ram = True

    def __init__(self, ctx: NodeContext, on_stuck: Callable[[set[int]], None]) -> None:
        self.ctx = ctx
        self.buckets: dict[int, BucketState] = {}
        #: gradient accumulators shared by the buckets (:class:`AccumulatorPool`); with
        #: node.push_memory_bytes, only those the budget has room for are kept (:mod:`.kept_frames`)
        self.accumulators = AccumulatorPool(ctx.cfg.inflight_bytes)
        self._on_stuck = on_stuck
        self._lent: dict[int, ReplyBuffers] = {}
        self._order: list[int] = []

    # ----------------------------------------------------------------- which buckets
    def bucket(self, bid: int) -> BucketState:
        """Bucket ``bid``; a bucket this node does not own is refused."""
        b = self.buckets.get(bid)
        if b is None:
            raise ProtocolError(f"bucket {bid} is not owned by node {self.ctx.index}")
        return b

    @property
    def step(self) -> int:
        """The node's step: the lowest version of its buckets."""
        return min((b.version for b in self.buckets.values()), default=0)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets.values())

    def make(self, spec: Bucket, kind: OptimizerKind) -> BucketState:
        """A bucket of ``spec``, not yet part of the shard (zero weights, no state)."""
        return BucketState(
            spec.id, spec.group, spec.numel, list(spec.segments), kind, self.accumulators
        )

    def add(self, spec: Bucket, kind: OptimizerKind, version: int) -> BucketState:
        """Own bucket ``spec`` from now on, at ``version`` (a group added mid-training starts at the
        job's step)."""
        b = self.buckets[spec.id] = self.make(spec, kind)
        b.version = version
        return b

    def replace(self, buckets: dict[int, BucketState]) -> None:
        """Hold ``buckets`` instead of the buckets held so far (a checkpoint restored)."""
        self.buckets, self._lent = buckets, {}
        self._order = [bid for bid in self._order if bid in buckets]

    def hold_state(self, b: BucketState, names: Iterable[str]) -> None:
        """Optimizer state ``names`` of ``b`` is about to be set nonzero (STATE set): make room for it
        where it is not held (on the optimizer thread). A shard in RAM holds every name."""

    def set_order(self, order: Iterable[int]) -> None:
        """The order in which the buckets will step from now on (an out-of-core shard reads ahead in
        it); buckets it leaves out step after, by id."""
        self._order = [bid for bid in order if bid in self.buckets]

    def in_step_order(self) -> list[BucketState]:
        """The buckets in the order they step (:meth:`set_order`, then by id)."""
        named = set(self._order)
        rest = sorted(bid for bid in self.buckets if bid not in named)
        return [self.buckets[bid] for bid in [*self._order, *rest]]

    # ----------------------------------------------------------------- the tensors
    def load(self, bid: int) -> BucketState:
        """Bucket ``bid`` with its tensors in RAM, until :meth:`store`."""
        raise NotImplementedError

    def store(self, bid: int, version: int | None = None, *, changed: bool = False) -> None:
        """Give bucket ``bid``'s tensors back; with ``version`` they were stepped and are kept as that
        version; ``changed``: they were changed outside a step (a seed, STATE set, IMPORT) and are kept."""
        raise NotImplementedError

    def discard(self, bid: int) -> None:
        """Give bucket ``bid``'s tensors back after a change that failed half-way."""
        self.store(bid)

    def commit(self) -> None:
        """Make every stored version durable."""
        raise NotImplementedError

    def close(self) -> None:
        """The node stops: commit and let go of what the shard holds open."""

    #: whether the shard's own files are its checkpoint (out of core: :meth:`commit` is a checkpoint)
    durable = False

    def make_durable(self) -> int | None:
        """Commit the stored versions from any thread; the step every bucket is durably at from then on
        (None: the shard has no files of its own)."""
        return None

    def reopen(self) -> dict | None:
        """At start: take up the state an earlier run of this node left in the shard's own files, and
        return the job's description (None: none, or a shard without files of its own)."""
        return None

    def roll_back(self, step: int) -> None:
        """Put every bucket at ``step`` from the shard's own files (ROLLBACK)."""
        raise NotImplementedError

    @contextmanager
    def loaded(self, bid: int, *, write: bool = False) -> Iterator[BucketState]:
        """Bucket ``bid`` with its tensors in RAM for the block; ``write``: the block changes them (kept
        when it completes, given up when it raises)."""
        b = self.load(bid)
        try:
            yield b
        except BaseException:
            self.discard(bid) if write else self.store(bid)
            raise
        self.store(bid, changed=write)

    def apply(
        self, b: BucketState, step: int, acc: Accumulator, divisor: float, skip: bool
    ) -> None:
        """The optimizer step of ``b`` with the gradient sum in ``acc`` / ``divisor`` (skipped: only
        the version moves); afterwards ``b`` is at version ``step + 1``."""
        self.load(b.id)
        if not skip:
            self.before_write(b.id)  # the last fp32 reply may still be leaving from the shard
            b.apply(acc, divisor)
            b.drop_sum(acc)
        self.store(b.id, step + 1)

    def step_bucket(
        self,
        b: BucketState,
        step: int,
        acc: Accumulator,
        divisor: float,
        skip: bool,
        codec: PullCodec,
    ) -> Payload:
        """:meth:`apply`, then the reply of the new weights for workers that hold what ``codec`` last
        sent (the optimizer thread)."""
        codec.before_step(b)  # (bf16 steps: the weights' bits before the step)
        self.apply(b, step, acc, divisor, skip)
        return encode_reply(b, codec, self.lent(b.id))

    def encode(self, b: BucketState, codec: PullCodec) -> Payload:
        """The reply of bucket ``b``'s weights now, through ``codec`` (a PULL, a seed's waiting PULLs)."""
        return encode_reply(b, codec, self.lent(b.id))

    # ----------------------------------------------------------------- lent to replies
    def lent(self, bid: int) -> ReplyBuffers:
        """The replies in flight that borrow bucket ``bid``'s tensors (or its encoder's buffers)."""
        buffers = self._lent.get(bid)
        if buffers is None:
            buffers = self._lent[bid] = ReplyBuffers(
                self._on_stuck, self.ctx.cfg.worker_timeout_s / 4
            )
        return buffers

    def before_write(self, bid: int) -> None:
        """Wait until the replies borrowing the bucket's tensors are out (before changing them)."""
        self.lent(bid).wait_all()


class ResidentShard(Shard):
    """The shard in RAM: every bucket's weights and optimizer state at hand."""

    def load(self, bid: int) -> BucketState:
        return self.buckets[bid]

    def store(self, bid: int, version: int | None = None, *, changed: bool = False) -> None:
        if version is not None:
            self.buckets[bid].version = version

    def commit(self) -> None:
        """Nothing to do: a resident shard is made durable by checkpoints."""

"""An aggregator's sums: its group's pushes of each (node, step, bucket), summed as the node would.

The node sums a (step, bucket)'s pushes as a pairwise tree over the job's ranks
(:class:`luwu.switch_nodes.summation.RankTree`). The group's ranks are cut into that tree's aligned
blocks (:func:`~luwu.switch_nodes.summation.aligned_blocks`); each block of two or more is summed here
with the same tree, every push decoded times ``1 / world_size`` as on the node, and goes up as one
fp32 PUSH naming the block's ``ranks``: the node folds it in where it would have built it, so the
sum has the same bits as without the aggregator. A block of one rank is the worker's push, passed
up as it came (its codec kept).

A rank that is late does not hold its block's other pushes back past the node's own deadline: a
block that waited ``late_after_s`` (a quarter of the node's ``worker_timeout_s``, which its WELCOME
tells) goes up as what it has, its partial sums as blocks (aligned subtrees still, so a late push
that comes after them completes the node's tree with the same bits) and its unfolded pushes as they
came (:meth:`GroupSums.overdue`). The node then sees each present rank and its watchdog names, or in
elastic mode drops, only the missing one. A rank the node dropped or that left (:meth:`GroupSums.gone`)
is not waited for at all until it says HELLO again (:meth:`GroupSums.back`); its pushes meanwhile
go up as they came, for the node to refuse or count.

Compression follows the workers: a block whose pushes all came fp32 (compression off, or a warm-up
step's) goes up fp32, bit for bit the flat sum. Otherwise its sum goes up under the hybrid policy
decided for the aggregator's own uplink (``compression``: its ``link_gbps``), with the error-feedback
residual kept here, per (node, bucket), as a worker keeps its own: except for a streamed unit's
bucket (its pushes say ``streamed``), whose workers keep no residual and whose sum keeps none here
either (it would be a copy of the model). Replies come back as they were.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from luwu.protocol import codec_facts
from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import ProtocolError, StepMismatchError
from luwu.protocol.feedback import ErrorFeedback
from luwu.protocol.layout import Bucket
from luwu.protocol.messages import Op
from luwu.protocol.policy import CompressionConfig, choose_codec
from luwu.switch_nodes.summation import RankTree, aligned_blocks

__all__ = ["GroupSums"]

#: How many steps back a block's finished sum is remembered (a retried push of it then goes up as it
#: came, for the node to recognise).
KEEP_DONE_STEPS = 4


@dataclass(slots=True)
class _Open:
    """One block's pushes of one (node, step, bucket) so far."""

    tree: RankTree
    header: dict  # the first push's header: what the summed push carries
    bucket: Bucket
    first_at: float = field(default_factory=time.monotonic)
    two_phase: bool = False
    compressed: bool = False  # a push came in another codec than fp32
    codec: str = "none"  # the last compressed push's codec (its workers' policy for the bucket)
    pushed: set = field(default_factory=set)
    streamed: bool = False  # a streamed unit's bucket: summed up without error feedback
    bodies: dict = field(default_factory=dict)  # rank -> its push as received, until folded


def _take(numel: int):
    return lambda: torch.empty(numel, dtype=torch.float32)


def _give(buf: torch.Tensor) -> None:
    pass


class GroupSums:
    """The sums of one aggregator's group (``group``: its ranks, contiguous) in a job of
    ``world_size`` ranks."""

    def __init__(
        self,
        group: tuple[int, ...],
        world_size: int,
        metrics=None,
        compression: CompressionConfig | None = None,
        max_open: int = 64,
    ):
        """``metrics``: an :class:`.metrics.AggregatorMetrics` to count into; ``compression``: the
        policy of the uplink (None: the defaults); ``max_open``: the most blocks that may wait for
        pushes at once (what the group's workers can make this process hold is bounded by it)."""
        self.group, self.world_size, self.metrics = group, world_size, metrics
        self.max_open = max_open
        self.compression = compression or CompressionConfig()
        self._feedback = ErrorFeedback()
        self._blocks = aligned_blocks(tuple(range(world_size)), group)
        self._block_of = {r: b for b in self._blocks for r in b}
        self._open: dict[tuple, _Open] = {}
        self._done: set[tuple] = set()
        self._newest = 0
        self._gone: dict[
            int, set[int]
        ] = {}  # node -> ranks it dropped or that left (not waited for)
        self.late_after_s: float | None = (
            None  # (the nodes' worker_timeout_s / 4, from their WELCOME)
        )

    @property
    def blocks(self) -> list[tuple[int, ...]]:
        return self._blocks

    def add(self, node: int, bucket: Bucket, msg: wire.Message, body: list) -> list[list] | None:
        """Rank ``msg``'s push to ``node`` (of ``bucket``): the messages to send up now (the push itself,
        a block's finished sum, its pieces) or None while its block waits for more pushes."""
        numel = bucket.numel
        h = msg.header
        r, step, bid = h["worker"], h["step"], h["bucket"]
        block = self._block_of.get(r)
        if block is None:
            raise ProtocolError(f"worker rank {r} is not in this aggregator's group {self.group}")
        key = (node, step, bid, block)
        gone = self._gone.get(node, set())
        if len(block) == 1 or key in self._done or h.get("partial") or r in gone:
            if self.metrics is not None:
                self.metrics.passed.inc()
            return [body]  # a leaf, a retry after the sum left, a micro-batch, a dropped rank's
        codec = get_codec(h["codec"])
        if codec.pull_only:
            raise ProtocolError(
                f"bucket {bid}: codec {codec.name!r} carries weights, not gradients"
            )
        codec.validate(numel, h["nbytes"], h["cmeta"])
        frames = msg.tensors()
        codec.check_payload(numel, frames, h["cmeta"])
        rec = self._open.get(key)
        if rec is None:
            if len(self._open) >= self.max_open:
                raise ProtocolError(
                    f"worker {r}: push of bucket {bid} step {step} would open a sum past the "
                    f"{self.max_open} that may wait for the rest of their pushes at once (steps "
                    f"open: {sorted({k[1] for k in self._open})[:8]}): a worker far ahead of its group"
                )
            rec = self._open[key] = _Open(RankTree(block, 1.0 / self.world_size), h, bucket)
        elif h["nograd"] != rec.header["nograd"]:
            raise StepMismatchError(
                f"bucket {bid} step {step}: worker {r} disagrees with worker "
                f"{rec.header['worker']} on which parameters have a gradient (nograd "
                f"{h['nograd']} against {rec.header['nograd']})"
            )
        if r in rec.pushed:
            return None  # a retry while the block waits: counted once
        rec.pushed.add(r)
        rec.two_phase = rec.two_phase or bool(h["two_phase"])
        rec.streamed = rec.streamed or bool(h.get("streamed"))
        if codec.name != "none":
            rec.compressed, rec.codec = True, h["codec"]

        rec.bodies[r] = body
        rec.tree.add(r, (codec, frames, h["cmeta"]), _take(numel), _give)
        rec.bodies = {q: b for q, b in rec.bodies.items() if not rec.tree.folded(q)}
        if self.metrics is not None:
            self.metrics.summed.inc()
        if rec.tree.complete:
            del self._open[key]
            if self.metrics is not None:
                self.metrics.sums.inc()
                self.metrics.group_wait.observe(time.monotonic() - rec.first_at)
            self._finished(key)
            total = rec.tree.result(_take(numel), _give)
            return [self._summed(node, bucket, rec, block, total)]
        if set(block) - gone <= rec.pushed:
            return self._pieces(key)  # every rank it waits for is in (the rest are gone)
        return None

    def overdue(self, now: float) -> list[tuple[int, int, list, list[int]]]:
        """The blocks that waited ``late_after_s`` for a rank, sent up as what they have: for each,
        (node, step, the frames of each piece, the late ranks)."""
        if self.late_after_s is None:
            return []
        out = []
        for key, rec in list(self._open.items()):
            if now - rec.first_at >= self.late_after_s:
                late = sorted(set(key[3]) - rec.pushed)
                out.append((key[0], key[1], self._pieces(key), late))
        return out

    def gone(self, node: int, rank: int) -> list[list]:
        """Node ``node`` dropped ``rank`` (elastic) or it left (BYE): its blocks no longer wait for it
        there. The pieces of the blocks that now have every push they wait for."""
        if self._block_of.get(rank) is None:
            return []
        self._gone.setdefault(node, set()).add(rank)
        out = []
        for key, rec in list(self._open.items()):
            if key[0] == node and rank in key[3] and set(key[3]) - self._gone[node] <= rec.pushed:
                out += self._pieces(key)
        return out

    def back(self, node: int, rank: int) -> None:
        """``rank`` was welcomed at ``node`` again: its blocks wait for it there."""
        self._gone.get(node, set()).discard(rank)

    def _pieces(self, key: tuple) -> list[list]:
        """A block without some of its ranks' pushes, as what it has: each partial sum (two or more
        ranks: an aligned subtree) summed up, each unfolded push as it came."""
        node = key[0]
        rec = self._open.pop(key)
        self._finished(key)
        sums, waiting = rec.tree.drain()
        out = [self._summed(node, rec.bucket, rec, ranks, buf) for ranks, buf in sums]
        out += [rec.bodies[r] for r in waiting]
        if self.metrics is not None:
            self.metrics.sums.inc(len(sums))
            self.metrics.passed.inc(len(waiting))
            self.metrics.late.inc()
        return out

    def _summed(
        self, node: int, bucket: Bucket, rec: _Open, block: tuple[int, ...], total: torch.Tensor
    ) -> list:
        h = rec.header
        name, ef = "none", False
        if rec.compressed:  # the workers compress: the uplink follows its own link's policy
            # (the bucket's shapes are its workers': a large codec of theirs says it holds no small
            # or 1-D parameter, which the positions HELLO carries cannot say)
            small = codec_facts.base_name(rec.codec) in codec_facts.ROUNDING_CODECS
            name, ef = choose_codec(
                bucket, h["step"], self.compression, small=small, residual=not rec.streamed
            )
        codec = get_codec(name)
        if ef:
            enc = self._feedback.encode((node, bucket.id), codec, total, codec.alloc(bucket.numel))
        else:
            enc = codec.encode(total)
        header = {
            "op": Op.PUSH,
            "job": h["job"],
            "step": h["step"],
            "worker": block[0],
            "bucket": h["bucket"],
            "codec": name,
            "cmeta": enc.meta,
            "hyper": h["hyper"],
            "nograd": h["nograd"],
            "two_phase": rec.two_phase,
            "pull": h["pull"],
            "ranks": list(block),
            "prescaled": self.world_size,
        }
        return wire.encode(header, enc.frames)

    def _finished(self, key: tuple) -> None:
        self._done.add(key)
        step = key[1]
        if step > self._newest:
            self._newest = step
            self._done = {k for k in self._done if k[1] > step - KEEP_DONE_STEPS}

    def forget(self) -> None:
        """Drop every open sum (a node rolled back: its pushes come again)."""
        self._open.clear()
        self._done.clear()

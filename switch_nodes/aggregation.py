"""The aggregator: pushes into accumulators, and the events that a (step, bucket) is ready to step.

Sync mode decodes each worker's push into the (step, bucket) accumulator and
steps the bucket once every member has pushed; async mode applies each push as
it arrives and, with ``staleness`` s, holds a worker's reply until the slowest
worker is at most s steps behind. Both check a push the same way
(:meth:`Aggregator.check_push`). With ``two_phase`` (global-norm clipping,
AMP) a complete bucket first reports its squared norm (NORM) and is stepped on
the workers' COMMIT with the global coefficient.

The aggregator holds no server and sends nothing: each handler returns effects
(:mod:`.effects`) — :class:`Ready` when a step has all its pushes, :class:`ApplyStep` on COMMIT,
:class:`ApplyPush` in async mode — and the server queues the step on the shard and the replies.
"""

from __future__ import annotations

import logging
import time

from luwu.protocol import messages as wire
from luwu.protocol.codecs import Codec, get_codec
from luwu.protocol.errors import ConfigError, ProtocolError, StepMismatchError
from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.protocol.messages import Op
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.effects import (
    ApplyPush,
    ApplyStep,
    Effect,
    Norm,
    Ready,
    Reply,
    SendCurrent,
    SendWeights,
)
from luwu.switch_nodes.optimizers import check_hyper, check_momentum_steps
from luwu.switch_nodes.replies import full_codec
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.store import Accumulator, BucketState

log = logging.getLogger(__name__)


class Aggregator:
    """Sums the pushes of each (step, bucket) of the shard; says when a step has them all."""

    def __init__(self, ctx: NodeContext, shard: Shard) -> None:
        self.ctx, self.shard = ctx, shard

    # ----------------------------------------------------------------- PUSH
    def check_push(
        self, b: BucketState, h: dict, frames: list, *, first: bool
    ) -> tuple[Codec, tuple, dict | None]:
        """Validate a push before it touches the accumulator (or is held undecoded): its codec,
        frames and payload (a sparse codec's indices), and for the first push of a step also its
        ``nograd`` segments, reply codec and hyperparameters (None otherwise)."""
        codec = get_codec(h["codec"])
        if codec.pull_only:
            raise ProtocolError(
                f"bucket {b.id}: codec {codec.name!r} carries weights back, not gradients"
            )
        codec.validate(b.numel, h["nbytes"], h["cmeta"])
        codec.check_payload(b.numel, frames, h["cmeta"])
        nograd = tuple(h["nograd"])
        if not first:
            return codec, nograd, None
        if any(not isinstance(i, int) or not 0 <= i < len(b.segments) for i in nograd):
            raise ProtocolError(
                f"bucket {b.id}: nograd names segments outside 0..{len(b.segments) - 1}"
            )
        full_codec(h["pull"])  # (raises on an unknown reply codec)
        hyper = dict(b.kind.defaults) | h["hyper"]
        check_hyper(b.kind, hyper)
        return codec, nograd, hyper

    def _count_push(self, b: BucketState, h: dict) -> None:
        m = self.ctx.metrics
        m.pushes.inc()
        m.bytes_in.labels("push").inc(sum(h["nbytes"]))
        m.raw_in.labels("push").inc(b.numel * 4)

    def on_push(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        h = msg.header
        b = self.shard.bucket(h["bucket"])
        if not b.initialized:
            raise StepMismatchError(
                f"bucket {b.id} has no weights yet: rank 0 must INIT it before pushes"
            )
        if self.ctx.cfg.mode == "async":
            return self._on_push_async(b, h, msg)
        w, step = h["worker"], h["step"]
        block = self._block(ident, b, h) if "ranks" in h else None
        if step < b.version and step not in b.accs:
            return self._on_retried_push(ident, b, h, block)
        acc = b.accumulator(step, max_ahead=2 + self.ctx.cfg.staleness)
        if block is not None and acc.workers.intersection(block):
            self.ctx.metrics.duplicates.inc()
            if not acc.workers.issuperset(block):
                raise StepMismatchError(
                    f"bucket {b.id} step {step}: the aggregator's sum of ranks {list(block)} "
                    f"overlaps pushes already in from ranks {sorted(acc.workers & set(block))}"
                )
            return []
        if h.get("partial") and 0 <= h.get("micro", -1) < acc.partial.get(w, 0):
            self.ctx.metrics.duplicates.inc()  # (a micro-batch push sent again: counted once)
            return []
        if w in acc.workers:
            self.ctx.metrics.duplicates.inc()
            if h.get("partial"):
                raise StepMismatchError(
                    f"bucket {b.id} step {step}: micro-batch push of worker {w} after its last "
                    "push of the step"
                )
            return self._norm_again(ident, b, w, step)
        codec, nograd, hyper = self.check_push(
            b, h, msg.tensors(), first=not acc.workers and not acc.partial
        )
        if hyper is None:
            self._check_same_nograd(b, h, acc, nograd)
        else:
            check_momentum_steps(b.kind, hyper, b.steps, ahead=step - b.version)
            acc.nograd, acc.hyper = nograd, hyper
        # one worker asking for the global round gets it (a worker's first step asks, in case it clips)
        acc.two_phase = acc.two_phase or bool(h["two_phase"])
        if acc.ticket is None:  # this push opens the (step, bucket): it holds its room in flight
            self.ctx.inflight.claim(acc, b, h)
        members = self.ctx.members
        partial = bool(h.get("partial"))
        ranks = acc.tree.ranks if acc.tree is not None else tuple(sorted(members))
        b.add_push(
            acc,
            codec,
            msg.tensors(),
            h["cmeta"],
            ranks,
            w,
            partial=partial,
            block=block,
            scaled_by=h.get("prescaled", 0),
        )
        self._count_push(b, h)
        if (
            partial
        ):  # no_sync() micro-batch: summed, unanswered; the worker's last push completes it
            acc.partial[w] = acc.partial.get(w, 0) + 1
            return []
        acc.workers.update(block or (w,))
        acc.pull = h["pull"]
        if acc.workers >= members:
            self.ctx.metrics.agg_wait.observe(time.monotonic() - acc.first_at)
            return self.complete(b, step, acc)
        return []

    def _block(self, ident: bytes, b: BucketState, h: dict) -> tuple[int, ...]:
        """The ranks an aggregator's PUSH sums (``ranks``): two or more, in order and contiguous, each
        a member that said HELLO through this connection; scaled by ``1 / prescaled``."""
        ranks, ctx = h["ranks"], self.ctx
        if (
            len(ranks) < 2
            or not all(type(r) is int for r in ranks)
            or ranks != list(range(ranks[0], ranks[0] + len(ranks)))
        ):
            raise ProtocolError(
                f"bucket {b.id}: a summed push names ranks {ranks[:16]}: two or more, in order, contiguous"
            )
        stranger = [r for r in ranks if ctx.peers.get(r) != ident]
        if stranger:
            raise ProtocolError(
                f"bucket {b.id}: a summed push names ranks {stranger[:16]} that did not say HELLO "
                "through this connection"
            )
        if not 1 <= h.get("prescaled", 0) <= (ctx.world_size or 0):
            raise ProtocolError(
                f"bucket {b.id}: a summed push is scaled by 1 / prescaled, 1 <= prescaled <= "
                f"world size; got prescaled {h.get('prescaled')}"
            )
        if h.get("partial"):
            raise ProtocolError(f"bucket {b.id}: a summed push is never partial")
        return tuple(ranks)

    def _on_retried_push(
        self, ident: bytes, b: BucketState, h: dict, block: tuple[int, ...] | None = None
    ) -> list[Effect]:
        """A push of a step already applied: answer the last step's retry with the weights, count
        nothing."""
        w, step = h["worker"], h["step"]
        self.ctx.metrics.duplicates.inc()
        if step != b.version - 1:
            raise StepMismatchError(
                f"bucket {b.id}: push of worker {w} for step {step}, node is at step {b.version}"
            )
        if h.get("partial"):
            return []  # (its step's last push is answered)
        norm = self._norm_again(ident, b, w, step) if h["two_phase"] and block is None else []
        return [*norm, SendCurrent(b, list(block or (w,)), full_codec(h["pull"]), seq=step)]

    def _norm_again(self, ident: bytes, b: BucketState, w: int, step: int) -> list[Effect]:
        """A push sent again (its aggregator died) of a two-phase step whose NORM went out: the NORM
        again, to this worker; nothing else (the step's reply reaches it as the others')."""
        if b.last_norm is None or b.last_norm[0] != step:
            return []
        _, sq, nonfinite = b.last_norm
        header = {"op": Op.NORM, "job": self.ctx.job, "step": step, "worker": w, "bucket": b.id}
        return [Reply(ident, wire.encode(header | {"sqnorm": sq, "nonfinite": nonfinite}))]

    def _check_same_nograd(self, b: BucketState, h: dict, acc: Accumulator, nograd: tuple) -> None:
        if nograd == acc.nograd:
            return
        names = sorted(set(nograd) ^ set(acc.nograd))
        params = [
            self.ctx.param_names.get(b.segments[i].param, f"#{b.segments[i].param}")
            for i in names
            if i < len(b.segments)
        ]
        raise StepMismatchError(
            f"bucket {b.id} step {h['step']}: worker {h['worker']} disagrees with the other workers "
            f"on which parameters have a gradient: {params} (None on some workers, a tensor on "
            "others)"
        )

    def _on_push_async(self, b: BucketState, h: dict, msg: wire.Message) -> list[Effect]:
        """Async mode: apply each push as it arrives; with ``staleness`` s, the reply to a worker at
        step t is held until every worker has pushed step t - s of this bucket (bounded staleness)."""
        w, step = h["worker"], h["step"]
        last = b.worker_steps.get(w, -1)
        if step <= last:
            self.ctx.metrics.duplicates.inc()
            if step == last:
                return [SendWeights(b, [w], full_codec(h["pull"]), seq=step)]
            return []
        if step != last + 1:
            raise StepMismatchError(
                f"bucket {b.id}: worker {w} pushed step {step} after step {last}"
            )
        if h["two_phase"]:
            raise ConfigError(
                "global-norm clipping and AMP need sync mode: an async node applies each push alone"
            )
        if h.get("partial"):
            raise ConfigError(
                "no_sync() in streaming mode needs sync mode: an async node applies each push alone"
            )
        codec, nograd, hyper = self.check_push(b, h, msg.tensors(), first=True)
        if hyper.get(WORKER_MOMENTUM) is not None:
            raise ConfigError(
                "momentum correction needs sync mode: an async node applies each worker's momentum "
                "alone"
            )
        # one accumulator per push, not per version: another worker's push may come while this one
        # is applied
        acc = Accumulator(first_at=time.monotonic(), nograd=nograd, hyper=hyper, pull=h["pull"])
        self.ctx.inflight.claim(acc, b, h)
        codec.decode_(b.buffer(acc), msg.tensors(), h["cmeta"])
        acc.workers.add(w)
        b.worker_steps[w] = step
        self._count_push(b, h)
        b.held.append((w, step, h["pull"]))  # answered once applied, as staleness allows
        return [ApplyPush(b, acc)]

    def release_held(self, b: BucketState) -> list[Effect]:
        """Async mode, after a push was applied: the held replies whose worker is at most
        ``staleness`` steps ahead of the slowest go."""
        if self.ctx.world_size is None:
            return []
        steps = [b.worker_steps.get(r, -1) for r in range(self.ctx.world_size)]
        slowest = min(steps)
        self.ctx.metrics.staleness.set(max(steps) - slowest)
        keep, out = [], []
        for w, step, pull in b.held:
            if step - slowest <= self.ctx.cfg.staleness:
                out.append(SendWeights(b, [w], full_codec(pull), seq=step))
            else:
                keep.append((w, step, pull))
        b.held = keep
        return out

    # ----------------------------------------------------------------- complete, norm, commit
    def complete(self, b: BucketState, step: int, acc: Accumulator) -> list[Effect]:
        """All expected pushes are in: the step is ready (two-phase: its norm round is)."""
        if step != b.version or acc.started:
            return []  # an earlier step of this bucket is still open (it picks this one up), or begun
        n = float(len(acc.workers))
        if acc.two_phase:
            if acc.norm_sent:
                return []
            acc.norm_sent = True
            return [Ready(b, step, Norm(b, step, acc, n))]
        acc.started = True
        return [Ready(b, step, ApplyStep(b, step, acc, n))]

    def complete_ready(self) -> list[Effect]:
        """After the membership shrank: every open step that now has all its (remaining) workers."""
        out = []
        for b in list(self.shard.buckets.values()):
            acc = b.accs.get(b.version)
            if acc is not None and acc.workers and acc.workers >= self.ctx.members:
                if not acc.norm_sent:
                    out += self.complete(b, b.version, acc)
        return out

    def next_ready(self, b: BucketState, step: int) -> list[Effect]:
        """Step ``step - 1`` of ``b`` was applied: step ``step`` may have completed meanwhile."""
        acc = b.accs.get(step)
        if acc is not None and acc.workers and acc.workers >= self.ctx.members:
            return self.complete(b, step, acc)
        return []

    @staticmethod
    def _stepped_again(b: BucketState, h: dict, bid: int) -> list[Effect]:
        """A retried COMMIT (its aggregator died) names a bucket stepped since: its weights whole to
        the worker, when it says it still waits for them (``pulls``: bucket -> reply codec)."""
        pull = h.get("pulls", {}).get(bid)
        if not isinstance(pull, str):
            return []
        return [SendCurrent(b, [h["worker"]], full_codec(pull), seq=h["step"])]

    def on_commit(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """The workers' global coefficient of a two-phase step: the buckets it names step."""
        h = msg.header
        step, out, again = h["step"], [], []
        for bid in h["buckets"]:
            b = self.shard.buckets.get(bid) if isinstance(bid, int) else None
            if b is None:
                raise ProtocolError(
                    f"COMMIT names bucket {bid!r}, not owned by node {self.ctx.index}"
                )
            acc = b.accs.get(step)
            if h.get("retry") and acc is None and step == b.version - 1:
                again += self._stepped_again(b, h, bid)
                continue
            if acc is None or not acc.norm_sent or acc.started or step != b.version:
                continue  # already committed by another worker's COMMIT, or not yet complete
            coef = h["coef"]
            if not (coef > 0 and coef == coef and coef != float("inf")) and not h["skip"]:
                raise ProtocolError(f"COMMIT coefficient must be positive and finite, got {coef}")
            acc.started = True
            divisor = len(acc.workers) / coef if not h["skip"] else 1.0
            out.append(ApplyStep(b, step, acc, divisor, skip=h["skip"]))
        if not h["skip"]:  # the sums in RAM step first (room), then the spilled ones come back
            out.sort(key=lambda e: self.ctx.inflight.spilled(e.acc))
            self.ctx.inflight.prefetch([(e.bucket, e.acc) for e in out])
        return out + again

"""Aggregation: pushes into accumulators, the optimizer step, the two-phase norm / commit.

Sync mode decodes each worker's push into the (step, bucket) accumulator and
steps the bucket once every member has pushed; async mode applies each push as
it arrives and, with ``staleness`` s, holds a worker's reply until the slowest
worker is at most s steps behind. Both check a push the same way
(:meth:`Aggregation.check_push`). With ``two_phase`` (global-norm clipping,
AMP) a complete bucket first reports its squared norm (NORM) and is stepped on
the workers' COMMIT with the global coefficient.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from luwu.protocol import messages as wire
from luwu.protocol.codecs import Codec, get_codec
from luwu.protocol.errors import ConfigError, ProtocolError, StepMismatchError
from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.protocol.messages import Op
from luwu.switch_nodes.optimizers import check_hyper, check_momentum_steps
from luwu.switch_nodes.store import Accumulator, BucketState

if TYPE_CHECKING:
    from luwu.switch_nodes.server import NodeServer

log = logging.getLogger(__name__)


class Aggregation:
    def __init__(self, node: NodeServer):
        self.node = node
        self._applied_since_log = 0

    # ----------------------------------------------------------------- PUSH
    def check_push(
        self, b: BucketState, h: dict, frames: list, *, first: bool
    ) -> tuple[Codec, tuple, dict | None]:
        """Validate a push before it touches the accumulator (or is held undecoded): its codec, frames and
        payload (a sparse codec's indices), and for the first push of a step also its ``nograd``
        segments, reply codec and hyperparameters (None otherwise)."""
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
        self.node.replies.codec(h["pull"])
        hyper = dict(b.kind.defaults) | h["hyper"]
        check_hyper(b.kind, hyper)
        return codec, nograd, hyper

    def _count_push(self, b: BucketState, h: dict) -> None:
        m = self.node.metrics
        m.pushes.inc()
        m.bytes_in.labels("push").inc(sum(h["nbytes"]))
        m.raw_in.labels("push").inc(b.numel * 4)

    async def on_push(self, ident: bytes, msg: wire.Message) -> None:
        h = msg.header
        b = self.node.bucket(h)
        if not b.initialized:
            raise StepMismatchError(
                f"bucket {b.id} has no weights yet: rank 0 must INIT it before pushes"
            )
        if self.node.cfg.mode == "async":
            await self._on_push_async(b, h, msg)
            return
        w, step = h["worker"], h["step"]
        if step < b.version and step not in b.accs:
            self._on_retried_push(b, h)
            return
        acc = b.accumulator(step, max_ahead=2 + self.node.cfg.staleness)
        if w in acc.workers:
            self.node.metrics.duplicates.inc()
            if h.get("partial"):
                raise StepMismatchError(
                    f"bucket {b.id} step {step}: micro-batch push of worker {w} after its last push of the step"
                )
            return
        codec, nograd, hyper = self.check_push(
            b, h, msg.tensors(), first=not acc.workers and not acc.partial
        )
        if hyper is None:
            self._check_same_nograd(b, h, acc, nograd)
        else:
            check_momentum_steps(b.kind, hyper, b.steps, ahead=step - b.version)
            acc.nograd, acc.hyper = nograd, hyper
        acc.two_phase = (
            acc.two_phase or bool(h["two_phase"])
        )  # one worker asking for the global round gets it (a worker's first step asks, in case it clips)
        members = self.node.members
        b.add_push(
            acc, codec, msg.tensors(), h["cmeta"], len(members), partial=bool(h.get("partial"))
        )
        self._count_push(b, h)
        if h.get(
            "partial"
        ):  # no_sync() micro-batch: summed, nothing answered, the worker's last push completes it
            acc.partial[w] = acc.partial.get(w, 0) + 1
            return
        acc.workers.add(w)
        acc.pull = h["pull"]
        if acc.workers >= members:
            self.node.metrics.agg_wait.observe(time.monotonic() - acc.first_at)
            await self.complete(b, step, acc)

    def _on_retried_push(self, b: BucketState, h: dict) -> None:
        """A push of a step already applied: answer the last step's retry with the weights, count nothing."""
        w, step = h["worker"], h["step"]
        self.node.metrics.duplicates.inc()
        if step != b.version - 1:
            raise StepMismatchError(
                f"bucket {b.id}: push of worker {w} for step {step}, node is at step {b.version}"
            )
        codec = self.node.replies.codec(h["pull"]).full
        self.node.submit(lambda: self.node.replies.send_current(b, [w], codec, seq=step))

    def _check_same_nograd(self, b: BucketState, h: dict, acc: Accumulator, nograd: tuple) -> None:
        if nograd == acc.nograd:
            return
        names = sorted(set(nograd) ^ set(acc.nograd))
        params = [
            self.node.param_names.get(b.segments[i].param, f"#{b.segments[i].param}")
            for i in names
            if i < len(b.segments)
        ]
        raise StepMismatchError(
            f"bucket {b.id} step {h['step']}: worker {h['worker']} disagrees with the other workers on which parameters have a "
            f"gradient: {params} (None on some workers, a tensor on others)"
        )

    async def _on_push_async(self, b: BucketState, h: dict, msg: wire.Message) -> None:
        """Async mode: apply each push as it arrives; with ``staleness`` s, the reply to a worker at step t
        is held until every worker has pushed step t - s of this bucket (bounded staleness)."""
        w, step = h["worker"], h["step"]
        last = b.worker_steps.get(w, -1)
        if step <= last:
            self.node.metrics.duplicates.inc()
            if step == last:
                self._reply_async(b, w, step, h["pull"])
            return
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
                "momentum correction needs sync mode: an async node applies each worker's momentum alone"
            )
        # one accumulator per push, not per version: another worker's push may come while this one is applied
        acc = Accumulator(first_at=time.monotonic(), nograd=nograd, hyper=hyper, pull=h["pull"])
        codec.decode_(b.buffer(acc), msg.tensors(), h["cmeta"])
        acc.workers.add(w)
        b.worker_steps[w] = step
        self._count_push(b, h)
        t0 = time.perf_counter()

        def work():
            self.node.replies.wait_sent(b.id)
            b.apply(acc, 1.0)
            b.version += 1

        await self.node.run(work)
        b.give_back(acc)
        self.node.metrics.opt_seconds.observe(time.perf_counter() - t0)
        self.node.metrics.updates.inc()
        b.held.append((w, step, h["pull"]))
        self._release_held(b)

    def _reply_async(self, b: BucketState, w: int, step: int, pull: str) -> None:
        replies = self.node.replies
        replies.send(b, [w], replies.encode(b, replies.codec(pull).full), seq=step)

    def _release_held(self, b: BucketState) -> None:
        """Send the held async replies whose worker is at most ``staleness`` steps ahead of the slowest."""
        if self.node.world_size is None:
            return
        steps = [b.worker_steps.get(r, -1) for r in range(self.node.world_size)]
        slowest = min(steps)
        self.node.metrics.staleness.set(max(steps) - slowest)
        keep = []
        for w, step, pull in b.held:
            if step - slowest <= self.node.cfg.staleness:
                self._reply_async(b, w, step, pull)
            else:
                keep.append((w, step, pull))
        b.held = keep

    # ----------------------------------------------------------------- complete, norm, commit
    async def complete(self, b: BucketState, step: int, acc: Accumulator) -> None:
        """All expected pushes are in: queue the step, or (two-phase) report the norm and wait for COMMIT."""
        if step != b.version or acc.started:
            return  # an earlier step of this bucket is still open (it picks this one up), or queued already
        if await self.node.durability.park_for_checkpoint(b, step):
            return
        if acc.two_phase:
            if not acc.norm_sent:
                acc.norm_sent = True
                n = float(len(acc.workers))
                self.node.submit(lambda: self._send_norm(b, step, acc, n))
            return
        self._queue_apply(b, step, acc, float(len(acc.workers)), skip=False)

    async def complete_ready(self) -> None:
        """After the membership shrank: every open step that now has all its (remaining) workers goes on."""
        for b in list(self.node.buckets.values()):
            acc = b.accs.get(b.version)
            if (
                acc is not None
                and acc.workers
                and acc.workers >= self.node.members
                and not acc.norm_sent
            ):
                await self.complete(b, b.version, acc)

    async def _send_norm(self, b: BucketState, step: int, acc: Accumulator, n: float) -> None:
        sq, nonfinite = await self.node.run(b.sqnorm, acc, n)
        job = self.node.job
        for w in acc.workers:
            self.node.send_to(
                w,
                wire.encode(
                    {
                        "op": Op.NORM,
                        "job": job,
                        "step": step,
                        "worker": w,
                        "bucket": b.id,
                        "sqnorm": sq,
                        "nonfinite": nonfinite,
                    }
                ),
            )

    def _queue_apply(
        self, b: BucketState, step: int, acc: Accumulator, divisor: float, *, skip: bool
    ) -> None:
        acc.started = True
        self.node.submit(lambda: self._apply(b, step, acc, divisor, skip=skip))

    async def on_commit(self, ident: bytes, msg: wire.Message) -> None:
        h = msg.header
        step = h["step"]
        for bid in h["buckets"]:
            b = self.node.buckets.get(bid) if isinstance(bid, int) else None
            if b is None:
                raise ProtocolError(
                    f"COMMIT names bucket {bid!r}, not owned by node {self.node.index}"
                )
            acc = b.accs.get(step)
            if acc is None or not acc.norm_sent or acc.started or step != b.version:
                continue  # already committed by another worker's COMMIT, or not yet complete
            coef = h["coef"]
            if not (coef > 0 and coef == coef and coef != float("inf")) and not h["skip"]:
                raise ProtocolError(f"COMMIT coefficient must be positive and finite, got {coef}")
            self._queue_apply(
                b, step, acc, len(acc.workers) / coef if not h["skip"] else 1.0, skip=h["skip"]
            )

    # ----------------------------------------------------------------- the step
    async def _apply(
        self, b: BucketState, step: int, acc: Accumulator, divisor: float, *, skip: bool
    ) -> None:
        """A queued job: the optimizer step of (bucket, step) on the optimizer thread, then the replies."""
        node, replies = self.node, self.node.replies
        t0 = time.perf_counter()
        gen = node.gen

        def work():
            pull = replies.codec(acc.pull)
            pull.before_step(b)  # (bf16 steps: the weights' bits before the step)
            if not skip:
                replies.wait_sent(b.id)  # the last fp32 reply may still be leaving from the shard
                b.apply(acc, divisor)
            b.version = step + 1
            return replies.encode(b, pull)

        try:
            payload = await node.run(work)
        except (
            Exception
        ) as exc:  # a bug, not an input: say so to the workers waiting for this bucket
            log.exception(
                "node %s: optimizer step of bucket %d, step %d failed", node.index, b.id, step
            )
            text = f"node {node.index}: optimizer step of bucket {b.id}, step {step} failed: {type(exc).__name__}: {exc}"
            for w in acc.workers:
                node.tell(w, "internal", text, step=step, bucket=b.id)
            raise
        if gen != node.gen:
            return  # a rollback came in meanwhile: these weights belong to the abandoned timeline
        node.metrics.opt_seconds.observe(time.perf_counter() - t0)
        (node.metrics.skipped if skip else node.metrics.updates).inc()
        workers = sorted(acc.workers)
        b.release(step)
        replies.send(b, workers, payload, skipped=skip, seq=step)
        node.metrics.step.set(node.step)
        self._log_progress()
        # A later step of this bucket may have completed while this one was open.
        nxt = b.accs.get(step + 1)
        if nxt is not None and nxt.workers and nxt.workers >= node.members:
            await self.complete(b, step + 1, nxt)

    def _log_progress(self) -> None:
        node = self.node
        self._applied_since_log += 1
        if self._applied_since_log >= node.cfg.log_every * max(1, len(node.buckets)):
            self._applied_since_log = 0
            log.info(
                "node %s at step %d: %d buckets, %d workers, %.0f pushes",
                node.index,
                node.step,
                len(node.buckets),
                len(node.peers),
                node.metrics.pushes._value.get(),
            )

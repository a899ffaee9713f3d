"""The node daemon: a pipeline of narrow rooms on an asyncio (uvloop) event loop.

One gradient walks the rooms in this order, and enters each once:

1. **listener** (:mod:`.zmtp`, NULL or CURVE; libzmq's ROUTER in :mod:`.listener` on request):
   hands over a whole PUSH within the peer's bounds; the server decodes and validates it.
2. **membership** (:mod:`.membership`): the sender is the connection that said HELLO as that
   rank, and still a member of the job.
3. **aggregator** (:mod:`.aggregation`): decodes the push into the (step, bucket) accumulator;
   the last push the step waits for makes it ready (:class:`~.effects.Ready`).
4. **durability** (:mod:`.durability`): a ready step waits there only while a periodic
   checkpoint waits for the other buckets to reach its step.
5. **shard** (:mod:`.shard`): the optimizer step of the bucket, on the optimizer thread; the
   bucket's version moves.
6. **reply encoder** (:mod:`.replies`): the new weights, encoded for the pull codec the workers
   named (the version they hold decides a delta or whole weights).
7. **outbox** (:mod:`.outbox`): the UPDATE to every worker that pushed, held until a worker's
   ``step()`` where it asked for that.

Other messages take shorter walks: HELLO, INIT, HEARTBEAT and BYE stay in membership; COMMIT goes
from the aggregator to the shard; PULL (:mod:`.pulls`) to the encoder and the outbox; STATE,
CHECKPOINT and ROLLBACK to durability; EXPORT and IMPORT to :mod:`.export`.

No room holds the server or another room: they share a :class:`~.context.NodeContext` (config,
clock, job identity, who is in the job, metrics, the optimizer thread's queue) and the shard, and
their handlers return effects (:mod:`.effects`) that this module alone dispatches. Work on the
shard goes into the job queue: one consumer hands the jobs, in order, to one optimizer thread
(torch releases the GIL) while the loop goes on receiving, so a reply never sees a half-stepped
bucket. A message that breaks the contract gets an ERROR reply naming what was wrong; the node
never dies of a message.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError, NodeStateLostError, ProtocolError, RollbackError
from luwu.protocol.messages import Op
from luwu.switch_nodes.aggregation import Aggregator
from luwu.switch_nodes.budget_memory import arrange_memory
from luwu.switch_nodes.checkpoint import CheckpointStore
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.context import NodeContext, OptimizerQueue
from luwu.switch_nodes.durability import Durability
from luwu.switch_nodes.effects import (
    Answer,
    ApplyPush,
    ApplyStep,
    Drop,
    Effect,
    GetState,
    Norm,
    Ready,
    Recheck,
    Release,
    Reply,
    Reset,
    Seeded,
    SendCurrent,
    SendWeights,
    Tell,
)
from luwu.switch_nodes.export import Exports
from luwu.switch_nodes.lines import READY_LINE
from luwu.switch_nodes.membership import Membership
from luwu.switch_nodes.metrics import NodeMetrics
from luwu.switch_nodes.ooc.shard import OocShard
from luwu.switch_nodes.outbox import Outbox
from luwu.switch_nodes.peer_roles import PeerRoles
from luwu.switch_nodes.pulls import Pulls
from luwu.switch_nodes.replies import Payload, PullCodecs, ReplyBuffers
from luwu.switch_nodes.shard import ResidentShard
from luwu.switch_nodes.store import BucketState

__all__ = ["NodeServer", "READY_LINE", "ReplyBuffers"]

log = logging.getLogger(__name__)

#: Ops a worker sends as a rank: the sender must be the connection that said HELLO as that rank.
_RANKED = frozenset(
    {
        Op.PUSH,
        Op.INIT,
        Op.PULL,
        Op.COMMIT,
        Op.STATE,
        Op.CHECKPOINT,
        Op.ROLLBACK,
        Op.EXPORT,
        Op.BYE,
        Op.IMPORT,
    }
)
#: Ops served to a connection that has not said HELLO.
_OPEN = frozenset({Op.HELLO, Op.STATS})

Handler = Callable[[bytes, wire.Message], "list[Effect] | Awaitable[list[Effect]]"]


class NodeServer:
    """One node: binds, serves until :meth:`stop`, and answers every message."""

    def __init__(self, cfg: NodeConfig, *, job: str = "luwu", registry=None):
        metrics = NodeMetrics(registry)
        ckpt = None
        if cfg.checkpoint_dir and cfg.index >= 0:
            ckpt = CheckpointStore(cfg.checkpoint_dir, cfg.index)
        queue = OptimizerQueue(metrics)
        self.ctx = ctx = NodeContext(cfg, job, metrics, queue, cfg.index, ckpt=ckpt)
        # out of core when node.state_dir is set (in RAM all the same while the state fits its budget)
        self.shard = (OocShard if cfg.state_dir else ResidentShard)(ctx, self._not_reading)
        self.codecs = PullCodecs()
        self.outbox = Outbox(ctx)
        ctx.inflight.bind(lambda: self.shard.buckets, self.outbox.held.flush)
        # who a connection is: what it may hold and leave unread, who may say HELLO
        self.roles = PeerRoles(ctx, self._not_reading)
        self.membership = Membership(ctx, self.shard)
        self.aggregator = Aggregator(ctx, self.shard)
        self.pulls = Pulls(self.shard, ctx)
        self.durability = Durability(ctx, self.shard, self.codecs)
        self.exports = Exports(ctx, self.shard, self.codecs)
        self._stop: asyncio.Event | None = None
        self._applied_since_log = 0
        self._handlers: dict[Op, Handler] = {
            Op.HELLO: self.membership.on_hello,
            Op.INIT: self.membership.on_init,
            Op.HEARTBEAT: self.membership.on_heartbeat,
            Op.BYE: self.membership.on_bye,
            Op.PUSH: self.aggregator.on_push,
            Op.COMMIT: self.aggregator.on_commit,
            Op.PULL: self.pulls.on_pull,
            Op.STATE: self.durability.on_state,
            Op.CHECKPOINT: self.durability.on_checkpoint,
            Op.ROLLBACK: self.durability.on_rollback,
            Op.STATS: self._on_stats,
            Op.EXPORT: self.exports.on_export,
            Op.IMPORT: self.exports.on_import,
        }
        self._effects: dict[type, Callable[[Effect], Awaitable[None] | None]] = {
            Reply: lambda e: self.outbox.send(e.ident, e.frames),
            Answer: lambda e: self.outbox.answer(
                e.ident, e.op, e.worker, self.shard.step, **e.fields
            ),
            Tell: lambda e: self.outbox.tell(
                e.worker, e.code, e.text, step=e.step, bucket=e.bucket, detail=e.detail
            ),
            Ready: self._ready,
            ApplyStep: lambda e: self.ctx.queue.submit(lambda: self._apply_step(e)),
            Norm: lambda e: self.ctx.queue.submit(lambda: self._norm(e)),
            ApplyPush: self._apply_push,
            SendWeights: self._send_weights,
            SendCurrent: lambda e: self.pulls.answer(e, self._send_current),
            GetState: lambda e: self.ctx.queue.submit(lambda: self._get_state(e)),
            Seeded: lambda e: self._do(self.pulls.seeded(e.bucket)),
            Drop: lambda e: self.outbox.held.forget(e.worker),
            Release: lambda e: self.outbox.held.release(e.worker, e.step),
            Recheck: lambda e: self._do(self.aggregator.complete_ready()),
            Reset: lambda e: self.ctx.queue.run(self._reset),
        }

    # the node as its callers see it
    cfg = property(lambda self: self.ctx.cfg)
    job = property(lambda self: self.ctx.job)
    index = property(lambda self: self.ctx.index)
    metrics = property(lambda self: self.ctx.metrics)
    address = property(lambda self: self.ctx.address)

    @property
    def restored_step(self) -> int | None:
        """The checkpointed step this process restarted from (None: it started fresh)."""
        return self.ctx.restored_step

    @property
    def step(self) -> int:
        return self.shard.step

    # ----------------------------------------------------------------- lifecycle
    def bind(self) -> str:
        """Bind the listener the config names; its address is what workers connect to."""
        self.ctx.listener = self.roles.listener()
        self.ctx.address = self.ctx.listener.address
        return self.ctx.address

    async def serve(self) -> None:
        ctx = self.ctx
        self.loop = asyncio.get_running_loop()
        torch.set_num_threads(ctx.cfg.torch_threads)
        if ctx.listener is None:
            self.bind()
        arrange_memory(ctx, self.shard.accumulators)
        await ctx.listener.start()
        self._stop = asyncio.Event()
        self.durability.restore_latest()
        print(f"{READY_LINE} {ctx.address}", flush=True)
        log.info(
            "node %s serving job %r at %s (mode %s)", ctx.index, ctx.job, ctx.address, ctx.cfg.mode
        )
        ctx.queue.open()
        recv = asyncio.ensure_future(self._recv_loop())
        jobs = asyncio.ensure_future(ctx.queue.serve(lambda: ctx.index))
        watch = asyncio.ensure_future(self._watchdog())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([recv, jobs, stop], return_when=asyncio.FIRST_COMPLETED)
            for t in (recv, jobs):
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        finally:
            recv.cancel()
            jobs.cancel()
            watch.cancel()
            if ctx.ckpt is not None and self.shard.buckets:
                try:  # checkpoint on SIGTERM: whatever the versions, pushes are idempotent on restart
                    ctx.queue.call(self.durability.write_checkpoint, 120)
                except Exception:
                    log.exception("checkpoint on shutdown failed")
            ctx.queue.shutdown()
            try:
                self.shard.close()
            except Exception:
                log.exception("closing the shard's state files failed")
            ctx.listener.close()
            ctx.listener = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def _watchdog(self) -> None:
        """Missing workers, every few seconds (:meth:`Membership.watch`)."""
        while True:
            await asyncio.sleep(self.membership.watch_every_s)
            await self._do(self.membership.watch())

    def _not_reading(self, ranks: set[int]) -> None:
        """From any thread: these workers left their replies unread (:meth:`Membership.not_reading`)."""

        async def lost(ranks: set[int]) -> None:
            await self._do(self.membership.not_reading(ranks))

        self.loop.call_soon_threadsafe(asyncio.ensure_future, lost(set(ranks)))

    # ----------------------------------------------------------------- receive, dispatch
    async def _recv_loop(self) -> None:
        ctx, listener = self.ctx, self.ctx.listener
        while True:
            ident, body, dropped = await listener.recv()
            try:
                msg = wire.decode(
                    body,
                    job=ctx.job,
                    max_message_bytes=ctx.cfg.max_message_bytes,
                    header_only=dropped,
                )
                if dropped:
                    raise self._dropped_error(ident, msg.header["op"])
                await self._dispatch(ident, msg)
            except LuwuError as exc:
                self.outbox.refuse(ident, body, exc)
            except RecursionError:  # a header nested deeper than Python walks: refused like any
                text = "a header nested too deep to read (lists or maps within each other)"
                self.outbox.refuse(ident, body, ProtocolError(text))
            except Exception as exc:  # a node never dies of a message
                log.exception("internal error handling a message")
                text = f"internal error: {type(exc).__name__}: {exc}"
                self.outbox.refuse(ident, body, ProtocolError(text))

    async def _dispatch(self, ident: bytes, msg: wire.Message) -> None:
        op = msg.header["op"]
        if op not in _OPEN and ident not in self.ctx.peers.values():
            raise self._stranger_error(op)
        if op == Op.HELLO:
            self.roles.check_hello(ident, msg.header)
        if op in _RANKED:
            self.membership.check_worker(ident, msg.header)
        handler = self._handlers.get(op)
        if handler is None:
            raise ProtocolError(f"op {op.name} is not served by a node")
        effects = handler(ident, msg)
        if inspect.isawaitable(effects):
            effects = await effects
        await self._do(effects)

    def _stranger_error(self, op: Op) -> LuwuError:
        """What a connection that did not say HELLO is told (after a restart: roll back)."""
        step = self.restored_step
        if step is not None and op != Op.ROLLBACK:
            return RollbackError(
                f"node {self.ctx.index} restarted from its checkpoint of step {step} (boot {self.ctx.boot}): "
                f"roll back to step {step} with optimizer.recover()",
                step=step,
                boot=self.ctx.boot,
            )
        if self.ctx.ckpt is None and op in _RANKED | {Op.HEARTBEAT} and not self.shard.buckets:
            # a worker of a job this node served before its restart: with no checkpoint its shard is gone
            return NodeStateLostError(
                f"{op.name} for a job this node does not hold (boot {self.ctx.boot}): it restarted without node.checkpoint_dir, so "
                "the weights and optimizer state of its shard are lost; restart the job from your own checkpoint "
                "(opt.state_dict()), and run the nodes with node.checkpoint_dir so that a restart rolls back instead",
                boot=self.ctx.boot,
            )
        return ProtocolError(f"{op.name} from a peer that did not say HELLO: say HELLO first")

    def _dropped_error(self, ident: bytes, op: Op) -> LuwuError:
        """What a stranger is told for a message whose payload was dropped unread: what its header would get
        (the payload decides nothing for a stranger)."""
        if op in _OPEN or self.roles.member(ident):
            return ProtocolError(
                f"{op.name} with a payload of more than node.stranger_bytes = {self.ctx.cfg.stranger_bytes} from a peer that did not say HELLO"
            )
        return self._stranger_error(op)

    # ----------------------------------------------------------------- effects
    async def _do(self, effects: list[Effect] | None) -> None:
        """Carry out what the rooms returned, in order (the only place effects are dispatched)."""
        for e in effects or ():
            done = self._effects[type(e)](e)
            if inspect.isawaitable(done):
                await done

    async def _ready(self, e: Ready) -> None:
        """A step with all its pushes goes on, unless a due checkpoint holds it."""
        held = await self.durability.hold(e)
        await self._do([e.then] if held is None else held)

    async def _apply_step(self, e: ApplyStep) -> None:
        """A queued job: the optimizer step of (bucket, step) on the optimizer thread, then the
        replies."""
        ctx, b, step, acc = self.ctx, e.bucket, e.step, e.acc
        t0, gen = time.perf_counter(), ctx.queue.gen
        codec = self.codecs.get(acc.pull)

        def work() -> Payload:
            return self.shard.step_bucket(b, step, acc, e.divisor, e.skip, codec)

        try:
            payload = await ctx.queue.run(work)
        except Exception as exc:  # a bug, not an input: say so to the workers waiting for it
            what = f"optimizer step of bucket {b.id}, step {step} failed"
            log.exception("node %s: %s", ctx.index, what)
            text = f"node {ctx.index}: {what}: {type(exc).__name__}: {exc}"
            for w in acc.workers:
                self.outbox.tell(w, "internal", text, step=step, bucket=b.id)
            raise
        took = time.perf_counter() - t0
        await self.durability.settle(b)  # (out of core: the step's last reply waits for its commit)
        if gen != ctx.queue.gen:
            return  # a rollback came in meanwhile: these weights belong to the abandoned timeline
        ctx.metrics.opt_seconds.observe(took)
        (ctx.metrics.skipped if e.skip else ctx.metrics.updates).inc()
        workers = sorted(acc.workers)
        b.release(step)
        self._send(b, workers, payload, e.skip, step)
        ctx.metrics.step.set(self.shard.step)
        self._log_progress()
        # A later step of this bucket may have completed while this one was open.
        await self._do(self.aggregator.next_ready(b, step + 1))

    async def _norm(self, e: Norm) -> None:
        """A queued job (two-phase step): the gradient's squared norm to the workers (NORM)."""
        b = e.bucket
        sq, nonfinite = await self.ctx.queue.run(b.sqnorm, e.acc, e.divisor)
        b.last_norm = (e.step, sq, nonfinite)
        for w in e.acc.workers:
            header = {"op": Op.NORM, "job": self.ctx.job, "step": e.step, "worker": w}
            header |= {"bucket": b.id, "sqnorm": sq, "nonfinite": nonfinite}
            self.outbox.send_to(w, wire.encode(header))

    async def _apply_push(self, e: ApplyPush) -> None:
        """Async mode: one push applied now, then the replies its staleness lets go."""
        ctx, b, acc = self.ctx, e.bucket, e.acc
        t0 = time.perf_counter()
        await ctx.queue.run(lambda: self.shard.apply(b, b.version, acc, 1.0, False))
        b.give_back(acc)
        ctx.metrics.opt_seconds.observe(time.perf_counter() - t0)
        ctx.metrics.updates.inc()
        await self._do(self.aggregator.release_held(b))

    def _send_weights(self, e: SendWeights) -> None:
        if not self.shard.in_ram:  # out of core: the weights are read on the optimizer thread
            self.ctx.queue.submit(lambda: self._send_loaded(e))
            return
        payload = self.shard.encode(e.bucket, e.codec)
        self._send(e.bucket, e.workers, payload, False, e.seq)

    async def _send_loaded(self, e: SendWeights) -> None:
        payload = await self.ctx.queue.run(self.shard.encode, e.bucket, e.codec)
        await self.durability.settle(e.bucket)
        self._send(e.bucket, e.workers, payload, False, e.seq)

    async def _send_current(self, e: SendCurrent) -> None:
        """A queued job: the bucket's weights whole, for some workers (a PULL, a retried push). They
        will hold them as sent, the others what the last replies gave them, so the next reply of
        the bucket goes whole to everyone."""
        b, queue = e.bucket, self.ctx.queue
        gen = queue.gen

        def encode() -> Payload:
            payload = self.shard.encode(b, e.codec)
            self.codecs.resync(b.id)
            return payload

        payload = await queue.run(encode)
        await self.durability.settle(b)
        if gen == queue.gen:
            self._send(b, e.workers, payload, False, e.seq)

    def _send(self, b: BucketState, workers, payload: Payload, skipped: bool, seq) -> None:
        trackers = self.outbox.send_update(b, workers, payload, skipped=skipped, seq=seq)
        self.ctx.inflight.reply(payload, trackers, self.shard.in_ram)
        if payload.borrowed:
            self.shard.lent(b.id).sent(trackers)

    async def _get_state(self, e: GetState) -> None:
        """A queued job: STATE get, a copy of the bucket's tensors as of the steps before it."""
        b = e.bucket

        def snapshot():
            with self.shard.loaded(b.id):
                e.header["step"] = b.version
                return [t.clone() for t in b.tensors()]

        self.outbox.send(e.ident, wire.encode(e.header, await self.ctx.queue.run(snapshot)))

    def _reset(self) -> None:
        """On the optimizer thread, after a rollback replaced the buckets."""
        self.outbox.held.forget()
        self.ctx.inflight.forget()
        self.pulls.reset()
        self.codecs.resync()

    def _log_progress(self) -> None:
        ctx = self.ctx
        self._applied_since_log += 1
        if self._applied_since_log >= ctx.cfg.log_every * max(1, len(self.shard.buckets)):
            self._applied_since_log = 0
            log.info(
                "node %s at step %d: %d buckets, %d workers, %.0f pushes",
                ctx.index,
                self.shard.step,
                len(self.shard.buckets),
                len(ctx.peers),
                ctx.metrics.pushes._value.get(),
            )

    # ----------------------------------------------------------------- stats
    def _on_stats(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        # (to the rank that asked: an aggregator passes the answer on to it)
        return [Answer(ident, Op.STATS, msg.header["worker"], {"detail": self.stats()})]

    def stats(self) -> dict:
        ctx, shard = self.ctx, self.shard
        # one pass over the registry (get_sample_value collects it all at each call: STATS is asked
        # often, by monitors and by peers that must not cost the loop much)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in ctx.metrics.registry.collect()
            for s in family.samples
        }

        def val(name, **labels):
            return float(samples.get((name, tuple(sorted(labels.items()))), 0.0) or 0.0)

        return {
            "node": ctx.index,
            "address": ctx.address or "",
            "step": shard.step,
            "workers": len(ctx.peers),
            "world_size": ctx.world_size or 0,
            "buckets": len(shard.buckets),
            "params": shard.numel,
            "bytes_in": val("luwu_node_bytes_received_total", op="push"),
            "bytes_out": val("luwu_node_bytes_sent_total", op="update"),
            "pushes": val("luwu_node_pushes_total"),
            "updates": val("luwu_node_updates_applied_total"),
            "uptime_s": time.monotonic() - ctx.started,
            "mode": ctx.cfg.mode,
            "checkpoint_step": ctx.ckpt.last_step
            if ctx.ckpt and ctx.ckpt.last_step is not None
            else -1,
            "checkpoint_age_s": time.time() - ctx.ckpt.last_time
            if ctx.ckpt and ctx.ckpt.last_time
            else -1.0,
            "members": sorted(ctx.members),
            # out-of-core state (node.state_dir): what luwu top shows per node
            "state_bytes_read": val("luwu_node_state_bytes_read_total"),
            "state_bytes_written": val("luwu_node_state_bytes_written_total"),
            "state_io_wait_s": val("luwu_node_state_io_wait_seconds_total"),
            "state_buffer_bytes": val("luwu_node_state_buffer_bytes"),
            "state_memory_bytes": val("luwu_node_state_memory_bytes"),
            "inflight_bytes": ctx.inflight.used,  # pushes in flight (node.push_memory_bytes)
            "inflight_blocked_s": val("luwu_node_inflight_blocked_seconds_total"),
        }

"""The node daemon: a ZMTP listener on an asyncio (uvloop) event loop.

The listener (:mod:`.zmtp`, NULL or CURVE; libzmq's ROUTER in :mod:`.listener` on request) hands
over whole messages within per-peer bounds. The loop validates every message and
dispatches it by op to the room that serves it: :mod:`.membership` (HELLO, INIT, the watchdog),
:mod:`.aggregation` (PUSH, COMMIT, the optimizer step), :mod:`.replies`
(PULL, the weights sent back) and :mod:`.durability` (STATE, CHECKPOINT,
ROLLBACK). Work on the shard goes into a job queue: one consumer hands the
jobs, in order, to one optimizer thread (torch releases the GIL) while the
loop goes on receiving. Everything that reads or writes the shard runs on that
thread, so a reply never sees a half-stepped bucket. A message that breaks the
contract gets an ERROR reply naming what was wrong; the node never dies of a
message.

The server holds the state the rooms share (buckets, peers, members, layout,
the job queue and its generation); each room holds a reference to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

import msgpack
import torch

from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError, NodeStateLostError, ProtocolError, RollbackError
from luwu.protocol.memory import retain_freed_memory
from luwu.protocol.messages import Op
from luwu.switch_nodes.aggregation import Aggregation
from luwu.switch_nodes.checkpoint import CheckpointStore
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.durability import Durability
from luwu.switch_nodes.export import Exports
from luwu.switch_nodes.lines import READY_LINE
from luwu.switch_nodes.listener import LibzmqListener, Listener, SendQueueFull
from luwu.switch_nodes.membership import Membership
from luwu.switch_nodes.metrics import NodeMetrics
from luwu.switch_nodes.optimizers import OptimizerKind
from luwu.switch_nodes.peer_roles import PeerRoles
from luwu.switch_nodes.replies import Replies, ReplyBuffers
from luwu.switch_nodes.store import AccumulatorPool, BucketState

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


class NodeServer:
    """One node: binds, serves until :meth:`stop`, and answers every message."""

    def __init__(self, cfg: NodeConfig, *, job: str = "luwu", registry=None):
        self.cfg = cfg
        self.job = job
        self.index = cfg.index
        self.metrics = NodeMetrics(registry)
        self.address: str | None = None
        self.started = time.monotonic()
        self.boot = uuid.uuid4().hex[
            :12
        ]  # identifies this process: a rollback is done once per boot
        # the job as the workers described it in HELLO
        self.buckets: dict[int, BucketState] = {}
        self.layout_hash: str | None = None
        self.world_size: int | None = None
        self.kind: OptimizerKind | None = None
        self.param_names: dict[int, str] = {}
        # who is in it
        self.peers: dict[int, bytes] = {}  # worker rank -> ZeroMQ routing id
        self.last_seen: dict[int, float] = {}
        self.members: set[int] = (
            set()
        )  # ranks expected in each step (elastic mode drops the missing)
        # the optimizer thread and the queue of jobs in front of it
        self.gen = 0  # bumped by a rollback: queued jobs of the abandoned timeline are dropped
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="luwu-opt")
        self._jobs: asyncio.Queue | None = None
        self._stop: asyncio.Event | None = None
        self.listener: Listener | None = None
        self.roles = PeerRoles(
            self
        )  # who a connection is: what it may hold and leave unread, who may say HELLO
        self._full_told: set[bytes] = set()  # connections told of in the log for not reading
        self.ckpt = (
            CheckpointStore(cfg.checkpoint_dir, cfg.index)
            if cfg.checkpoint_dir and cfg.index >= 0
            else None
        )
        self.accumulators = AccumulatorPool(
            cfg.inflight_bytes
        )  # shared by the buckets (luwu.switch_nodes.store)
        self.replies = Replies(self)
        self.membership = Membership(self)
        self.aggregation = Aggregation(self)
        self.durability = Durability(self)
        self.exports = Exports(self)
        self._handlers: dict[Op, Callable[[bytes, wire.Message], Awaitable[None] | None]] = {
            Op.HELLO: self.membership.on_hello,
            Op.INIT: self.membership.on_init,
            Op.HEARTBEAT: self.membership.on_heartbeat,
            Op.BYE: self.membership.on_bye,
            Op.PUSH: self.aggregation.on_push,
            Op.COMMIT: self.aggregation.on_commit,
            Op.PULL: self.replies.on_pull,
            Op.STATE: self.durability.on_state,
            Op.CHECKPOINT: self.durability.on_checkpoint,
            Op.ROLLBACK: self.durability.on_rollback,
            Op.STATS: self._on_stats,
            Op.EXPORT: self.exports.on_export,
            Op.IMPORT: self.exports.on_import,
        }

    @property
    def restored_step(self) -> int | None:
        """The checkpointed step this process restarted from (None: it started fresh)."""
        return self.durability.restored_step

    # ----------------------------------------------------------------- lifecycle
    def bind(self) -> str:
        cfg = self.cfg
        if cfg.uses_zmtp:
            from luwu.switch_nodes.curve import CurveKeys
            from luwu.switch_nodes.zmtp import ZmtpListener

            keys = (
                CurveKeys(
                    cfg.curve_public_key,
                    cfg.curve_secret_key,
                    cfg.curve_authorized_keys,
                    cfg.curve_monitor_keys,
                )
                if cfg.curve_secret_key
                else None
            )
            roles = self.roles
            self.listener = ZmtpListener(
                cfg.bind,
                max_message_bytes=cfg.max_message_bytes,
                max_frames=cfg.max_message_frames,
                budget=roles.budget,
                who=self.who,
                max_connections=cfg.max_connections,
                sndhwm=cfg.rcvhwm,
                join_secret=cfg.join_secret,
                member=roles.member,
                curve=keys,
                reply_budget=roles.reply_budget,
                total_bytes=cfg.peers_total_budget,
                exclusive=roles.exclusive,
                replaced=roles.replaced,
                stuck_s=cfg.worker_timeout_s / 4,
                on_stuck=roles.stuck,
            )
        else:
            curve = (
                (
                    cfg.curve_public_key,
                    cfg.curve_secret_key,
                    [*cfg.curve_authorized_keys, *cfg.curve_monitor_keys],
                )
                if cfg.curve_secret_key
                else None
            )
            self.listener = LibzmqListener(
                cfg.bind, max_message_bytes=cfg.max_message_bytes, hwm=cfg.rcvhwm, curve=curve
            )
        self.address = self.listener.address
        return self.address

    def _member(self, ident: bytes) -> bool:
        """Said HELLO, or holds a worker's CURVE key (:class:`PeerRoles`)."""
        return self.roles.member(ident)

    def who(self, ident: bytes) -> str:
        """A connection as a log line names it."""
        rank = next((r for r, i in self.peers.items() if i == ident), None)
        if rank is not None:
            return f"worker rank {rank}"
        key = self.listener.peer_key(ident) if self.listener is not None else None
        return "a peer that did not say HELLO" + (f" (CURVE key {key})" if key else "")

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        torch.set_num_threads(self.cfg.torch_threads)
        if self.cfg.retain_freed_memory:
            retain_freed_memory()
        if self.listener is None:
            self.bind()
        await self.listener.start()
        self._stop = asyncio.Event()
        self.durability.restore_latest()
        print(f"{READY_LINE} {self.address}", flush=True)
        log.info(
            "node %s serving job %r at %s (mode %s)",
            self.index,
            self.job,
            self.address,
            self.cfg.mode,
        )
        self._jobs = asyncio.Queue()
        recv = asyncio.ensure_future(self._recv_loop())
        jobs = asyncio.ensure_future(self._job_loop())
        watch = asyncio.ensure_future(self.membership.watchdog())
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
            if self.ckpt is not None and self.buckets:
                try:  # checkpoint on SIGTERM: whatever the versions, pushes are idempotent on restart
                    self._executor.submit(self.durability.write_checkpoint).result(120)
                except Exception:
                    log.exception("checkpoint on shutdown failed")
            self._executor.shutdown(wait=True)
            self.listener.close()
            self.listener = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    # ----------------------------------------------------------------- the optimizer thread
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the optimizer thread (the only thread that touches the shard)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def submit(self, job: Callable[[], Awaitable[None]]) -> None:
        """Queue ``job`` (a coroutine function) behind the optimizer work already queued."""
        self._jobs.put_nowait((self.gen, job))

    async def _job_loop(self) -> None:
        """Run the queued jobs one at a time: their shard work goes to the optimizer thread in queue
        order while the receive loop keeps reading. A failing job is logged and counted; the node goes on."""
        while True:
            gen, job = await self._jobs.get()
            if gen != self.gen:
                continue  # queued before a rollback: that timeline is gone
            try:
                await job()
            except Exception as exc:
                self.metrics.errors.labels(getattr(exc, "code", "internal")).inc()
                log.exception("node %s: optimizer job failed", self.index)

    # ----------------------------------------------------------------- receive, dispatch, send
    async def _recv_loop(self) -> None:
        listener = self.listener
        while True:
            ident, body, dropped = await listener.recv()
            try:
                msg = wire.decode(
                    body,
                    job=self.job,
                    max_message_bytes=self.cfg.max_message_bytes,
                    header_only=dropped,
                )
                if dropped:
                    raise self._dropped_error(ident, msg.header["op"])
                await self._dispatch(ident, msg)
            except LuwuError as exc:
                self._refuse(ident, body, exc)
            except (
                RecursionError
            ):  # a header nested deeper than Python formats or walks: refused like any bad input
                self._refuse(
                    ident,
                    body,
                    ProtocolError(
                        "a header nested too deep to read (lists or maps within each other)"
                    ),
                )
            except Exception as exc:  # a node never dies of a message
                log.exception("internal error handling a message")
                self._refuse(
                    ident, body, ProtocolError(f"internal error: {type(exc).__name__}: {exc}")
                )

    async def _dispatch(self, ident: bytes, msg: wire.Message) -> None:
        op = msg.header["op"]
        if op not in _OPEN and ident not in self.peers.values():
            raise self._stranger_error(op)
        if op == Op.HELLO:
            self.roles.check_hello(ident)
        if op in _RANKED:
            self.membership.check_worker(ident, msg.header)
        handler = self._handlers.get(op)
        if handler is None:
            raise ProtocolError(f"op {op.name} is not served by a node")
        done = handler(ident, msg)
        if done is not None:
            await done

    def _stranger_error(self, op: Op) -> LuwuError:
        """What a connection that did not say HELLO is told (after a restart: roll back)."""
        step = self.restored_step
        if step is not None and op != Op.ROLLBACK:
            return RollbackError(
                f"node {self.index} restarted from its checkpoint of step {step} (boot {self.boot}): "
                f"roll back to step {step} with optimizer.recover()",
                step=step,
                boot=self.boot,
            )
        if self.ckpt is None and op in _RANKED | {Op.HEARTBEAT} and not self.buckets:
            # a worker of a job this node served before its restart: with no checkpoint its shard is gone
            return NodeStateLostError(
                f"{op.name} for a job this node does not hold (boot {self.boot}): it restarted without node.checkpoint_dir, so "
                "the weights and optimizer state of its shard are lost; restart the job from your own checkpoint "
                "(opt.state_dict()), and run the nodes with node.checkpoint_dir so that a restart rolls back instead",
                boot=self.boot,
            )
        return ProtocolError(f"{op.name} from a peer that did not say HELLO: say HELLO first")

    def _dropped_error(self, ident: bytes, op: Op) -> LuwuError:
        """What a stranger is told for a message whose payload was dropped unread: what its header would get
        (the payload decides nothing for a stranger)."""
        if op in _OPEN or self._member(ident):
            return ProtocolError(
                f"{op.name} with a payload of more than node.stranger_bytes = {self.cfg.stranger_bytes} from a peer that did not say HELLO"
            )
        return self._stranger_error(op)

    def _refuse(self, ident: bytes, body, exc: LuwuError) -> None:
        """Answer ERROR, echoing what can be read of the refused header (step, worker, bucket, op)."""
        code = getattr(exc, "code", "luwu")
        self.metrics.errors.labels(code).inc()
        hdr: dict = {}
        try:
            h = (
                msgpack.unpackb(getattr(body[0], "bytes", body[0]), raw=False, strict_map_key=False)
                if body
                else {}
            )
            hdr = h if isinstance(h, dict) else {}
        except Exception:
            pass

        def num(k, d):
            v = hdr.get(k, d)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else d

        step = exc.step if exc.step is not None else num("step", 0)
        detail = {"boot": exc.boot} if exc.boot is not None else None
        bucket = num("bucket", -1) if "bucket" in hdr else -1
        self.send(
            ident,
            wire.error_message(
                self.job,
                code,
                str(exc),
                ref_op=num("op", 0),
                step=step,
                worker=num("worker", 0),
                bucket=bucket,
                detail=detail,
            ),
        )

    def send(self, ident: bytes, frames: list, track: bool = False, priority=None):
        """Send without blocking; returns the send tracker when ``track`` (see :meth:`Listener.send`). A full
        queue drops the reply."""
        try:
            return self.listener.send(ident, frames, track, priority)
        except SendQueueFull:
            self.metrics.errors.labels("send_queue_full").inc()
            if (
                ident not in self._full_told
            ):  # once per connection: a peer that does not read writes no log
                if len(self._full_told) > 4096:
                    self._full_told.clear()
                self._full_told.add(ident)
                log.warning(
                    'send queue full for %s (%r): it does not read; its replies are dropped (luwu_node_errors_total{code="send_queue_full"} counts them)',
                    self.who(ident),
                    ident,
                )
            return None

    def send_to(self, worker: int, frames: list, track: bool = False, priority=None):
        """:meth:`send` to a connected worker rank (nothing if it is not connected)."""
        ident = self.peers.get(worker)
        return None if ident is None else self.send(ident, frames, track, priority)

    def connected(self, worker: int) -> bool:
        """Whether ``worker``'s connection is still open (from any thread)."""
        ident = self.peers.get(worker)
        return ident is not None and self.listener is not None and self.listener.connected(ident)

    def not_reading(self, ranks: set[int]) -> None:
        """From the optimizer thread: these workers left their replies unread (see :class:`ReplyBuffers`)."""
        self.loop.call_soon_threadsafe(
            asyncio.ensure_future, self.membership.not_reading(set(ranks))
        )

    def tell(self, worker: int, code: str, text: str, *, step: int, bucket: int) -> None:
        """An ERROR to ``worker`` that answers no message of its own (a lost peer, a failed step)."""
        self.send_to(
            worker,
            wire.error_message(self.job, code, text, step=step, worker=worker, bucket=bucket),
        )

    def answer(self, ident: bytes, op: Op, worker: int, **fields: Any) -> None:
        """A header-only reply with the node's step."""
        self.send(
            ident,
            wire.encode({"op": op, "job": self.job, "step": self.step, "worker": worker, **fields}),
        )

    def bucket(self, h: dict) -> BucketState:
        b = self.buckets.get(h["bucket"])
        if b is None:
            raise ProtocolError(f"bucket {h['bucket']} is not owned by node {self.index}")
        return b

    @property
    def step(self) -> int:
        return min((b.version for b in self.buckets.values()), default=0)

    # ----------------------------------------------------------------- stats
    def _on_stats(self, ident: bytes, msg: wire.Message) -> None:
        self.answer(ident, Op.STATS, 0, detail=self.stats())

    def stats(self) -> dict:
        reg = self.metrics.registry

        def val(name, **labels):
            v = reg.get_sample_value(name, labels or None)
            return float(v or 0.0)

        return {
            "node": self.index,
            "address": self.address or "",
            "step": self.step,
            "workers": len(self.peers),
            "world_size": self.world_size or 0,
            "buckets": len(self.buckets),
            "params": sum(b.numel for b in self.buckets.values()),
            "bytes_in": val("luwu_node_bytes_received_total", op="push"),
            "bytes_out": val("luwu_node_bytes_sent_total", op="update"),
            "pushes": val("luwu_node_pushes_total"),
            "updates": val("luwu_node_updates_applied_total"),
            "uptime_s": time.monotonic() - self.started,
            "mode": self.cfg.mode,
            "checkpoint_step": self.ckpt.last_step
            if self.ckpt and self.ckpt.last_step is not None
            else -1,
            "checkpoint_age_s": time.time() - self.ckpt.last_time
            if self.ckpt and self.ckpt.last_time
            else -1.0,
            "members": sorted(self.members),
        }

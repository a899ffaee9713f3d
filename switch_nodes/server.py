"""The node daemon: a ZeroMQ ROUTER on an asyncio (uvloop) event loop.

The loop receives and validates every message and decodes pushes straight into
the (step, bucket) accumulator, scaled by 1/n on the way (the average costs no
pass of its own). A complete bucket goes into a job queue: one consumer hands
the jobs, in order, to one optimizer thread (torch releases the GIL) and sends
the replies, while the loop goes on receiving. Everything that reads or writes
the shard runs on that thread, so a reply never sees a half-stepped bucket.
The reply to the last push of a bucket is the new weights, sent to every
worker: one round trip per bucket; fp32 weights leave zero-copy from the shard
(the next step of that bucket waits until ZeroMQ has sent them). A message
that breaks the contract gets an ERROR reply naming what was wrong; the node
never dies of a message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid

import torch
import zmq
import zmq.asyncio

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.protocol.memory import retain_freed_memory
from luwu.protocol.errors import (
    ConfigError,
    LayoutMismatchError,
    LuwuError,
    ProtocolError,
    RollbackError,
    StepMismatchError,
    WorkerLostError,
)
from luwu.switch_nodes.checkpoint import CheckpointStore
from luwu.protocol.messages import Op
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.metrics import NodeMetrics
from luwu.switch_nodes.optimizers import check_hyper, check_momentum_steps, get_kind
from luwu.switch_nodes.store import Accumulator, BucketState, parse_spec

log = logging.getLogger(__name__)

READY_LINE = "LUWU_NODE_READY"


class ReplyBuffers:
    """Preallocated encode buffers for a bucket's replies, two per codec (by step parity), each reused
    only once ZeroMQ has finished sending what was encoded into it last time."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._trackers: dict[tuple[str, int], list] = {}

    def take(self, codec, numel: int, parity: int) -> list[torch.Tensor]:
        key = (codec.name, parity)
        for t in self._trackers.pop(key, ()):
            t.wait(60)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = codec.alloc(numel)
        return buf

    def encode(self, codec, params: torch.Tensor, version: int):
        """The bucket's weights encoded for the reply of ``version``. fp32 goes zero-copy: the frame is
        ``params`` itself, so whatever changes them next calls :meth:`wait_all` first."""
        if codec.name == "none":
            return codec.encode(params)
        return codec.encode(params, self.take(codec, params.numel(), version & 1))

    def wait_all(self) -> None:
        for key in list(self._trackers):
            for t in self._trackers.pop(key, ()):
                t.wait(60)

    def sent(self, codec_name: str, parity: int, trackers: list) -> None:
        self._trackers.setdefault((codec_name, parity), []).extend(t for t in trackers if t is not None)


class _KeyList:
    """CURVE credentials provider: only the listed worker public keys get in."""

    def __init__(self, allowed: set[bytes]):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        import zmq.utils.z85

        return zmq.utils.z85.encode(key) in self.allowed or key in self.allowed


class NodeServer:
    def __init__(self, cfg: NodeConfig, *, job: str = "luwu", registry=None):
        self.cfg = cfg
        self.job = job
        self.metrics = NodeMetrics(registry)
        self.buckets: dict[int, BucketState] = {}
        self.replies: dict[int, ReplyBuffers] = {}
        self.layout_hash: str | None = None
        self.world_size: int | None = None
        self.kind = None
        self.index = cfg.index
        self.peers: dict[int, bytes] = {}  # worker rank -> ZeroMQ routing id
        self.last_seen: dict[int, float] = {}
        self.address: str | None = None
        self.started = time.monotonic()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="luwu-opt")
        self._stop: asyncio.Event | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._pending_pulls: dict[int, list[tuple[int, str]]] = {}
        self._applied_since_log = 0
        self.param_names: dict[int, str] = {}
        self._delta = None  # DeltaEncoder of the int8-delta pull direction, made on first use
        self.members: set[int] = set()  # ranks expected in each step (elastic mode drops the missing)
        self.boot = uuid.uuid4().hex[:12]  # identifies this process: a rollback is done once per boot
        self.restored_step: int | None = None
        self._rollbacks_done: set[tuple[int, str]] = set()
        self._parked: list[tuple[BucketState, int]] = []  # completions held for a periodic checkpoint
        self._ckpt_due: int | None = None
        self._lost_reported: set[tuple[int, int]] = set()
        self._jobs: asyncio.Queue | None = None  # coroutine factories run in order by _job_loop
        self._gen = 0  # bumped by a rollback: queued jobs of the abandoned timeline are dropped
        self.ckpt = CheckpointStore(cfg.checkpoint_dir, cfg.index) if cfg.checkpoint_dir and cfg.index >= 0 else None

    # ----------------------------------------------------------------- lifecycle
    def bind(self) -> str:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
        sock.setsockopt(zmq.SNDHWM, self.cfg.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes + wire.MAX_HEADER_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.cfg.curve_secret_key:
            from zmq.auth.asyncio import AsyncioAuthenticator

            allowed = {k.encode() for k in self.cfg.curve_authorized_keys}
            self._auth = AsyncioAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback(domain="*", credentials_provider=_KeyList(allowed))
            sock.curve_server = True
            sock.curve_secretkey = self.cfg.curve_secret_key.encode()
            sock.curve_publickey = self.cfg.curve_public_key.encode()
        sock.bind(self.cfg.bind)
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    async def serve(self) -> None:
        torch.set_num_threads(self.cfg.torch_threads)
        if self.cfg.retain_freed_memory:
            retain_freed_memory()
        if self._sock is None:
            self.bind()
        self._stop = asyncio.Event()
        if self.ckpt is not None:
            ckpt = self.ckpt.latest()
            if ckpt is not None:
                self._restore(ckpt)
                self.restored_step = ckpt.meta["step"]
                log.warning("node %s restored step %d from %s", self.index, self.restored_step, ckpt.path)
        print(f"{READY_LINE} {self.address}", flush=True)
        log.info("node %s serving job %r at %s (mode %s)", self.index, self.job, self.address, self.cfg.mode)
        self._jobs = asyncio.Queue()
        recv = asyncio.ensure_future(self._recv_loop())
        jobs = asyncio.ensure_future(self._job_loop())
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
            if self.ckpt is not None and self.buckets:
                try:  # checkpoint on SIGTERM: whatever the versions, pushes are idempotent on restart
                    self._executor.submit(self._write_checkpoint).result(120)
                except Exception:
                    log.exception("checkpoint on shutdown failed")
            self._executor.shutdown(wait=True)
            self._sock.close(0)
            self._sock = None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    # ----------------------------------------------------------------- receive
    async def _recv_loop(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            ident, body = frames[0].bytes, frames[1:]
            try:
                msg = wire.decode(body, job=self.job, max_message_bytes=self.cfg.max_message_bytes)
                await self._handle(ident, msg)
            except LuwuError as exc:
                self._refuse(ident, body, exc)
            except Exception as exc:  # a node never dies of a message
                log.exception("internal error handling a message")
                self._refuse(ident, body, ProtocolError(f"internal error: {type(exc).__name__}: {exc}"))

    def _submit(self, job) -> None:
        """Queue ``job`` (a coroutine function) behind the optimizer work already queued."""
        self._jobs.put_nowait((self._gen, job))

    async def _job_loop(self) -> None:
        """Run the queued jobs one at a time: their shard work goes to the optimizer thread in queue
        order while the receive loop keeps reading. A failing job is logged and counted; the node goes on."""
        while True:
            gen, job = await self._jobs.get()
            if gen != self._gen:
                continue  # queued before a rollback: that timeline is gone
            try:
                await job()
            except Exception as exc:
                code = getattr(exc, "code", "internal")
                self.metrics.errors.labels(code).inc()
                log.exception("node %s: optimizer job failed", self.index)

    def _refuse(self, ident: bytes, body, exc: LuwuError) -> None:
        code = getattr(exc, "code", "luwu")
        self.metrics.errors.labels(code).inc()
        hdr = {}
        try:
            import msgpack

            h = msgpack.unpackb(getattr(body[0], "bytes", b""), raw=False, strict_map_key=False) if body else {}
            hdr = h if isinstance(h, dict) else {}
        except Exception:
            pass

        def num(k, d):
            v = hdr.get(k, d)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else d

        step = exc.step if isinstance(exc, RollbackError) and exc.step is not None else num("step", 0)
        detail = {"boot": exc.boot} if hasattr(exc, "boot") else None
        self._send(ident, wire.error_message(self.job, code, str(exc), ref_op=num("op", 0), step=step, worker=num("worker", 0), bucket=num("bucket", -1) if "bucket" in hdr else -1, detail=detail))

    def _send(self, ident: bytes, frames: list, track: bool = False):
        try:
            fut = self._sock.send_multipart([ident, *frames], copy=False, track=track, flags=zmq.NOBLOCK)
            # zmq.asyncio settles a NOBLOCK send at once; its result is the MessageTracker
            return fut.result() if fut.done() else None
        except zmq.Again:
            self.metrics.errors.labels("send_queue_full").inc()
            log.warning("send queue full for peer %r; reply dropped", ident)
            return None

    async def _handle(self, ident: bytes, msg: wire.Message) -> None:
        h = msg.header
        op = h["op"]
        if op not in (Op.HELLO, Op.STATS) and ident not in self.peers.values():
            if self.restored_step is not None and op != Op.ROLLBACK:
                err = RollbackError(
                    f"node {self.index} restarted from its checkpoint of step {self.restored_step} (boot {self.boot}): "
                    f"roll back to step {self.restored_step} with optimizer.recover()",
                    step=self.restored_step,
                )
                err.boot = self.boot  # type: ignore[attr-defined]
                raise err
            raise ProtocolError(f"{op.name} from a peer that did not say HELLO: say HELLO first")
        if op in (Op.PUSH, Op.INIT, Op.PULL, Op.COMMIT, Op.STATE, Op.CHECKPOINT, Op.ROLLBACK):
            self._check_worker(ident, h)
        if op == Op.HELLO:
            self._on_hello(ident, h)
        elif op == Op.INIT:
            self._on_init(h, msg)
        elif op == Op.PULL:
            self._on_pull(ident, h)
        elif op == Op.PUSH:
            await self._on_push(h, msg)
        elif op == Op.COMMIT:
            await self._on_commit(h)
        elif op == Op.STATE:
            await self._on_state(ident, h, msg)
        elif op == Op.CHECKPOINT:
            if self.ckpt is None:
                raise ConfigError(f"node {self.index} has no checkpoint_dir (and a node index) configured")
            await asyncio.get_running_loop().run_in_executor(self._executor, self._write_checkpoint)
            self._send(ident, wire.encode({"op": Op.CHECKPOINT, "job": self.job, "step": self.step, "worker": h["worker"]}))
        elif op == Op.ROLLBACK:
            await self._on_rollback(ident, h)
        elif op == Op.STATS:
            self._send(ident, wire.encode({"op": Op.STATS, "job": self.job, "step": self.step, "worker": 0, "detail": self.stats()}))
        elif op == Op.HEARTBEAT:
            self.last_seen[h["worker"]] = time.monotonic()
            self._send(ident, wire.encode({"op": Op.HEARTBEAT, "job": self.job, "step": self.step, "worker": h["worker"]}))
        else:
            raise ProtocolError(f"op {op.name} is not served by a node")

    def _check_worker(self, ident: bytes, h: dict) -> None:
        w = h["worker"]
        if self.world_size is None or w >= self.world_size:
            raise ProtocolError(f"worker rank {w} is outside world size {self.world_size}")
        if self.peers.get(w) != ident:
            raise ProtocolError(f"worker {w}: message from a peer that did not say HELLO as this rank")
        if w not in self.members and h["op"] == Op.PUSH:
            raise WorkerLostError(f"worker {w} was dropped from the job after {self.cfg.worker_timeout_s:.0f} s without pushes (elastic mode): call optimizer.recover() to rejoin")
        self.last_seen[w] = time.monotonic()

    def _bucket(self, h: dict) -> BucketState:
        b = self.buckets.get(h["bucket"])
        if b is None:
            raise ProtocolError(f"bucket {h['bucket']} is not owned by node {self.index}")
        return b

    @property
    def step(self) -> int:
        return min((b.version for b in self.buckets.values()), default=0)

    # ----------------------------------------------------------------- HELLO / INIT / PULL
    def _on_hello(self, ident: bytes, h: dict) -> None:
        if h["world_size"] < 1 or h["worker"] >= h["world_size"]:
            raise ProtocolError(f"worker rank {h['worker']} is outside world size {h['world_size']}")
        if self.index >= 0 and h["node_index"] != self.index:
            raise LayoutMismatchError(f"this is node {self.index}, worker {h['worker']} addressed it as node {h['node_index']}")
        kind = get_kind(h["optimizer"])
        if h["mode"] != self.cfg.mode:
            raise ConfigError(f"worker {h['worker']} runs mode {h['mode']!r}, this node runs {self.cfg.mode!r}")
        specs = [parse_spec(s) for s in h["buckets"]]
        names = h.get("param_names", {})
        if not all(type(k) is int and isinstance(v, str) and len(v) < 1024 for k, v in names.items()):
            raise ProtocolError("param_names must map parameter indices (ints) to names (short strings)")
        w = h["worker"]
        bound = self.peers.get(w)
        if bound is not None and bound != ident and time.monotonic() - self.last_seen.get(w, 0.0) < self.cfg.worker_timeout_s:
            # a rank is one connection: another peer claiming a live rank is refused (a restarted worker
            # can take its rank back once the old connection has been silent for worker_timeout_s)
            raise ProtocolError(f"worker rank {w} is held by a live connection (heard from {time.monotonic() - self.last_seen[w]:.1f} s ago)")
        new_numel = sum(n for bid, _, n, _ in specs if bid not in self.buckets)
        held = sum(b.numel for b in self.buckets.values())
        if (held + new_numel) * 4 * (1 + len(kind.state_names)) > self.cfg.max_shard_bytes:
            raise ConfigError(f"HELLO of worker {w} would make this node hold {(held + new_numel) * 4 * (1 + len(kind.state_names)) / 2**30:.1f} GiB, over node.max_shard_bytes")
        if self.layout_hash is not None and h["layout"] != self.layout_hash and bound != ident:
            raise LayoutMismatchError(
                f"layout hash mismatch: worker {w} has layout {h['layout']}, the job has {self.layout_hash} (only a connected "
                "worker can extend the layout with add_param_group)"
            )
        if self.layout_hash is None:
            self.index, self.world_size, self.kind = h["node_index"], h["world_size"], kind
        else:
            if h["world_size"] != self.world_size:
                raise LayoutMismatchError(f"worker {h['worker']} says world size {h['world_size']}, the job has {self.world_size}")
            if kind is not self.kind:
                raise LayoutMismatchError(f"worker {h['worker']} uses optimizer {kind.name!r}, the job uses {self.kind.name!r}")
            if h["layout"] != self.layout_hash:
                # Accepted only as an extension (add_param_group): every known bucket unchanged.
                new = {bid: (g, n, segs) for bid, g, n, segs in specs}
                for b in self.buckets.values():
                    got = new.get(b.id)
                    if got is None or [b.group, b.numel, b.spec[3]] != [got[0], got[1], [[s.param, s.param_offset, s.offset, s.numel] for s in got[2]]]:
                        raise LayoutMismatchError(
                            f"layout hash mismatch: worker {h['worker']} has layout {h['layout']}, the job has {self.layout_hash} "
                            f"(bucket {b.id} differs: a different model or bucket_bytes)"
                        )
        for bid, group, numel, segs in specs:
            if bid not in self.buckets:
                self.buckets[bid] = BucketState(bid, group, numel, segs, kind)
                self.buckets[bid].version = h["step"]  # a group added mid-training starts at the job's step
                self.replies[bid] = ReplyBuffers()
        self.param_names.update(names)
        self.layout_hash = h["layout"]
        self.peers[h["worker"]] = ident
        if not self.members:
            self.members = set(range(self.world_size))
        self.members.add(h["worker"])
        self.last_seen[h["worker"]] = time.monotonic()
        self.metrics.workers.set(len(self.peers))
        self._send(
            ident,
            wire.encode(
                {
                    "op": Op.WELCOME,
                    "job": self.job,
                    "step": self.step,
                    "worker": h["worker"],
                    "layout": self.layout_hash,
                    "versions": {b.id: b.version for b in self.buckets.values()},
                    "initialized": [b.id for b in self.buckets.values() if b.initialized],
                }
            ),
        )

    def _on_init(self, h: dict, msg: wire.Message) -> None:
        b = self._bucket(h)
        if b.initialized:
            return  # idempotent: the first seed wins (a restarted rank 0 must not reset the weights)
        codec = get_codec(h["codec"])
        codec.validate(b.numel, h["nbytes"], h["cmeta"])
        codec.decode_(b.params, msg.tensors(), h["cmeta"])
        b.initialized = True
        for w, pull_codec in self._pending_pulls.pop(b.id, []):
            self._reply_weights(b, [w], pull_codec)

    def _on_pull(self, ident: bytes, h: dict) -> None:
        b = self._bucket(h)
        if h["codec"] != "int8_delta":
            get_codec(h["codec"])  # validate the name now
        if not b.initialized:
            self._pending_pulls.setdefault(b.id, []).append((h["worker"], h["codec"]))
            return
        self._submit(lambda: self._reply_current(b, [h["worker"]], h["codec"]))

    async def _reply_current(self, b: BucketState, workers, codec_name: str, seq: int | None = None) -> None:
        """Encode the bucket's weights on the optimizer thread (behind the queued steps) and send them."""
        gen = self._gen
        frames = await asyncio.get_running_loop().run_in_executor(self._executor, self._encode_weights, b, codec_name, seq is None)
        if gen == self._gen:
            self._reply_weights(b, workers, codec_name, frames=frames, seq=seq)

    def _encode_weights(self, b: BucketState, pull: str, full: bool = False) -> tuple[str, bool, dict, list]:
        """Encode the bucket's weights for the pull direction: (codec, is_delta, meta, frames)."""
        if pull == "int8_delta" and not full:
            from luwu.protocol.feedback import DeltaEncoder

            if self._delta is None:
                self._delta = DeltaEncoder("int8")
            self.replies[b.id].wait_all()  # the encoder reuses its buffers
            enc = self._delta.encode(b.id, b.params, b.version)
            return enc.codec, enc.delta, enc.encoded.meta, enc.encoded.frames
        name = "none" if pull == "int8_delta" else pull
        enc = self.replies[b.id].encode(get_codec(name), b.params, b.version)
        return name, False, enc.meta, enc.frames

    def _reply_weights(self, b: BucketState, workers, codec_name: str, skipped: bool = False, frames=None, seq: int | None = None) -> None:
        """Send the bucket's current weights (encoded now unless ``frames`` are given). A PULL always gets
        full weights (a joining worker has no copy to add a delta to)."""
        parity = b.version & 1
        if frames is None:
            frames = self._encode_weights(b, codec_name, full=seq is None)
        codec_name, delta, meta, payload = frames
        header = {"op": Op.UPDATE, "job": self.job, "step": b.version, "worker": 0, "bucket": b.id, "codec": codec_name, "cmeta": meta, "skipped": skipped}
        if delta:
            header["delta"] = True
        if seq is not None:
            header["seq"] = seq
        data = wire.encode(header, payload)
        nbytes = sum(f.nbytes for f in data[1:])
        trackers = []
        for w in workers:
            ident = self.peers.get(w)
            if ident is None:
                continue
            trackers.append(self._send(ident, data, track=True))
            self.metrics.bytes_out.labels("update").inc(nbytes)
            self.metrics.raw_out.labels("update").inc(b.numel * 4)
        self.replies[b.id].sent(codec_name, parity, trackers)

    # ----------------------------------------------------------------- PUSH / COMMIT
    async def _on_push(self, h: dict, msg: wire.Message) -> None:
        b = self._bucket(h)
        if not b.initialized:
            raise StepMismatchError(f"bucket {b.id} has no weights yet: rank 0 must INIT it before pushes")
        if self.cfg.mode == "async":
            await self._on_push_async(b, h, msg)
            return
        w, step = h["worker"], h["step"]
        if step < b.version and step not in b.accs:
            # A retried push of a step already applied: answer with the weights, count nothing.
            self.metrics.duplicates.inc()
            if step == b.version - 1:
                pull = "none" if h["pull"] == "int8_delta" else h["pull"]
                self._submit(lambda: self._reply_current(b, [w], pull, seq=step))
                return
            raise StepMismatchError(f"bucket {b.id}: push of worker {w} for step {step}, node is at step {b.version}")
        acc = b.accumulator(step, max_ahead=2 + self.cfg.staleness)
        if w in acc.workers:
            self.metrics.duplicates.inc()
            return
        codec = get_codec(h["codec"])
        codec.validate(b.numel, h["nbytes"], h["cmeta"])
        nograd = tuple(h["nograd"])
        if acc.workers:
            if nograd != acc.nograd:
                names = sorted(set(nograd) ^ set(acc.nograd))
                params = [self.param_names.get(b.segments[i].param, f"#{b.segments[i].param}") for i in names if i < len(b.segments)]
                raise StepMismatchError(
                    f"bucket {b.id} step {step}: worker {w} disagrees with the other workers on which parameters have a "
                    f"gradient: {params} (None on some workers, a tensor on others)"
                )
        else:
            if any(not isinstance(i, int) or not 0 <= i < len(b.segments) for i in nograd):
                raise ProtocolError(f"bucket {b.id}: nograd names segments outside 0..{len(b.segments) - 1}")
            if h["pull"] != "int8_delta":
                get_codec(h["pull"])
            hyper = dict(b.kind.defaults) | h["hyper"]
            check_hyper(b.kind, hyper)
            check_momentum_steps(b.kind, hyper, b.steps, ahead=step - b.version)
            acc.nograd, acc.hyper, acc.two_phase = nograd, hyper, h["two_phase"]
        b.add_push(acc, codec, msg.tensors(), h["cmeta"], len(self.members))
        acc.workers.add(w)
        acc.pull = h["pull"]
        self.metrics.pushes.inc()
        self.metrics.bytes_in.labels("push").inc(sum(h["nbytes"]))
        self.metrics.raw_in.labels("push").inc(b.numel * 4)
        if acc.workers >= self.members:
            self.metrics.agg_wait.observe(time.monotonic() - acc.first_at)
            await self._complete(b, step, acc)

    async def _on_push_async(self, b: BucketState, h: dict, msg: wire.Message) -> None:
        """Async mode: apply each push as it arrives; with ``staleness`` s, the reply to a worker at step t
        is held until every worker has pushed step t - s of this bucket (bounded staleness)."""
        w, step = h["worker"], h["step"]
        last = b.worker_steps.get(w, -1)
        if step <= last:
            self.metrics.duplicates.inc()
            if step == last:
                self._reply_weights(b, [w], "none" if h["pull"] == "int8_delta" else h["pull"], seq=step)
            return
        if step != last + 1:
            raise StepMismatchError(f"bucket {b.id}: worker {w} pushed step {step} after step {last}")
        if h["two_phase"]:
            raise ConfigError("global-norm clipping and AMP need sync mode: an async node applies each push alone")
        codec = get_codec(h["codec"])
        codec.validate(b.numel, h["nbytes"], h["cmeta"])
        nograd = tuple(h["nograd"])
        if any(not isinstance(i, int) or not 0 <= i < len(b.segments) for i in nograd):
            raise ProtocolError(f"bucket {b.id}: nograd names segments outside 0..{len(b.segments) - 1}")
        hyper = dict(b.kind.defaults) | h["hyper"]
        check_hyper(b.kind, hyper)
        if hyper.get(WORKER_MOMENTUM) is not None:
            raise ConfigError("momentum correction needs sync mode: an async node applies each worker's momentum alone")
        acc = b.accumulator(b.version, max_ahead=0)
        acc.nograd, acc.hyper, acc.pull = nograd, hyper, h["pull"]
        codec.decode_(acc.buf, msg.tensors(), h["cmeta"])
        acc.workers.add(w)
        b.worker_steps[w] = step
        self.metrics.pushes.inc()
        self.metrics.bytes_in.labels("push").inc(sum(h["nbytes"]))
        self.metrics.raw_in.labels("push").inc(b.numel * 4)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()

        def work():
            self.replies[b.id].wait_all()
            b.apply(acc, 1.0)
            b.version += 1

        version = b.version
        await loop.run_in_executor(self._executor, work)
        b.release(version)
        self.metrics.opt_seconds.observe(time.perf_counter() - t0)
        self.metrics.updates.inc()
        b.held.append((w, step, h["pull"]))
        self._release_held(b)

    def _release_held(self, b: BucketState) -> None:
        """Send the held async replies whose worker is at most ``staleness`` steps ahead of the slowest."""
        if self.world_size is None:
            return
        steps = [b.worker_steps.get(r, -1) for r in range(self.world_size)]
        slowest = min(steps)
        self.metrics.staleness.set(max(steps) - slowest)
        keep = []
        for w, step, pull in b.held:
            if step - slowest <= self.cfg.staleness:
                self._reply_weights(b, [w], "none" if pull == "int8_delta" else pull, seq=step)
            else:
                keep.append((w, step, pull))
        b.held = keep

    async def _complete(self, b: BucketState, step: int, acc: Accumulator) -> None:
        """All expected pushes are in: queue the step, or (two-phase) report the norm and wait for COMMIT."""
        if step != b.version or acc.started:
            return  # an earlier step of this bucket is still open (it picks this one up), or queued already
        every = self.cfg.checkpoint_every
        if self.ckpt is not None and every and step % every == 0 and step > 0 and (self.ckpt.last_step or 0) < step:
            # a periodic checkpoint at `step`: hold this bucket until every bucket has reached it
            self._parked.append((b, step))
            if all(x.version >= step for x in self.buckets.values()):
                await asyncio.get_running_loop().run_in_executor(self._executor, self._write_checkpoint)
                parked, self._parked = self._parked, []
                for pb, pstep in parked:
                    pacc = pb.accs.get(pstep)
                    if pacc is not None and pacc.workers >= self.members:
                        await self._complete(pb, pstep, pacc)
            return
        n = len(acc.workers)
        if acc.two_phase:
            if acc.norm_sent:
                return
            acc.norm_sent = True
            self._submit(lambda: self._send_norm(b, step, acc, float(n)))
            return
        self._queue_apply(b, step, acc, float(n), skip=False)

    async def _send_norm(self, b: BucketState, step: int, acc: Accumulator, n: float) -> None:
        sq, nonfinite = await asyncio.get_running_loop().run_in_executor(self._executor, b.sqnorm, acc, n)
        for w in acc.workers:
            if w in self.peers:
                self._send(self.peers[w], wire.encode({"op": Op.NORM, "job": self.job, "step": step, "worker": w, "bucket": b.id, "sqnorm": sq, "nonfinite": nonfinite}))

    def _queue_apply(self, b: BucketState, step: int, acc: Accumulator, divisor: float, *, skip: bool) -> None:
        acc.started = True
        self._submit(lambda: self._apply(b, step, acc, divisor, skip=skip))

    async def _on_commit(self, h: dict) -> None:
        step = h["step"]
        for bid in h["buckets"]:
            b = self.buckets.get(bid) if isinstance(bid, int) else None
            if b is None:
                raise ProtocolError(f"COMMIT names bucket {bid!r}, not owned by node {self.index}")
            acc = b.accs.get(step)
            if acc is None or not acc.norm_sent or acc.started or step != b.version:
                continue  # already committed by another worker's COMMIT, or not yet complete
            coef = h["coef"]
            if not (coef > 0 and coef == coef and coef != float("inf")) and not h["skip"]:
                raise ProtocolError(f"COMMIT coefficient must be positive and finite, got {coef}")
            self._queue_apply(b, step, acc, len(acc.workers) / coef if not h["skip"] else 1.0, skip=h["skip"])

    async def _apply(self, b: BucketState, step: int, acc: Accumulator, divisor: float, *, skip: bool) -> None:
        """A queued job: the optimizer step of (bucket, step) on the optimizer thread, then the replies."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        gen = self._gen

        def work():
            if not skip:
                self.replies[b.id].wait_all()  # the last fp32 reply may still be leaving from the shard
                b.apply(acc, divisor)
            b.version = step + 1
            return self._encode_weights(b, acc.pull)

        try:
            frames = await loop.run_in_executor(self._executor, work)
        except Exception as exc:  # a bug, not an input: say so to the workers waiting for this bucket
            log.exception("node %s: optimizer step of bucket %d, step %d failed", self.index, b.id, step)
            for w in acc.workers:
                if w in self.peers:
                    self._send(self.peers[w], wire.error_message(self.job, "internal", f"node {self.index}: optimizer step of bucket {b.id}, step {step} failed: {type(exc).__name__}: {exc}", step=step, worker=w, bucket=b.id))
            raise
        if gen != self._gen:
            return  # a rollback came in meanwhile: these weights belong to the abandoned timeline
        self.metrics.opt_seconds.observe(time.perf_counter() - t0)
        (self.metrics.skipped if skip else self.metrics.updates).inc()
        workers = sorted(acc.workers)
        b.release(step)
        self._reply_weights(b, workers, acc.pull, skipped=skip, frames=frames, seq=step)
        self.metrics.step.set(self.step)
        self._applied_since_log += 1
        if self._applied_since_log >= self.cfg.log_every * max(1, len(self.buckets)):
            self._applied_since_log = 0
            log.info("node %s at step %d: %d buckets, %d workers, %.0f pushes", self.index, self.step, len(self.buckets), len(self.peers), self.metrics.pushes._value.get())
        # A later step of this bucket may have completed while this one was open.
        nxt = b.accs.get(step + 1)
        if nxt is not None and nxt.workers and nxt.workers >= self.members:
            await self._complete(b, step + 1, nxt)

    async def _on_state(self, ident: bytes, h: dict, msg: wire.Message) -> None:
        """Get or set a bucket's weights and optimizer state (``state_dict`` / ``load_state_dict``)."""
        b = self._bucket(h)
        names = ["params", *b.kind.state_names, "steps"]
        reply = {"op": Op.STATE, "job": self.job, "step": b.version, "worker": h["worker"], "bucket": b.id, "action": h["action"], "names": names}
        if h["action"] == "get":

            def snapshot():
                reply["step"] = b.version  # as of the snapshot, behind the steps queued before it
                steps = torch.stack(b.steps) if b.steps else torch.zeros(0)
                return [b.params.clone(), *(b.state[n].clone() for n in b.kind.state_names), steps]

            async def get():
                self._send(ident, wire.encode(reply, await asyncio.get_running_loop().run_in_executor(self._executor, snapshot)))

            self._submit(get)
        elif h["action"] == "set":
            if h["names"] != names:
                raise ProtocolError(f"STATE set of bucket {b.id} must carry {names}, got {h['names']}")
            want = [b.numel * 4] * (len(names) - 1) + [len(b.segments) * 4]
            if h["nbytes"] != want:
                raise ProtocolError(f"STATE set of bucket {b.id}: frame sizes {h['nbytes']}, expected {want}")
            if b.accs:
                raise StepMismatchError(f"STATE set of bucket {b.id} while step {sorted(b.accs)} is being aggregated")
            frames = [t.view(torch.float32) for t in msg.tensors()]
            loop = asyncio.get_running_loop()

            def work():
                self.replies[b.id].wait_all()
                b.params.copy_(frames[0])
                for n, t in zip(b.kind.state_names, frames[1:-1]):
                    b.state[n].copy_(t)
                for s, v in zip(b.steps, frames[-1]):
                    s.fill_(v)
                b.initialized = True
                if self._delta is not None:
                    self._delta.force_resync(b.id)

            await loop.run_in_executor(self._executor, work)
            self._send(ident, wire.encode(reply))
        else:
            raise ProtocolError(f"STATE action must be 'get' or 'set', got {h['action']!r}")

    # ----------------------------------------------------------------- durability
    def _write_checkpoint(self) -> None:
        """Runs on the optimizer thread (nothing else touches the shard meanwhile)."""
        meta = {
            "job": self.job,
            "node": self.index,
            "layout": self.layout_hash,
            "world_size": self.world_size,
            "optimizer": self.kind.name if self.kind else None,
            "step": self.step,
            "param_names": {str(k): v for k, v in self.param_names.items()},
            "buckets": [{"id": b.id, "spec": b.spec, "version": b.version, "initialized": b.initialized, "numels": [b.numel] * (1 + len(b.state)) + [len(b.steps)]} for b in self.buckets.values()],
        }
        tensors = {b.id: [b.params, *(b.state[n] for n in b.kind.state_names), torch.stack(b.steps) if b.steps else torch.zeros(0)] for b in self.buckets.values()}
        path = self.ckpt.save(meta, tensors)
        self.metrics.checkpoint_step.set(meta["step"])
        log.info("node %s wrote checkpoint of step %d: %s", self.index, meta["step"], path)

    def _restore(self, ckpt) -> None:
        m = ckpt.meta
        if m["job"] != self.job:
            raise ConfigError(f"checkpoint {ckpt.path} belongs to job {m['job']!r}, this node serves {self.job!r}")
        self.kind = get_kind(m["optimizer"])
        self.layout_hash, self.world_size = m["layout"], m["world_size"]
        self.param_names = {int(k): v for k, v in m.get("param_names", {}).items()}
        self.members = set(range(self.world_size))
        self.buckets, self.replies = {}, {}
        for b in m["buckets"]:
            bid, group, numel, segs = parse_spec(b["spec"])
            st = BucketState(bid, group, numel, segs, self.kind)
            ts = ckpt.tensors[bid]
            st.params.copy_(ts[0])
            for n, t in zip(st.kind.state_names, ts[1:-1]):
                st.state[n].copy_(t)
            for sv, v in zip(st.steps, ts[-1]):
                sv.fill_(v)
            st.version, st.initialized = b["version"], b["initialized"]
            self.buckets[bid] = st
            self.replies[bid] = ReplyBuffers()
        if self._delta is not None:
            self._delta.force_resync()
        self.metrics.step.set(self.step)
        self.metrics.checkpoint_step.set(m["step"])

    async def _on_rollback(self, ident: bytes, h: dict) -> None:
        """Roll this node back to its checkpoint of ``step`` (once per (step, boot of the restarted node))."""
        step = h["step"]
        boot = str((h.get("detail") or {}).get("boot", ""))
        if (step, boot) not in self._rollbacks_done and not (self.restored_step == step and boot == self.boot):
            self._gen += 1  # queued steps and replies of the abandoned timeline are dropped
            if self.ckpt is None:
                raise ConfigError(f"node {self.index} cannot roll back: no checkpoint_dir configured")
            loop = asyncio.get_running_loop()
            ckpt = await loop.run_in_executor(self._executor, self.ckpt.latest, step)
            if ckpt is None:
                raise RollbackError(f"node {self.index} has no valid checkpoint of step {step} to roll back to", step=step)
            peers = dict(self.peers)
            await loop.run_in_executor(self._executor, self._restore, ckpt)
            self.peers = peers
            self._parked, self._pending_pulls = [], {}
            log.warning("node %s rolled back to step %d (restart of boot %s)", self.index, step, boot)
        self._rollbacks_done.add((step, boot))
        self._send(ident, wire.encode({"op": Op.ROLLBACK, "job": self.job, "step": self.step, "worker": h["worker"]}))

    async def _complete_ready(self) -> None:
        """After the membership shrank: every open step that now has all its (remaining) workers goes on."""
        for b in list(self.buckets.values()):
            acc = b.accs.get(b.version)
            if acc is not None and acc.workers and acc.workers >= self.members and not acc.norm_sent:
                await self._complete(b, b.version, acc)

    async def _watchdog(self) -> None:
        """Missing workers: strict mode fails the step naming them; elastic mode drops them and goes on."""
        last_said = 0.0
        while True:
            await asyncio.sleep(min(1.0, self.cfg.worker_timeout_s / 4))
            now = time.monotonic()
            if now - last_said >= 5.0 and self.world_size:
                # start-up without silent hangs: say which ranks this node is still waiting for
                absent = sorted(set(range(self.world_size)) - set(self.peers))
                waiting = sorted({w for b in self.buckets.values() for acc in b.accs.values() if now - acc.first_at > 5.0 for w in self.members - acc.workers})
                if absent or waiting:
                    last_said = now
                    log.warning("node %s at %s: waiting for worker ranks %s (not connected: %s)", self.index, self.address, waiting or absent, absent)
            if self.ckpt is not None and self.ckpt.last_time is not None:
                self.metrics.checkpoint_age.set(time.time() - self.ckpt.last_time)
            for b in list(self.buckets.values()):
                for step, acc in list(b.accs.items()):
                    missing = self.members - acc.workers
                    if not missing or not acc.workers or now - acc.first_at < self.cfg.worker_timeout_s:
                        continue
                    if self.cfg.worker_policy == "elastic":
                        self.members -= missing
                        self.metrics.dropped_workers.inc(len(missing))
                        log.warning("node %s: dropped workers %s from step %d (elastic)", self.index, sorted(missing), step)
                        text = f"dropped from step {step} after {self.cfg.worker_timeout_s:.0f} s without a push (elastic mode): call optimizer.recover() to rejoin"
                        for w in missing:  # a stalled worker learns it when it wakes up
                            if w in self.peers:
                                self._send(self.peers[w], wire.error_message(self.job, WorkerLostError.code, f"worker {w} {text}", step=step, worker=w, bucket=b.id))
                        await self._complete_ready()
                    elif (step, b.id) not in self._lost_reported:
                        self._lost_reported.add((step, b.id))
                        text = f"workers {sorted(missing)} sent nothing for step {step}, bucket {b.id} within {self.cfg.worker_timeout_s:.0f} s (strict mode)"
                        for w in acc.workers:
                            self._send(self.peers[w], wire.error_message(self.job, WorkerLostError.code, text, step=step, worker=w, bucket=b.id))

    # ----------------------------------------------------------------- stats
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
            "checkpoint_step": self.ckpt.last_step if self.ckpt and self.ckpt.last_step is not None else -1,
            "checkpoint_age_s": time.time() - self.ckpt.last_time if self.ckpt and self.ckpt.last_time else -1.0,
            "members": sorted(self.members),
        }

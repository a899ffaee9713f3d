"""``AggregatorServer``: the switch tier's daemon, in front of the nodes for one group of workers.

The group's workers connect to it as they would to the nodes (one connection per node, each saying
HELLO with its node index). It holds one connection per node and speaks for the group there:

- HELLO goes up marked ``relay``: the node binds the rank to the aggregator's connection, and checks
  it as it checks any worker (job, layout, world size, resume). Until a rank's WELCOME came back, its
  connection may say nothing else; a peer without the job's join secret never gets that far (the
  same listener as the node's, :mod:`luwu.switch_nodes.zmtp`, with the same bounds).
- Keys (CURVE): with ``cfg.curve_secret_key`` the listener is a CURVE server with the aggregator's own
  key pair, letting in the group's worker keys only (``cfg.curve_authorized_keys`` in rank order: rank
  r says HELLO with the r-th), and with ``upstream_curve`` each node connection is a CURVE client with
  the aggregator's key (one of the nodes' ``node.curve_aggregator_keys``, bound to this group).
- PUSH: the group's pushes of a (step, bucket) are summed (:mod:`.group_sums`) and go up once,
  fp32 when they came fp32, else under the uplink's own compression policy (``compression``).
- A late rank: a block that waited a quarter of the nodes' ``worker_timeout_s`` (their WELCOME says
  it) goes up as what it has, so the node's watchdog names (strict) or drops (elastic) only the rank
  that is missing; a rank a node dropped (its ERROR says ``dropped``) or that left is not waited for
  there until it is welcomed again (:class:`.group_sums.GroupSums`).
- PULL (streaming mode's fetches): in sync mode, the group's PULLs of a bucket that come while one
  is in flight wait for its answer and get it too (:mod:`.fetches`).
- Every other op goes up as it came, and the node's answers come back to the rank they name: a
  reply that answers several of the group's ranks (``ranks``: an UPDATE, which the node sends the
  aggregator once) is passed to each of them, as it came, never re-encoded.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import zmq
import zmq.asyncio

from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError, ProtocolError
from luwu.protocol.layout import Bucket
from luwu.protocol.messages import Op
from luwu.protocol.policy import CompressionConfig
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.curve import CurveKeys
from luwu.switch_nodes.lines import READY_LINE
from luwu.switch_nodes.tier.fetches import Fetches
from luwu.switch_nodes.tier.group_sums import GroupSums
from luwu.switch_nodes.tier.metrics import AggregatorMetrics
from luwu.switch_nodes.zmtp import ZmtpListener

__all__ = ["AggregatorServer"]

log = logging.getLogger(__name__)


def _header(frame) -> dict:
    return msgpack.unpackb(getattr(frame, "bytes", frame), raw=False, strict_map_key=False)


def _readdressed(frames: list, worker: int) -> list:
    """A reply that named several ranks, as the one worker ``worker`` gets it."""
    header = _header(frames[0])
    header.pop("ranks", None)
    header["worker"] = worker
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


class AggregatorServer:
    """One aggregator: ``cfg`` its listener's settings (a node's: bind, join secret or CURVE keys,
    bounds), ``nodes`` the job's node addresses in index order, ``group`` the worker ranks it serves;
    ``upstream_secret`` the join secret it shows the nodes, or ``upstream_curve`` its CURVE keys to them
    (the nodes' public key, its own public and secret key, Z85)."""

    def __init__(
        self,
        cfg: NodeConfig,
        *,
        job: str,
        nodes: list[str],
        group: tuple[int, ...],
        upstream_secret: str = "",
        upstream_curve: tuple[str, str, str] | None = None,
        registry=None,
        compression: CompressionConfig | None = None,
    ) -> None:
        if not nodes:
            raise ProtocolError("an aggregator needs the job's node addresses")
        if not group or list(group) != list(range(group[0], group[0] + len(group))):
            raise ProtocolError(f"an aggregator's ranks are a contiguous run, got {list(group)}")
        self.cfg, self.job, self.nodes, self.group = cfg, job, nodes, tuple(group)
        self.upstream_secret, self.compression = upstream_secret, compression
        self.upstream_curve = upstream_curve
        self._route: dict[tuple[int, int], bytes] = {}  # (node, rank) -> the worker's connection
        self._welcomed: dict[
            bytes, tuple[int, int]
        ] = {}  # connection -> (node, rank) it speaks for
        self._buckets: dict[tuple[int, int], Bucket] = {}  # (node, bucket id) -> its layout
        self._sums: GroupSums | None = None
        self.listener: ZmtpListener | None = None
        self.address: str | None = None
        self._up: list[zmq.asyncio.Socket] = []
        self.metrics = AggregatorMetrics(registry)
        self._late_said: set[tuple] = set()  # (step, late ranks) logged once
        self._fetches = Fetches()
        self._sync = True  # (the job's mode, from its HELLOs: async shares no fetch)

    # ----------------------------------------------------------------- life
    def bind(self) -> str:
        cfg = self.cfg
        self.listener = ZmtpListener(
            cfg.bind,
            max_message_bytes=cfg.max_message_bytes,
            max_frames=cfg.max_message_frames,
            budget=lambda i: cfg.peer_budget if i in self._welcomed else cfg.stranger_bytes,
            who=self._who,
            max_connections=cfg.max_connections,
            sndhwm=cfg.rcvhwm,
            join_secret=cfg.join_secret,
            member=lambda i: i in self._welcomed,
            total_bytes=cfg.peers_total_budget,
            curve=self._curve_keys(),
        )
        self.address = self.listener.address
        return self.address

    def _curve_keys(self) -> CurveKeys | None:
        """The listener's CURVE keys: its own pair, and the group's worker keys (by rank: only theirs)."""
        cfg = self.cfg
        if not cfg.curve_secret_key:
            return None
        keys = cfg.curve_authorized_keys
        if cfg.curve_keys_by_rank:
            keys = [keys[r] for r in self.group if r < len(keys)]
            if not keys:
                raise ProtocolError(
                    f"the aggregator of ranks {self.group[0]}-{self.group[-1]} lists no key of its "
                    f"ranks: node.curve_authorized_keys has {len(cfg.curve_authorized_keys)} (rank "
                    "r's is the r-th: luwu keys writes them)"
                )
        return CurveKeys(cfg.curve_public_key, cfg.curve_secret_key, keys)

    def _check_key(self, ident: bytes, rank: int) -> None:
        """With CURVE and curve_keys_by_rank, rank ``rank`` says HELLO with the rank-th key only."""
        cfg = self.cfg
        if not cfg.curve_secret_key or not cfg.curve_keys_by_rank:
            return
        key, keys = self.listener.peer_key(ident), cfg.curve_authorized_keys
        if rank < len(keys) and key == keys[rank]:
            return
        owner = keys.index(key) if key in keys else None
        raise ProtocolError(
            f"HELLO as worker rank {rank} with the CURVE key {key}, which is not rank {rank}'s: it is "
            + (f"rank {owner}'s" if owner is not None else "no rank's")
            + " (the i-th of the aggregator's node.curve_authorized_keys is rank i's)"
        )

    def _dealer(self, zctx, addr: str) -> zmq.asyncio.Socket:
        """A connection to one node, showing it the join secret or the aggregator's CURVE key."""
        s = zctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self.cfg.rcvhwm)
        s.setsockopt(zmq.RCVHWM, self.cfg.rcvhwm)
        if self.upstream_curve:
            server, public, secret = self.upstream_curve
            s.setsockopt(zmq.CURVE_SERVERKEY, server.encode())
            s.setsockopt(zmq.CURVE_PUBLICKEY, public.encode())
            s.setsockopt(zmq.CURVE_SECRETKEY, secret.encode())
        elif self.upstream_secret:
            s.setsockopt(zmq.METADATA, wire.join_metadata(self.upstream_secret))
        s.connect(addr)
        return s

    @property
    def num_workers(self) -> int:
        """Worker connections welcomed through this aggregator."""
        return len(self._welcomed)

    def _who(self, ident: bytes) -> str:
        at = self._welcomed.get(ident)
        return "a peer that did not say HELLO" if at is None else f"worker rank {at[1]}"

    async def serve(self) -> None:
        if self.listener is None:
            self.bind()
        await self.listener.start()
        zctx = zmq.asyncio.Context.instance()
        self._up = [self._dealer(zctx, addr) for addr in self.nodes]
        print(f"{READY_LINE} {self.address}", flush=True)
        log.info(
            "aggregator for ranks %s of job %r at %s, in front of %d nodes",
            list(self.group),
            self.job,
            self.address,
            len(self.nodes),
        )
        tasks = [asyncio.ensure_future(self._down_loop()), asyncio.ensure_future(self._late_loop())]
        tasks += [asyncio.ensure_future(self._up_loop(i)) for i in range(len(self.nodes))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        finally:
            for t in tasks:
                t.cancel()
            for s in self._up:
                s.close(0)
            self.listener.close()

    # ----------------------------------------------------------------- workers -> nodes
    async def _down_loop(self) -> None:
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
                    raise ProtocolError(
                        f"{msg.op.name} with a payload of more than node.stranger_bytes from a peer "
                        "that did not say HELLO"
                    )
                self._count(self.metrics.bytes_in, msg.header, "workers")
                await self._from_worker(ident, msg, body)
            except LuwuError as exc:
                self._refuse(ident, body, exc)
            except Exception as exc:  # an aggregator never dies of a message
                log.exception("aggregator: internal error handling a message")
                self._refuse(ident, body, ProtocolError(f"internal error: {exc}"))

    async def _from_worker(self, ident: bytes, msg: wire.Message, body: list) -> None:
        h, op = msg.header, msg.op
        if op == Op.HELLO:
            await self._hello(ident, msg)
            return
        at = self._welcomed.get(ident)
        if at is None:
            raise ProtocolError(f"{op.name} from a peer that did not say HELLO: say HELLO first")
        node, rank = at
        if h["worker"] != rank:
            raise ProtocolError(
                f"worker {h['worker']}: message on the connection of worker rank {rank}"
            )
        if op == Op.PUSH and self._sums is not None:
            bucket = self._buckets.get((node, h["bucket"]))
            if bucket is None:
                raise ProtocolError(f"bucket {h['bucket']} is not one of node {node}'s")
            for frames in self._sums.add(node, bucket, msg, body) or ():
                await self._send_up(node, frames)
            return
        if op == Op.PULL and self._sync:
            if not self._fetches.ask(node, h["bucket"], h["codec"], rank):
                self.metrics.fetches_shared.inc()
                return
        await self._send_up(node, body)

    async def _late_loop(self) -> None:
        """Send up, as what they have, the blocks that waited too long for a rank (named once a step)."""
        while True:
            sums = self._sums
            wait = sums.late_after_s if sums is not None else None
            await asyncio.sleep(min(1.0, wait / 4) if wait else 0.5)
            if sums is None or sums is not self._sums:
                continue
            try:
                await self._send_late(sums)
            except Exception:  # an aggregator never dies of what its workers pushed
                log.exception("aggregator: internal error sending late blocks up")

    async def _send_late(self, sums: GroupSums) -> None:
        wait = sums.late_after_s
        for node, step, pieces, late in sums.overdue(time.monotonic()):
            if (step, tuple(late)) not in self._late_said:
                self._late_said = {k for k in self._late_said if k[0] > step - 4}
                self._late_said.add((step, tuple(late)))
                log.warning(
                    "aggregator of ranks %d-%d: step %d waited %.1f s for ranks %s; sent the "
                    "nodes what the rest pushed",
                    self.group[0],
                    self.group[-1],
                    step,
                    wait,
                    late,
                )
            for frames in pieces:
                await self._send_up(node, frames)

    async def _send_up(self, node: int, frames: list) -> None:
        await self._up[node].send_multipart(frames, copy=False)
        self._count(self.metrics.bytes_out, _header(frames[0]), "nodes")

    @staticmethod
    def _count(counter, h: dict, direction: str) -> None:
        n = sum(h.get("nbytes", ()))
        if n:
            counter.labels(Op(h["op"]).name.lower(), direction).inc(n)

    async def _hello(self, ident: bytes, msg: wire.Message) -> None:
        h = msg.header
        rank, node = h["worker"], h["node_index"]
        if rank not in self.group:
            raise ProtocolError(
                f"worker rank {rank} said HELLO to the aggregator of ranks {list(self.group)}: "
                "connect it to its own group's aggregator"
            )
        if not 0 <= node < len(self.nodes):
            raise ProtocolError(
                f"worker {rank} addressed node {node}; this aggregator serves nodes "
                f"0..{len(self.nodes) - 1}"
            )
        self._check_key(ident, rank)
        buckets = [Bucket.from_wire(b) for b in h["buckets"]]  # (checked: a bad one is refused)
        self._sync = h["mode"] == "sync"
        if self._sums is None or self._sums.world_size != h["world_size"]:
            self._sums = GroupSums(self.group, h["world_size"], self.metrics, self.compression)
        for b in buckets:
            self._buckets[(node, b.id)] = b
        # a worker may push a few steps ahead of its group, not without bound: 4 steps of every bucket
        self._sums.max_open = max(64, 4 * len(self._buckets))
        self._route[(node, rank)] = ident  # its answers come back here (the WELCOME admits it)
        header = dict(h, relay=True)
        header.pop("nbytes", None)
        await self._send_up(node, wire.encode(header))

    def _refuse(self, ident: bytes, body: list, exc: LuwuError) -> None:
        h: dict = {}
        try:
            h = _header(body[0]) if body else {}
        except Exception:
            pass
        h = h if isinstance(h, dict) else {}

        def num(k: str, d: int) -> int:
            v = h.get(k, d)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else d

        self.metrics.errors.labels(getattr(exc, "code", "luwu")).inc()
        frames = wire.error_message(
            self.job,
            getattr(exc, "code", "luwu"),
            f"aggregator: {exc}",
            ref_op=num("op", 0),
            step=num("step", 0),
            worker=num("worker", 0),
            bucket=num("bucket", -1) if "bucket" in h else -1,
        )
        self._send(ident, frames)

    def _send(self, ident: bytes, frames: list, h: dict | None = None) -> None:
        try:
            self.listener.send(ident, frames)
            if h is not None:
                self._count(self.metrics.bytes_out, h, "workers")
        except Exception:  # a full queue: the worker does not read (its rank's timeouts name it)
            log.warning(
                "aggregator: a reply to %s was dropped (its queue is full)", self._who(ident)
            )

    # ----------------------------------------------------------------- nodes -> workers
    def _welcome(self, node: int, rank: int, h: dict) -> None:
        """A rank welcomed at ``node``: its blocks wait for it there, up to the node's deadline / 4."""
        if self._sums is None:
            return
        self._sums.back(node, rank)
        wait = h.get("wait_s")
        if isinstance(wait, int | float) and wait > 0:
            self._sums.late_after_s = wait / 4

    async def _gone(self, node: int, rank) -> None:
        """Node ``node`` dropped ``rank`` or freed it: the blocks that waited only for it go up."""
        if self._sums is not None and isinstance(rank, int):
            try:
                for frames in self._sums.gone(node, rank):
                    await self._send_up(node, frames)
            except Exception:  # (the up loop goes on: the node's watchdog still names the rank)
                log.exception("aggregator: internal error sending up the blocks rank %d held", rank)

    async def _up_loop(self, node: int) -> None:
        sock = self._up[node]
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                h = _header(frames[0])
                ranks = h.get("ranks")
                worker = h.get("worker")
            except Exception:
                log.warning("aggregator: an unreadable message from node %d was dropped", node)
                continue
            body = [frames[0].bytes, *(f.buffer for f in frames[1:])]
            self._count(self.metrics.bytes_in, h, "nodes")
            if h.get("op") == Op.WELCOME:
                ident = self._route.get((node, worker))
                if ident is not None:
                    self._welcomed[ident] = (node, worker)
                    self.metrics.workers.set(len(self._welcomed))
                self._welcome(node, worker, h)
            if h.get("op") == Op.BYE:  # its rank is free on the node: the connection says no more
                ident = self._route.pop((node, worker), None)
                self._welcomed.pop(ident, None)
                self.metrics.workers.set(len(self._welcomed))
                if ident is not None:
                    self._send(ident, body, h)
                await self._gone(node, worker)
                continue
            if h.get("op") == Op.ERROR and (h.get("detail") or {}).get("dropped"):
                await self._gone(node, worker)
            shared = self._fetched(node, h, ranks if isinstance(ranks, list) else [worker])
            if isinstance(ranks, list):
                if len(ranks) > 1:
                    self.metrics.fanned.inc()
                for r in ranks + shared:
                    ident = self._route.get((node, r))
                    if ident is not None:
                        self._send(ident, _readdressed(body, r), h)
                continue
            ident = self._route.get((node, worker))
            if ident is not None:
                self._send(ident, body, h)
            for r in shared:
                ident = self._route.get((node, r))
                if ident is not None:
                    self._send(ident, _readdressed(body, r), h)

    def _fetched(self, node: int, h: dict, ranks: list) -> list[int]:
        """The ranks that waited on the PULL of one of ``ranks`` that ``h`` (an UPDATE without ``seq``,
        an ERROR answering a PULL) answers."""
        op = h.get("op")
        if not (
            op == Op.UPDATE and "seq" not in h or op == Op.ERROR and h.get("ref_op") == Op.PULL
        ):
            return []
        codec = h.get("codec") if op == Op.UPDATE else None
        return [w for r in ranks for w in self._fetches.answered(node, h.get("bucket"), r, codec)]

"""The worker's connection to the nodes: one I/O thread owning every socket.

ZeroMQ sockets are not thread-safe, so one thread owns a DEALER per node. The
training thread (and autograd threads running gradient hooks) hand it frames
through a queue and wake it through a pipe; it sends without blocking (a full
high-water mark leaves the message queued, and receiving goes on), resolves the
future of each bucket's reply (:mod:`~luwu.gpu_workers.channel`) and files every
control reply where a waiter finds it. Every wait has a deadline and its error
names the node address, this worker's rank, the step and the bucket. A node
address that refuses every connection at start-up is named within
:data:`~luwu.gpu_workers.reach.REFUSED_WINDOW_S` (ZeroMQ would retry it silently until the deadline).
Closing says BYE to the nodes, so the rank is free at once for the next run;
a client still open when the interpreter exits (Ctrl-C, a script that never
closed its optimizer) is closed then.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref

import zmq
from zmq.utils.monitor import recv_monitor_message

from luwu.gpu_workers.channel import Channels, Reply, resolved
from luwu.gpu_workers.config import TransportConfig
from luwu.gpu_workers.fallback import Fallback
from luwu.gpu_workers.reach import WATCHED, Reach, check_resolves
from luwu.gpu_workers.send_order import SendOrder
from luwu.gpu_workers.wake import Wake
from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError, ProtocolError, error_for_code
from luwu.protocol.memory import check_torch_huge_pages, retain_freed_memory
from luwu.protocol.messages import Op

log = logging.getLogger(__name__)

#: Replies libzmq may hold for the I/O thread, per node (a DEALER's receive pipe). Past it libzmq stops
#: reading the socket and a burst (the held replies of a step, released at once) waits at the node,
#: where it is in flight anyway, instead of piling up here as a second copy of the weights it brings.
REPLY_HWM = 4

#: A wait longer than this logs a progress line this often (INFO), so a slow start is never silent.
PROGRESS_EVERY_S = 5.0

#: What closing waits at most for the nodes to answer BYE (a node that is gone costs this, never more).
BYE_LINGER_S = 1.0

_OPEN_CLIENTS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    """At interpreter exit (Ctrl-C, a script that never closed its optimizer): every client still open says
    BYE, while its I/O thread still runs (atexit comes before daemon threads stop)."""
    mine = [c for c in list(_OPEN_CLIENTS) if c.pid == os.getpid()]  # (not a forked copy's)
    for client in mine:
        try:
            client.close()
        except Exception:  # exiting anyway: a failed goodbye leaves the rank to the node's timeout
            log.debug("closing a worker client at exit failed", exc_info=True)


#: The replies that resolve a bucket channel's futures (the others are filed for control waits).
_BUCKET_REPLIES = (Op.UPDATE, Op.NORM, Op.STATE)


def _key_where(key: tuple) -> tuple:
    """(node, step, bucket) of a control reply's key."""
    return key[1], key[2], key[3]


class WorkerClient:
    def __init__(
        self, nodes: list[str], *, job: str, rank: int, cfg: TransportConfig, via="", via_key=""
    ):
        """``via``: this worker's aggregator (the switch tier; ``via_key`` its CURVE server key): every
        node's socket connects there, what is said of a node names both, and when the aggregator's
        connection closes the socket falls back to the node itself (:mod:`.fallback`)."""
        if not nodes:
            raise ValueError("no node addresses given")
        connect = [via] * len(nodes) if via else list(nodes)
        for addr in connect:
            check_resolves(addr)
        self.job, self.rank, self.cfg, self._via_key = job, rank, cfg, via_key
        #: how each node is named in messages (its address, and the aggregator it is reached through)
        self.nodes = [f"{a} through aggregator {via}" for a in nodes] if via else list(nodes)
        if cfg.retain_freed_memory:
            retain_freed_memory()
        check_torch_huge_pages()
        self._out: list[collections.deque] = [collections.deque() for _ in nodes]
        self.order = SendOrder(len(nodes))
        self._cv = threading.Condition()
        self._inbox: dict[tuple, wire.Message] = {}  # control replies: (op, node, step, bucket)
        self._errors: list[tuple[int, LuwuError]] = []
        self.channels = Channels(self)  # the buckets' requests and the futures of their replies
        self.wake = Wake()  # how sends wake the I/O thread (``with client.wake.batched():``)
        self._running = True
        self.bytes_sent = 0
        self.bytes_received = 0
        self.node_bytes = [[0, 0] for _ in nodes]  # per node: payload bytes sent, received
        self._last_heard = [time.monotonic()] * len(nodes)
        self._welcomed: set[int] = set()  # nodes that answered HELLO: told BYE on close
        self._reach = Reach(self.nodes, rank, cfg)  # what each socket's connection events said
        # each socket's connection events, until a handshake succeeds (through an aggregator: on)
        self._monitors: list[zmq.Socket | None] = []
        self.fallback = Fallback(self, list(nodes), via) if via else None
        self._closed = False
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=f"luwu-io-r{rank}", daemon=True)
        self._ctx = zmq.Context()
        self._socks = [self._connect(a, bool(via)) for a in connect]
        self._poller, self._waiting_out = zmq.Poller(), set()  # (sockets waiting for POLLOUT)
        self._thread.start()
        _OPEN_CLIENTS.add(self)

    def _connect(self, addr: str, via: bool = False) -> zmq.Socket:
        """A DEALER connected to ``addr`` and its monitor (``via``: watching for its end too)."""
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self.cfg.sndhwm)
        if self.cfg.sndbuf_bytes:
            s.setsockopt(zmq.SNDBUF, self.cfg.sndbuf_bytes)
        s.setsockopt(zmq.RCVHWM, REPLY_HWM)
        s.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes + wire.MAX_HEADER_BYTES)
        if self.cfg.join_secret:
            s.setsockopt(zmq.METADATA, wire.join_metadata(self.cfg.join_secret))
        if self.cfg.curve_server_key:
            s.curve_serverkey = ((via and self._via_key) or self.cfg.curve_server_key).encode()
            s.curve_publickey = self.cfg.curve_public_key.encode()
            s.curve_secretkey = self.cfg.curve_secret_key.encode()
        mon = s.get_monitor_socket(WATCHED | (zmq.EVENT_DISCONNECTED if via else 0))
        mon.setsockopt(zmq.LINGER, 0)
        self._monitors.append(mon)
        s.connect(addr)
        return s

    # ----------------------------------------------------------------- API for the training thread
    def send(self, node: int, header: dict, payload=(), priority: int | None = None) -> None:
        """Queue a message to a node (thread-safe). The payload tensors must stay untouched until the
        reply to this message has arrived. ``priority`` (pushes): among the messages with a priority
        queued one after another, the lowest goes out first (P3: the first layers' gradients); a
        message without one keeps its place, so no request overtakes or falls behind it; a node with
        a push budget gets pushes in the order they were made (:mod:`.send_order`)."""
        priority = self.order.priority(node, priority)
        header.setdefault("job", self.job)
        header.setdefault("worker", self.rank)
        header.setdefault("step", 0)
        frames = wire.encode(header, payload)
        if self.fallback is not None:  # (kept until answered, to go again if the aggregator dies)
            self.fallback.queue(node, header, priority, frames)
        else:
            self._out[node].append((priority, frames))
        self.wake.queued()

    def release(self, step: int) -> None:
        """Tell every node this worker reached ``step()`` of ``step``: the replies they hold for it may come
        (``optimizer.hold_replies``; luwu.switch_nodes.held_replies). Ahead of the pushes still queued: on a
        slow link they would hold up the replies the node has ready."""
        with self.wake.batched():
            for n in range(len(self._out)):
                self.send(n, {"op": Op.HEARTBEAT, "step": max(step, 0), "seq": step}, priority=-1)

    def wait(
        self,
        keys: list[tuple],
        timeout_s: float | None = None,
        what: str = "reply",
        errors_of: tuple | None = None,
    ) -> list[wire.Message]:
        """Wait for the control replies filed under ``keys`` = (op, node, step, bucket); pops and
        returns them. ``errors_of``: raise only ERRORs answering these ops (the others stay for
        later or are fenced off). A bucket's replies come as futures (:mod:`.channel`)."""
        timeout_s = timeout_s or self.cfg.timeout_s
        deadline = time.monotonic() + timeout_s
        got: dict = {}
        pending = list(keys)
        while pending:
            with self._cv:
                args = (deadline, timeout_s, what, errors_of, len(keys))
                for k in self._await_any(pending, self._filed, _key_where, *args):
                    got[k] = self._inbox.pop(k)
            pending = [k for k in pending if k not in got]
        return [got[k] for k in keys]

    def arrivals(self, replies: list[Reply], timeout_s: float | None = None, what: str = "reply"):
        """Yield each of ``replies`` (futures of bucket replies) as soon as it resolves, in arrival
        order, so the caller consumes each reply (and frees its buffer) while the others are still
        coming; a failed one raises its error. One deadline for all; the error names the node,
        step and bucket still missing."""
        for ready in self.batches(replies, timeout_s, what):
            yield from ready

    def batches(self, replies: list[Reply], timeout_s: float | None = None, what: str = "reply"):
        """:meth:`arrivals` a batch at a time: the replies resolved by each wake-up (the first batch
        alone: which arrived, their messages left for a later wait)."""
        timeout_s = timeout_s or self.cfg.timeout_s
        args = (time.monotonic() + timeout_s, timeout_s, what, None, len(replies))
        pending = replies
        while pending:
            with self._cv:
                ready = self._await_any(pending, resolved, Reply.where, *args)
                pending = [r for r in pending if not r.done]
            yield ready

    def answers(
        self, keys: list[tuple], ref_op: Op, timeout_s: float | None = None, what: str = "reply"
    ) -> list:
        """Wait until every key has its answer, the message or an ERROR of its node answering ``ref_op``;
        pops and returns them in key order, raising nothing: a request sent to several nodes at once
        leaves no answer behind for a later call, whichever of them refused it."""
        timeout_s = timeout_s or self.cfg.timeout_s
        deadline = time.monotonic() + timeout_s
        out: dict = {}
        with self._cv:
            while len(out) < len(keys):
                for k in [k for k in keys if k not in out]:
                    if k in self._inbox:
                        out[k] = self._inbox.pop(k)
                        continue
                    errs = self._errors
                    i = [j for j, (n, e) in enumerate(errs) if n == k[1] and e.ref_op == ref_op]
                    if i:
                        out[k] = errs.pop(i[0])[1]
                missing = [k for k in keys if k not in out]
                if missing:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._running:
                        raise self._timeout(missing, _key_where, what, timeout_s, len(keys))
                    self.wake.flush()  # (a send of this thread's batch: out before the wait)
                    self._cv.wait(min(left, 0.5))
        return [out[k] for k in keys]

    def _filed(self, keys: list[tuple]) -> list[tuple]:
        return [k for k in keys if k in self._inbox]

    def _await_any(
        self, missing: list, ready_of, where, deadline, timeout_s, what, errors_of, total
    ) -> list:
        """With the lock held: wait until ``ready_of(missing)`` (control keys filed, futures
        resolved) is not empty and return it; ``where(m)``: (node, step, bucket) of ``m``."""
        probed = told = time.monotonic()
        while True:
            self._raise_errors(errors_of)
            ready = ready_of(missing)
            if ready:
                return ready
            nodes = sorted({where(m)[0] for m in missing})
            self._reach.raise_refused(nodes)
            now = time.monotonic()
            left = deadline - now
            if left <= 0 or not self._running:
                raise self._timeout(missing, where, what, timeout_s, total)
            if now - told >= PROGRESS_EVERY_S:
                told = now
                log.info(
                    "worker %d: still waiting for %s from %s (%.0f of %.0f s)",
                    self.rank,
                    what,
                    ", ".join(self.nodes[n] for n in nodes),
                    timeout_s - left,
                    timeout_s,
                )
            self.wake.flush()  # (a send of this thread's batch: out before the wait)
            self._cv.wait(min(left, 0.5))
            if time.monotonic() - probed >= 1.0:
                # a node that restarted answers a probe with ERROR (rollback) long before the deadline
                probed = time.monotonic()
                for n in nodes:
                    self.send(n, {"op": Op.HEARTBEAT})

    def _timeout(self, missing: list, where, what: str, timeout_s: float, total: int):
        welcome = isinstance(missing[0], tuple) and missing[0][0] == Op.WELCOME
        return self._reach.timeout([where(m) for m in missing], what, timeout_s, total, welcome)

    def reset(self) -> None:
        """Forget filed replies and errors, and abandon the buckets' unresolved futures (after a
        rollback or rejoin: they belong to abandoned steps)."""
        with self._cv:
            self._inbox.clear()
            self._errors.clear()
        self.channels.reset()

    def fail(self, node: int, err: LuwuError, *refused: Reply) -> None:
        """An error of ``node`` (an ERROR it sent, a reply that could not be taken): raised by the
        next wait, and the error of the futures it refuses."""
        with self._cv:
            self._errors.append((node, err))
            for reply in refused:
                if not reply.done:
                    reply.error, reply.done = err, True
            self._cv.notify_all()

    def _raise_errors(self, errors_of) -> None:
        for i, (_node, err) in enumerate(self._errors):
            if errors_of is None or getattr(err, "ref_op", None) in errors_of:
                del self._errors[i]
                raise err

    @staticmethod
    def key_of(node: int, h: dict) -> tuple:
        """Where a control reply is filed: (op, node, step, bucket). WELCOME and STATS have no
        step; a bucket's replies (UPDATE, NORM, STATE) resolve its channel's futures instead."""
        op = h["op"]
        if op in (Op.WELCOME, Op.STATS, Op.ROLLBACK, Op.CHECKPOINT, Op.EXPORT, Op.BYE):
            return (op, node, None, -1)
        return (op, node, h["step"], h.get("bucket", -1))

    def file(self, key: tuple, msg: wire.Message) -> None:
        with self._cv:
            if key[0] in (Op.WELCOME, Op.ROLLBACK):
                # a new session with this node, or its answer to ROLLBACK: whatever it answered
                # before belongs to abandoned steps (a bucket's reply sent in between, of a step
                # finished between answering HELLO and rolling back, found no future: reset())
                node = key[1]
                self._welcomed.add(node)
                if key[0] == Op.WELCOME:
                    self.order.in_order[node] = bool(msg.header.get("in_order"))
                self._errors = [(n, e) for n, e in self._errors if n != node]
                for k in [k for k in self._inbox if k[1] == node]:
                    del self._inbox[k]
            self._inbox[key] = msg
            self._cv.notify_all()

    def close(self) -> None:
        """Say BYE to the nodes that welcomed this worker (the rank is free there at once), then stop the I/O
        thread and close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN_CLIENTS.discard(self)
        self._say_bye()
        self._running = False
        self.wake.stop()
        self._thread.join(5)
        for node, s in enumerate(self._socks):
            self._unwatch(node)
            s.close(0)
        self._ctx.term()
        self.wake.close()

    def _say_bye(self) -> None:
        """BYE to every node that welcomed this worker; their answers waited for at most BYE_LINGER_S."""
        nodes = sorted(self._welcomed)
        if not nodes or not self._thread.is_alive() or threading.current_thread() is self._thread:
            return
        for n in nodes:
            self.send(n, {"op": Op.BYE})
        keys = [(Op.BYE, n, None, -1) for n in nodes]
        try:
            self.answers(keys, Op.BYE, timeout_s=BYE_LINGER_S, what="answer to BYE")
        except LuwuError as exc:
            log.info(
                "worker %d: %s; its rank frees there after node.worker_timeout_s", self.rank, exc
            )

    # ----------------------------------------------------------------- the I/O thread
    def _run(self) -> None:
        poller = self._poller
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        poller.register(self.wake.fd, zmq.POLLIN)
        for m in self._monitors:
            poller.register(m, zmq.POLLIN)
        waiting_out = self._waiting_out
        hb = self.cfg.heartbeat_s
        last_sent = [time.monotonic()] * len(self._socks)
        while self._running:
            events = dict(poller.poll(200))
            if self.fallback is not None:
                self.fallback.tick()
            if self.wake.fd in events:
                self.wake.drain()  # (before reading the queues)
            for i, s in enumerate(self._socks):
                q = self._out[i]
                while q:
                    at = SendOrder.next_out(q)
                    try:
                        s.send_multipart(q[at][1], copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        if i not in waiting_out:
                            poller.modify(s, zmq.POLLIN | zmq.POLLOUT)
                            waiting_out.add(i)
                        break
                    frames = q[at][1]
                    del q[at]
                    n = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames[1:])
                    self.bytes_sent += n
                    self.node_bytes[i][0] += n
                    last_sent[i] = time.monotonic()
                else:
                    if i in waiting_out:
                        poller.modify(s, zmq.POLLIN)
                        waiting_out.discard(i)
                if events.get(s, 0) & zmq.POLLIN:
                    self._drain(i, s)
                mon = self._monitors[i]
                if mon is not None and events.get(mon, 0) & zmq.POLLIN:
                    self._watch(i, mon)
                if hb and time.monotonic() - last_sent[i] > hb and not q:
                    self.send(i, {"op": Op.HEARTBEAT})
                    last_sent[i] = time.monotonic()

    def _watch(self, node: int, mon: zmq.Socket) -> None:
        """A node socket's connection events until a handshake first succeeds (the monitor is then closed;
        through an aggregator, watched until its end): refusals and cut handshakes (:class:`.Reach`)."""
        while True:
            try:
                event = recv_monitor_message(mon, flags=zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            with self._cv:
                self._reach.note(node, event)
                self._cv.notify_all()
            fallback = self.fallback
            if fallback is not None and node not in fallback.fell_back:
                if event == zmq.EVENT_DISCONNECTED and self._reach.joined[node]:
                    fallback.start(node)  # (the aggregator is gone: the node itself, from now on)
                    return
                continue  # (its monitor stays: the end of the aggregator's connection is watched)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._unwatch(node)
                return

    def _unwatch(self, node: int) -> None:
        """Stop and close ``node``'s socket monitor, if any: stopped first, as an event for a closed monitor
        would block libzmq's I/O thread, and every socket with it, for good (libzmq#3575)."""
        mon, self._monitors[node] = self._monitors[node], None
        if mon is not None:
            self._poller.unregister(mon)
            self._socks[node].disable_monitor()
            mon.close(0)

    def reconnect(self, node: int, addr: str) -> None:
        """Replace ``node``'s socket by one connected to ``addr`` (the I/O thread: a fallback)."""
        poller = self._poller
        self._unwatch(node)
        poller.unregister(self._socks[node])
        self._socks[node].close(0)
        self._waiting_out.discard(node)
        self._socks[node] = self._connect(addr)
        self._monitors[node] = self._monitors.pop()
        poller.register(self._socks[node], zmq.POLLIN)
        poller.register(self._monitors[node], zmq.POLLIN)
        with self._cv:
            self.nodes[node] = addr
            self._reach.forget(node)

    def _drain(self, node: int, s: zmq.Socket) -> None:
        while True:
            try:
                frames = s.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard[node] = time.monotonic()
            try:
                # job checked below: an ERROR saying "wrong job" must reach the training loop
                msg = wire.decode(frames, max_message_bytes=self.cfg.max_message_bytes)
                if msg.header["job"] != self.job and msg.header["op"] != Op.ERROR:
                    raise ProtocolError(
                        f"reply of job {msg.header['job']!r}, this worker runs job {self.job!r}"
                    )
            except LuwuError as exc:
                log.warning("undecodable message from node %s: %s", self.nodes[node], exc)
                continue
            n = sum(msg.header.get("nbytes", ()))
            self.bytes_received += n
            self.node_bytes[node][1] += n
            h = msg.header
            if self.fallback is not None and self.fallback.reply(node, h):
                continue  # (the fallback's own HELLO answered)
            op = h["op"]
            if op == Op.ERROR:
                err = error_for_code(
                    h["code"],
                    h["message"],
                    node=self.nodes[node],
                    step=h["step"],
                    bucket=h["bucket"],
                    detail=h.get("detail") or {},
                    ref_op=h["ref_op"],
                )
                with self._cv:  # (and the futures of the push or PULL it refuses)
                    self.fail(node, err, *self.channels.refused(node, err))
                continue
            try:
                if op in _BUCKET_REPLIES:
                    self.channels.deliver(node, msg)
                elif op != Op.HEARTBEAT:
                    self.file(self.key_of(node, h), msg)
            except LuwuError as exc:  # a bad reply must not kill the I/O thread
                self.fail(node, exc)
            except Exception as exc:
                self.fail(node, ProtocolError(f"node {self.nodes[node]}: {exc}"))

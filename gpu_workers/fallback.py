"""Falling back from a dead aggregator to the nodes, with every request answered exactly once.

A worker that reaches the nodes through an aggregator (the switch tier) keeps, per node, each request
the node has not answered yet, in the order it was queued: a push until its UPDATE (a two-phase push
until its NORM: from then on only which step, bucket and reply codec it was, for its COMMIT to ask
for the weights: the one sent again, or the first made after the fallback),
its micro-batch pushes with it, a PULL, a STATE request or a control request until its answer, INIT
until its bucket is answered, a COMMIT until its step's pushes are; and the last HELLO and the last
release word. The frames kept are the ones queued: a push's payload stays untouched until its reply
anyway (:meth:`~luwu.gpu_workers.client.WorkerClient.send`), so keeping them copies nothing.

When the aggregator's connection of a node's socket closes after its handshake (a SIGKILLed aggregator:
its TCP connections end at once), the I/O thread connects that socket to the node itself and says HELLO
again (``resume``: the same rank, the job as it is; the node frees a rank an aggregator's closed
connection held at once). Until the WELCOME comes back nothing else goes to that node, and what the
training thread queues meanwhile is kept. Then every unanswered request goes again, in its first order,
and the last release word after them. A refused HELLO (the node has not seen the aggregator's
connection end yet) is said again every :data:`RETRY_S` until ``transport.connect_timeout_s``, then its
error is the next wait's.

The node makes the resend exactly once: a push it summed already (alone, or in the aggregator's sum of
its block) counts once, and is answered when the step is (a two-phase one with its NORM again, if the
NORM went to the dead aggregator); a push of a step it applied since is answered with the bucket's
weights whole; a micro-batch push carries its index in the step (``micro``) and counts once; a retried
COMMIT (``retry``) is answered, for each bucket already stepped, with its weights whole. With
compression on, the aggregator's error-feedback residual of its uplink is lost with it (the workers'
own residuals are kept): the gradients are all applied once, their compression error is not carried on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError
from luwu.protocol.messages import Op

if TYPE_CHECKING:
    from luwu.gpu_workers.client import WorkerClient

__all__ = ["RETRY_S", "Fallback"]

log = logging.getLogger(__name__)

#: How long a fallback waits before saying a refused HELLO again.
RETRY_S = 0.25

#: The ops a node answers with a reply of the same op, kept until that answer (or its ERROR).
_CONTROL = (Op.STATS, Op.ROLLBACK, Op.CHECKPOINT, Op.EXPORT, Op.IMPORT)


@dataclass(slots=True)
class _Sent:
    """One unanswered request: its frames (None once only what it was is kept) and header fields."""

    priority: int | None
    frames: list | None
    header: dict | None = None  # a COMMIT's (re-encoded with ``retry``)
    pull: str = ""  # a push's reply codec


def _key(h: dict) -> tuple | None:
    """Where a request is kept (None: it is not kept: HEARTBEAT, BYE, HELLO)."""
    op, step, bucket = h["op"], h.get("step", 0), h.get("bucket", -1)
    if op == Op.PUSH:
        return (
            ("partial", step, bucket, h.get("micro", 0))
            if h.get("partial")
            else ("push", step, bucket)
        )
    if op in (Op.PULL, Op.STATE, Op.INIT):
        return (Op(op).name.lower(), bucket)
    if op == Op.COMMIT:
        return ("commit", step)
    if op in _CONTROL:
        return ("control", op)
    return None


class Fallback:
    """The unanswered requests of a client that talks through an aggregator, and its fallback."""

    def __init__(self, client: WorkerClient, nodes: list[str], via: str) -> None:
        self.client, self.direct, self.via = client, nodes, via
        self._lock = threading.Lock()
        self._kept: list[dict[tuple, _Sent]] = [{} for _ in nodes]
        self._hello: list[dict | None] = [None] * len(nodes)
        self._release: list[tuple | None] = [None] * len(nodes)  # (priority, frames)
        self._pending: dict[int, tuple[float, float]] = {}  # node -> (deadline, next HELLO at)
        # per node, after its fallback: step -> {bucket: reply codec} of two-phase pushes whose NORM came
        # but whose UPDATE did not, and whose COMMIT was not sent yet (it asks for them when it goes)
        self._owed: list[dict[int, dict]] = [{} for _ in nodes]
        self.fell_back: set[int] = set()  # nodes reached directly now

    # ----------------------------------------------------------------- the training thread's side
    def queue(self, node: int, header: dict, priority: int | None, frames: list) -> None:
        """Keep ``header``'s request until answered, and queue it (held while ``node``'s fallback
        waits for its WELCOME; a heartbeat then is dropped: the node does not know the rank yet)."""
        with self._lock:
            if node not in self.fell_back:
                self._keep(node, header, priority, frames)
            elif header["op"] == Op.COMMIT and header["step"] in self._owed[node]:
                pulls = self._owed[node].pop(header["step"])
                frames = wire.encode({**header, "retry": True, "pulls": pulls})
            if node not in self._pending:
                self.client._out[node].append((priority, frames))

    def _keep(self, node: int, header: dict, priority: int | None, frames: list) -> None:
        op = header["op"]
        if op == Op.HELLO:
            self._hello[node] = dict(header)
        elif op == Op.HEARTBEAT and "seq" in header:
            self._release[node] = (priority, frames)
        key = _key(header)
        if key is not None:
            kept = self._kept[node]
            kept.pop(key, None)  # (a request made again goes at its new place)
            commit = header if op == Op.COMMIT else None
            kept[key] = _Sent(priority, frames, commit, header.get("pull", ""))

    # ----------------------------------------------------------------- the I/O thread's side
    def reply(self, node: int, h: dict) -> bool:
        """A message of ``node``: forget what it answers. True when it was the fallback's own (the
        WELCOME of its HELLO, or its refusal): the caller does nothing more with it."""
        with self._lock:
            if node in self._pending and h["op"] == Op.WELCOME:
                self._resume(node)
                return True
            refused = node in self._pending and h["op"] == Op.ERROR and h.get("ref_op") == Op.HELLO
            err = self._refused(node, h) if refused else self._answered(self._kept[node], h)
        if err is not None:  # (outside the lock: waiters hold the client's while they send)
            self.client.fail(node, err)
        return refused

    @staticmethod
    def _answered(kept: dict, h: dict) -> None:
        op, step, bucket = h["op"], h.get("step", 0), h.get("bucket", -1)
        if op == Op.ERROR:
            ref = h.get("ref_op")
            for k in [k for k in kept if _answers_error(k, ref, step, bucket)]:
                del kept[k]
        elif op == Op.UPDATE:
            seq = h.get("seq", -1)
            if seq == -1:
                kept.pop(("pull", bucket), None)
            else:
                _drop_push(kept, seq, bucket)
                if not any(k[0] == "push" and k[1] == seq for k in kept):
                    kept.pop(("commit", seq), None)
            kept.pop(("init", bucket), None)
        elif op == Op.NORM:
            sent = kept.get(("push", step, bucket))
            if sent is not None:  # (summed at the node: its buffer may be reused from now on)
                sent.frames = None
            for k in [k for k in kept if k[:3] == ("partial", step, bucket)]:
                del kept[k]
        elif op == Op.STATE:
            kept.pop(("state", bucket), None)
        elif op in _CONTROL:
            kept.pop(("control", op), None)

    def start(self, node: int) -> None:
        """The aggregator's connection of ``node``'s socket closed: connect to the node itself and
        say HELLO again; the kept requests wait for its WELCOME."""
        client = self.client
        with self._lock:
            if node in self._pending or node in self.fell_back or self._hello[node] is None:
                return
            now = time.monotonic()
            self._pending[node] = (now + client.cfg.connect_timeout_s, now)
            client._out[node].clear()  # (every request in it is kept; heartbeats are not needed)
        log.warning(
            "worker %d: aggregator %s closed its connection: node %d goes on directly at %s, "
            "%d unanswered requests to send again",
            client.rank,
            self.via,
            node,
            self.direct[node],
            sum(s.frames is not None for s in self._kept[node].values()),
        )
        client.reconnect(node, self.direct[node])
        self.tick()

    def tick(self) -> None:
        """Say HELLO to each node whose fallback waits and whose retry is due (the I/O thread)."""
        if not self._pending:
            return
        now = time.monotonic()
        with self._lock:
            for node, (deadline, due) in list(self._pending.items()):
                if due is not None and now >= due:
                    self._pending[node] = (deadline, None)
                    hello = wire.encode({**self._hello[node], "resume": True})
                    self.client._out[node].append((None, hello))
        self.client.wake.queued()

    def _refused(self, node: int, h: dict) -> LuwuError | None:
        """A refused HELLO: said again after RETRY_S, or past the deadline the error to raise."""
        deadline, _ = self._pending[node]
        log.warning(
            "worker %d: node %d refused its HELLO: %s", self.client.rank, node, h.get("message")
        )
        if time.monotonic() + RETRY_S < deadline:
            self._pending[node] = (deadline, time.monotonic() + RETRY_S)
            return None
        del self._pending[node]
        client = self.client
        return LuwuError(
            f"worker {client.rank}: aggregator {self.via} is gone and node {node} at "
            f"{self.direct[node]} refused this worker's HELLO for "
            f"{client.cfg.connect_timeout_s:.0f} s: {h.get('message')}",
            node=self.direct[node],
            worker=client.rank,
            ref_op=Op.HELLO,
        )

    def _resume(self, node: int) -> None:
        """The node welcomed the rank back: every unanswered request goes again, in order."""
        del self._pending[node]
        self.fell_back.add(node)
        kept, out, owed = self._kept[node], [], self._owed[node]
        for key, sent in kept.items():  # (a push answered by its NORM only: its COMMIT asks for it)
            if key[0] == "push" and sent.frames is None:
                owed.setdefault(key[1], {})[key[2]] = sent.pull
        for key, sent in kept.items():
            if key[0] == "commit":
                pulls = owed.pop(key[1], {})
                out.append(
                    (sent.priority, wire.encode({**sent.header, "retry": True, "pulls": pulls}))
                )
            elif sent.frames is not None:
                out.append((sent.priority, sent.frames))
        if self._release[node] is not None:
            out.append(self._release[node])
        self.client._out[node].extend(out)
        self._kept[node] = {}
        log.warning(
            "worker %d: node %d at %s welcomed it back: %d requests sent again",
            self.client.rank,
            node,
            self.direct[node],
            len(out),
        )


def _drop_push(kept: dict, step: int, bucket: int) -> None:
    kept.pop(("push", step, bucket), None)
    for k in [k for k in kept if k[:3] == ("partial", step, bucket)]:
        del kept[k]


def _answers_error(key: tuple, ref_op, step: int, bucket: int) -> bool:
    """Whether an ERROR answering ``ref_op`` of (step, bucket) refuses the request kept at ``key``."""
    kind = key[0]
    if ref_op == Op.PUSH:
        return kind in ("push", "partial") and key[1:3] == (step, bucket)
    if ref_op in (Op.PULL, Op.STATE, Op.INIT):
        return key == (Op(ref_op).name.lower(), bucket)
    if ref_op == Op.COMMIT:
        return key == ("commit", step)
    return key == ("control", ref_op)

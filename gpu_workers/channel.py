"""One channel per bucket between a worker and the node that owns it: requests out, futures back.

As DDP's comm hook hands a bucket to the wire and gets a future back, :meth:`BucketChannel.push`
and :meth:`BucketChannel.pull` send a bucket's request and return a :class:`Reply`, the future of
the node's answer. The client's I/O thread resolves it: an UPDATE answering a push carries the
pushed step in ``seq`` (-1 answers a PULL), a NORM (two-phase pushes) the pushed step. A future
is resolved once; a reply no future waits for (a duplicate, or one of a step abandoned by
:meth:`Channels.reset` before a rejoin) is dropped. An ERROR of the node refusing a push or a
PULL fails that request's future with the error the waiters raise (the client raises it too, as
every node error, in the first wait).

A :class:`Reply` has no lock of its own: it is resolved under the client's condition, which every
wait shares (:meth:`WorkerClient.arrivals`), so a wait for many replies takes them in arrival
order, raises the nodes' errors, probes a silent node and names node, rank, step and bucket at
its deadline.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError, ProtocolError, StepMismatchError
from luwu.protocol.messages import Op

if TYPE_CHECKING:
    from luwu.gpu_workers.client import WorkerClient

log = logging.getLogger(__name__)


class Reply:
    """The future of one node reply for a bucket: ``msg`` once resolved, or ``error`` once failed.

    ``then(reply, msg) -> msg``: called on the I/O thread before the reply resolves (a per-layer
    wait writes the weights as they land and resolves it with what is left of the message).
    ``norm``: a two-phase push's first answer, the future of its NORM."""

    __slots__ = ("channel", "step", "msg", "error", "then", "norm", "done")

    def __init__(self, channel: BucketChannel, step: int):
        self.channel, self.step = channel, step
        self.msg: wire.Message | None = None
        self.error: LuwuError | None = None
        self.then: Callable | None = None
        self.norm: Reply | None = None
        self.done = False

    @property
    def node(self) -> int:
        return self.channel.node

    @property
    def bucket(self) -> int:
        return self.channel.bucket

    def where(self) -> tuple[int, int, int]:
        """(node, step, bucket): what a wait past its deadline names."""
        return self.channel.node, self.step, self.channel.bucket

    def result(self, timeout_s: float | None = None, what: str = "reply") -> wire.Message:
        """Wait for the reply (raising the node's error, or a timeout naming what is missing)."""
        for _ in self.channel.client.arrivals([self], timeout_s, what):
            pass
        return self.msg


class BucketChannel:
    """Bucket ``bucket``'s requests to its node ``node`` and the futures of their replies, kept
    for the worker until it takes them (:meth:`reply`, :meth:`fetched`)."""

    __slots__ = ("client", "node", "bucket", "_updates", "_norms", "_pushed", "_fetch", "_state")

    def __init__(self, client: WorkerClient, node: int, bucket: int):
        self.client, self.node, self.bucket = client, node, bucket
        self._updates: dict[int, Reply] = {}  # seq (pushed step, -1: a PULL) -> unresolved future
        self._norms: dict[int, Reply] = {}  # pushed step -> unresolved future of its NORM
        self._pushed: dict[int, Reply] = {}  # pushed step -> its future, until taken
        self._fetch: Reply | None = None  # the last PULL's future, until taken
        self._state: Reply | None = None  # the future of the STATE request on its way

    def push(self, header: dict, frames, priority: int | None = None) -> Reply | None:
        """Send a PUSH (``header`` names op, step, bucket...; ``frames``: its payload, untouched
        until the reply) and return the future of its answer (None for a ``partial`` push: the
        node answers nothing). A ``two_phase`` push is answered twice: ``reply.norm`` first."""
        reply = None
        if not header.get("partial"):
            step = header["step"]
            reply = Reply(self, step)  # (armed before it can be answered)
            if header.get("two_phase"):
                reply.norm = self._norms[step] = Reply(self, step)
            self._updates[step] = self._pushed[step] = reply
        self.client.send(self.node, header, frames, priority=priority)
        return reply

    def pull(self, codec: str) -> Reply:
        """Ask the node for the bucket's current weights in ``codec``; the future of its answer."""
        reply = self._updates[-1] = self._fetch = Reply(self, -1)
        self.client.send(self.node, {"op": Op.PULL, "bucket": self.bucket, "codec": codec})
        return reply

    def state(self, header: dict, frames=()) -> Reply:
        """Send a STATE request (``header``: op, step, action, names; ``frames``: a ``set``'s
        tensors) and return the future of its answer (the state, or the node's acknowledgement)."""
        reply = self._state = Reply(self, header["step"])
        self.client.send(self.node, {**header, "bucket": self.bucket}, frames)
        return reply

    def reply(self, step: int, take: bool = True, norm: bool = False) -> Reply:
        """The future of the answer to the push of ``step``; ``take``: the worker is done with it
        after this wait (not: a streamed push's ack, still to come); ``norm``: of its NORM (a
        two-phase push's first answer; never taken). One never sent is waited for until its
        deadline, which names node, step and bucket."""
        reply = self._pushed.pop(step, None) if take and not norm else self._pushed.get(step)
        if norm:
            reply = reply.norm if reply is not None else None
        return reply if reply is not None else Reply(self, step)

    def fetched(self) -> Reply:
        """The future of the answer to the last :meth:`pull` (the worker is done with it after)."""
        reply, self._fetch = self._fetch, None
        return reply if reply is not None else Reply(self, -1)

    # ----------------------------------------------------------------- the I/O thread's side
    def deliver(self, msg: wire.Message) -> None:
        """Resolve the future ``msg`` answers (an UPDATE, a NORM or a STATE); drop a reply nobody
        waits for."""
        h = msg.header
        if h["op"] == Op.STATE:  # (one request on its way at a time)
            table, seq = {-1: self._state} if self._state is not None else {}, -1
            self._state = None
        elif h["op"] == Op.UPDATE:
            table, seq = self._updates, h.get("seq", -1)
        else:
            table, seq = self._norms, h["step"]
        client = self.client
        with client._cv:
            reply = table.pop(seq, None)
            then = None if reply is None else reply.then
            if reply is not None and then is None and not reply.done:
                reply.msg, reply.done = msg, True
                client._cv.notify_all()
        if reply is None:
            log.debug("bucket %d: dropped a reply for step %s nobody waits for", self.bucket, seq)
        if then is None:
            return
        try:  # (outside the lock: it writes weights)
            msg = then(reply, msg)
        except Exception as exc:  # a bad reply must not kill the I/O thread
            err = exc if isinstance(exc, LuwuError) else _bad_reply(client, self.node, exc)
            client.fail(self.node, err, reply)
            return
        with client._cv:
            if not reply.done:
                reply.msg, reply.done = msg, True
                client._cv.notify_all()

    def refused(self, ref_op: int, step: int) -> list[Reply]:
        """The unresolved futures an ERROR answering ``ref_op`` of ``step`` refuses (taken out)."""
        if ref_op == Op.PULL:
            return [r for r in (self._updates.pop(-1, None),) if r is not None]
        if ref_op == Op.PUSH:
            refused = (self._updates.pop(step, None), self._norms.pop(step, None))
            return [r for r in refused if r is not None]
        if ref_op == Op.STATE:
            refused, self._state = self._state, None
            return [refused] if refused is not None else []
        return []

    def abandon(self) -> list[Reply]:
        """Every unresolved future (taken out): their steps were abandoned."""
        out = [*self._updates.values(), *self._norms.values(), *filter(None, [self._state])]
        self._state = None
        self._updates.clear()
        self._norms.clear()
        self._pushed.clear()
        self._fetch = None
        return out


def resolved(replies: list[Reply]) -> list[Reply]:
    """The resolved ones of ``replies``; a failed one raises its error."""
    ready = [r for r in replies if r.done]
    for r in ready:
        if r.error is not None:
            raise r.error
    return ready


def _bad_reply(client: WorkerClient, node: int, exc: Exception) -> ProtocolError:
    return ProtocolError(f"node {client.nodes[node]}: {exc}")


class Channels:
    """The client's bucket channels, by bucket id (a worker's layout opens them)."""

    def __init__(self, client: WorkerClient):
        self.client = client
        self._by_bucket: dict[int, BucketChannel] = {}

    def open(self, buckets: list[tuple[int, int]]) -> list[BucketChannel]:
        """A channel per (node, bucket) of a layout, replacing the earlier layout's (whose
        unresolved futures are abandoned)."""
        self.reset()
        self._by_bucket = {bid: BucketChannel(self.client, node, bid) for node, bid in buckets}
        return list(self._by_bucket.values())

    def deliver(self, node: int, msg: wire.Message) -> None:
        """A reply of ``node`` to a bucket's request (the I/O thread)."""
        channel = self._by_bucket.get(msg.header.get("bucket", -1))
        if channel is None or channel.node != node:
            log.debug("node %d: dropped a reply for a bucket it does not own here", node)
            return
        channel.deliver(msg)

    def refused(self, node: int, err: LuwuError) -> list[Reply]:
        """The futures a node's ERROR refuses: those of the push or PULL it answers (with the
        client's lock held)."""
        channel = self._by_bucket.get(err.bucket if err.bucket is not None else -1)
        if channel is None or channel.node != node:
            return []
        return channel.refused(err.ref_op, err.step)

    def reset(self) -> None:
        """Abandon every unresolved future (after a rollback or rejoin: their steps are gone); a
        waiter still holding one raises at once instead of waiting for its deadline."""
        client = self.client
        with client._cv:
            for channel in self._by_bucket.values():
                for reply in channel.abandon():
                    if not reply.done:
                        node, step, bucket = reply.where()
                        reply.error = StepMismatchError(
                            f"worker {client.rank}: the reply of node {client.nodes[node]} for "
                            f"step {step}, bucket {bucket} belongs to a step abandoned by a "
                            "rollback or rejoin (recover())",
                            node=client.nodes[node],
                            worker=client.rank,
                            step=step,
                            bucket=bucket,
                        )
                        reply.done = True
            client._cv.notify_all()

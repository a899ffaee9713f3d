"""PULL: a worker asks for a bucket's weights whole (a joiner, a reload, a streaming fetch).

The answer is encoded behind the steps already queued, so it carries the newest weights; a PULL
of a bucket that rank 0 has not seeded yet waits for the seed (INIT or IMPORT) and is answered
then. With ``node.push_memory_bytes``, an answer that holds memory (out of core, or not fp32) is
queued only once it fits the budget (:mod:`.fetch_room`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from luwu.protocol import messages as wire
from luwu.protocol.codec_facts import bytes_per_element
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.effects import Effect, SendCurrent
from luwu.switch_nodes.inflight import Ticket
from luwu.switch_nodes.replies import ACK, PullCodec, full_codec
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.store import BucketState

__all__ = ["Pulls"]


class Pulls:
    """The PULLs of one node, and those waiting for their bucket's seed."""

    def __init__(self, shard: Shard, ctx: NodeContext) -> None:
        self.shard, self.ctx = shard, ctx
        self._pending: dict[int, list[tuple[int, PullCodec]]] = {}  # bucket -> (worker, codec)
        self._held: set[Ticket] = set()  # the budget the answers queued hold, until sent
        self._waiting: set[Ticket] = set()  # of those, the ones not encoding yet

    def answer(self, e: SendCurrent, send: Callable[[SendCurrent], Awaitable[None]]) -> None:
        """Queue ``send(e)`` (the bucket's weights whole) behind the steps once its answer fits the push
        budget; what it holds is given back once it is sent (or dropped by a rollback)."""
        queue, gen = self.ctx.queue, self.ctx.queue.gen

        def go(ticket: Ticket | None) -> None:
            if ticket is not None:
                self._held.add(ticket)
                self._queued(ticket, +1)

            async def job() -> None:
                self._queued(ticket, -1)  # (its memory is taken from now on)
                # (queued jobs run one at a time: the next reply counted is this answer)
                self.ctx.inflight.handover = ticket
                try:
                    await send(e)
                finally:
                    self.ctx.inflight.handover = None
                    self._give(ticket)

            if gen == queue.gen:
                queue.submit(job)
            else:  # a rollback came while it waited: its bucket is gone
                self._give(ticket)

        self.ctx.inflight.fetches.admit(self._answer_bytes(e), go, e.workers)

    def _answer_bytes(self, e: SendCurrent) -> int:
        """What the answer holds until sent: nothing for fp32 from a shard in RAM (its frames are the
        shard's own), else the encoded weights."""
        if e.codec.name == ACK or (e.codec.name == "none" and self.shard.in_ram):
            return 0
        return int(e.bucket.numel * bytes_per_element(e.codec.name)) + 64

    def _queued(self, ticket: Ticket | None, sign: int) -> None:
        """An answer's room is queued behind the steps (+1) or its encoding starts (-1)."""
        if ticket is not None and (sign > 0) != (ticket in self._waiting):
            self._waiting.symmetric_difference_update({ticket})
            self.ctx.inflight.queued += sign * ticket.nbytes

    def _give(self, ticket: Ticket | None) -> None:
        if ticket is not None and ticket in self._held:
            self._queued(ticket, -1)
            self._held.discard(ticket)
            ticket.release()

    def on_pull(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """Full weights to one worker, behind the queued steps (or once the bucket is seeded)."""
        h = msg.header
        b = self.shard.bucket(h["bucket"])
        codec = full_codec(h["codec"])
        if not b.initialized:
            self._pending.setdefault(b.id, []).append((h["worker"], codec))
            return []
        return [SendCurrent(b, [h["worker"]], codec)]

    def seeded(self, b: BucketState) -> list[Effect]:
        """The bucket got its weights: the PULLs that waited for them are answered now."""
        return [SendCurrent(b, [w], codec) for w, codec in self._pending.pop(b.id, [])]

    def reset(self) -> None:
        """Forget the waiting PULLs (a rollback replaced the buckets) and the answers queued for them."""
        self._pending = {}
        self.ctx.inflight.fetches.reset()
        for ticket in list(self._held):  # (their jobs are dropped: queued before the rollback)
            self._give(ticket)

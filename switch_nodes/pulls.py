"""PULL: a worker asks for a bucket's weights whole (a joiner, a reload, a streaming fetch).

The answer is encoded behind the steps already queued, so it carries the newest weights; a PULL
of a bucket that rank 0 has not seeded yet waits for the seed (INIT or IMPORT) and is answered
then.
"""

from __future__ import annotations

from luwu.protocol import messages as wire
from luwu.switch_nodes.effects import Effect, SendCurrent, SendWeights
from luwu.switch_nodes.replies import PullCodec, full_codec
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.store import BucketState

__all__ = ["Pulls"]


class Pulls:
    """The PULLs of one node, and those waiting for their bucket's seed."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self._pending: dict[int, list[tuple[int, PullCodec]]] = {}  # bucket -> (worker, codec)

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
        return [SendWeights(b, [w], codec) for w, codec in self._pending.pop(b.id, [])]

    def reset(self) -> None:
        """Forget the waiting PULLs (a rollback replaced the buckets)."""
        self._pending = {}

"""An aggregator's fetches: the group's PULLs of one bucket that are in flight at once go up once.

In streaming mode every worker fetches every unit's weights each step (PULL, answered by an UPDATE
without ``seq``: the bucket's weights whole). Through an aggregator, the first PULL of a (node,
bucket, codec) goes up; the group's others that come while it is in flight wait for its answer and
get the same frames, addressed to them (PULLs whose answers share a codec: ``int8_delta``'s and
``none``'s are both fp32 whole). In sync mode that is the answer each would have got: a
bucket steps only once every rank pushed it, and a rank that still fetches it for this step has not,
so the bucket cannot step between their PULLs. In async mode each PULL goes up as it came.
An ERROR answering the PULL in flight goes to its waiters too.
"""

from __future__ import annotations

from luwu.switch_nodes.replies import full_codec

__all__ = ["Fetches"]


def _answer_codec(codec: str) -> str | None:
    """The codec a node answers a PULL in ``codec`` with (the weights whole), None for a name it
    refuses (that PULL goes up alone, for the node to say why)."""
    try:
        return full_codec(codec).name
    except Exception:
        return None


class Fetches:
    """The PULLs in flight through one aggregator and the ranks waiting on each."""

    def __init__(self) -> None:
        # (node, bucket, the answer's codec) -> (the rank whose PULL went up, the ranks waiting)
        self._open: dict[tuple[int, int, str], tuple[int, list[int]]] = {}
        self._sent: dict[tuple[int, int, int], tuple[int, int, str]] = {}  # (node, bucket, rank)

    def ask(self, node: int, bucket: int, codec: str, rank: int) -> bool:
        """Rank ``rank`` PULLs ``bucket`` of ``node`` in ``codec``: True to send it up (no PULL of it in
        flight, or its own again), False when it waits on the one in flight."""
        answer = _answer_codec(codec)
        if answer is None:
            return True
        key = (node, bucket, answer)
        held = self._open.get(key)
        if held is None:
            if (node, bucket, rank) in self._sent:
                return True  # (its PULL of the bucket in another codec is in flight: not shared)
            self._open[key] = (rank, [])
            self._sent[(node, bucket, rank)] = key
            return True
        first, waiting = held
        if rank == first:
            return True  # (a retry of its own: the node answers it again, the record stays)
        if rank not in waiting:
            waiting.append(rank)
        return False

    def answered(self, node: int, bucket: int, rank: int, codec: str | None) -> list[int]:
        """The answer to ``rank``'s PULL of ``bucket`` came (an UPDATE without ``seq`` in ``codec``,
        or an ERROR: None): the ranks that waited on it, each to get it too. An UPDATE in another
        codec answers another PULL of the rank's: nobody waited on it."""
        key = self._sent.get((node, bucket, rank))
        if key is None or codec is not None and codec != key[2]:
            return []
        del self._sent[(node, bucket, rank)]
        _, waiting = self._open.pop(key)
        return waiting

    @property
    def in_flight(self) -> int:
        return len(self._open)

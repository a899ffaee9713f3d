"""An aggregator's sums (switch_nodes/tier/group_sums.py), without processes: a block's sum goes up
once its last push is in, a block of one passes as it came, a retry is counted once, what a worker
far ahead of its group can make the aggregator hold is bounded, and a late or dropped rank holds
its block back no longer than the node's deadline allows, with the node's bits kept."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import ProtocolError
from luwu.protocol.layout import Bucket, Segment
from luwu.protocol.messages import Op
from luwu.protocol.policy import CompressionConfig
from luwu.switch_nodes.summation import RankTree, Summed
from luwu.switch_nodes.tier.group_sums import GroupSums

pytestmark = pytest.mark.timeout(60)

NUMEL = 64
BUCKET = Bucket(0, 0, 0, NUMEL, (Segment(0, "w", (NUMEL,), 0, 0, NUMEL),))


def _push(rank: int, step: int, value: float) -> tuple[wire.Message, list]:
    enc = get_codec("none").encode(torch.full((NUMEL,), value))
    header = {"op": Op.PUSH, "job": "j", "step": step, "worker": rank, "bucket": 0}
    header |= {"codec": "none", "cmeta": enc.meta, "hyper": {}, "nograd": [], "two_phase": False}
    header["pull"] = "none"
    body = wire.encode(header, enc.frames)
    return wire.decode(body), body


def _sum_of(frames: list) -> tuple[dict, torch.Tensor]:
    h = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    return h, torch.frombuffer(bytearray(frames[1]), dtype=torch.float32)


def test_a_blocks_sum_goes_up_once_its_last_push_is_in():
    sums = GroupSums((0, 1, 2), world_size=4)
    assert sums.blocks == [(0, 1), (2,)]
    assert sums.add(0, BUCKET, *_push(0, 0, 1.0)) is None
    assert sums.add(0, BUCKET, *_push(0, 0, 1.0)) is None, "a retry is counted once"
    (up,) = sums.add(0, BUCKET, *_push(1, 0, 3.0))
    h, total = _sum_of(up)
    assert h["ranks"] == [0, 1] and h["prescaled"] == 4 and h["worker"] == 0
    assert total.equal(torch.full((NUMEL,), 1.0)), "(1 + 3) / 4"
    msg, body = _push(2, 0, 5.0)
    assert sums.add(0, BUCKET, msg, body) == [body], "a block of one rank passes as it came"
    msg, body = _push(1, 0, 3.0)
    assert sums.add(0, BUCKET, msg, body) == [body], (
        "a retry after the sum left passes, for the node"
    )


def test_a_worker_far_ahead_of_its_group_is_refused_past_the_bound():
    sums = GroupSums((0, 1), world_size=2, max_open=3)
    for step in range(3):
        assert sums.add(0, BUCKET, *_push(0, step, 1.0)) is None
    with pytest.raises(ProtocolError, match="worker 0: push of bucket 0 step 3"):
        sums.add(0, BUCKET, *_push(0, 3, 1.0))
    assert sums.add(0, BUCKET, *_push(1, 0, 1.0)) is not None, "the group catches up"
    assert sums.add(0, BUCKET, *_push(0, 3, 1.0)) is None


def test_the_uplink_of_a_bucket_that_cuts_a_tensor_follows_its_workers_large_codec():
    """A bucket that holds part of a matrix arrives in HELLO as positions only (no shape): the policy
    alone would call it 1-D and send bf16 up. Its workers pushed int8, so they know it is large: the
    sum goes up int8 too (told 1 Gbit/s), and bf16 where the workers pushed bf16."""
    numel = 1 << 16
    part = Bucket.from_wire([0, 0, numel, [[0, 4096, 0, numel]]])  # (a slice of parameter 0)
    assert part.segments[0].shape == (), "what an aggregator knows of it"
    config = CompressionConfig(link_gbps=1.0, warmup_steps=0)
    for codec, want in (("int8", "int8"), ("bf16", "bf16")):
        sums = GroupSums((0, 1), world_size=2, compression=config)
        got = None
        for rank in (0, 1):
            enc = get_codec(codec).encode(torch.randn(numel))
            h = {"op": Op.PUSH, "job": "j", "step": 5, "worker": rank, "bucket": 0, "codec": codec}
            h |= {"cmeta": enc.meta, "hyper": {}, "nograd": [], "two_phase": False, "pull": "none"}
            body = wire.encode(h, enc.frames)
            got = sums.add(0, part, wire.decode(body), body)
        up = msgpack.unpackb(got[0][0], raw=False, strict_map_key=False)
        assert up["codec"].partition(":")[0] == want, (codec, up["codec"])


def _values(world: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {r: torch.randn(NUMEL, generator=g) for r in range(world)}


def _raw_push(rank: int, step: int, grad: torch.Tensor) -> tuple[wire.Message, list]:
    enc = get_codec("none").encode(grad)
    header = {"op": Op.PUSH, "job": "j", "step": step, "worker": rank, "bucket": 0}
    header |= {"codec": "none", "cmeta": enc.meta, "hyper": {}, "nograd": [], "two_phase": False}
    header["pull"] = "none"
    body = wire.encode(header, enc.frames)
    return wire.decode(body), body


def _node_sum(world: int, ups: list[list]) -> torch.Tensor:
    """What a node's tree over ``world`` ranks makes of what went up (blocks and single pushes)."""
    tree = RankTree(tuple(range(world)), 1.0 / world)
    codec = get_codec("none")
    take = lambda: torch.empty(NUMEL)  # noqa: E731
    for frames in ups:
        msg = wire.decode(frames)
        h, tensors = msg.header, msg.tensors()
        if "ranks" in h:
            block = tuple(h["ranks"])
            assert tree.fits(block), f"{block} is an aligned subtree of the node's tree"
            tree.add_block(
                block, (Summed(codec, 1.0, len(block)), tensors, h["cmeta"]), take, print
            )
        else:
            tree.add(h["worker"], (codec, tensors, h["cmeta"]), take, print)
    assert tree.complete
    return tree.result(take, print)


@pytest.mark.parametrize("late", [0, 2, 3, 5])
def test_a_late_rank_sends_its_block_up_in_pieces_that_keep_the_nodes_bits(late):
    """Ranks 0-7 behind one aggregator (world 8), rank ``late`` late: past ``late_after_s`` the block
    goes up as its partial sums (aligned subtrees) and its unfolded pushes as they came; the late push
    passes as it came. The node's tree then has the bits of the flat sum."""
    world, grads = 8, _values(8)
    flat = _node_sum(world, [_raw_push(r, 0, grads[r])[1] for r in range(world)])
    sums = GroupSums(tuple(range(world)), world_size=world)
    sums.late_after_s = 0.5
    for r in range(world):
        if r != late:
            assert sums.add(0, BUCKET, *_raw_push(r, 0, grads[r])) is None
    assert sums.overdue(time.monotonic()) == [], "not yet due"
    ((node, step, pieces, named),) = sums.overdue(time.monotonic() + 1.0)
    assert (node, step, named) == (0, 0, [late])
    covered = []
    for frames in pieces:
        h = wire.decode(frames).header
        covered += h.get("ranks", [h["worker"]])
    assert sorted(covered) == [r for r in range(world) if r != late]
    after = sums.add(0, BUCKET, *_raw_push(late, 0, grads[late]))
    assert len(after) == 1 and "ranks" not in wire.decode(after[0]).header, "as it came"
    assert _node_sum(world, pieces + after).equal(flat)


def test_a_dropped_rank_is_not_waited_for_until_it_is_welcomed_again():
    sums = GroupSums((0, 1, 2, 3), world_size=4)
    grads = _values(4)
    for r in (0, 1, 3):
        assert sums.add(0, BUCKET, *_raw_push(r, 0, grads[r])) is None
    pieces = sums.gone(0, 2)  # node 0 dropped rank 2: the block waited only for it
    assert [wire.decode(f).header.get("ranks") for f in pieces] == [[0, 1], None]
    ups = [u for r in (0, 1, 3) for u in sums.add(0, BUCKET, *_raw_push(r, 1, grads[r])) or ()]
    assert len(ups) == 2, "step 1 goes up once ranks 0, 1 and 3 are in: a sum of 0-1, and 3"
    msg, body = _raw_push(2, 1, grads[2])
    assert sums.add(0, BUCKET, msg, body) == [body], (
        "the dropped rank's push, for the node to refuse"
    )
    for r in (0, 1, 3):
        assert sums.add(1, BUCKET, *_raw_push(r, 1, grads[r])) is None, "node 1 still waits for 2"
    sums.back(0, 2)
    for r in (0, 1, 3):
        assert sums.add(0, BUCKET, *_raw_push(r, 2, grads[r])) is None, "welcomed again: waited for"
    (up,) = sums.add(0, BUCKET, *_raw_push(2, 2, grads[2]))
    assert wire.decode(up).header["ranks"] == [0, 1, 2, 3]


def test_a_streamed_buckets_sum_goes_up_without_error_feedback():
    """Workers push a streamed unit's bucket int8 without error feedback (they keep nothing of it);
    the aggregator's uplink follows: no residual kept, the codec the policy picks for streaming."""
    numel = 1 << 16
    big = Bucket(0, 0, 0, numel, (Segment(0, "w", (256, 256), 0, 0, numel),))
    config = CompressionConfig(link_gbps=1.0, warmup_steps=0)
    for streamed in (False, True):
        sums = GroupSums((0, 1), world_size=2, compression=config)
        for rank in (0, 1):
            enc = get_codec("int8").encode(torch.randn(numel))
            h = {"op": Op.PUSH, "job": "j", "step": 5, "worker": rank, "bucket": 0, "codec": "int8"}
            h |= {"cmeta": enc.meta, "hyper": {}, "nograd": [], "two_phase": False, "pull": "none"}
            if streamed:
                h["streamed"] = True
            body = wire.encode(h, enc.frames)
            got = sums.add(0, big, wire.decode(body), body)
        assert got is not None
        kept = sums._feedback.residual((0, 0)) is not None
        assert kept is not streamed, "a residual only for a resident bucket's sum"

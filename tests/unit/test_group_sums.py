"""An aggregator's sums (switch_nodes/tier/group_sums.py), without processes: a block's sum goes up
once its last push is in, a block of one passes as it came, a retry is counted once, and what a
worker far ahead of its group can make the aggregator hold is bounded."""

from __future__ import annotations

import msgpack
import pytest
import torch

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import ProtocolError
from luwu.protocol.layout import Bucket, Segment
from luwu.protocol.messages import Op
from luwu.protocol.policy import CompressionConfig
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
    h, total = _sum_of(sums.add(0, BUCKET, *_push(1, 0, 3.0)))
    assert h["ranks"] == [0, 1] and h["prescaled"] == 4 and h["worker"] == 0
    assert total.equal(torch.full((NUMEL,), 1.0)), "(1 + 3) / 4"
    msg, body = _push(2, 0, 5.0)
    assert sums.add(0, BUCKET, msg, body) is body, "a block of one rank passes as it came"
    msg, body = _push(1, 0, 3.0)
    assert sums.add(0, BUCKET, msg, body) is body, "a retry after the sum left passes, for the node"


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
        up = msgpack.unpackb(got[0], raw=False, strict_map_key=False)
        assert up["codec"].partition(":")[0] == want, (codec, up["codec"])

"""The node's half of the switch tier's fallback: requests a worker sends again once its aggregator
died are counted once, and each is answered with what the dead aggregator may have swallowed.

The aggregator room alone, without a server (as tests/unit/test_node_rooms.py walks it): the effects
it returns for a push, a micro-batch push and a COMMIT that come again. The end to end run is
tests/integration/test_aggregator.py's."""

from __future__ import annotations

import pytest
import torch
from support.node_messages import push_message

from luwu.protocol import messages as wire
from luwu.protocol.layout import Bucket
from luwu.protocol.messages import Op
from luwu.switch_nodes.aggregation import Aggregator
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.context import NodeContext, OptimizerQueue
from luwu.switch_nodes.effects import ApplyStep, Norm, Ready, Reply, SendCurrent
from luwu.switch_nodes.metrics import NodeMetrics
from luwu.switch_nodes.optimizers import ADAMW
from luwu.switch_nodes.shard import ResidentShard

pytestmark = pytest.mark.timeout(60)

NUMEL = 64
HYPER = {"lr": 1e-2}


def _room():
    metrics = NodeMetrics(None)
    ctx = NodeContext(
        cfg=NodeConfig(), job="j", metrics=metrics, queue=OptimizerQueue(metrics), index=0
    )
    ctx.world_size, ctx.members = 2, {0, 1}
    ctx.peers = {0: b"w0", 1: b"w1"}
    shard = ResidentShard(ctx, on_stuck=lambda ranks: None)
    b = shard.add(Bucket.from_wire([0, 0, NUMEL, [[0, 0, 0, NUMEL]]]), ADAMW, 0)
    b.params.copy_(torch.randn(NUMEL))
    b.initialized = True
    return Aggregator(ctx, shard), shard, b


def _push(worker: int, grad: torch.Tensor, **extra) -> wire.Message:
    return push_message(worker, grad, HYPER, **{"pull": "none", **extra})


def _commit(worker: int, **extra) -> wire.Message:
    h = {"op": Op.COMMIT, "job": "j", "step": 0, "worker": worker, "coef": 1.0, "skip": False}
    return wire.decode(wire.encode(h | {"buckets": [0], **extra}), job="j")


def _norm_of(effects) -> dict:
    (reply,) = [e for e in effects if isinstance(e, Reply)]
    return wire.decode(reply.frames, job="j").header


def test_a_two_phase_push_sent_again_gets_its_norm_again_before_and_after_the_step():
    agg, shard, b = _room()
    grads = [torch.randn(NUMEL), torch.randn(NUMEL)]
    assert agg.on_push(b"w0", _push(0, grads[0], two_phase=True)) == []
    (ready,) = agg.on_push(b"w1", _push(1, grads[1], two_phase=True))
    assert isinstance(ready.then, Norm)
    b.last_norm = (0, 2.5, False)  # (what the server's norm job leaves)
    # the NORM went to an aggregator that died: the push comes again, and is counted once
    again = agg.on_push(b"w0", _push(0, grads[0], two_phase=True))
    norm = _norm_of(again)
    assert (norm["op"], norm["worker"], norm["sqnorm"], norm["bucket"]) == (Op.NORM, 0, 2.5, 0)
    assert b.accs[0].workers == {0, 1}
    (step,) = agg.on_commit(b"w1", _commit(1))
    assert isinstance(step, ApplyStep) and step.divisor == 2.0
    shard.apply(b, 0, step.acc, step.divisor, step.skip)
    b.release(0)
    # stepped since (the other worker's COMMIT): the NORM again, and the weights whole
    late = agg.on_push(b"w0", _push(0, grads[0], two_phase=True))
    assert _norm_of(late)["sqnorm"] == 2.5
    (current,) = [e for e in late if isinstance(e, SendCurrent)]
    assert (current.workers, current.seq) == ([0], 0)


def test_a_commit_sent_again_asks_for_the_weights_of_the_buckets_stepped_since():
    agg, shard, b = _room()
    agg.on_push(b"w0", _push(0, torch.randn(NUMEL), two_phase=True))
    agg.on_push(b"w1", _push(1, torch.randn(NUMEL), two_phase=True))
    (step,) = agg.on_commit(b"w1", _commit(1))
    shard.apply(b, 0, step.acc, step.divisor, step.skip)
    b.release(0)
    assert agg.on_commit(b"w0", _commit(0)) == [], "a plain second COMMIT changes nothing"
    (again,) = agg.on_commit(b"w0", _commit(0, retry=True, pulls={0: "none"}))
    assert isinstance(again, SendCurrent) and (again.workers, again.seq) == ([0], 0)
    assert agg.on_commit(b"w0", _commit(0, retry=True, pulls={})) == [], "its UPDATE came: nothing"


def test_a_micro_batch_push_sent_again_is_counted_once():
    agg, shard, b = _room()
    micro = [torch.randn(NUMEL) for _ in range(3)]
    for i in range(2):
        assert agg.on_push(b"w0", _push(0, micro[i], partial=True, micro=i)) == []
    summed = b.accs[0].partial[0]
    assert agg.on_push(b"w0", _push(0, micro[0], partial=True, micro=0)) == []
    assert b.accs[0].partial[0] == summed == 2
    assert agg.on_push(b"w0", _push(0, micro[2])) == []
    (ready,) = agg.on_push(b"w1", _push(1, torch.randn(NUMEL)))
    assert isinstance(ready, Ready)
    # the last push and a micro-batch push of a step already complete: nothing counted again
    assert agg.on_push(b"w0", _push(0, micro[1], partial=True, micro=1)) == []
    assert agg.on_push(b"w0", _push(0, micro[2])) == []
    assert b.accs[0].workers == {0, 1} and b.accs[0].partial[0] == 2

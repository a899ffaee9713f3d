"""A bucket's channel: ``push()`` and ``pull()`` return futures that the client's I/O thread
resolves with the node's reply, once; an ERROR refusing the push fails its future with the
node's error (a second wait raises it again at once, not at the deadline); a rejoin abandons the
futures still open (their waiters raise at once) and a push of the same step again gets a fresh
future that only the new reply resolves. The node is a scripted ROUTER socket, to put the
messages on the wire in exactly the order wanted; the client and its channels are the real ones."""

import time

import pytest
import torch
from support import scripted_node

from luwu.protocol import messages as wire
from luwu.protocol.errors import NodeTimeoutError, StepMismatchError
from luwu.protocol.messages import Op

JOB = "channel-test"


def update(seq: int, bucket: int, value: float) -> list:
    return scripted_node.update(JOB, seq, bucket, value)


def stats() -> list:
    return wire.encode({"op": Op.STATS, "job": JOB, "step": 0, "worker": 0})


def value(msg) -> float:
    return float(msg.tensors()[0].view(torch.float32)[0])


@pytest.fixture
def scripted():
    """(node ROUTER socket, the worker's identity there, client, channels of buckets 0 and 1)."""
    with scripted_node.scripted(JOB) as s:
        yield s


def settled(node, ident, client) -> None:
    """Wait until the client took every message the node sent before (a STATS answer after them)."""
    node.send_multipart([ident, *stats()])
    client.wait([(Op.STATS, 0, None, -1)])


def push(channel, step: int, two_phase: bool = False):
    header = {"op": Op.PUSH, "step": step, "bucket": channel.bucket, "two_phase": two_phase}
    return channel.push(header, [torch.zeros(4)])


@pytest.mark.timeout(30)
def test_a_future_is_resolved_once_by_its_own_reply(scripted):
    node, ident, client, (ch0, ch1) = scripted
    first, other = push(ch0, 3), push(ch1, 3)
    ch0.pull("none")
    node.send_multipart([ident, *update(3, 0, 1.0)])
    node.send_multipart([ident, *update(3, 0, 2.0)])  # a duplicate: nobody waits for it
    node.send_multipart([ident, *update(-1, 0, 7.0)])  # the PULL's answer
    settled(node, ident, client)
    assert first.done and value(first.msg) == 1.0
    assert not other.done, "a reply of bucket 0 resolved bucket 1's future"
    assert value(ch0.fetched().result()) == 7.0
    second = push(ch0, 4)
    node.send_multipart([ident, *update(3, 0, 9.0)])  # step 3 again: not step 4's
    node.send_multipart([ident, *update(4, 0, 5.0)])
    assert value(second.result()) == 5.0
    assert value(first.msg) == 1.0, "a resolved future changed"
    assert ch0.reply(3) is first and ch0.reply(4) is second


@pytest.mark.timeout(30)
def test_a_refused_push_fails_its_futures_with_the_nodes_error(scripted):
    node, ident, client, (ch0, ch1) = scripted
    refused, fine = push(ch1, 5, two_phase=True), push(ch0, 5)
    err = wire.error_message(
        JOB, "step_mismatch", "push of step 5 refused", ref_op=Op.PUSH, step=5, bucket=1
    )
    node.send_multipart([ident, *err])
    with pytest.raises(StepMismatchError, match="push of step 5 refused") as e:
        for _ in client.arrivals([refused.norm, fine], what="gradient norm"):
            pass
    assert (e.value.node, e.value.step, e.value.bucket) == (client.nodes[0], 5, 1)
    t0 = time.monotonic()
    for f in (refused, refused.norm):  # again: the same error at once, not at the deadline
        with pytest.raises(StepMismatchError, match="push of step 5 refused"):
            f.result(timeout_s=3)
    assert time.monotonic() - t0 < 2
    assert not fine.done, "the error failed a future it does not refuse"
    node.send_multipart([ident, *update(5, 0, 4.0)])
    assert value(fine.result()) == 4.0
    with pytest.raises(NodeTimeoutError, match="step 6, bucket 1"):
        ch1.reply(6).result(timeout_s=0.5)  # (never pushed: its deadline names it)


@pytest.mark.timeout(30)
def test_a_rejoin_abandons_open_futures_and_a_push_again_rearms(scripted):
    node, ident, client, (ch0, _) = scripted
    old = push(ch0, 7)
    client.reset()  # (recover(): the step is abandoned)
    t0 = time.monotonic()
    with pytest.raises(StepMismatchError, match="abandoned"):
        old.result(timeout_s=3)
    assert time.monotonic() - t0 < 2, "a waiter of an abandoned future waited for its deadline"
    node.send_multipart([ident, *update(7, 0, 1.0)])  # the abandoned step's reply, late
    settled(node, ident, client)
    new = push(ch0, 7)  # the step again
    node.send_multipart([ident, *update(7, 0, 3.0)])
    assert value(new.result()) == 3.0
    assert old.msg is None and isinstance(old.error, StepMismatchError)


def state_reply(bucket: int, value: float) -> list:
    h = {"op": Op.STATE, "job": JOB, "step": 0, "worker": 0, "bucket": bucket}
    return wire.encode(h | {"action": "get", "names": ["params"]}, [torch.full((4,), value)])


@pytest.mark.timeout(30)
def test_state_requests_are_answered_through_their_buckets_futures(scripted):
    """A STATE request's answer resolves its bucket's future (not a control key); an ERROR refusing
    one bucket's request fails that future alone, naming node and bucket."""
    node, ident, client, (ch0, ch1) = scripted
    get = {"op": Op.STATE, "step": 2, "action": "get", "names": []}
    first, second = ch0.state(get), ch1.state(get)
    node.send_multipart([ident, *state_reply(1, 5.0)])  # (answers in another order)
    node.send_multipart([ident, *state_reply(0, 3.0)])
    got = {r.bucket: value(r.msg) for r in client.arrivals([first, second], what="state")}
    assert got == {0: 3.0, 1: 5.0}
    node.send_multipart([ident, *state_reply(0, 9.0)])  # nobody asked: dropped
    settled(node, ident, client)
    refused, fine = ch1.state(get), ch0.state(get)
    err = wire.error_message(
        JOB, "bad_state", "state of bucket 1 refused", ref_op=Op.STATE, step=2, bucket=1
    )
    node.send_multipart([ident, *err])
    with pytest.raises(Exception, match="state of bucket 1 refused"):
        refused.result(timeout_s=3)
    assert not fine.done
    node.send_multipart([ident, *state_reply(0, 4.0)])
    assert value(fine.result()) == 4.0

"""What a worker behind an aggregator keeps to send again when the aggregator dies (gpu_workers.fallback).

The bookkeeping alone, on a stand-in for the client's queues: which requests are kept until which
answer, and what goes out, in which order, once the node welcomed the worker back. The end to end
run (a SIGKILLed aggregator, the job equal to the undisturbed one) is in
tests/integration/test_aggregator.py."""

import collections
import types

import msgpack
import pytest

from luwu.gpu_workers.fallback import Fallback
from luwu.protocol.messages import Op

pytestmark = pytest.mark.timeout(30)


class _Client:
    """The queues and settings a Fallback uses (the socket it would reconnect is the test's)."""

    def __init__(self, nodes: int = 1) -> None:
        self._out = [collections.deque() for _ in range(nodes)]
        self.cfg = types.SimpleNamespace(connect_timeout_s=5.0)
        self.rank = 3
        self.wake = types.SimpleNamespace(queued=lambda: None)
        self.reconnected: list[tuple[int, str]] = []

    def reconnect(self, node: int, addr: str) -> None:
        self.reconnected.append((node, addr))


def _send(fb: Fallback, header: dict, tag: str, priority=None) -> list:
    frames = [tag.encode()]
    fb.queue(0, dict(header, job="j", worker=3), priority, frames)
    return frames


def _push(fb: Fallback, step: int, bucket: int, **extra) -> list:
    h = {"op": Op.PUSH, "step": step, "bucket": bucket, "pull": "bf16", **extra}
    return _send(
        fb, h, f"push {step}/{bucket}{'/' + str(extra['micro']) if 'micro' in extra else ''}"
    )


def _fall_back(fb: Fallback, client: _Client) -> list:
    """Kill the aggregator, welcome the worker back: the frames sent again (the HELLO's first)."""
    client._out[0].clear()
    fb.start(0)
    hello = client._out[0].popleft()[1]
    assert msgpack.unpackb(hello[0])["resume"] is True
    assert client.reconnected == [(0, "tcp://node0")]
    assert fb.reply(0, {"op": Op.WELCOME, "step": 0}) is True
    return [frames for _, frames in client._out[0]]


def _fallback() -> tuple[Fallback, _Client]:
    client = _Client()
    fb = Fallback(client, ["tcp://node0"], "tcp://aggregator")
    _send(fb, {"op": Op.HELLO, "step": 0, "resume": False}, "hello")
    fb.reply(0, {"op": Op.WELCOME, "step": 0})
    return fb, client


def test_a_push_is_kept_until_its_update_and_goes_again_in_order_with_the_last_release():
    fb, client = _fallback()
    a, b = _push(fb, 4, 0), _push(fb, 4, 1)
    c = _push(fb, 4, 2)
    _send(fb, {"op": Op.HEARTBEAT, "step": 4, "seq": 4}, "release", priority=-1)
    _send(fb, {"op": Op.HEARTBEAT, "step": 0}, "probe")  # (not kept)
    fb.reply(0, {"op": Op.UPDATE, "step": 5, "bucket": 1, "seq": 4})
    fb.reply(0, {"op": Op.ERROR, "step": 4, "bucket": 2, "ref_op": Op.PUSH})  # refused: not again
    again = _fall_back(fb, client)
    assert again == [a, [b"release"]]
    assert b not in again and c not in again


def test_while_the_node_has_not_welcomed_the_worker_back_its_requests_wait_and_probes_are_dropped():
    fb, client = _fallback()
    a = _push(fb, 1, 0)
    client._out[0].clear()
    fb.start(0)
    client._out[0].clear()  # (the HELLO)
    b = _push(fb, 1, 1)
    _send(fb, {"op": Op.HEARTBEAT, "step": 1}, "probe")
    assert not client._out[0], "nothing but the HELLO before the WELCOME"
    fb.reply(0, {"op": Op.WELCOME, "step": 1})
    assert [f for _, f in client._out[0]] == [a, b]
    client._out[0].clear()
    c = _push(fb, 2, 0)  # (from now on straight to the node, not kept)
    assert [f for _, f in client._out[0]] == [c]


def test_a_refused_hello_is_said_again_until_the_deadline():
    fb, client = _fallback()
    client._out[0].clear()
    fb.start(0)
    client._out[0].clear()
    assert fb.reply(0, {"op": Op.ERROR, "step": 0, "ref_op": Op.HELLO, "message": "held"})
    fb.tick()
    assert not client._out[0], "not before RETRY_S"
    fb._pending[0] = (fb._pending[0][0], 0.0)
    fb.tick()
    assert msgpack.unpackb(client._out[0].popleft()[1][0])["op"] == Op.HELLO


def test_a_two_phase_push_is_forgotten_at_its_norm_and_its_commit_goes_again_asking_for_the_weights():
    fb, client = _fallback()
    _push(fb, 7, 0, two_phase=True)
    _push(fb, 7, 1, two_phase=True)
    fb.reply(0, {"op": Op.NORM, "step": 7, "bucket": 0})
    fb.reply(0, {"op": Op.NORM, "step": 7, "bucket": 1})
    _send(fb, {"op": Op.COMMIT, "step": 7, "coef": 1.0, "skip": False, "buckets": [0, 1]}, "commit")
    fb.reply(0, {"op": Op.UPDATE, "step": 8, "bucket": 0, "seq": 7})
    again = _fall_back(fb, client)
    assert len(again) == 1, "the pushes' buffers may be reused after their NORM: not sent again"
    commit = msgpack.unpackb(again[0][0], strict_map_key=False)
    assert commit["retry"] is True and commit["pulls"] == {1: "bf16"}


def test_the_commit_of_a_step_is_forgotten_once_every_push_of_it_is_answered():
    fb, client = _fallback()
    _push(fb, 2, 0)
    _send(fb, {"op": Op.COMMIT, "step": 2, "coef": 1.0, "skip": False, "buckets": [0]}, "commit")
    fb.reply(0, {"op": Op.UPDATE, "step": 3, "bucket": 0, "seq": 2})
    assert _fall_back(fb, client) == []


def test_micro_batch_pushes_go_again_with_their_step_and_are_forgotten_with_it():
    fb, client = _fallback()
    m0, m1 = _push(fb, 3, 0, partial=True, micro=0), _push(fb, 3, 0, partial=True, micro=1)
    last = _push(fb, 3, 0)
    other = _push(fb, 3, 1, partial=True, micro=0)
    fb.reply(0, {"op": Op.UPDATE, "step": 4, "bucket": 1, "seq": 3})  # (bucket 1's step answered)
    assert _fall_back(fb, client) == [m0, m1, last]
    assert other not in client._out[0]


def test_pulls_state_and_control_requests_are_kept_until_their_answers():
    fb, client = _fallback()
    pull = _send(fb, {"op": Op.PULL, "step": 0, "bucket": 5, "codec": "none"}, "pull")
    state = _send(fb, {"op": Op.STATE, "step": 0, "bucket": 6}, "state")
    stats = _send(fb, {"op": Op.STATS, "step": 0}, "stats")
    ckpt = _send(fb, {"op": Op.CHECKPOINT, "step": 0}, "checkpoint")
    fb.reply(0, {"op": Op.STATE, "step": 0, "bucket": 6})
    fb.reply(0, {"op": Op.STATS, "step": 0})
    assert _fall_back(fb, client) == [pull, ckpt]
    assert state not in client._out[0] and stats not in client._out[0]


def test_a_commit_made_after_the_fallback_asks_for_the_weights_whose_norm_came_before_it():
    """The NORMs of a step came through the aggregator, not yet the UPDATEs, and the COMMIT was not
    sent: the one sent after the fallback asks for those buckets' weights (they may be stepped)."""
    fb, client = _fallback()
    _push(fb, 5, 0, two_phase=True)
    _push(fb, 5, 1, two_phase=True)
    fb.reply(0, {"op": Op.NORM, "step": 5, "bucket": 0})
    fb.reply(0, {"op": Op.NORM, "step": 5, "bucket": 1})
    fb.reply(0, {"op": Op.UPDATE, "step": 6, "bucket": 1, "seq": 5})  # (one came: not asked for)
    assert _fall_back(fb, client) == []
    client._out[0].clear()
    _send(fb, {"op": Op.COMMIT, "step": 5, "coef": 1.0, "skip": False, "buckets": [0, 1]}, "c")
    (commit,) = [msgpack.unpackb(f[0], strict_map_key=False) for _, f in client._out[0]]
    assert commit["retry"] is True and commit["pulls"] == {0: "bf16"}
    client._out[0].clear()
    _send(fb, {"op": Op.COMMIT, "step": 6, "coef": 1.0, "skip": False, "buckets": [0]}, "next")
    assert [f for _, f in client._out[0]] == [[b"next"]], "the next step's goes as it is"

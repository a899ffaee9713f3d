"""What a node sent before a new session (WELCOME) or before its answer to ROLLBACK belongs to abandoned
steps and is forgotten: a node that finishes a step between answering the rejoin's HELLO and rolling back
sends that step's weights in between, and the redone step must not take them for its own (with
``bf16_steps`` pulls, steps from weights the worker no longer holds). The rejoin abandons the buckets'
open futures (``reset()``), so the stale reply finds none; the redone pushes' futures take the new
timeline's replies. The node here is a scripted ROUTER socket, to put the messages on the wire in exactly
the order the race produces; the client and its bucket channels are the real ones."""

import pytest
import torch
from support import scripted_node

from luwu.protocol import messages as wire
from luwu.protocol.messages import Op

JOB = "inbox-test"


def update(seq: int, bucket: int, value: float) -> list:
    return scripted_node.update(JOB, seq, bucket, value)


def answer(op: Op) -> list:
    fields = {"layout": "x", "versions": {}, "initialized": []} if op == Op.WELCOME else {}
    return wire.encode({"op": op, "job": JOB, "step": 6, "worker": 0, **fields})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("new_timeline", [Op.ROLLBACK, Op.WELCOME], ids=["rollback", "welcome"])
def test_replies_sent_before_a_rollback_or_rejoin_answer_are_forgotten(new_timeline):
    with scripted_node.scripted(JOB) as (node, ident, client, (ch0, ch1)):
        pushes = [ch.push({"op": Op.PUSH, "step": 7, "bucket": ch.bucket}, []) for ch in (ch0, ch1)]
        client.reset()  # recover(): step 7 is abandoned, then HELLO (and ROLLBACK)
        node.send_multipart([ident, *update(7, 0, 1.0)])  # the abandoned step 7's weights
        node.send_multipart([ident, *answer(new_timeline)])
        client.wait([(new_timeline, 0, None, -1)])
        redone = [ch.push({"op": Op.PUSH, "step": 7, "bucket": ch.bucket}, []) for ch in (ch0, ch1)]
        node.send_multipart([ident, *update(7, 1, 2.0)])  # the new timeline's
        node.send_multipart([ident, *update(7, 0, 3.0)])  # the redone step's reply is the one taken
        got = {r.bucket: r.msg.tensors()[0].view(torch.float32) for r in client.arrivals(redone)}
        assert torch.equal(got[0], torch.full((4,), 3.0)) and torch.equal(
            got[1], torch.full((4,), 2.0)
        )
        assert all(p.msg is None and p.error is not None for p in pushes)

"""The worker's I/O client files a node's replies by (op, node, step, bucket). What a node sent before a new
session (WELCOME) or before its answer to ROLLBACK belongs to abandoned steps and is forgotten: a node that
finishes a step between answering the rejoin's HELLO and rolling back sends that step's weights in between,
and the redone step must not take them for its own (with ``bf16_steps`` pulls, steps from weights the worker
no longer holds). The node here is a scripted ROUTER socket, to put the messages on the wire in exactly the
order the race produces; the client is the real one."""

import pytest
import torch
import zmq

from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.config import TransportConfig
from luwu.protocol import messages as wire
from luwu.protocol.messages import Op

JOB = "inbox-test"


def update(seq: int, bucket: int, value: float) -> list:
    h = {
        "op": Op.UPDATE,
        "job": JOB,
        "step": seq + 1,
        "worker": 0,
        "bucket": bucket,
        "codec": "none",
        "cmeta": {},
        "skipped": False,
        "seq": seq,
    }
    return wire.encode(h, [torch.full((4,), value)])


def answer(op: Op) -> list:
    fields = {"layout": "x", "versions": {}, "initialized": []} if op == Op.WELCOME else {}
    return wire.encode({"op": op, "job": JOB, "step": 6, "worker": 0, **fields})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("new_timeline", [Op.ROLLBACK, Op.WELCOME], ids=["rollback", "welcome"])
def test_replies_sent_before_a_rollback_or_rejoin_answer_are_forgotten(new_timeline):
    ctx = zmq.Context()
    node = ctx.socket(zmq.ROUTER)
    node.setsockopt(zmq.LINGER, 0)
    node.setsockopt(zmq.RCVTIMEO, 10_000)
    node.bind("tcp://127.0.0.1:0")
    addr = node.getsockopt(zmq.LAST_ENDPOINT).decode()
    client = WorkerClient([addr], job=JOB, rank=0, cfg=TransportConfig(timeout_s=10))
    try:
        client.send(0, {"op": Op.HEARTBEAT})  # (the node learns the worker's identity)
        ident = node.recv_multipart()[0]
        stale, kept = (Op.UPDATE, 0, 7, 0), (Op.UPDATE, 0, 7, 1)
        node.send_multipart([ident, *update(7, 0, 1.0)])  # the abandoned step 7's weights
        node.send_multipart([ident, *answer(new_timeline)])
        node.send_multipart([ident, *update(7, 1, 2.0)])  # sent after: the new timeline's
        client.wait([(new_timeline, 0, None, -1), kept])
        assert client.ready([stale]) == []
        node.send_multipart([ident, *update(7, 0, 3.0)])  # the redone step's reply is the one taken
        (m,) = client.wait([stale])
        assert torch.equal(m.tensors()[0].view(torch.float32), torch.full((4,), 3.0))
    finally:
        client.close()
        node.close()
        ctx.term()

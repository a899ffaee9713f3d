"""Messages a scripted node (a ROUTER socket in a test) sends a real worker client."""

import contextlib

import torch
import zmq

from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.config import TransportConfig
from luwu.protocol import messages as wire
from luwu.protocol.messages import Op


def update(job: str, seq: int, bucket: int, value: float) -> list:
    """An fp32 UPDATE of ``bucket`` answering the push of step ``seq`` (-1: a PULL), four values."""
    h = {
        "op": Op.UPDATE,
        "job": job,
        "step": seq + 1,
        "worker": 0,
        "bucket": bucket,
        "codec": "none",
        "cmeta": {},
        "skipped": False,
        "seq": seq,
    }
    return wire.encode(h, [torch.full((4,), value)])


@contextlib.contextmanager
def scripted(job: str):
    """A scripted node (a ROUTER socket on loopback) and a real client of it with the channels of
    buckets 0 and 1 open, once the node knows the worker's identity: (node, identity, client,
    channels). Everything is closed on the way out."""
    ctx = zmq.Context()
    node = ctx.socket(zmq.ROUTER)
    node.setsockopt(zmq.LINGER, 0)
    node.setsockopt(zmq.RCVTIMEO, 10_000)
    node.bind("tcp://127.0.0.1:0")
    addr = node.getsockopt(zmq.LAST_ENDPOINT).decode()
    client = WorkerClient([addr], job=job, rank=0, cfg=TransportConfig(timeout_s=10))
    try:
        channels = client.channels.open([(0, 0), (0, 1)])
        client.send(0, {"op": Op.HEARTBEAT})  # (the node learns the worker's identity)
        ident = node.recv_multipart()[0]
        yield node, ident, client, channels
    finally:
        client.close()
        node.close()
        ctx.term()

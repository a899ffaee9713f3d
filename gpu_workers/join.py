"""Joining the nodes: HELLO and its WELCOMEs, INIT, ROLLBACK.

A worker says HELLO to every node with the layout's hash and the buckets the node owns; a node
that accepted another layout is refused here, named. Rank 0 seeds the buckets no node holds yet
(INIT, fp32). After a node restart every node is rolled back to the step it restarted from.
"""

from __future__ import annotations

import torch

from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.segments import gather
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import LayoutMismatchError
from luwu.protocol.layout import Bucket, Layout
from luwu.protocol.messages import Op


def hello(
    client: WorkerClient,
    layout: Layout,
    *,
    step: int,
    world_size: int,
    optimizer: str,
    mode: str,
    resume: bool = False,
) -> list[dict]:
    """HELLO every node, wait for the WELCOMEs (their headers, in node order). ``resume``: go on
    from the nodes' step (resume=True, recover())."""
    for n in range(layout.num_nodes):
        mine = layout.buckets_of(n)
        header = {
            "op": Op.HELLO,
            "step": step,
            "param_names": {s.param: s.name for b in mine for s in b.segments},
            "world_size": world_size,
            "layout": layout.hash,
            "node_index": n,
            "buckets": [b.to_wire() for b in mine],
            "optimizer": optimizer,
            "mode": mode,
            "resume": resume,
        }
        client.send(n, header)
    keys = [(Op.WELCOME, n, None, -1) for n in range(layout.num_nodes)]
    timeout_s = client.cfg.connect_timeout_s
    got = client.wait(keys, timeout_s, what="WELCOME", errors_of=(Op.HELLO,))
    welcomes = [m.header for m in got]
    for n, w in enumerate(welcomes):
        if w["layout"] != layout.hash:
            raise LayoutMismatchError(
                f"node {client.nodes[n]} accepted layout {w['layout']}, "
                f"this worker has {layout.hash}"
            )
    return welcomes


def send_init(
    client: WorkerClient, b: Bucket, params: list[torch.Tensor], buf: torch.Tensor | None
) -> None:
    """INIT: bucket ``b``'s weights as they are in ``params``, fp32, to its node (rank 0),
    gathered into ``buf`` (its gradient buffer; a streamed bucket has none, nor has a bf16 one
    an fp32 one: a one-off copy then, kept alive by its frame)."""
    flat = buf if buf is not None and buf.dtype == torch.float32 else torch.empty(b.numel)
    gather(b, params, flat)
    enc = get_codec("none").encode(flat)
    header = {"op": Op.INIT, "bucket": b.id, "codec": "none", "cmeta": enc.meta}
    client.send(b.node, header, enc.frames)


def rollback(client: WorkerClient, num_nodes: int, step: int, boot: str) -> None:
    """Roll every node back to ``step`` (a node restarted from its checkpoint, ``boot`` its boot id)
    and wait for each acknowledgement."""
    for n in range(num_nodes):
        client.send(n, {"op": Op.ROLLBACK, "step": step, "detail": {"boot": boot}})
    client.wait(
        [(Op.ROLLBACK, n, None, -1) for n in range(num_nodes)], what="rollback acknowledgement"
    )

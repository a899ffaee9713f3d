"""Messages to a node's rooms, built as a worker's would arrive (encoded, then decoded), for tests that
walk the rooms without a server."""

from __future__ import annotations

import torch

from luwu.protocol import messages as wire
from luwu.protocol.messages import Op


def push_message(worker: int, grad: torch.Tensor, hyper: dict, **extra) -> wire.Message:
    """Worker ``worker``'s fp32 PUSH of bucket 0, step 0 (``extra``: header fields to add or change)."""
    header = {
        "op": Op.PUSH,
        "job": "j",
        "step": 0,
        "worker": worker,
        "bucket": 0,
        "codec": "none",
        "cmeta": {},
        "nbytes": [grad.numel() * 4],
        "hyper": hyper,
        "nograd": [],
        "two_phase": False,
        "pull": "bf16",
        **extra,
    }
    return wire.decode(wire.encode(header, [grad]), job="j", max_message_bytes=1 << 30)

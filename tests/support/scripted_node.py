"""Messages a scripted node (a ROUTER socket in a test) sends a real worker client."""

import torch

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

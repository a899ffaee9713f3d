"""A bucket's flat buffer and the parameters its segments cover: :func:`gather` copies the parameters'
slices into the buffer (INIT, a delta's base), :func:`scatter` writes the buffer back into them (a
multi-segment bucket's new weights, decoded into a staging buffer)."""

from __future__ import annotations

import torch

from luwu.protocol.layout import Bucket


def gather(bucket: Bucket, params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``flat[segment] = param[its elements]`` for every segment of ``bucket``."""
    for s in bucket.segments:
        flat.narrow(0, s.offset, s.numel).copy_(
            params[s.param].detach().reshape(-1).narrow(0, s.param_offset, s.numel)
        )


def scatter(bucket: Bucket, params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """The parameters' elements covered by ``bucket`` = their slices of ``flat`` (in place: a
    non-contiguous parameter is written through a contiguous copy)."""
    for s in bucket.segments:
        p = params[s.param].data
        src = flat.narrow(0, s.offset, s.numel)
        if p.is_contiguous():
            p.view(-1).narrow(0, s.param_offset, s.numel).copy_(src)
        else:
            tmp = p.reshape(-1).clone()
            tmp.narrow(0, s.param_offset, s.numel).copy_(src)
            p.copy_(tmp.view_as(p))

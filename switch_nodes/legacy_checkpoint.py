"""The node checkpoint file of earlier LuWu versions (``node<index>-step<step>.ckpt``), read to convert.

Layout::

    b"LUWUCKP1" | u64 header length | JSON header | raw fp32 tensors | sha256 of all before it

The header holds what a node checkpoint's manifest holds today (:mod:`.checkpoint`), with each
bucket's tensor sizes (``numels``: the weights, every state tensor of the kind, the step counters).
A node reads such a file once, when it is the newest checkpoint it can restore, and writes it again
as a DCP folder (:meth:`luwu.switch_nodes.durability.Durability.restore_latest`). :func:`write` is
the old writer, kept so tests can make such files.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from luwu.protocol.errors import CorruptCheckpointError

__all__ = ["MAGIC", "SUFFIX", "read", "write"]

MAGIC = b"LUWUCKP1"
SUFFIX = ".ckpt"


def write(path: Path, meta: dict, tensors: dict[int, list[torch.Tensor]]) -> None:
    """Write ``meta`` (with ``numels`` per bucket) and each bucket's tensors as an old-format file."""
    header = json.dumps(meta, separators=(",", ":")).encode()
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        for part in (MAGIC, struct.pack("<Q", len(header)), header):
            fh.write(part)
            h.update(part)
        for b in meta["buckets"]:
            for t in tensors[b["id"]]:
                mv = memoryview(t.contiguous().numpy()).cast("B")
                fh.write(mv)
                h.update(mv)
        fh.write(h.digest())
        fh.flush()
        os.fsync(fh.fileno())


def read(path: Path) -> tuple[dict, dict[int, list[torch.Tensor]]]:
    """The header and each bucket's tensors (``[params, *state, steps]``) of an old-format file; raises
    CorruptCheckpointError for a file that does not read whole (checksum, sizes, header), OSError
    when it cannot be read."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if fh.read(8) != MAGIC:
            raise CorruptCheckpointError(f"{path}: not a LuWu checkpoint (bad magic)")
        (hlen,) = struct.unpack("<Q", fh.read(8))
        if hlen > size:
            raise CorruptCheckpointError(f"{path}: header length {hlen} exceeds the file size")
        raw = fh.read(hlen)
        try:
            meta = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{path}: header is not JSON ({exc})") from None
        h = hashlib.sha256()
        for part in (MAGIC, struct.pack("<Q", hlen), raw):
            h.update(part)
        _check_sizes(path, meta, size - 16 - hlen - 32)  # before anything is allocated
        tensors: dict[int, list[torch.Tensor]] = {}
        for b in meta["buckets"]:
            ts = []
            for numel in b["numels"]:
                t = torch.empty(int(numel), dtype=torch.float32)
                mv = memoryview(t.numpy()).cast("B")
                if fh.readinto(mv) != mv.nbytes:
                    raise CorruptCheckpointError(f"{path}: truncated in bucket {b['id']}")
                h.update(mv)
                ts.append(t)
            tensors[b["id"]] = ts
        if fh.read(32) != h.digest() or fh.read(1):
            raise CorruptCheckpointError(f"{path}: checksum mismatch (corrupt or truncated file)")
    return meta, tensors


def _check_sizes(path: Path, meta, data_bytes: int) -> None:
    """The header's tensor sizes must be non-negative ints that add up to exactly the file's data."""
    try:
        numels = [n for b in meta["buckets"] for n in b["numels"]]
    except (KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path}: malformed header ({exc!r})") from None
    if any(type(n) is not int or n < 0 for n in numels):
        raise CorruptCheckpointError(
            f"{path}: header names tensor sizes that are not non-negative integers"
        )
    if 4 * sum(numels) != data_bytes:
        raise CorruptCheckpointError(
            f"{path}: header describes {4 * sum(numels)} bytes of tensors, the file holds {data_bytes}"
        )

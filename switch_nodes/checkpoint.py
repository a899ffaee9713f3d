"""Durable shard checkpoints: atomic, checksummed, the last few kept.

File layout (``node<index>-step<step>.ckpt``)::

    b"LUWUCKP1" | u64 header length | JSON header | raw fp32 tensors | sha256 of all before it

Written to a temporary file, fsynced, renamed over, and the directory fsynced,
so a crash leaves either the old or the new file. A file that cannot be read
whole (its checksum does not match, its header is not what a node writes, or
reading it raises anything at all, such as a header nested past the
interpreter's recursion limit) is corrupt: it is skipped (and reported), and
the previous checkpoint is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from luwu.protocol.errors import CorruptCheckpointError

__all__ = ["Checkpoint", "CheckpointStore", "CorruptCheckpointError"]

log = logging.getLogger(__name__)

MAGIC = b"LUWUCKP1"
CHUNK = 8 << 20


@dataclass
class Checkpoint:
    path: Path
    meta: dict  # job, node, layout, world_size, optimizer, step, buckets: [{id, spec, version, names}]
    tensors: dict[int, list[torch.Tensor]]  # bucket id -> [params, *state, steps]


class CheckpointStore:
    def __init__(self, directory: str, node_index: int, keep: int = 3):
        self.dir = Path(directory)
        self.node = node_index
        self.keep = max(2, keep)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.last_step: int | None = None
        self.last_time: float | None = None

    def _name(self, step: int) -> Path:
        return self.dir / f"node{self.node}-step{step:010d}.ckpt"

    def list(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.glob(f"node{self.node}-step*.ckpt"):
            try:
                out.append((int(p.stem.split("step")[1]), p))
            except ValueError:
                continue
        return sorted(out)

    def save(self, meta: dict, tensors: dict[int, list[torch.Tensor]]) -> Path:
        step = meta["step"]
        header = json.dumps(meta, separators=(",", ":")).encode()
        final = self._name(step)
        tmp = final.with_suffix(".ckpt.tmp")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as fh:
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
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
            raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.last_step, self.last_time = step, time.time()
        for _, old in self.list()[: -self.keep]:
            old.unlink(missing_ok=True)
        return final

    def load(self, path: Path) -> Checkpoint:
        """The checkpoint in ``path``; raises :class:`CorruptCheckpointError` for a file that cannot be read
        whole, whatever goes wrong while reading it (``OSError``: the file could not be opened or read)."""
        try:
            return self._load(path)
        except (CorruptCheckpointError, OSError):
            raise
        except Exception as exc:  # a crafted or damaged header: RecursionError, MemoryError, OverflowError...
            raise CorruptCheckpointError(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None

    def _load(self, path: Path) -> Checkpoint:
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
            h.update(MAGIC)
            h.update(struct.pack("<Q", hlen))
            h.update(raw)
            tensors: dict[int, list[torch.Tensor]] = {}
            self._check_sizes(path, meta, size - 16 - hlen - 32)  # before anything is allocated
            try:
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
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptCheckpointError(f"{path}: malformed header ({exc})") from None
            if fh.read(32) != h.digest() or fh.read(1):
                raise CorruptCheckpointError(f"{path}: checksum mismatch (corrupt or truncated file)")
        return Checkpoint(path, meta, tensors)

    @staticmethod
    def _check_sizes(path: Path, meta, data_bytes: int) -> None:
        """The header's tensor sizes must be non-negative ints that add up to exactly the file's data."""
        try:
            numels = [n for b in meta["buckets"] for n in b["numels"]]
        except (KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{path}: malformed header ({exc!r})") from None
        if any(type(n) is not int or n < 0 for n in numels):
            raise CorruptCheckpointError(f"{path}: header names tensor sizes that are not non-negative integers")
        if 4 * sum(numels) != data_bytes:
            raise CorruptCheckpointError(f"{path}: header describes {4 * sum(numels)} bytes of tensors, the file holds {data_bytes}")

    def candidates(self, at_step: int | None = None):
        """The checkpoints that read whole, newest first (at exactly ``at_step`` if given); corrupt ones are
        skipped and logged. A caller that cannot use one takes the next."""
        for step, path in reversed(self.list()):
            if at_step is not None and step != at_step:
                continue
            try:
                ckpt = self.load(path)
            except (CorruptCheckpointError, OSError) as exc:
                log.error("skipping checkpoint %s: %s", path, exc)
                continue
            yield ckpt

    def used(self, ckpt: Checkpoint) -> None:
        """``ckpt`` is the state the node holds now (the last checkpoint's step and time)."""
        self.last_step, self.last_time = int(ckpt.path.stem.split("step")[1]), ckpt.path.stat().st_mtime

    def latest(self, at_step: int | None = None) -> Checkpoint | None:
        """The newest valid checkpoint (at exactly ``at_step`` if given); corrupt ones are skipped."""
        for ckpt in self.candidates(at_step):
            self.used(ckpt)
            return ckpt
        return None

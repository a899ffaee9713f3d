"""The layout of one shard's state on disk: which tensors each bucket's slot holds, and where.

A :class:`StateLayout` is the shard's buckets (:class:`BucketSpec`: an id and its
tensors, :class:`TensorSpec`: name, element count, dtype) for one job. A slot is
the bucket's tensors one after another, each starting at a multiple of 4096 (the
``O_DIRECT`` alignment, so a tensor is a view of the slot's buffer), the slot
rounded up to 4096; ``slots.bin`` holds two slots per bucket, in layout order.
The layout hash (SHA-256 of the format and every bucket's tensors, in order)
names the layout in the state files' header and journal, so state of another
layout is refused rather than read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.ooc.io import ALIGN, CHECKSUM_BLOCK_BYTES, align_up

MAGIC = "luwu-ooc-state"
FORMAT_VERSION = 1
#: a journal version is the bucket's version (the steps applied to it) ``<< STEP_SHIFT`` plus the changes made
#: outside steps since (a seed, STATE set, IMPORT): ``version >> STEP_SHIFT`` is the step a slot holds
STEP_SHIFT = 20
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
#: bytes an element of each dtype takes (TensorSpec.nbytes is asked at every read, write, eviction)
ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a bucket's slot: its name, element count and dtype name (a key of :data:`DTYPES`)."""

    name: str
    numel: int
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket's tensors, in slot order."""

    id: int
    tensors: tuple[TensorSpec, ...]

    def offsets(self) -> list[int]:
        """Byte offset of each tensor in the slot (each aligned to 4096)."""
        out, pos = [], 0
        for t in self.tensors:
            out.append(pos)
            pos = align_up(pos + t.nbytes)
        return out

    @property
    def slot_bytes(self) -> int:
        return align_up(max(1, sum(align_up(t.nbytes) for t in self.tensors)))


class StateLayout:
    """The buckets of one job's shard and where their slots lie in ``slots.bin``."""

    def __init__(self, job: str, buckets: Sequence[BucketSpec]):
        self.job = job
        self.buckets = tuple(buckets)
        self._index: dict[int, int] = {}
        self._offsets: list[int] = []
        pos = 0
        for i, b in enumerate(self.buckets):
            if b.id in self._index:
                raise ConfigError(f"state layout of job {job!r}: bucket {b.id} is listed twice")
            names = [t.name for t in b.tensors]
            if (
                not names
                or len(set(names)) != len(names)
                or any(t.numel < 0 or t.dtype not in DTYPES for t in b.tensors)
            ):
                raise ConfigError(
                    f"state layout of job {job!r}: bucket {b.id} needs tensors of distinct names, numel >= 0, dtype in {sorted(DTYPES)}: got {b.tensors}"
                )
            self._index[b.id] = i
            self._offsets.append(pos)
            pos += 2 * b.slot_bytes
        self.data_bytes = max(pos, ALIGN)
        canon = json.dumps(
            {"format": FORMAT_VERSION, "buckets": self._buckets_json()}, separators=(",", ":")
        )
        self.hash = hashlib.sha256(canon.encode()).hexdigest()

    @classmethod
    def for_shard(
        cls,
        job: str,
        buckets: Iterable[tuple[int, int, int] | tuple[int, int, int, dict]],
        state_names: Sequence[str],
    ) -> StateLayout:
        """The layout of a node's shard from ``(bucket id, numel, number of segments)``: per bucket the
        fp32 master ``params``, each state tensor of ``state_names`` (the optimizer kind's, same numel)
        and ``steps`` (one counter per segment), the order of :meth:`BucketState.tensors`. A fourth
        item, name -> element count, sizes a state that is not elementwise (Adafactor's factored
        statistics, :meth:`~luwu.switch_nodes.store.SegmentState.sizes`)."""
        specs = []
        for bid, numel, nsegs, *sized in buckets:
            sizes = sized[0] if sized else {}
            ts = [
                TensorSpec("params", numel),
                *(TensorSpec(n, sizes.get(n, numel)) for n in state_names),
                TensorSpec("steps", nsegs),
            ]
            specs.append(BucketSpec(bid, tuple(ts)))
        return cls(job, specs)

    def _buckets_json(self) -> list:
        return [
            {"id": b.id, "tensors": [[t.name, t.numel, t.dtype] for t in b.tensors]}
            for b in self.buckets
        ]

    def bucket(self, bid: int) -> BucketSpec:
        return self.buckets[self.index(bid)]

    def index(self, bid: int) -> int:
        try:
            return self._index[bid]
        except KeyError:
            raise KeyError(f"bucket {bid} is not in the state layout of job {self.job!r}") from None

    def slot_offset(self, bid: int, slot: int) -> int:
        return self._offsets[self.index(bid)] + slot * self.bucket(bid).slot_bytes

    def to_json(self) -> dict:
        return {
            "magic": MAGIC,
            "format": FORMAT_VERSION,
            "job": self.job,
            "layout_hash": self.hash,
            "checksum_block_bytes": CHECKSUM_BLOCK_BYTES,
            "buckets": self._buckets_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> StateLayout:
        specs = [
            BucketSpec(
                int(b["id"]),
                tuple(TensorSpec(str(n), int(k), str(dt)) for n, k, dt in b["tensors"]),
            )
            for b in d["buckets"]
        ]
        return cls(str(d["job"]), specs)

"""The storage of streamed units' parameters, recycled from unit to unit within a byte cap.

A streaming worker gives a unit's parameters their storage just before the unit runs and takes it
back right after, twice a step per unit (forward, backward). Storage the system maps afresh costs a
page fault per 4 KiB page on first write (fresh memory fills at ~2.4 GB/s here, against tens of
GB/s for memory already touched), so released storage is kept here instead, per size, and given to
the next parameter of that size: repeated blocks have parameters of equal sizes, so one block's
storage serves the next, and in steady state no unit's weights are freshly allocated.

The parameter keeps its storage object (autograd's saved views reference it, as with FSDP2's
``resize_``): only the memory under it moves, by swapping data pointers with an empty storage that
holds it while it is free. The bound: the storage held for parameters plus the storage kept free
never passes ``cap_bytes`` (the units a step has resident at once), so keeping storage costs no
memory beyond the peak the units in flight need anyway; a release past that frees its storage.
Accelerator storage (its allocator caches already) and a torch without ``_swap_data_ptr_`` are
resized as before.

:func:`heap_free_bytes` tells the streamer how much freed memory the C heap holds, so it returns
that memory to the system only when it passes a bound rather than every step.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from luwu.gpu_workers.units import alloc_storage, free_storage

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class UnitMemory:
    """Storage lent to streamed parameters and kept for reuse (see the module docstring)."""

    def __init__(self, cap_bytes: int):
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # nbytes -> storages holding memory
        self.lent_bytes = 0  # storage given to parameters by alloc() and not yet released
        self.kept_bytes = 0  # storage free here for the next parameter of its size
        self.fresh = 0  # storages allocated anew (not reused)

    def alloc(self, p: torch.Tensor) -> None:
        """Give ``p`` back storage of its size (contents undefined): kept storage of that size if
        there is some, else fresh (as :func:`~luwu.gpu_workers.units.alloc_storage`)."""
        storage = p.untyped_storage()
        size = p.numel() * p.itemsize
        if storage.size() == size:
            return
        kept = self._free.get(size) if self._reusable(storage) and storage.size() == 0 else None
        if kept:
            storage._swap_data_ptr_(kept.pop())  # (the empty storage it swaps with is dropped)
            self.kept_bytes -= size
        else:
            self._evict(self.cap_bytes - self.lent_bytes - size)
            alloc_storage(p)
            self.fresh += 1
        self.lent_bytes += size

    def release(self, p: torch.Tensor) -> None:
        """Take ``p``'s storage (the tensor, its shape and its storage object stay, with no bytes):
        kept for reuse while lent and kept storage fit ``cap_bytes``, else freed."""
        storage = p.untyped_storage()
        size = storage.size()
        if size == 0:
            return
        # (storage given by someone else, e.g. the meta-device initializer, was never counted)
        self.lent_bytes = max(0, self.lent_bytes - size)
        if self._reusable(storage) and self.lent_bytes + self.kept_bytes + size <= self.cap_bytes:
            holder = torch.UntypedStorage(0)
            holder._swap_data_ptr_(storage)
            self._free.setdefault(size, []).append(holder)
            self.kept_bytes += size
        else:
            free_storage(p)

    def clear(self) -> None:
        """Free every kept storage."""
        self._free.clear()
        self.kept_bytes = 0

    def _evict(self, limit: int) -> None:
        """Free kept storage (largest sizes first) until at most ``limit`` bytes are kept."""
        for size in sorted(self._free, reverse=True):
            kept = self._free[size]
            while kept and self.kept_bytes > limit:
                kept.pop()
                self.kept_bytes -= size
            if not kept:
                del self._free[size]

    @staticmethod
    def _reusable(storage: torch.UntypedStorage) -> bool:
        return _CAN_SWAP and storage.device.type == "cpu"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_mallinfo2 = None


def heap_free_bytes() -> int | None:
    """Bytes of freed memory the C heap holds for reuse, all arenas (glibc 2.33's ``mallinfo2``);
    None where that cannot be asked."""
    global _mallinfo2
    if _mallinfo2 is None:
        try:
            _mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
            _mallinfo2.restype = _Mallinfo2
        except (OSError, AttributeError):
            _mallinfo2 = False
    if not _mallinfo2:
        return None
    return int(_mallinfo2().fordblks)

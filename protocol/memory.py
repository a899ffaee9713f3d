"""Keep freed memory in the process, so that message buffers are recycled instead of faulted in.

ZeroMQ allocates every received message anew, autograd every gradient, torch
every temporary; a block of 4 MiB or more is, by glibc's default, an mmap of
its own, and each 4 KiB page of it costs a page fault on first touch: fresh
memory fills an order of magnitude slower than memory already touched.
At 67 MB of gradients out and 67 MB of weights in per step, that is ~60 ms a
step on a worker. glibc adapts its mmap threshold to the process's history,
so a process may or may not land in the fast regime; this pins it: blocks up
to ``mmap_threshold`` come from the heap and freed memory stays there for the
next allocation of that size (``trim_threshold``).

The cost is resident memory: what a step freed stays mapped, bounded by the
peak of what the process ever held at once. Workers and nodes call
:func:`retain_freed_memory` at start-up unless their config turns it off.
On a libc other than glibc it does nothing and says so once in the log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MAX_MMAP_THRESHOLD = 32 << 20

_done: tuple[int, int] | None = None


def retain_freed_memory(
    mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = 1 << 30
) -> bool:
    """Serve blocks below ``mmap_threshold`` bytes from the heap and keep up to ``trim_threshold`` bytes
    of freed heap memory for reuse. Idempotent; returns whether glibc took the setting."""
    global _done
    if _done == (mmap_threshold, trim_threshold):
        return True
    if not 0 < mmap_threshold <= MAX_MMAP_THRESHOLD or trim_threshold <= 0:
        raise ValueError(
            f"mmap_threshold must be in (0, {MAX_MMAP_THRESHOLD}] and trim_threshold > 0, got {mmap_threshold}, {trim_threshold}"
        )
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: freed memory is left to the allocator's defaults")
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )
    if ok:
        _done = (mmap_threshold, trim_threshold)
    else:
        log.warning(
            "mallopt refused mmap_threshold=%d / trim_threshold=%d", mmap_threshold, trim_threshold
        )
    return ok


_malloc_trim = None


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc ``malloc_trim``; elsewhere nothing).

    Workers keep freed memory for reuse (:func:`retain_freed_memory`); a streaming
    worker frees a unit's weights and gradients many times a step, in sizes that fragment that kept
    memory until it is as large as the model. Trimming once a step keeps the worker at the units in
    flight, at the cost of faulting in the next step's fetch buffers."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


#: madvise(2)'s MADV_HUGEPAGE (Linux), and the smallest storage worth advising huge pages for (two
#: huge pages)
MADV_HUGEPAGE, HUGE_ADVICE_MIN_BYTES = 14, 4 << 20
_madvise = None


def _madvise_fn():
    """libc's ``madvise``, or False where there is none."""
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _madvise = libc.madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def advise_huge_pages(storage: torch.UntypedStorage) -> None:
    """Ask the kernel for transparent huge pages under a freshly allocated CPU ``storage`` of
    ``HUGE_ADVICE_MIN_BYTES`` or more, before anything writes it (Linux ``madvise(MADV_HUGEPAGE)``; elsewhere,
    or where the kernel refuses, nothing).

    A streaming worker gives each unit's weights their storage back just before the unit runs, in
    memory the system maps afresh: every 4 KiB page costs a fault on first write (~2.4-3.7 GB/s here), twice a
    step per unit. Under a 2 MiB page the same write runs ~2.5x faster (9 GB/s measured, THP in ``madvise``
    mode). torch's own advice (:data:`TORCH_HUGE_PAGES_ENV`, on by default) covers this storage too; this
    keeps the fetched weights in 2 MiB pages where it is off or came too late."""
    global _madvise
    if storage.device.type != "cpu" or storage.nbytes() < HUGE_ADVICE_MIN_BYTES:
        return
    madvise = _madvise_fn()
    if madvise:
        page = mmap.PAGESIZE
        lo = storage.data_ptr() // page * page
        hi = -(-(storage.data_ptr() + storage.nbytes()) // page) * page
        if (
            madvise(lo, hi - lo, MADV_HUGEPAGE) != 0
        ):  # (no THP in this kernel: said once, then not asked again)
            log.info(
                "madvise(MADV_HUGEPAGE) refused (errno %d): fetched weights are written into 4 KiB pages",
                ctypes.get_errno(),
            )
            _madvise = False


#: torch's CPU allocator advises transparent huge pages for each of its blocks of 2 MiB and up when
#: this environment variable is 1 at its first allocation, which reads it once. ``import luwu`` sets
#: it unless it is set (``THP_MEM_ALLOC_ENABLE=0`` keeps torch's default).
TORCH_HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
_huge_checked: bool | None = None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``); None where
    there is none to read."""
    try:
        with open(THP_MODE_PATH) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (Linux ``/proc/self/smaps``: ``hg``
    is huge pages advised); empty where there is no such mapping or file."""
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "VmFlags:":
                    return line.split()[1:]
    except OSError:
        pass
    return []


def check_torch_huge_pages() -> bool | None:
    """Whether torch's allocator advises huge pages for its large blocks
    (:data:`TORCH_HUGE_PAGES_ENV`), where the kernel gives them only to memory so advised
    (``madvise`` mode); None where that does not apply (another mode, no such kernel, or the
    variable set to 0 by the user). Where it could but does not (the variable came too late: a
    tensor was made before ``import luwu``), says so once in the log, with the fix.

    Why it matters: each fresh 4 KiB page costs a fault on first touch, and autograd's gradients,
    activations and received replies are fresh memory every step in a streaming worker (~23k faults
    a step on the cluster study's model, 20-30 ms of CPU); under 2 MiB pages the same memory fills
    with 512x fewer faults."""
    global _huge_checked
    if _huge_checked is not None:
        return _huge_checked
    if thp_mode() != "madvise" or os.environ.get(TORCH_HUGE_PAGES_ENV, "1") == "0":
        return None
    import torch

    probe = torch.empty(HUGE_ADVICE_MIN_BYTES, dtype=torch.uint8)
    _huge_checked = "hg" in vm_flags(probe.data_ptr() + HUGE_ADVICE_MIN_BYTES // 2)
    if not _huge_checked:
        log.warning(
            "torch's CPU allocator does not ask for transparent huge pages: it read %s before "
            "luwu could set it (a tensor was made before `import luwu`), so large gradients and "
            "activations fault in 4 KiB at a time (tens of ms a step). Import luwu before making "
            "tensors, or export %s=1 before starting Python (=0 to keep torch's default and "
            "silence this).",
            TORCH_HUGE_PAGES_ENV,
            TORCH_HUGE_PAGES_ENV,
        )
    return _huge_checked

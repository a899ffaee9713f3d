"""Aligned buffers and an I/O engine with several requests in flight, for the out-of-core state.

:class:`BufferPool` is one arena of page-aligned memory, mapped and faulted in once
(in transparent huge pages where the kernel gives them), handed out as 4096-aligned
:class:`Extent` s and reused: fresh pages cost a page fault each, and ``O_DIRECT``
needs aligned memory. Its capacity is
the node's memory budget for state, so nothing resident can exceed the budget.

:class:`IOEngine` reads and writes extents of files in requests of
``request_bytes`` (4 MiB by default), ``num_threads`` of them in flight: a small
thread pool calling ``os.preadv`` / ``os.pwritev`` on ``O_DIRECT`` descriptors
(the GIL is released during the syscalls; the checksums of the blocks are
computed by the I/O threads too).
Threads (plain ones on one queue: a request is a tuple, no
future) were chosen over io_uring / Linux AIO: of the Python packages that
reach those (``liburing``, ``caio``), one stops the interpreter with SIGILL on
these CPUs and the other reads into buffers it allocates per request, which are
neither aligned for ``O_DIRECT`` nor reused. At one request per 4 MiB a thread's
cost per request is small beside the disk's; ``benchmarks/bench_ooc.py`` runs
fio with ``io_uring`` at the same depth beside the threads, to tell when a ring
would pay. The page cache is bypassed on purpose: a shard larger than memory
read through it would evict everything else and then itself. Where ``O_DIRECT``
is refused (ramfs, tmpfs before Linux 6.6), the engine falls back to buffered
I/O and drops the pages it touched (``posix_fadvise(DONTNEED)``), with one
logged warning.

A checksum is computed per block of :data:`CHECKSUM_BLOCK_BYTES` (a unit of the
on-disk format): the checksum of a transfer is the CRC32 of its blocks' CRC32s
(:func:`combine_checksums`), so the blocks can be summed by different threads.
The blocks' CRC32 is ISA-L's (``isal``, the same values as ``zlib.crc32``): 22.6 GB/s
on one core here against zlib's 3.9. With zlib, writing 256 MiB cost 125 ms of CPU, of
which the checksums took 100. ISA-L holds the GIL while it sums (11 us a block); zlib,
the fallback where ``isal`` is not installed, releases it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from luwu.protocol.errors import ConfigError

try:
    from isal.isal_zlib import crc32 as block_crc32
except ImportError:  # pragma: no cover -- isal is a dependency; zlib gives the same values
    block_crc32 = zlib.crc32

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and memory (the page size; a multiple of any sector)
CHECKSUM_BLOCK_BYTES = (
    256 << 10
)  # a transfer's checksum is over the CRC32s of its blocks of this size
#: 4 MiB: measured here (virtio disk, O_DIRECT, 4 threads), the kernel's CPU per byte moved is a
#: third of 1 MiB requests' (0.03 against 0.08-0.12 s per GB) at the same bandwidth
DEFAULT_REQUEST_BYTES = 4 << 20
DEFAULT_NUM_THREADS = 4

_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
_MADV_POPULATE_WRITE = 23  # (Linux's value; Python's mmap names it from 3.12 on Linux 5.14+)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def combine_checksums(block_crcs: list[int]) -> int:
    """The checksum of a transfer from its blocks' CRC32s (in order)."""
    return zlib.crc32(struct.pack(f"<{len(block_crcs)}I", *block_crcs))


def checksum(view: memoryview) -> int:
    """The checksum :class:`IOEngine` computes for ``view`` (one thread)."""
    b = CHECKSUM_BLOCK_BYTES
    return combine_checksums([block_crc32(view[i : i + b]) for i in range(0, len(view), b)])


@dataclass(slots=True, eq=False)
class Extent:
    """A 4096-aligned piece of a :class:`BufferPool`'s arena."""

    offset: int
    nbytes: int
    view: memoryview  # writable, over exactly this extent
    data: torch.Tensor  # uint8 tensor over the same memory

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``numel`` elements of ``dtype`` at byte ``offset`` of the extent (no copy)."""
        size = numel * dtype.itemsize
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(
                f"tensor of {size} B at {offset} does not fit an extent of {self.nbytes} B"
            )
        return self.data.narrow(0, offset, size).view(dtype)


class BufferPool:
    """``capacity_bytes`` of page-aligned memory allocated once; first-fit allocation of aligned extents,
    freed extents coalesced. Not thread-safe: its owner (the window) calls it under its own lock."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < ALIGN:
            raise ConfigError(f"buffer pool of {capacity_bytes} B: needs at least {ALIGN} B")
        self.capacity = align_up(capacity_bytes)
        self._mm = _huge_populated(self.capacity)
        self._mv = memoryview(self._mm)
        self._arena = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self.used_bytes = 0
        self.peak_bytes = 0

    @property
    def storage_ptr(self) -> int:
        """The address of the arena's storage: a tensor whose storage starts there is a view of the pool."""
        return self._arena.untyped_storage().data_ptr()

    def alloc(self, nbytes: int) -> Extent | None:
        """An extent of ``nbytes`` rounded up to 4096, or None when no free run is that long."""
        size = align_up(max(nbytes, 1))
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self.used_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                return Extent(
                    off, size, self._mv[off : off + size], self._arena.narrow(0, off, size)
                )
        return None

    def free(self, ext: Extent) -> None:
        """Give ``ext`` back; adjacent free runs merge."""
        self.used_bytes -= ext.nbytes
        _insert_run(self._free, ext.offset, ext.nbytes)

    def fits_after_freeing(self, nbytes: int, extents: list[Extent]) -> bool:
        """Whether ``nbytes`` would find a free run once ``extents`` were freed (nothing is freed)."""
        runs = list(self._free)
        for e in extents:
            _insert_run(runs, e.offset, e.nbytes)
        return max((s for _, s in runs), default=0) >= align_up(max(nbytes, 1))

    def largest_free(self) -> int:
        return max((s for _, s in self._free), default=0)

    def close(self) -> None:
        """Unmap the arena once no tensor or view of it is alive (otherwise it goes with the last one)."""
        self._arena = None
        self._mv.release()
        try:
            self._mm.close()
        except BufferError:
            pass


def _huge_populated(nbytes: int) -> mmap.mmap:
    """``nbytes`` of anonymous memory, faulted in now, in transparent huge pages where the kernel
    gives them: ``O_DIRECT`` pins every page of a request it moves (``get_user_pages``), and 2 MiB
    pages cut that and the TLB misses of the steps over the window (measured here: 2 GiB moved in
    1 MiB requests cost 0.2 s of system CPU in 4 KiB pages, 0.1 s in huge ones). ``MAP_POPULATE``
    would fault it in 4 KiB pages, so the mapping asks for huge pages first, then is populated
    (``MADV_POPULATE_WRITE``, Linux 5.14; otherwise by writing it)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # (no THP in this kernel or build: 4 KiB pages)
        pass
    try:
        mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    except OSError:
        torch.frombuffer(mm, dtype=torch.uint8).zero_()
    return mm


def _insert_run(runs: list[tuple[int, int]], off: int, size: int) -> None:
    """Insert the free run (``off``, ``size``) into ``runs`` (sorted by offset), merging neighbours."""
    lo, hi = 0, len(runs)
    while lo < hi:
        mid = (lo + hi) // 2
        if runs[mid][0] < off:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(runs) and off + size == runs[lo][0]:
        size += runs.pop(lo)[1]
    if lo > 0 and runs[lo - 1][0] + runs[lo - 1][1] == off:
        off, size = runs[lo - 1][0], runs[lo - 1][1] + size
        lo -= 1
        runs.pop(lo)
    runs.insert(lo, (off, size))


@dataclass(slots=True)
class FileHandle:
    """An open state file: its descriptor and whether it bypasses the page cache."""

    path: str
    fd: int
    direct: bool
    size: int


class Transfer:
    """One read or write of an extent, cut into requests that run in parallel. ``wait`` raises the
    first request's error; ``checksum`` is set when the transfer was asked to compute it."""

    def __init__(
        self,
        kind: str,
        fh: FileHandle,
        offset: int,
        nbytes: int,
        num_requests: int,
        num_blocks: int,
    ):
        self.kind, self.fh, self.offset, self.nbytes = kind, fh, offset, nbytes
        self.block_crcs: list[int] = [0] * num_blocks
        self.error: BaseException | None = None
        self.checksum: int | None = None
        self._left = num_requests
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[Transfer], None]] = []

    def _request_done(self, error: BaseException | None, want_checksum: bool) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left:
                return
            if want_checksum and self.error is None:
                self.checksum = combine_checksums(self.block_crcs)
            callbacks, self._callbacks = self._callbacks, []
            self._done.set()
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Transfer], None]) -> None:
        """Call ``cb(self)`` when every request has finished (at once if it has), in an I/O thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Transfer:
        if not self._done.wait(timeout_s):
            raise TimeoutError(
                f"{self.kind} of {self.nbytes} B at {self.offset} of {self.fh.path} not done after {timeout_s} s"
            )
        if self.error is not None:
            raise self.error
        return self


class IOEngine:
    """Reads and writes extents of files with ``num_threads`` requests of ``request_bytes`` in flight."""

    def __init__(
        self, *, num_threads: int = DEFAULT_NUM_THREADS, request_bytes: int = DEFAULT_REQUEST_BYTES
    ):
        if num_threads < 1:
            raise ConfigError(f"I/O engine num_threads={num_threads}: needs at least 1")
        if request_bytes < CHECKSUM_BLOCK_BYTES or request_bytes % CHECKSUM_BLOCK_BYTES:
            raise ConfigError(
                f"I/O engine request_bytes={request_bytes}: must be a multiple of {CHECKSUM_BLOCK_BYTES} (the checksum block)"
            )
        self.num_threads, self.request_bytes = num_threads, request_bytes
        # the requests, served by threads of our own: a concurrent.futures pool's Future, its
        # condition and semaphore per request held the GIL about twice as long as the request's own
        # Python (profiled: 2 GB of state moved a step is ~2000 requests)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._serve, name=f"luwu-ooc-io_{i}", daemon=True)
            for i in range(num_threads)
        ]
        for th in self._threads:
            th.start()
        self._warned = False

    def open(self, path: str, size: int) -> FileHandle:
        """Open (creating) ``path`` for reading and writing, at least ``size`` bytes with the blocks
        allocated, ``O_DIRECT`` where the file system allows it."""
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        direct = hasattr(os, "O_DIRECT")
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct = False
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        try:
            _preallocate(fd, size)
            if direct and not _direct_works(fd):
                os.close(fd)
                fd, direct = os.open(path, flags, 0o600), False
        except BaseException:
            os.close(fd)
            raise
        if not direct and not self._warned:
            self._warned = True
            log.warning(
                "out-of-core state: %s refuses O_DIRECT (ramfs? tmpfs?); using buffered I/O and dropping the pages after use",
                path,
            )
        return FileHandle(path, fd, direct, max(size, os.fstat(fd).st_size))

    def read(
        self, fh: FileHandle, offset: int, view: memoryview, *, checksum: bool = False
    ) -> Transfer:
        """Start reading ``len(view)`` bytes at ``offset`` into ``view``."""
        return self._submit("read", fh, offset, view, checksum)

    def write(
        self, fh: FileHandle, offset: int, view: memoryview, *, checksum: bool = True
    ) -> Transfer:
        """Start writing ``view`` at ``offset`` (not yet durable: see :meth:`sync`)."""
        return self._submit("write", fh, offset, view, checksum)

    def sync(self, fh: FileHandle) -> None:
        """Make every completed write to ``fh`` durable (``fdatasync``)."""
        os.fdatasync(fh.fd)
        if not fh.direct and _FADV_DONTNEED is not None:
            os.posix_fadvise(fh.fd, 0, 0, _FADV_DONTNEED)

    def _submit(
        self, kind: str, fh: FileHandle, offset: int, view: memoryview, want_checksum: bool
    ) -> Transfer:
        n = len(view)
        if fh.direct and (offset % ALIGN or n % ALIGN):
            raise ValueError(
                f"{kind} of {n} B at {offset} of {fh.path}: O_DIRECT needs both aligned to {ALIGN}"
            )
        step = self.request_bytes
        starts = list(range(0, n, step)) or [0]
        t = Transfer(
            kind, fh, offset, n, len(starts), -(-n // CHECKSUM_BLOCK_BYTES) if want_checksum else 0
        )
        with self._close_lock:
            if self._closed:
                raise RuntimeError(f"{kind} of {fh.path}: the I/O engine is closed")
            for s in starts:
                self._requests.put((t, s, view[s : s + step], want_checksum))
        return t

    def _serve(self) -> None:
        """An I/O thread: serve requests until the stop sign (None)."""
        while (r := self._requests.get()) is not None:
            try:
                self._request(*r)
            except Exception:  # (a done-callback's error: the thread serves on)
                log.exception("out-of-core I/O: a request's callback failed")
            del r

    def _request(self, t: Transfer, start: int, view: memoryview, want_checksum: bool) -> None:
        error = None
        try:
            fh, pos = t.fh, t.offset + start
            op = os.preadv if t.kind == "read" else os.pwritev
            done = 0
            while done < len(view):
                got = op(fh.fd, [view[done:]], pos + done)
                if got <= 0:
                    raise OSError(
                        errno.EIO,
                        f"{t.kind} of {fh.path} at {pos + done}: got {got} B (file too short?)",
                    )
                done += got
            if want_checksum:
                b, first = CHECKSUM_BLOCK_BYTES, start // CHECKSUM_BLOCK_BYTES
                for i in range(0, len(view), b):
                    t.block_crcs[first + i // b] = block_crc32(view[i : i + b])
            if not fh.direct and t.kind == "read" and _FADV_DONTNEED is not None:
                os.posix_fadvise(fh.fd, pos, len(view), _FADV_DONTNEED)
        except Exception as exc:  # noqa: BLE001 -- handed to the waiter (Transfer.error)
            error = exc
        t._request_done(error, want_checksum)

    def close(self) -> None:
        """Finish the requests in flight and stop the threads."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._requests.put(None)
        for th in self._threads:
            if th is not threading.current_thread():
                th.join()


def _preallocate(fd: int, size: int) -> None:
    """Give the file its blocks now, so a write never extends it (no metadata to commit for it later)."""
    if size <= os.fstat(fd).st_size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _direct_works(fd: int) -> bool:
    """Whether an aligned O_DIRECT read on ``fd`` is accepted (some file systems open, then refuse)."""
    probe = mmap.mmap(-1, ALIGN)
    try:
        os.preadv(fd, [probe], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        probe.close()

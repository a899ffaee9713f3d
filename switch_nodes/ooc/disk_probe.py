"""The disk's bandwidth where a node keeps its state, measured when its state files open.

An out-of-core node's step is bound by its disk once the state is several times its memory, so
the node logs what that disk moves, beside the layout: :func:`measure` writes and reads back
:data:`PROBE_BYTES` of a scratch file in the state folder through the node's own
:class:`~.io.IOEngine` (``O_DIRECT``, its requests in flight), then removes it. The memory is one
page-aligned buffer of :data:`BUFFER_BYTES`, unmapped before the window's buffers are made, so the
probe adds nothing to the node's peak. Where the file system refuses ``O_DIRECT`` the numbers
would be the page cache's, so none are given.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from luwu.switch_nodes.ooc.io import DEFAULT_NUM_THREADS, DEFAULT_REQUEST_BYTES, IOEngine

__all__ = ["PROBE_BYTES", "BUFFER_BYTES", "measure"]

PROBE_BYTES = 64 << 20
BUFFER_BYTES = DEFAULT_NUM_THREADS * DEFAULT_REQUEST_BYTES  # the engine's default depth


def measure(
    engine: IOEngine, folder: Path, nbytes: int = PROBE_BYTES, buffer_bytes: int = BUFFER_BYTES
) -> tuple[float, float] | None:
    """(write, read) MB/s of ``nbytes`` through ``engine`` in ``folder``, or None without ``O_DIRECT``."""
    path = folder / ".disk-probe"
    mm = mmap.mmap(-1, buffer_bytes)  # page-aligned, as O_DIRECT needs
    view = memoryview(mm)
    try:
        view[:] = os.urandom(buffer_bytes)  # not zeros: a disk or hypervisor may elide those
        fh = engine.open(str(path), nbytes)
        try:
            if not fh.direct:
                return None
            offsets = range(0, nbytes, buffer_bytes)
            t0 = time.perf_counter()
            for off in offsets:
                engine.write(fh, off, view, checksum=False).wait(60.0)
            engine.sync(fh)
            t1 = time.perf_counter()
            for off in offsets:
                engine.read(fh, off, view).wait(60.0)
            t2 = time.perf_counter()
        finally:
            os.close(fh.fd)
            path.unlink(missing_ok=True)
    finally:
        view.release()
        mm.close()
    return nbytes / (t1 - t0) / 1e6, nbytes / (t2 - t1) / 1e6

"""The out-of-core I/O engine's checksums: the on-disk format's values, whichever CRC32 computes them.

A slot's checksum is the CRC32 of its 256 KiB blocks' CRC32s (``io.combine_checksums``). The blocks
are summed with ISA-L's CRC32 where ``isal`` is installed and zlib's otherwise: the two must give
the same values, or files written by one would be refused as corrupt by the other. Also: the
engine's own threads and the pool's memory, and where a reply's copy of the window lands."""

from __future__ import annotations

import logging
import os
import random
import re
import struct
import zlib

import pytest

from luwu.switch_nodes.ooc.io import (
    CHECKSUM_BLOCK_BYTES,
    BufferPool,
    IOEngine,
    block_crc32,
    checksum,
)

pytestmark = pytest.mark.timeout(60)


def zlib_checksum(data: bytes) -> int:
    """The format's checksum written with zlib alone."""
    b = CHECKSUM_BLOCK_BYTES
    crcs = [zlib.crc32(data[i : i + b]) for i in range(0, len(data), b)]
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs))


@pytest.mark.parametrize("nbytes", [1, 4095, CHECKSUM_BLOCK_BYTES, 3 * CHECKSUM_BLOCK_BYTES + 777])
def test_checksum_is_zlibs_block_checksum(nbytes):
    data = random.Random(nbytes).randbytes(nbytes)
    assert block_crc32(data) == zlib.crc32(data)
    assert block_crc32(data[1:], 0x1234) == zlib.crc32(data[1:], 0x1234)
    assert checksum(memoryview(data)) == zlib_checksum(data)


def test_a_written_transfers_checksum_is_its_datas(tmp_path):
    """Split over requests of 1 MiB on 4 threads, the blocks' sums land in order."""
    nbytes = 5 << 20
    pool = BufferPool(nbytes)
    ext = pool.alloc(nbytes)
    data = random.Random(7).randbytes(nbytes)
    ext.view[:] = data
    engine = IOEngine(num_threads=4, request_bytes=1 << 20)
    try:
        fh = engine.open(str(tmp_path / "slots.bin"), nbytes)
        t = engine.write(fh, 0, ext.view).wait(30)
        assert t.error is None and t.checksum == zlib_checksum(data)
        ext.view[:] = bytes(nbytes)
        t = engine.read(fh, 0, ext.view, checksum=True).wait(30)
        assert bytes(ext.view) == data and t.checksum == zlib_checksum(data)
    finally:
        engine.close()


def test_the_disk_probe_measures_both_ways_and_leaves_nothing(tmp_path, caplog):
    """What a node logs of its state disk as the files open (``OocShard._log_disk``)."""
    from types import SimpleNamespace

    from luwu.switch_nodes.ooc import disk_probe
    from luwu.switch_nodes.ooc.shard import OocShard

    engine = IOEngine()
    try:
        fh = engine.open(str(tmp_path / "direct"), 4096)
        os.close(fh.fd)
        os.unlink(fh.path)
        got = disk_probe.measure(engine, tmp_path, nbytes=8 << 20)
        if not fh.direct:
            assert got is None
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        assert got is not None and min(got) > 0, got
        assert list(tmp_path.iterdir()) == []
        with caplog.at_level(logging.INFO, logger="luwu.switch_nodes.ooc.shard"):
            OocShard._log_disk(
                SimpleNamespace(_engine=engine, ctx=SimpleNamespace(index=3)), tmp_path
            )
        assert re.search(
            r"node 3: state disk at .*: O_DIRECT writes \d+ MB/s, reads \d+ MB/s", caplog.text
        )
    finally:
        engine.close()


def test_the_pools_memory_is_zeroed_and_the_engines_threads_stop(tmp_path):
    """The arena (huge pages asked for, then populated) reads as zeros; the engine's own threads
    finish what is queued at close, then refuse new transfers, and a done-callback's error is
    logged, not the end of the thread that ran it."""
    pool = BufferPool(3 << 20)
    ext = pool.alloc(3 << 20)
    assert not any(bytes(ext.view))
    ext.view[:] = random.Random(3).randbytes(3 << 20)
    engine = IOEngine(num_threads=2, request_bytes=1 << 20)
    fh = engine.open(str(tmp_path / "slots.bin"), 3 << 20)
    try:
        t = engine.write(fh, 0, ext.view)
        t.add_done_callback(lambda t: 1 / 0)  # (logged by the I/O thread, which serves on)
        t.wait(30)
        writes = [engine.write(fh, 0, ext.view) for _ in range(4)]
        threads = [th for th in engine._threads if th.is_alive()]
        assert len(threads) == 2
    finally:
        engine.close()
    assert all(w.done and w.error is None for w in writes)
    assert not any(th.is_alive() for th in engine._threads)
    with pytest.raises(RuntimeError, match="closed"):
        engine.read(fh, 0, ext.view)
    engine.close()  # (twice: nothing more)
    os.close(fh.fd)


def test_a_replys_copy_of_the_window_lands_in_a_kept_buffer():
    """Out of core, a step's fp32 reply is a copy of the window's weights: on a budgeted node it is
    made into the buffers the node keeps for reuse (the pushes'), taken again once the reply let go
    of it; a node that keeps none clones."""
    from types import SimpleNamespace

    import torch

    from luwu.switch_nodes.kept_frames import KeptFrames
    from luwu.switch_nodes.ooc.shard import OocShard

    def shard(frames):
        s = SimpleNamespace(ctx=SimpleNamespace(listener=SimpleNamespace(frames=frames)))
        s._take = lambda nbytes: OocShard._take(s, nbytes)
        return s

    src = torch.randn(3, 1024)
    kept = shard(KeptFrames())
    a = OocShard._copy(kept, src)
    assert torch.equal(a, src) and a.shape == src.shape and a.data_ptr() != src.data_ptr()
    first = a.data_ptr()
    b = OocShard._copy(kept, src)  # (the first is still held: another buffer)
    assert b.data_ptr() != first
    del a
    c = OocShard._copy(kept, src * 2)
    assert c.data_ptr() == first and torch.equal(c, src * 2)
    plain = OocShard._copy(shard(None), src)
    assert torch.equal(plain, src) and plain.data_ptr() != src.data_ptr()

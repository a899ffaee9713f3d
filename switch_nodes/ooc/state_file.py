"""The on-disk form of one shard's state: two slots per bucket and a journal of commits.

A folder (``node.state_dir``) holds three files:

``header.json``
    Written last at creation (temporary file, fsync, rename, fsync of the folder), so
    a folder with a header is complete. ``{"magic": "luwu-ooc-state", "format": 1,
    "job": ..., "layout_hash": ..., "checksum_block_bytes": 262144, "buckets":
    [{"id": 7, "tensors": [["params", 1048576, "float32"], ...]}, ...]}``. The layout
    hash is the SHA-256 of the format and the buckets' tensors (ids, names, sizes,
    dtypes, in order); opening a folder of another job or layout is refused
    (:class:`LayoutMismatchError`) rather than read as this one.

``slots.bin``
    Per bucket, in layout order, two slots of ``slot_bytes`` each; a slot is the
    bucket's tensors one after another (for AdamW ``params | exp_avg | exp_avg_sq |
    steps``), each starting at a multiple of 4096, the slot rounded up to 4096. The
    blocks are allocated at creation, so no write changes the file's size.

``journal.bin``
    A 4096-byte header block (magic ``LWJH``, format, the layout hash and the bucket
    count, CRC32), then two regions, one per slot number, each holding one record
    per bucket (layout order) every :data:`RECORD_PITCH` bytes, so that a record
    never shares a sector with another. A record (:data:`RECORD`) is: magic ``LWJR``,
    format, slot, bucket id, bucket index, version, slot bytes, the checksum of the
    slot's data (``io.combine_checksums`` of its 256 KiB blocks' CRC32s), the first 8
    bytes of the layout hash, and a CRC32 of all that. All zero: never written.

A step of bucket b commits as: its data written into the slot that does NOT hold
b's newest committed version, ``fdatasync`` of ``slots.bin``, then the record of
that slot written and ``fdatasync`` of ``journal.bin`` (several buckets' commits
share the two syncs). Opening picks, per bucket, the valid record with the highest
version. A process killed before the record lands leaves the old record and the
old slot untouched: the bucket is at its previous version. A torn record (bad CRC)
is skipped with a warning, and the other slot's record, which no write of this
step touched, is used. A bucket with no valid record has never been committed.

A restart puts every bucket at one step (:meth:`StateFile.bring_to`): the lowest
step a bucket is committed at (:meth:`StateFile.floor`), which the buckets ahead
hold in their other slot as long as writes asked :meth:`StateFile.may_overwrite`.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from luwu.protocol.errors import (
    ConfigError,
    CorruptCheckpointError,
    LayoutMismatchError,
)
from luwu.switch_nodes.ooc.io import (
    ALIGN,
    BufferPool,
    FileHandle,
    IOEngine,
    Transfer,
    align_up,
)
from luwu.switch_nodes.ooc.layout import (
    FORMAT_VERSION,
    MAGIC,
    STEP_SHIFT,
    BucketSpec,
    StateLayout,
)

log = logging.getLogger(__name__)

HEADER_FILE, DATA_FILE, JOURNAL_FILE = "header.json", "slots.bin", "journal.bin"
JOURNAL_MAGIC, RECORD_MAGIC = b"LWJH", b"LWJR"
#: magic, format, slot, pad, bucket id, bucket index, version, slot bytes, data checksum, layout hash[:8]
RECORD = struct.Struct("<4sHBxIIQQI8s")
RECORD_PITCH = 512  # one record per sector: a torn sector write damages one record at most
_JOURNAL_HEAD = struct.Struct("<4sHI32s")  # magic, format, number of buckets, layout hash (raw)


class Commit(NamedTuple):
    """A bucket's step made durable: its data in ``slot`` is ``version``, with ``checksum``."""

    bucket: int
    slot: int
    version: int
    checksum: int


class StateFile:
    """One shard's state files, opened (created when the folder has none) for a layout. Reads and writes
    of slots go through the shared :class:`IOEngine`; :meth:`commit` makes steps durable."""

    def __init__(
        self, folder: Path, layout: StateLayout, engine: IOEngine, data: FileHandle, journal_fd: int
    ):
        self.folder, self.layout, self.engine, self.data = folder, layout, engine, data
        self._journal_fd = journal_fd
        self._region = align_up(len(layout.buckets) * RECORD_PITCH)
        self._hash8 = bytes.fromhex(layout.hash)[:8]
        self.committed: dict[int, Commit | None] = {}
        self.records: dict[int, dict[int, Commit]] = {}  # bucket -> slot -> its valid record
        self.torn: list[tuple[int, int]] = []  # (bucket, slot) whose record was unreadable at open

    @classmethod
    def open(cls, folder: str | os.PathLike, layout: StateLayout, engine: IOEngine) -> StateFile:
        """Open the state in ``folder`` for ``layout``, creating it when the folder holds none; refuse
        one of another job or layout."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        header = folder / HEADER_FILE
        exists = header.exists()
        if exists:
            _check_header(header, layout)
        data = engine.open(str(folder / DATA_FILE), layout.data_bytes)
        try:
            jfd = os.open(
                folder / JOURNAL_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600
            )
        except BaseException:
            os.close(data.fd)
            raise
        sf = cls(folder, layout, engine, data, jfd)
        try:
            if exists:
                sf._load_journal()
            else:
                sf._create()
        except BaseException:
            sf.close()
            raise
        return sf

    # --------------------------------------------------------------- creation and loading
    def _create(self) -> None:
        lay = self.layout
        os.ftruncate(self._journal_fd, 0)
        head = _JOURNAL_HEAD.pack(
            JOURNAL_MAGIC, FORMAT_VERSION, len(lay.buckets), bytes.fromhex(lay.hash)
        )
        head += struct.pack("<I", zlib.crc32(head))
        os.pwrite(self._journal_fd, head.ljust(ALIGN, b"\0"), 0)
        os.ftruncate(self._journal_fd, ALIGN + 2 * self._region)
        os.fsync(self._journal_fd)
        self.engine.sync(self.data)
        tmp = self.folder / (HEADER_FILE + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(lay.to_json(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.folder / HEADER_FILE)
        dfd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.committed = {b.id: None for b in lay.buckets}
        self.records = {b.id: {} for b in lay.buckets}

    def _load_journal(self) -> None:
        lay, path = self.layout, self.folder / JOURNAL_FILE
        raw = os.pread(self._journal_fd, ALIGN + 2 * self._region, 0)
        n = _JOURNAL_HEAD.size
        if len(raw) < ALIGN + 2 * self._region or struct.unpack_from("<I", raw, n)[0] != zlib.crc32(
            raw[:n]
        ):
            raise CorruptCheckpointError(
                f"out-of-core state {path}: journal header unreadable or file truncated ({len(raw)} B)"
            )
        magic, fmt, nbuckets, lhash = _JOURNAL_HEAD.unpack_from(raw)
        if (
            magic != JOURNAL_MAGIC
            or fmt != FORMAT_VERSION
            or nbuckets != len(lay.buckets)
            or lhash.hex() != lay.hash
        ):
            raise LayoutMismatchError(
                f"out-of-core state {path}: journal is of another layout or format (format {fmt}, {nbuckets} buckets) than header.json"
            )
        for i, b in enumerate(lay.buckets):
            found = []
            for slot in (0, 1):
                at = ALIGN + slot * self._region + i * RECORD_PITCH
                rec = self._decode(raw[at : at + RECORD.size + 4], b, i, slot)
                if rec is not None:
                    found.append(rec)
            self.committed[b.id] = max(found, key=lambda c: c.version, default=None)
            self.records[b.id] = {c.slot: c for c in found}
        for bid, slot in self.torn:
            c = self.committed[bid]
            log.warning(
                "out-of-core state %s: bucket %d: the journal record of slot %d is torn; %s",
                path,
                bid,
                slot,
                f"using slot {c.slot} at version {c.version}"
                if c
                else "the bucket has no committed version",
            )

    def _decode(self, raw: bytes, b: BucketSpec, index: int, slot: int) -> Commit | None:
        """The commit a record holds, None when never written or torn (recorded in ``torn``)."""
        if not any(raw):
            return None
        body, (crc,) = raw[: RECORD.size], struct.unpack_from("<I", raw, RECORD.size)
        magic, fmt, rslot, bid, idx, version, nbytes, data_crc, h8 = RECORD.unpack(body)
        if crc != zlib.crc32(body) or (magic, fmt, rslot, bid, idx, nbytes, h8) != (
            RECORD_MAGIC,
            FORMAT_VERSION,
            slot,
            b.id,
            index,
            b.slot_bytes,
            self._hash8,
        ):
            self.torn.append((b.id, slot))
            return None
        return Commit(b.id, slot, version, data_crc)

    # --------------------------------------------------------------- data and commits
    def read_slot(
        self, bid: int, slot: int, view: memoryview, *, checksum: bool = False
    ) -> Transfer:
        """Start reading bucket ``bid``'s ``slot`` into ``view`` (``slot_bytes`` long)."""
        return self.engine.read(
            self.data, self.layout.slot_offset(bid, slot), view, checksum=checksum
        )

    def write_slot(self, bid: int, slot: int, view: memoryview) -> Transfer:
        """Start writing ``view`` into bucket ``bid``'s ``slot``; its checksum is computed on the way.
        Nothing is committed: see :meth:`commit`."""
        if self.committed.get(bid) is not None and self.committed[bid].slot == slot:
            raise AssertionError(
                f"bucket {bid}: a write into slot {slot}, which holds the committed version"
            )
        return self.engine.write(self.data, self.layout.slot_offset(bid, slot), view)

    def commit(self, commits: Sequence[Commit]) -> None:
        """Make ``commits`` durable: the data they name (written and complete) first, then their records."""
        if not commits:
            return
        self.engine.sync(self.data)
        for c in commits:
            i = self.layout.index(c.bucket)
            body = RECORD.pack(
                RECORD_MAGIC,
                FORMAT_VERSION,
                c.slot,
                c.bucket,
                i,
                c.version,
                self.layout.bucket(c.bucket).slot_bytes,
                c.checksum,
                self._hash8,
            )
            rec = body + struct.pack("<I", zlib.crc32(body))
            os.pwrite(self._journal_fd, rec, ALIGN + c.slot * self._region + i * RECORD_PITCH)
        os.fdatasync(self._journal_fd)
        for c in commits:
            self.committed[c.bucket] = c
            self.records[c.bucket][c.slot] = c

    def versions(self, bid: int) -> list[int]:
        """The versions bucket ``bid``'s journal records name, newest first (the committed one first)."""
        return sorted((c.version for c in self.records[bid].values()), reverse=True)

    def rewind(self, bid: int, version: int, pool: BufferPool | None = None) -> None:
        """Make ``version``, held by the slot beside the committed one, bucket ``bid``'s committed version
        again, durably (the newer record is erased): how a restarting node brings every bucket to one
        step when a crash left some of them a step ahead. Call it before a window opens over the state.
        Refused (ValueError) when no slot holds ``version`` intact any more."""
        cur = self.committed[bid]
        if cur is not None and cur.version == version:
            return
        c = next((r for r in self.records[bid].values() if r.version == version), None)
        if c is None or not self.intact(c, pool):
            raise ValueError(
                f"out-of-core state {self.folder}: bucket {bid} cannot go back to version {version}: "
                f"its slots hold {self.versions(bid)}"
                + ("" if c is None else f" and slot {c.slot}'s data was overwritten since")
            )
        other = 1 - c.slot
        at = ALIGN + other * self._region + self.layout.index(bid) * RECORD_PITCH
        os.pwrite(self._journal_fd, bytes(RECORD.size + 4), at)
        os.fdatasync(self._journal_fd)
        self.records[bid].pop(other, None)
        self.committed[bid] = c

    def floor(self) -> int | None:
        """The lowest step a committed bucket is at (None: none committed): every bucket holds it in one of
        its slots while writes go through :meth:`may_overwrite`, so a restart can put every bucket there."""
        return min((c.version >> STEP_SHIFT for c in self.committed.values() if c), default=None)

    def may_overwrite(self, bid: int) -> bool:
        """Whether bucket ``bid``'s older slot may be written now without losing the step every bucket can
        be put at (:meth:`floor`): it holds another step, or the committed slot holds that one too. A bucket
        a step ahead of the others waits for them to commit before it steps again."""
        c = self.committed[bid]
        old = self.records[bid].get(1 - c.slot) if c else None
        if old is None:
            return True
        floor = self.floor()
        return c.version >> STEP_SHIFT == floor or old.version >> STEP_SHIFT != floor

    def bring_to(self, step: int | None = None, pool: BufferPool | None = None) -> int | None:
        """Put every committed bucket at ``step`` (default: :meth:`floor`, the newest step all of them
        hold), rewinding the buckets ahead to their other slot (:meth:`rewind`), durably; returns the step
        (None: nothing committed). Refused (:class:`CorruptCheckpointError`) naming the bucket and what its
        slots hold when one cannot be put there; nothing changes then. Before a window opens."""
        step = self.floor() if step is None else step
        if step is None:
            return None
        picks = {}
        for bid, c in self.committed.items():
            if c is None or c.version >> STEP_SHIFT == step:
                continue
            r = self.records[bid].get(1 - c.slot)
            there = r is not None and r.version >> STEP_SHIFT == step
            if not there or not self.intact(r, pool):
                held = [v >> STEP_SHIFT for v in self.versions(bid)]
                raise CorruptCheckpointError(
                    f"out-of-core state {self.folder}: bucket {bid} cannot be put at step {step}: its "
                    f"slots hold steps {held}"
                    + (" (that slot was overwritten since)" if there else ""),
                    bucket=bid,
                    step=step,
                )
            picks[bid] = r.version
        for bid, version in picks.items():
            self.rewind(bid, version, pool)
        return step

    def verify(self, bid: int, pool: BufferPool | None = None) -> bool:
        """Whether bucket ``bid``'s committed slot holds the data its record's checksum names (True for a
        bucket never committed)."""
        c = self.committed[bid]
        return c is None or self.intact(c, pool)

    def intact(self, c: Commit, pool: BufferPool | None = None) -> bool:
        """Whether the slot of ``c`` holds the data of ``c``'s checksum. Reads the slot whole (into
        ``pool``, or a pool of its own)."""
        nbytes = self.layout.bucket(c.bucket).slot_bytes
        own = pool is None
        pool = pool or BufferPool(nbytes)
        ext = pool.alloc(nbytes)
        try:
            t = self.read_slot(c.bucket, c.slot, ext.view, checksum=True).wait(60.0)
            return t.checksum == c.checksum
        finally:
            pool.free(ext)
            if own:
                del ext
                pool.close()

    def close(self) -> None:
        for fd in (self.data.fd, self._journal_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def _check_header(path: Path, layout: StateLayout) -> None:
    """Refuse a state folder that is not this job's and this layout's, naming what differs."""
    try:
        d = json.loads(path.read_text())
        magic, fmt, job, lhash = d["magic"], d["format"], d["job"], d["layout_hash"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"out-of-core state {path}: header unreadable ({exc}); point node.state_dir at an empty folder, or restore this one"
        ) from exc
    if magic != MAGIC:
        raise CorruptCheckpointError(
            f"out-of-core state {path}: not a LuWu state folder (magic {magic!r})"
        )
    if fmt != FORMAT_VERSION:
        raise ConfigError(
            f"out-of-core state {path}: format {fmt}, this node reads format {FORMAT_VERSION}"
        )
    if job != layout.job:
        raise LayoutMismatchError(
            f"out-of-core state {path} belongs to job {job!r}, not {layout.job!r}: point node.state_dir at this job's folder or an empty one"
        )
    if lhash != layout.hash:
        theirs = StateLayout.from_json(d)
        raise LayoutMismatchError(
            f"out-of-core state {path}: layout {lhash[:12]} ({len(theirs.buckets)} buckets) differs from this shard's {layout.hash[:12]} "
            f"({len(layout.buckets)} buckets): a different model, bucket_bytes, node list or optimizer; point node.state_dir at an empty folder"
        )

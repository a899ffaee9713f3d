"""Re-laying a shard's state files to hold more optimizer state (a switch such as ``amsgrad`` on).

The files are laid out at the first seed, before any push said the job's hyperparameters, so they
leave out the state of a boolean switch that is off by default (:func:`~.recovery.file_state`). When
the first step names such a switch, every bucket is still at step 0 (its seed, or a STATE set): the
files are laid out again with the new names (zeros, as torch starts them) beside the old tensors,
copied slot by slot into a new folder ``<folder>.relay``; once that one is committed whole (its
``job.json`` naming the state it holds), the folders are swapped (``<folder>`` to ``<folder>.old``,
``<folder>.relay`` to ``<folder>``) and the old one removed. A restart finishes a swap a kill cut
short (:func:`finish_swap`): a complete ``.relay`` folder beside no state is the new state; otherwise
the one in place is, and what is left beside it is removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from luwu.switch_nodes.ooc.io import BufferPool, IOEngine
from luwu.switch_nodes.ooc.layout import DTYPES, StateLayout
from luwu.switch_nodes.ooc.state_file import HEADER_FILE, Commit, StateFile

RELAY, OLD = ".relay", ".old"


def _beside(folder: Path, suffix: str) -> Path:
    return folder.with_name(folder.name + suffix)


def copy_state(old: StateFile, new: StateFile, timeout_s: float = 60.0) -> None:
    """Every committed bucket of ``old`` into slot 0 of ``new`` at the same version: the tensors both
    layouts name copied, the others zeros; committed in one batch."""
    commits = []
    for spec in new.layout.buckets:
        c = old.committed.get(spec.id)
        if c is None:
            continue
        was = old.layout.bucket(spec.id)
        pool = BufferPool(was.slot_bytes + spec.slot_bytes)
        try:
            src, dst = pool.alloc(was.slot_bytes), pool.alloc(spec.slot_bytes)
            old.read_slot(spec.id, c.slot, src.view, checksum=False).wait(timeout_s)
            dst.data.zero_()
            have = dict(zip((t.name for t in was.tensors), zip(was.tensors, was.offsets())))
            for t, off in zip(spec.tensors, spec.offsets()):
                if t.name in have:
                    ts, soff = have[t.name]
                    dtype = DTYPES[t.dtype]
                    dst.tensor(off, t.numel, dtype).copy_(src.tensor(soff, ts.numel, dtype))
            t = new.write_slot(spec.id, 0, dst.view).wait(timeout_s)
            commits.append(Commit(spec.id, 0, c.version, t.checksum))
        finally:
            pool.close()
    new.commit(commits)


def relay(
    folder: Path, old: StateFile, layout: StateLayout, engine: IOEngine, write_meta
) -> StateFile:
    """``old`` (open on ``folder``, its writes committed) laid out again as ``layout``; returns the new
    state open on ``folder`` (``old`` closed). ``write_meta(path)`` writes the new ``job.json``."""
    tmp = _beside(folder, RELAY)
    shutil.rmtree(tmp, ignore_errors=True)
    write_meta(tmp)  # (before the header, as at creation)
    new = StateFile.open(tmp, layout, engine)
    try:
        copy_state(old, new)
    finally:
        new.close()
    old.close()
    gone = _beside(folder, OLD)
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(folder, gone)
    os.replace(tmp, folder)
    _sync_dir(folder.parent)
    shutil.rmtree(gone, ignore_errors=True)
    return StateFile.open(folder, layout, engine)


def finish_swap(folder: Path) -> None:
    """At start: complete a re-lay that a kill cut short (see the module's doc)."""
    tmp, gone = _beside(folder, RELAY), _beside(folder, OLD)
    if not (folder / HEADER_FILE).exists() and (tmp / HEADER_FILE).exists():
        os.replace(tmp, folder)  # (the old state was moved aside: the new one is complete)
        _sync_dir(folder.parent)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(gone, ignore_errors=True)


def _sync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)

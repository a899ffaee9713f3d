"""A bucket's fp32 weights alone, for a reply (a PULL, a streaming worker's fetch of a unit's weights).

A reply needs the weights only (4 B a parameter), not the whole slot (weights, moments, step
counters): :class:`WeightsReader` gives the bucket's newest version of them without taking a window
entry. Where the window holds the bucket (read, or being written back) it copies them from there;
otherwise it reads the ``params`` extent alone (offset 0 of the slot, 4096-aligned, so ``O_DIRECT``
holds) of the newest written slot, through the window's :class:`~.io.IOEngine`. Either way into
page-aligned memory that the returned tensor keeps: the shard's ``take`` (a budgeted node's buffers
kept for reuse, whose pages are touched already), or memory of its own. A bucket being read ahead
is waited for. It answers None where only a full acquire is right: the bucket is held (or its read
failed), or its slot was never verified since the files were opened (a full read checks the slot's
checksum first, as the window's ``verify="first"`` asks). It works under the window's lock, with
the window's bookkeeping: part of :class:`~.window.StateWindow`, kept apart for the module's size.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable

import torch

from luwu.protocol.errors import LuwuError
from luwu.switch_nodes.ooc.io import align_up
from luwu.switch_nodes.ooc.state_file import StateFile
from luwu.switch_nodes.ooc.window import READING, READY, WRITING, StateWindow

__all__ = ["WeightsReader", "take_kept"]


def take_kept(listener, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of page-aligned memory (uint8) for what leaves in a reply: on a budgeted node one of
    the buffers ``listener`` keeps for reuse (:mod:`...kept_frames`: the pushes' too, free again once
    nothing refers to it, trimmed to the budget's room), so that a copy lands in pages already touched
    instead of fresh ones (~10x slower to fill: 0.1 s of the optimizer thread's CPU a step on 89M
    parameters); None where the node keeps no buffers (its freed memory is kept anyway)."""
    frames = getattr(listener, "frames", None)
    if frames is None or nbytes <= 0:
        return None
    return torch.from_numpy(frames.take(nbytes))


class WeightsReader:
    """Weights-only reads of ``window``'s buckets (see the module's doc)."""

    def __init__(
        self,
        window: StateWindow,
        files: StateFile,
        take: Callable[[int], torch.Tensor | None] = lambda nbytes: None,
    ):
        # take(nbytes): page-aligned uint8 memory of that size for a read (None: map some)
        self._window, self._files, self._take = window, files, take

    def read(self, bucket: int) -> torch.Tensor | None:
        """A copy of ``bucket``'s newest weights (fp32, its numel), or None: acquire it whole instead."""
        w = self._window
        spec = w.state.layout.bucket(bucket)
        names = [t.name for t in spec.tensors]
        where = spec.offsets()[names.index("params")]
        numel = spec.tensors[names.index("params")].numel
        deadline = time.monotonic() + w.timeout_s
        with w._cond:
            w._check_failure()
            e = w._entries.get(bucket)
            while e is not None and e.state == READING:  # read ahead: it lands soon, whole
                w._wait(deadline, bucket, "its slot (reading)")
                w._check_failure()
                e = w._entries.get(bucket)
            if e is not None:
                if e.state not in (READY, WRITING):  # held, or its read failed: as an acquire does
                    return None
                src = e.extent.tensor(where, numel, torch.float32)
                raw = self._take(4 * numel)
                return src.clone() if raw is None else raw.view(torch.float32).copy_(src)
            latest = w._latest[bucket]
            if latest is None:  # never written: zeros
                return torch.zeros(numel, dtype=torch.float32)
            if w.verify == "always" or (w.verify == "first" and bucket not in w._verified):
                return None
            size = align_up(max(4 * numel, 1))
            w.stats.reads += 1
            w.stats.bytes_read += size
        # no write of this bucket can start meanwhile: its writes follow an acquire, on the caller's thread.
        # The weights are read straight into page-aligned memory (O_DIRECT) that the returned tensor
        # keeps: no buffer beside the window's, no copy.
        raw = self._take(size)
        mm = mmap.mmap(-1, size) if raw is None else raw.numpy()
        offset = self._files.layout.slot_offset(bucket, latest.slot) + where
        view = memoryview(mm)
        try:
            self._files.engine.read(self._files.data, offset, view).wait(w.timeout_s)
        except Exception as exc:
            raise LuwuError(
                f"out-of-core state: reading the weights of bucket {bucket} (slot "
                f"{latest.slot}, version {latest.version}) from {self._files.folder} failed: {exc}",
                bucket=bucket,
            ) from exc
        finally:
            view.release()
        if raw is not None:
            return raw.view(torch.float32)[:numel]
        return torch.frombuffer(mm, dtype=torch.float32, count=numel)

    def close(self) -> None:
        """Nothing to let go of: each read's memory goes with its tensor."""

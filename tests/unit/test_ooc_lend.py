"""A step's reply zero-copy from the state window (switch_nodes/ooc/lend.py): a lent frame keeps the
weights it was given while other buckets stream through the window (its slot is not evicted, so no
read lands in it), the slot is evicted again once the frame is gone, at most half the window is lent
(past that the caller copies), and a payload's frames that are views of the window are lent or
copied, never left as views."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout, StateWindow
from luwu.switch_nodes.ooc.lend import Lender
from luwu.switch_nodes.replies import Payload

pytestmark = pytest.mark.timeout(120)

NUMEL = 50_000


@contextlib.contextmanager
def _window(folder, num_buckets: int = 6, budget_slots: int = 4):
    lay = StateLayout.for_shard("job-l", [(i, NUMEL, 1) for i in range(num_buckets)], ("m",))
    engine = IOEngine(num_threads=2)
    sf = StateFile.open(folder, lay, engine)
    w = StateWindow(sf, list(range(num_buckets)), budget_slots * lay.buckets[0].slot_bytes)
    try:
        yield w
    finally:
        try:
            w.close()
        finally:
            sf.close()
            engine.close()


def _step(w: StateWindow, b: int, value: float, lender: Lender | None = None):
    """Bucket ``b``'s weights set to ``value`` and stored; with ``lender``, the weights lent."""
    v = w.acquire(b)
    v.tensors["params"].fill_(value)
    lent = None if lender is None else lender.lend(b, v.tensors["params"])
    w.release(b, (v.version or 0) + 1)
    return lent


def _cycle(w: StateWindow, rounds: int, first: int = 1, num_buckets: int = 6) -> None:
    for r in range(rounds):
        for b in range(first, num_buckets):
            _step(w, b, float(100 + r))


def test_a_lent_frame_keeps_its_weights_while_the_window_streams(tmp_path):
    with _window(tmp_path) as w:
        lender = Lender(w)
        lent = _step(w, 0, 7.0, lender)
        # bucket 0 is needed last of all: the first to evict, but for its loan
        w.set_order(range(1, 6))
        assert lent is not None and lent.numel() == NUMEL and torch.all(lent == 7.0)
        evicted = w.stats.evictions
        _cycle(w, 3)  # 5 other buckets through a window of 4 slots: evictions
        assert w.stats.evictions > evicted
        assert torch.all(lent == 7.0), "a read landed in the memory of a lent frame"
        entry = w._entries[0]
        assert entry.pins == 1
        del lent
        gc.collect()
        assert entry.pins == 0 and lender.lent_bytes == 0  # (it may be evicted from now on)
        _cycle(w, 2)
        assert 0 not in w._entries, "a slot whose loan ended must be evicted again"
        v = w.acquire(0)
        assert v.version == 1 and torch.all(v.tensors["params"] == 7.0)
        w.release(0)


def test_at_most_half_the_window_is_lent(tmp_path):
    with _window(tmp_path) as w:
        lender = Lender(w)
        kept = [_step(w, b, float(b), lender) for b in range(3)]
        assert kept[0] is not None and kept[1] is not None
        assert kept[2] is None, "a third slot of four lent: past half the window"
        assert lender.lent_bytes <= w.budget_bytes // 2
        # (the lent buckets do not step: Shard.before_write would wait for their replies)
        _cycle(w, 2, first=3)
        assert all(torch.all(t == float(b)) for b, t in enumerate(kept[:2]))


def test_a_payloads_window_frames_are_lent_or_copied(tmp_path):
    with _window(tmp_path, budget_slots=2) as w:
        lender = Lender(w)
        v = w.acquire(0)
        p = v.tensors["params"]
        p.fill_(3.0)
        other = torch.ones(4)
        pay = Payload("none", False, {}, [p, other], True)
        copies = []

        def copy(t):
            copies.append(t)
            return t.clone()

        got = lender.own(pay, 0, copy)  # (two slots: one may be lent)
        assert got.borrowed and not copies and got.frames[1] is other
        assert got.frames[0].data_ptr() == p.data_ptr(), "a lent frame is the window's memory"
        plain = lender.own(pay, None, copy)  # (not to be lent: copied)
        assert len(copies) == 1 and plain.frames[0].data_ptr() != p.data_ptr() and plain.borrowed
        only = lender.own(pay._replace(frames=[p]), None, copy)
        assert not only.borrowed, "a payload of copies alone borrows nothing"
        w.release(0, 1)
        del got

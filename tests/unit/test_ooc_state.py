"""Out-of-core state (switch_nodes/ooc): the state files round-trip, a step commits atomically (a kill
before the journal record, a torn record, a real SIGKILL mid write-back), another job's or layout's
folder is refused, and the window never holds more than its budget while returning what an in-RAM dict
of the same steps holds; a bucket can be rewound one version, a restart puts every bucket at the step
all of them hold, and (keep_step) a bucket a step ahead never overwrites that step. Files go under
pytest's tmp_path (O_DIRECT where its disk takes it), and once on a ramfs in a mount namespace of a
child's own (O_DIRECT refused: the buffered fallback)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luwu.protocol.errors import (
    ConfigError,
    CorruptCheckpointError,
    LayoutMismatchError,
)
from luwu.switch_nodes.ooc import (
    BufferPool,
    IOEngine,
    StateFile,
    StateLayout,
    StateWindow,
)
from luwu.switch_nodes.ooc.layout import STEP_SHIFT
from luwu.switch_nodes.ooc.state_file import ALIGN, JOURNAL_FILE, RECORD_PITCH

pytestmark = pytest.mark.timeout(180)

NAMES = ("exp_avg", "exp_avg_sq")


def _layout(
    job: str = "job-a", numels=(20_000, 70_000, 5_000, 40_000, 33_333), segs: int = 3
) -> StateLayout:
    return StateLayout.for_shard(job, [(10 + i, n, segs) for i, n in enumerate(numels)], NAMES)


@contextlib.contextmanager
def _opened(folder, layout: StateLayout, budget_slots: float = 2.5, order=None, **kw):
    """(state file, window) over ``folder``, closed (window, state, engine) on exit."""
    engine = IOEngine(num_threads=3)
    sf = StateFile.open(folder, layout, engine)
    biggest = max(b.slot_bytes for b in layout.buckets)
    w = StateWindow(
        sf,
        order if order is not None else [b.id for b in layout.buckets],
        int(budget_slots * biggest),
        **kw,
    )
    try:
        yield sf, w
    finally:
        try:
            w.close()
        finally:
            sf.close()
            engine.close()


def _step(w: StateWindow, bucket: int, seed: int) -> dict[str, torch.Tensor]:
    """One 'optimizer step' on ``bucket``: every tensor changed in place; returns copies of the result."""
    v = w.acquire(bucket)
    g = torch.Generator().manual_seed(seed)
    for t in v.tensors.values():
        t.mul_(0.5).add_(torch.randn(t.shape, generator=g))
    out = {n: t.clone() for n, t in v.tensors.items()}
    w.release(bucket, (v.version or 0) + 1)
    return out


def _read(w: StateWindow, bucket: int) -> tuple[int | None, dict[str, torch.Tensor]]:
    v = w.acquire(bucket)
    out = (v.version, {n: t.clone() for n, t in v.tensors.items()})
    w.release(bucket)
    return out


def test_round_trip(tmp_path):
    lay = _layout()
    ref = {}
    with _opened(tmp_path, lay, budget_slots=1.5) as (sf, w):
        for rnd in range(3):
            for b in lay.buckets:
                ref[b.id] = _step(w, b.id, seed=rnd * 100 + b.id)
        assert w.stats.bytes_read > 0, (
            "the shard is larger than the window: buckets must have been read back"
        )
    with _opened(tmp_path, lay, budget_slots=1) as (sf, w):
        for b in lay.buckets:
            assert sf.committed[b.id].version == 3 and sf.verify(b.id)
            version, got = _read(w, b.id)
            assert version == 3
            for n in ref[b.id]:
                assert torch.equal(got[n], ref[b.id][n]), (b.id, n)
        assert w.peak_resident_bytes <= w.budget_bytes


def test_a_kill_before_the_journal_record_leaves_the_old_version(tmp_path):
    """The data of version 2 reached its slot (and the disk) but the process died before the record:
    the bucket is at version 1 with version 1's data."""
    lay = _layout()
    with _opened(tmp_path, lay) as (sf, w):
        v1 = {b.id: _step(w, b.id, seed=b.id) for b in lay.buckets}
    bid = lay.buckets[1].id
    with _opened(tmp_path, lay) as (sf, w):
        old = sf.committed[bid]
        pool = BufferPool(lay.bucket(bid).slot_bytes)
        ext = pool.alloc(lay.bucket(bid).slot_bytes)
        ext.data.fill_(7)
        sf.write_slot(bid, 1 - old.slot, ext.view).wait(30)  # what release does, up to the data
        sf.engine.sync(sf.data)  # the new data is durable; its record never comes
        pool.free(ext)
    with _opened(tmp_path, lay, verify="always") as (sf, w):
        assert sf.committed[bid] == old and sf.torn == []
        version, got = _read(w, bid)
        assert version == 1
        assert all(torch.equal(got[n], v1[bid][n]) for n in got)


def _corrupt_record(folder: Path, layout: StateLayout, bucket: int, slot: int) -> None:
    """Tear the journal record of (bucket, slot) as a partial write would: its version field (bytes 16..24
    of :data:`RECORD`) holds other bytes, the rest is intact; only the record's CRC tells."""
    region = -(-len(layout.buckets) * RECORD_PITCH // ALIGN) * ALIGN
    at = ALIGN + slot * region + layout.index(bucket) * RECORD_PITCH
    with open(folder / JOURNAL_FILE, "r+b") as fh:
        fh.seek(at + 16)
        fh.write(b"\xa5" * 8)


def test_a_torn_record_falls_back_to_the_other_slot(tmp_path, caplog):
    lay = _layout()
    with _opened(tmp_path, lay) as (sf, w):
        v1 = {b.id: _step(w, b.id, seed=b.id) for b in lay.buckets}
        v2 = {b.id: _step(w, b.id, seed=50 + b.id) for b in lay.buckets}
        w.flush()
        assert {sf.committed[b.id].slot for b in lay.buckets} == {1}
    torn = lay.buckets[2].id
    _corrupt_record(tmp_path, lay, torn, slot=1)
    with caplog.at_level(logging.WARNING), _opened(tmp_path, lay, verify="always") as (sf, w):
        assert sf.torn == [(torn, 1)]
        for b in lay.buckets:
            version, got = _read(w, b.id)
            want, wv = (v1, 1) if b.id == torn else (v2, 2)
            assert version == wv, b.id
            assert all(torch.equal(got[n], want[b.id][n]) for n in got), b.id
    assert (
        f"bucket {torn}: the journal record of slot 1 is torn; using slot 0 at version 1"
        in caplog.text
    )


def test_a_torn_first_record_leaves_the_bucket_uncommitted(tmp_path):
    lay = _layout(numels=(1000, 2000))
    with _opened(tmp_path, lay) as (sf, w):
        _step(w, 10, seed=1)
    _corrupt_record(tmp_path, lay, 10, slot=0)
    with _opened(tmp_path, lay) as (sf, w):
        assert sf.committed[10] is None and sf.torn == [(10, 0)]
        version, got = _read(w, 10)
        assert version is None and all(not t.any() for t in got.values())


def test_rewind_brings_a_bucket_back_one_version(tmp_path):
    """A restarting node brings a bucket a step ahead back to the others' step: the slot beside the
    committed one still holds the previous version, and the rewind survives a reopen. A version no slot
    holds intact any more is refused."""
    lay = _layout(numels=(3000, 5000))
    with _opened(tmp_path, lay) as (sf, w):
        v1 = _step(w, 10, seed=1)
        _step(w, 10, seed=2)
        _step(w, 11, seed=3)
    engine = IOEngine(num_threads=2)
    try:
        sf = StateFile.open(tmp_path, lay, engine)
        assert sf.versions(10) == [2, 1] and sf.versions(11) == [1]
        sf.rewind(10, 1)
        with pytest.raises(
            ValueError, match=r"bucket 11 cannot go back to version 0: its slots hold \[1\]"
        ):
            sf.rewind(11, 0)
        sf.close()
        sf = StateFile.open(tmp_path, lay, engine)
        assert sf.versions(10) == [1] and sf.committed[10].version == 1
        with pytest.raises(ValueError, match="cannot go back to version 2"):
            sf.rewind(10, 2)  # its record was erased: the rewind is durable
        w = StateWindow(sf, [], lay.bucket(11).slot_bytes)
        version, got = _read(w, 10)
        assert version == 1 and all(torch.equal(got[n], v1[n]) for n in got)
        _step(w, 10, seed=4)  # version 2 again, a different one
        w.flush()
        pool = BufferPool(lay.bucket(10).slot_bytes)
        ext = pool.alloc(lay.bucket(10).slot_bytes)
        sf.write_slot(10, 1 - sf.committed[10].slot, ext.view).wait(
            30
        )  # a write-back never committed
        pool.free(ext)
        with pytest.raises(
            ValueError, match="cannot go back to version 1: its slots hold \\[2, 1\\] and slot"
        ):
            sf.rewind(10, 1)
        w.close()
        sf.close()
    finally:
        engine.close()


def _step_to(w: StateWindow, bucket: int, step: int) -> dict[str, torch.Tensor]:
    """:func:`_step`, released as the journal version of ``step`` (as the node's shard does)."""
    v = w.acquire(bucket)
    for t in v.tensors.values():
        t.add_(step * 10 + bucket)
    out = {n: t.clone() for n, t in v.tensors.items()}
    w.release(bucket, step << STEP_SHIFT)
    return out


def _steps(sf: StateFile, bucket: int) -> list[int]:
    return [v >> STEP_SHIFT for v in sf.versions(bucket)]


def test_keep_step_a_bucket_a_step_ahead_waits_for_the_others_commits(tmp_path):
    """With keep_step, a bucket a step ahead does not overwrite the slot of the step every bucket holds
    until the others have committed past it (its write waits meanwhile), so a kill at any time leaves a
    step all buckets hold."""
    lay = _layout(numels=(3000, 5000))
    with _opened(tmp_path, lay, keep_step=True, commit_interval_s=0) as (sf, w):
        for step in (1, 2):
            for b in (10, 11):
                _step_to(w, b, step)
        _step_to(w, 10, 3)
        w.flush()
        assert (_steps(sf, 10), _steps(sf, 11), sf.floor()) == ([3, 2], [2, 1], 2)
        _step_to(w, 10, 4)  # would overwrite step 2, which bucket 11 is at: it waits
        time.sleep(0.3)
        assert _steps(sf, 10) == [3, 2], (
            "bucket 10 overwrote the only step bucket 11 shares with it"
        )
        _step_to(w, 11, 3)  # bucket 11 commits step 3: bucket 10's write goes
        w.flush()
        assert (_steps(sf, 10), _steps(sf, 11), sf.floor()) == ([4, 3], [3, 2], 3)


def test_bring_to_puts_every_bucket_at_the_step_all_hold(tmp_path):
    """A restart puts every bucket at the newest step all of them hold (the buckets ahead rewound to
    their other slot, durably, with that step's data); a step some bucket no longer holds is refused
    naming the bucket and its steps, and nothing changes."""
    lay = _layout(numels=(3000, 5000))
    with _opened(tmp_path, lay) as (sf, w):
        at1 = {b: _step_to(w, b, 1) for b in (10, 11)}
        _step_to(w, 10, 2)
    engine = IOEngine(num_threads=2)
    try:
        sf = StateFile.open(tmp_path, lay, engine)
        with pytest.raises(CorruptCheckpointError, match=r"bucket 11 cannot be put at step 2: "):
            sf.bring_to(2)
        assert sf.bring_to() == 1
        sf.close()
        sf = StateFile.open(tmp_path, lay, engine)
        assert (_steps(sf, 10), _steps(sf, 11)) == ([1], [1])
        w = StateWindow(sf, [10, 11], 2 * lay.bucket(11).slot_bytes)
        for b in (10, 11):
            version, got = _read(w, b)
            assert version == 1 << STEP_SHIFT and all(torch.equal(got[n], at1[b][n]) for n in got)
        _step_to(w, 10, 2)
        _step_to(w, 10, 3)  # (no keep_step: bucket 10 overwrites step 1, the one bucket 11 holds)
        w.close()
        sf.close()
        sf = StateFile.open(tmp_path, lay, engine)
        with pytest.raises(
            CorruptCheckpointError,
            match=r"bucket 10 cannot be put at step 1: its slots hold steps \[3, 2\]",
        ):
            sf.bring_to()
        assert _steps(sf, 10) == [3, 2]
        sf.close()
    finally:
        engine.close()


def test_refuses_a_folder_of_another_job_or_layout(tmp_path):
    with _opened(tmp_path, _layout()) as (_, w):
        _step(w, 10, seed=0)
    engine = IOEngine(num_threads=1)
    try:
        with pytest.raises(LayoutMismatchError, match="belongs to job 'job-a', not 'job-b'"):
            StateFile.open(tmp_path, _layout(job="job-b"), engine)
        with pytest.raises(LayoutMismatchError, match=r"layout \w+ \(5 buckets\) differs"):
            StateFile.open(
                tmp_path, _layout(numels=(20_000, 70_000, 5_000, 40_000, 33_334)), engine
            )
        (tmp_path / "header.json").write_text(
            json.dumps({"magic": "something else", "format": 1, "job": "job-a", "layout_hash": "x"})
        )
        with pytest.raises(CorruptCheckpointError, match="not a LuWu state folder"):
            StateFile.open(tmp_path, _layout(), engine)
    finally:
        engine.close()


def test_corrupt_slot_data_is_refused_when_read(tmp_path):
    lay = _layout()
    with _opened(tmp_path, lay) as (sf, w):
        for b in lay.buckets:
            _step(w, b.id, seed=b.id)
    bid = lay.buckets[3].id
    with open(tmp_path / "slots.bin", "r+b") as fh:
        fh.seek(lay.slot_offset(bid, 0) + 5000)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))
    with _opened(tmp_path, lay, order=[]) as (sf, w):
        assert not sf.verify(bid) and sf.verify(lay.buckets[0].id)
        with pytest.raises(CorruptCheckpointError, match=f"bucket {bid} slot 0 \\(version 1\\)"):
            w.acquire(bid)


def test_budget_smaller_than_a_bucket_is_refused(tmp_path):
    lay = _layout()
    engine = IOEngine(num_threads=1)
    sf = StateFile.open(tmp_path, lay, engine)
    try:
        with pytest.raises(ConfigError, match="state_memory_bytes"):
            StateWindow(sf, [], lay.bucket(11).slot_bytes - 1)
        w = StateWindow(sf, [], lay.bucket(11).slot_bytes + lay.bucket(10).slot_bytes)
        w.acquire(11)
        w.acquire(10)
        with pytest.raises(ConfigError, match=r"beside the buckets held \(\[10, 11\]\)"):
            w.acquire(13)
        w.release(10)
        w.release(11)
        w.close()
    finally:
        sf.close()
        engine.close()


FALLBACK_CHILD = r"""
import logging, sys, torch
from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout, StateWindow
logging.basicConfig(level=logging.WARNING)
lay = StateLayout.for_shard("job-ramfs", [(0, 3000, 1), (1, 9000, 2)], ("exp_avg", "exp_avg_sq"))
ref = {}
for verify in ("first", "always"):
    engine = IOEngine(num_threads=2)
    sf = StateFile.open(sys.argv[1], lay, engine)
    w = StateWindow(sf, [0, 1], lay.bucket(1).slot_bytes, verify=verify)
    for b in (0, 1):
        v = w.acquire(b)
        if verify == "first":
            for t in v.tensors.values():
                t.normal_()
            ref[b] = {n: t.clone() for n, t in v.tensors.items()}
            w.release(b, 1)
        else:
            assert v.version == 1 and all(torch.equal(t, ref[b][n]) for n, t in v.tensors.items())
            w.release(b)
    w.close(); sf.close(); engine.close()
    print("direct", sf.data.direct, flush=True)
print("ok", flush=True)
"""


def test_buffered_fallback_where_o_direct_is_refused(tmp_path):
    """On a file system that refuses O_DIRECT (ramfs, mounted in a mount namespace of the child's own,
    gone when it exits), the state goes through the page cache with a warning, and round-trips."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    probe = subprocess.run(
        ["unshare", "-m", "mount", "-t", "ramfs", "none", str(mnt)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"cannot mount a ramfs in a mount namespace (needs root and unshare): {probe.stderr.decode()[:200]}"
        )
    cmd = f'mount -t ramfs none "{mnt}" && exec "{sys.executable}" -c "$0" "{mnt}"'
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd, FALLBACK_CHILD],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["direct", "False", "direct", "False", "ok"]
    assert "refuses O_DIRECT" in r.stderr


# ------------------------------------------------------------------ the window against a dict, by hypothesis
OPS = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from(["step", "step", "read", "reorder"])),
    min_size=1,
    max_size=30,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    budget_slots=st.sampled_from([1.0, 1.5, 2.0, 3.0, 7.0]),
    readahead=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_window_matches_a_dict_within_its_budget(ops, budget_slots, readahead, seed):
    """Random steps, reads and changes of order against a dict of the same steps: the window's tensors
    equal the dict's, before and after a reopen, and RAM never exceeds the budget."""
    lay = _layout(numels=(4000, 9000, 1000, 6000, 9000, 3000), segs=2)
    ids = [b.id for b in lay.buckets]
    rng = random.Random(seed)
    order = rng.sample(ids, len(ids))
    ref: dict[int, tuple[int, dict]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        with _opened(d, lay, budget_slots=budget_slots, order=order, readahead=readahead) as (
            sf,
            w,
        ):
            for k, (i, op) in enumerate(ops):
                bid = ids[i]
                if op == "reorder":
                    w.set_order(rng.sample(ids, rng.randint(0, len(ids))))
                elif op == "step":
                    ref[bid] = ((ref[bid][0] if bid in ref else 0) + 1, _step(w, bid, seed=k))
                else:
                    _check(w, bid, ref)
                assert w.resident_bytes <= w.budget_bytes
            biggest = max(b.slot_bytes for b in lay.buckets)
            assert w.peak_resident_bytes <= w.budget_bytes <= budget_slots * biggest
        with _opened(d, lay, budget_slots=1, verify="always") as (sf, w):
            for bid in ids:
                _check(w, bid, ref)
                assert sf.verify(bid)


def _check(w: StateWindow, bid: int, ref: dict) -> None:
    version, got = _read(w, bid)
    want_v, want = ref.get(bid, (None, None))
    assert version == want_v, bid
    for n, t in got.items():
        assert torch.equal(t, want[n]) if want else not t.any(), (bid, n)


# ------------------------------------------------------------------ a real SIGKILL mid write-back
CHILD = r"""
import sys, torch
from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout, StateWindow
folder = sys.argv[1]
lay = StateLayout.for_shard("job-kill", [(b, 150_000 + 1000 * b, 2) for b in range(8)], ("exp_avg", "exp_avg_sq"))
engine = IOEngine(num_threads=4)
sf = StateFile.open(folder, lay, engine)
w = StateWindow(sf, list(range(8)), 3 * lay.bucket(7).slot_bytes)
base = {}
print("ready", flush=True)
while True:
    for b in range(8):
        v = w.acquire(b)
        version = (v.version or 0) + 1
        for i, t in enumerate(v.tensors.values()):
            if t.numel() not in base:
                base[t.numel()] = torch.arange(t.numel(), dtype=t.dtype).remainder_(97)
            torch.add(base[t.numel()], version * 1000 + b * 10 + i, out=t)
        w.release(b, version)
"""


def _pattern(t: torch.Tensor, version: int, bucket: int, i: int) -> torch.Tensor:
    return (
        torch.arange(t.numel(), dtype=t.dtype).remainder_(97).add_(version * 1000 + bucket * 10 + i)
    )


def _newer_data_in_other_slot(sf: StateFile, bucket: int) -> bool:
    """Whether the slot beside the committed one starts with the next version's data: a write-back that
    reached the disk (in part at least) and was never committed."""
    c, spec = sf.committed[bucket], sf.layout.bucket(bucket)
    pool = BufferPool(spec.slot_bytes)
    ext = pool.alloc(spec.slot_bytes)
    sf.read_slot(bucket, 1 - c.slot, ext.view).wait(30)
    head = ext.tensor(0, 1024, torch.float32)
    out = torch.equal(head, _pattern(head, c.version + 1, bucket, 0))
    del head
    pool.free(ext)
    return out


def _run_and_kill(folder: Path, rng: random.Random) -> None:
    """Start a child stepping the state in ``folder`` in a loop and SIGKILL it at a random time."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.1, 0.6))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL


def _check_recovered(folder: Path, lay: StateLayout, last: dict[int, int]) -> bool:
    """Every bucket at a committed version, with its checksum and exactly that version's data, never
    older than after the last kill; returns whether some write-back was caught uncommitted."""
    with _opened(folder, lay, budget_slots=1, verify="always") as (sf, w):
        assert sf.torn == []
        for b in range(8):
            c = sf.committed[b]
            assert c is not None and sf.verify(b), b
            assert c.version >= last.get(b, 0), f"bucket {b}: committed version went back"
            last[b] = c.version
            view = w.acquire(b)
            assert view.version == c.version
            for i, t in enumerate(view.tensors.values()):
                assert torch.equal(t, _pattern(t, c.version, b, i)), (b, i)
            w.release(b)
        return any(_newer_data_in_other_slot(sf, b) for b in range(8))


def test_sigkill_mid_write_back_recovers_each_bucket_at_a_committed_version(tmp_path):
    """A process stepping in a loop is SIGKILLed at random times; after each kill every bucket is at a
    committed version whose data checksum matches and whose data is exactly that version's; the next
    process continues from there. Kills go on (4 to 12) until one has landed between a write-back
    reaching the disk and its journal record (the next version's data found beside the committed slot)."""
    rng = random.Random(1234)
    lay = StateLayout.for_shard("job-kill", [(b, 150_000 + 1000 * b, 2) for b in range(8)], NAMES)
    last: dict[int, int] = {}
    caught = kills = 0
    while kills < 4 or (not caught and kills < 12):
        _run_and_kill(tmp_path, rng)
        kills += 1
        caught += _check_recovered(tmp_path, lay, last)
    print(f"kills that landed mid write-back: {caught} of {kills}; versions {last}")
    assert min(last.values()) >= 2, (
        f"the children made too little progress to test anything: {last}"
    )
    assert caught, f"none of {kills} kills landed between a write-back and its commit"

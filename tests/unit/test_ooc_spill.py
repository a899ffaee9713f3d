"""The scratch file of two-phase sums (switch_nodes/ooc/spill.py), with no server: a complete sum
stays in RAM until a push waits for room, then goes to disk and its bytes leave the push budget;
asked for, it comes back bit for bit and counts again (the sum and its reply); read ahead in the
order given while the budget has room; a sum asked for before its write ended stays in RAM; the file
goes with the spill."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.context import NodeContext, OptimizerQueue
from luwu.switch_nodes.metrics import NodeMetrics
from luwu.switch_nodes.ooc.bucket import OocBucket
from luwu.switch_nodes.ooc.spill import SCRATCH_FILE, AlignedPool, Spill
from luwu.switch_nodes.optimizers import ADAMW
from luwu.switch_nodes.store import Accumulator, SegmentSpec

pytestmark = pytest.mark.timeout(60)

NUMEL = 3000  # not a whole number of pages: the slot is rounded up to them


def _node(tmp_path, limit: int):
    cfg = NodeConfig(state_dir=str(tmp_path), push_memory_bytes=limit)
    metrics = NodeMetrics(CollectorRegistry())
    ctx = NodeContext(cfg, "j", metrics, OptimizerQueue(metrics), 0)
    ctx.members = {0, 1}
    pool = AlignedPool(0)
    buckets = [OocBucket(i, 0, NUMEL, [SegmentSpec(i, 0, 0, NUMEL)], ADAMW, pool) for i in range(3)]
    spill = Spill(ctx, pool, lambda: buckets)
    spill.open(tmp_path, None)
    ctx.inflight.use_spill(spill)
    for b in buckets:
        b.spill = spill
    return ctx, spill, buckets


def _complete_sum(ctx, b, seed: int) -> tuple[Accumulator, torch.Tensor]:
    """An accumulator of (step 0, ``b``) that holds its ticket and a summed gradient."""
    acc = Accumulator(two_phase=True, pull="none")
    header = {"step": 0, "worker": 0, "bucket": b.id, "nbytes": [NUMEL * 4], "pull": "none"}
    ctx.inflight.claim(acc, b, header)
    want = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    b.buffer(acc).copy_(want)
    acc.workers = {0, 1}
    return acc, want


def _settle(spill: Spill) -> None:
    deadline = time.monotonic() + 10
    while spill.busy():
        assert time.monotonic() < deadline, "a transfer did not end"
        time.sleep(0.005)


def _value(ctx, name: str) -> float:
    return ctx.metrics.registry.get_sample_value(f"luwu_node_{name}") or 0.0


def test_a_spilled_sum_leaves_the_budget_and_comes_back_bit_for_bit(tmp_path):
    ctx, spill, (b, *_) = _node(tmp_path, 1 << 20)
    acc, want = _complete_sum(ctx, b, 0)
    held = acc.ticket.nbytes
    assert ctx.inflight.used == held == NUMEL * 4 * (1 + 2 + 1)
    sq, nonfinite = b.sqnorm(acc, 2.0)  # the norm round: the sum may wait for COMMIT on disk
    _settle(spill)
    assert acc.buf is not None and ctx.inflight.used == held  # no push waits: it stays
    spill.relieve()  # (what a push that waits for room does)
    _settle(spill)
    assert acc.buf is None and acc.ticket.nbytes == 0 and ctx.inflight.used == 0
    assert (tmp_path / SCRATCH_FILE).exists()
    assert _value(ctx, "spill_bytes_written_total") == 12288  # 3 pages
    got = b.buffer(acc)  # COMMIT: asked for, read back
    assert torch.equal(got, want) and got.data_ptr() % 4096 == 0
    assert ctx.inflight.used == NUMEL * 4 * 2  # the sum and room for its fp32 reply
    assert _value(ctx, "spill_bytes_read_total") == 12288
    assert sq == float(torch.dot(want, want)) / 4 and not nonfinite
    b.give_back(acc)
    assert ctx.inflight.used == 0
    spill.close()
    assert not (tmp_path / SCRATCH_FILE).exists()


def test_prefetch_reads_in_order_within_the_budget(tmp_path):
    need = NUMEL * 4 * 2
    ctx, spill, buckets = _node(tmp_path, need * 2)  # room for two sums read back, not three
    accs = []
    for i, b in enumerate(buckets):
        acc, want = _complete_sum(ctx, b, i)
        b.sqnorm(acc, 2.0)
        spill.relieve()
        _settle(spill)  # (each in turn: three open sums would not fit the budget)
        accs.append((b, acc, want))
    assert ctx.inflight.used == 0
    spill.prefetch([(b, acc) for b, acc, _ in reversed(accs)])  # the order they will step
    _settle(spill)
    assert ctx.inflight.used == 2 * need  # buckets 2 and 1 came back; 0 waits for room
    assert [acc.buf is None for _, acc, _ in accs] == [True, True, True]  # (until asked for)
    for b, acc, want in reversed(accs):
        assert torch.equal(b.buffer(acc), want)
        b.give_back(acc)  # its room lets the next one in
    assert ctx.inflight.used == 0
    assert _value(ctx, "spill_bytes_read_total") == 3 * 12288
    spill.close()


def test_a_sum_asked_for_while_it_is_written_stays_in_ram(tmp_path):
    ctx, spill, (b, *_) = _node(tmp_path, 1 << 20)
    acc, want = _complete_sum(ctx, b, 3)
    buf = b.buffer(acc)
    spill.put(b, acc)
    spill.relieve()
    spill.prefetch([(b, acc)])  # COMMIT before the write may have ended
    _settle(spill)
    if acc.buf is not None:  # the COMMIT came first: kept
        assert acc.buf is buf and acc.ticket.nbytes == NUMEL * 4 * 4
    assert torch.equal(b.buffer(acc), want)
    b.give_back(acc)
    assert ctx.inflight.used == 0
    acc, want = _complete_sum(ctx, b, 4)  # COMMIT before any push waited: nothing written
    b.sqnorm(acc, 2.0)
    spill.prefetch([(b, acc)])
    spill.relieve()
    _settle(spill)
    assert acc.buf is not None and torch.equal(b.buffer(acc), want)
    b.give_back(acc)
    assert ctx.inflight.used == 0
    spill.close()

"""The node's accumulation of pushes: the average folded into the decode, the first push held and decoded
with the second in one pass, and the optimizer step without grad_scale, all against plain torch."""

from __future__ import annotations

import pytest
import torch

from luwu.protocol.codecs import get_codec
from luwu.switch_nodes.optimizers import ADAMW
from luwu.switch_nodes.store import AccumulatorPool, BucketState, SegmentSpec

pytestmark = pytest.mark.timeout(60)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _bucket(numel: int) -> BucketState:
    return BucketState(0, 0, numel, [SegmentSpec(0, 0, 0, numel)], ADAMW)


def _push(codec_name: str, x: torch.Tensor):
    codec = get_codec(codec_name)
    enc = codec.encode(x.clone(), codec.alloc(x.numel()))
    # as received: read-only-able uint8 frames, copies of what was sent
    return codec, [f.contiguous().view(torch.uint8).clone() for f in enc.frames], enc.meta


def _decoded(codec, frames, meta, numel: int) -> torch.Tensor:
    out = torch.empty(numel)
    codec.decode_(out, frames, meta)
    return out


@pytest.mark.parametrize("codec_name", ["none", "bf16", "fp16", "int8", "int4", "topk"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_accumulator_holds_the_average(codec_name, n):
    numel = 3000
    g = torch.Generator().manual_seed(n)
    pushes = [_push(codec_name, torch.randn(numel, generator=g)) for _ in range(n)]
    want = sum(_decoded(c, f, m, numel) for c, f, m in pushes) / n
    b = _bucket(numel)
    acc = b.accumulator(0, 0)
    for w, (c, f, m) in enumerate(pushes):
        b.add_push(acc, c, f, m, tuple(range(n)), w)
        acc.workers.add(w)
    b.settle(acc)
    assert acc.tree is None
    torch.testing.assert_close(acc.buf, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("order", ["partial_first", "held_then_partial", "partials_between"])
def test_micro_batch_pushes_add_into_the_step(order):
    """no_sync() in streaming mode: a worker's partial pushes (micro-batches) and the last pushes of every
    worker add up to the average of the per-worker sums, whichever arrives first (a held push included)."""
    numel = 2000
    g = torch.Generator().manual_seed(7)
    w0 = [_push("none", torch.randn(numel, generator=g)) for _ in range(3)]  # two partial, one last
    w1 = [_push("bf16", torch.randn(numel, generator=g)) for _ in range(2)]  # one partial, one last
    want = (
        sum(_decoded(c, f, m, numel) for c, f, m in w0)
        + sum(_decoded(c, f, m, numel) for c, f, m in w1)
    ) / 2
    seq = {
        "partial_first": [
            (0, w0[0], True),
            (0, w0[1], True),
            (1, w1[0], True),
            (1, w1[1], False),
            (0, w0[2], False),
        ],
        "held_then_partial": [
            (1, w1[0], True),
            (0, w0[0], True),
            (0, w0[1], True),
            (0, w0[2], False),
            (1, w1[1], False),
        ],
        "partials_between": [
            (0, w0[0], True),
            (1, w1[0], True),
            (0, w0[1], True),
            (0, w0[2], False),
            (1, w1[1], False),
        ],
    }[order]
    b = _bucket(numel)
    acc = b.accumulator(0, 0)
    for w, (c, f, m), partial in seq:
        b.add_push(acc, c, f, m, (0, 1), w, partial=partial)
        if not partial:
            acc.workers.add(w)
        else:
            acc.partial[w] = acc.partial.get(w, 0) + 1
    b.settle(acc)
    torch.testing.assert_close(acc.buf, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("codec_name", ["none", "bf16"])
def test_a_last_push_held_before_any_partial_is_still_counted(codec_name):
    """The first push of a step (a worker's last, held undecoded) followed by the other worker's micro-batch
    pushes: the held push is decoded before the partial one is added."""
    numel = 1000
    g = torch.Generator().manual_seed(3)
    a, p1, p2 = (_push(codec_name, torch.randn(numel, generator=g)) for _ in range(3))
    b = _bucket(numel)
    acc = b.accumulator(0, 0)
    b.add_push(acc, *a, (0, 1), 0)
    acc.workers.add(0)
    assert acc.tree is not None
    b.add_push(acc, *p1, (0, 1), 1, partial=True)
    acc.partial[1] = 1
    b.add_push(acc, *p2, (0, 1), 1)
    acc.workers.add(1)
    b.settle(acc)
    want = sum(_decoded(*x, numel) for x in (a, p1, p2)) / 2
    torch.testing.assert_close(acc.buf, want, rtol=1e-6, atol=1e-6)


def test_a_held_push_is_decoded_when_the_step_goes_on_without_the_others():
    """Elastic mode: 2 workers expected, one dropped; the step applies the one push at full weight."""
    numel = 1000
    x = torch.randn(numel)
    b = _bucket(numel)
    b.params.copy_(torch.randn(numel))
    p = torch.nn.Parameter(b.params.clone())
    acc = b.accumulator(0, 0)
    c, f, m = _push("none", x)
    b.add_push(acc, c, f, m, (0, 1), 0)
    acc.workers.add(0)
    assert acc.tree is not None
    acc.hyper = HYPER
    b.apply(acc, 1.0)  # one push, divisor 1: the held push at weight 1/2, rescaled by grad_scale
    opt = torch.optim.AdamW(
        [p],
        lr=HYPER["lr"],
        betas=HYPER["betas"],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    p.grad = x.clone()
    opt.step()
    torch.testing.assert_close(b.params, p.detach(), rtol=1e-6, atol=1e-7)


def test_mixed_codecs_in_one_step():
    """A worker that found a non-finite value sends fp32 while the other sends bf16."""
    numel = 2048
    a, bx = torch.randn(numel), torch.randn(numel)
    pa, pb = _push("bf16", a), _push("none", bx)
    b = _bucket(numel)
    acc = b.accumulator(0, 0)
    for w, (c, f, m) in enumerate((pa, pb)):
        b.add_push(acc, c, f, m, (0, 1), w)
        acc.workers.add(w)
    want = (_decoded(*pa, numel) + bx) / 2
    torch.testing.assert_close(acc.buf, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [2, 3])
def test_node_step_equals_torch_adamw_on_the_averaged_gradient(n):
    numel = 4096
    g = torch.Generator().manual_seed(7)
    b = _bucket(numel)
    b.params.copy_(torch.randn(numel, generator=g))
    p = torch.nn.Parameter(b.params.clone())
    opt = torch.optim.AdamW(
        [p],
        lr=HYPER["lr"],
        betas=HYPER["betas"],
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        fused=True,
    )
    for step in range(3):
        grads = [torch.randn(numel, generator=g) for _ in range(n)]
        acc = b.accumulator(step, 0)
        for w, x in enumerate(grads):
            c, f, m = _push("none", x)
            b.add_push(acc, c, f, m, tuple(range(n)), w)
            acc.workers.add(w)
        acc.hyper = HYPER
        b.apply(acc, float(n))
        b.release(step)
        b.version += 1
        p.grad = torch.stack(grads).sum(0) / n
        opt.step()
    torch.testing.assert_close(b.params, p.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        b.state["exp_avg_sq"], opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-9
    )


def test_pull_codecs_plain_steps_and_int8_delta_share_one_interface():
    """A plain pull codec sends the weights in frames of the reply's own (a node keeps no buffers per bucket);
    bf16_steps sends full bf16 first, then steps from the bits taken before each step (the same bits as a
    bf16 reply), and full bf16 again after a resync or a gap; int8_delta sends full fp32 first, then deltas
    the workers add to their copy, and full weights again after a resync (a restore or a state load)."""
    from luwu.switch_nodes.replies import DeltaPullCodec, PullCodec, ReplyBuffers, StepsPullCodec

    b, buffers = _bucket(1024), ReplyBuffers()
    b.params.copy_(torch.randn(1024))
    plain = PullCodec("bf16")
    assert plain.full is plain
    out, again = plain.encode(b, buffers), plain.encode(b, buffers)
    assert (out.codec, out.delta, out.borrowed) == ("bf16", False, False)
    assert out.frames[0].data_ptr() != again.frames[0].data_ptr(), "each reply's frames are its own"
    assert PullCodec("none").encode(b, buffers).borrowed, "fp32 goes zero-copy from the shard"

    steps, held = StepsPullCodec(), torch.empty(1024)
    assert steps.full.name == "bf16"
    for k in range(4):
        if k == 2:
            steps.resync(b.id)
        steps.before_step(b)
        b.params.add_(torch.randn(1024) * 1e-2)
        b.version += 1
        r = steps.encode(b, buffers)
        assert r.delta == (k not in (0, 2)) and r.codec == ("bf16_steps" if r.delta else "bf16")
        (get_codec(r.codec).decode_add_ if r.delta else get_codec(r.codec).decode_)(
            held, r.frames, r.meta
        )
        assert torch.equal(held, b.params.to(torch.bfloat16).float()), (
            "the bf16 rounding, bit for bit"
        )
    b.version += 1  # a step whose reply did not go through this codec: full bf16 again
    steps.before_step(b)
    b.version += 1
    assert steps.encode(b, buffers).delta is False

    delta = DeltaPullCodec()
    assert delta.full.name == "none"
    first = delta.encode(b, buffers)
    assert (first.codec, first.delta, first.borrowed) == ("none", False, True)
    get_codec("none").decode_(held, first.frames, first.meta)
    b.params.add_(0.01)
    b.version += 1
    step = delta.encode(b, buffers)
    assert step.delta and step.codec.startswith("int8")
    get_codec(step.codec).decode_add_(held, step.frames, step.meta)
    assert torch.allclose(held, b.params, atol=1e-3)
    delta.resync(b.id)
    b.version += 1
    assert delta.encode(b, buffers).delta is False


def test_accumulators_are_shared_by_the_buckets_and_sized_by_those_in_flight():
    """A node's buckets take accumulators from one pool: stepping 8 buckets one after another holds one
    bucket's accumulator at a time, not eight, and the first of several pushes holds none (it is kept
    as received until the second comes)."""
    numel, n = 2048, 2
    pool = AccumulatorPool()
    buckets = [
        BucketState(i, 0, numel, [SegmentSpec(i, 0, 0, numel)], ADAMW, pool) for i in range(8)
    ]
    g = torch.Generator().manual_seed(3)
    for step in range(2):
        for b in buckets:
            acc = b.accumulator(step, 0)
            for w in range(n):
                b.add_push(acc, *_push("int8", torch.randn(numel, generator=g)), (0, 1), w)
                acc.workers.add(w)
                if w == 0:
                    assert acc.buf is None and pool.taken_bytes == 0, (
                        "the held first push takes no accumulator"
                    )
            acc.hyper = HYPER
            b.apply(acc, float(n))
            b.release(step)
            b.version += 1
    assert pool.peak_bytes == numel * 4 and pool.taken_bytes == 0
    assert pool.free_bytes == numel * 4, "the one buffer is kept for the next step"


def test_a_first_step_that_waits_for_the_round_makes_the_state_in_the_sums_memory():
    """The first step's sums all wait for COMMIT (the round a first step asks for, in case the user
    clips), then the buckets step one after another: each bucket's state is made at its first step from
    the sums already given back, so the node grows by one bucket's moment a bucket, not two (a node's
    peak is the floor, 12 B/param, not the floor plus the sums)."""
    numel, nb = 2048, 8
    pool = AccumulatorPool()
    buckets = [
        BucketState(i, 0, numel, [SegmentSpec(i, 0, 0, numel)], ADAMW, pool) for i in range(nb)
    ]
    assert all(b.state.allocated() == () for b in buckets)
    g = torch.Generator().manual_seed(5)
    accs = []
    for b in buckets:  # every sum held at once, as before COMMIT
        acc = b.accumulator(0, 0)
        b.add_push(acc, *_push("none", torch.randn(numel, generator=g)), (0,), 0)
        acc.workers.add(0)
        acc.hyper = HYPER
        accs.append(acc)
    sums = {acc.buf.data_ptr() for acc in accs}
    for b, acc in zip(buckets, accs):
        b.apply(acc, 1.0)
        b.release(0)
    state_ptrs = [b.state[n].data_ptr() for b in buckets for n in ("exp_avg", "exp_avg_sq")]
    assert len(set(state_ptrs)) == 2 * nb
    recycled = sum(p in sums for p in state_ptrs)
    assert recycled == nb - 1, f"{recycled} of {2 * nb} moments took a given-back sum's memory"
    assert pool.free_bytes == numel * 4, "only the last bucket's sum is left in the pool"


def test_the_pool_keeps_no_more_than_its_budget():
    pool = AccumulatorPool(keep_bytes=4 * 1000)
    bufs = [pool.take(1000) for _ in range(3)]
    assert pool.peak_bytes == 3 * 4000
    for buf in bufs:
        pool.give(buf)
    assert pool.free_bytes == 4000 and pool.taken_bytes == 0
    assert pool.take(1000) is bufs[0]  # reused


def test_kept_buffers_reuse_what_nothing_refers_to_within_the_budgets_room():
    """A budgeted node keeps given-back accumulators and the buffers of large received frames for reuse
    (no fresh pages a push); a frame's buffer is free once no view of it is left, and a ticket that
    needs the room lets free buffers go (:class:`Kept`)."""
    from luwu.switch_nodes.kept_frames import Kept, KeptFrames

    pool, frames = AccumulatorPool(), KeptFrames()
    kept = Kept(pool, frames)
    for buf in [pool.take(1000) for _ in range(2)]:
        pool.give(buf)
    a, b = frames.take(5000), frames.take(5000)
    assert a.ctypes.data != b.ctypes.data and frames.free_bytes == 0
    at = a.ctypes.data
    del a
    assert frames.free_bytes == 5000
    assert frames.take(5000).ctypes.data == at  # reused (and free again: the result was dropped)
    view = b[10:]  # a message's tensor of it
    del b
    assert frames.free_bytes == 5000, "a buffer a view still reads is not free"
    kept.fit(13000)  # room for all that is free: all kept
    assert pool.free_bytes == 8000 and frames.free_bytes == 5000
    kept.fit(9000)  # each kind trimmed in proportion to what it keeps (8/13 and 5/13 of the room)
    assert pool.free_bytes == 4000 and frames.free_bytes == 0
    del view
    assert frames.free_bytes == 5000
    kept.fit(4500)
    assert pool.free_bytes == 0 and frames.free_bytes == 0
    kept.fit(-4000)  # a push let in past the budget, nothing kept: nothing to do (no division by 0)
    assert pool.free_bytes == 0 and frames.free_bytes == 0

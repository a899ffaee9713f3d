"""The worker's cheaper CPU paths (issue 36) give what the passes they replace gave.

- A gradient copied into its bucket is checked for NaN / inf as it is copied (``copy_finite_``), so
  the push needs no second pass over the bucket: the answer is ``has_nonfinite``'s, and ``copy_in``
  keeps a bucket's answer over its segments (one non-finite segment decides, one not checked leaves
  it to the push).
- A ``bf16_steps`` reply to a bucket of several parameters steps each parameter's slice where it is
  (``decode_add_segments_``): the same bits as stepping a staging buffer gathered from them, and a
  reply that does not add up is refused before anything is written.
- A streamed bucket's int8 or int4 push is encoded from its gradients where they are
  (``encode_pieces_``): the bits of copying them together first, and nothing written when one holds
  a NaN or an infinity.
"""

from __future__ import annotations

import pytest
import torch

from luwu.gpu_workers.grad_views import copy_in
from luwu.protocol import native
from luwu.protocol.codecs import copy_finite_, get_codec, has_nonfinite
from luwu.protocol.errors import ProtocolError

pytestmark = pytest.mark.timeout(120)
STEPS = get_codec("bf16_steps")


@pytest.fixture
def kernels():
    native.reset()
    if native.kernels() is None:
        pytest.skip(f"no kernels here ({native.reason})")
    yield
    native.reset()


@pytest.mark.parametrize("n", [1, 7, 4096, 70_001])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_the_copy_answers_what_has_nonfinite_answers(kernels, n, bad):
    g = torch.Generator().manual_seed(n)
    for at in sorted({0, n // 2, n - 1}):
        src = torch.randn(n, generator=g) * 1e3
        src[: min(n, 4)] = torch.tensor([3.4e38, -3.4e38, 1e-45, -0.0])[: min(n, 4)]
        if bad is not None:
            src[at] = bad
        dst = torch.full((n,), 7.0)
        finite = copy_finite_(dst, src)
        assert finite is (not has_nonfinite(src))
        assert torch.equal(dst.view(torch.int32), src.view(torch.int32))  # bit for bit (NaN too)


def test_what_the_kernel_cannot_take_is_copied_and_left_unknown(kernels, monkeypatch):
    src = torch.randn(64)
    for dst, s in [
        (torch.zeros(64, dtype=torch.bfloat16), src),  # another dtype
        (torch.zeros(64), src.to(torch.bfloat16)),
        (torch.zeros(128)[::2], src),  # not contiguous
    ]:
        assert copy_finite_(dst, s) is None
        assert torch.equal(dst.float(), s.to(dst.dtype).float())
    monkeypatch.setenv("LUWU_NATIVE", "0")
    native.reset()
    dst = torch.zeros(64)
    assert copy_finite_(dst, src) is None and torch.equal(dst, src)


def test_a_bucket_is_finite_when_every_segment_was_checked_finite(kernels):
    ok, bad = torch.randn(8), torch.randn(8)
    bad[3] = float("nan")
    bucket = torch.zeros(16)
    assert copy_in(bucket[:8], ok) is True
    assert copy_in(bucket[8:], bad, True) is False
    assert copy_in(bucket[:8], ok, False) is False  # a non-finite segment decides
    view = bucket[:8]
    assert copy_in(view, view, True) is None  # already the bucket's view: not checked here
    assert copy_in(bucket[:8], ok, None) is None
    assert copy_in(bucket[:8], bad, None) is False


def _bucket(seed: int, sizes: list[int], half: list[bool]):
    """A bucket of parameters (sizes, bf16 or fp32), their weights before and after a step, and the reply."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    old = torch.randn(n, generator=g) * 0.02
    new = old + torch.randn(n, generator=g) * 1e-3
    new[:: max(1, n // 50)] += 1.0  # escapes, in several segments
    old_bf = old.to(torch.bfloat16)
    enc = STEPS.encode_steps(new, STEPS.snapshot(old))
    assert enc.meta["escapes"] > 0
    frames = [f.contiguous().view(torch.uint8) for f in enc.frames]
    params, at = [], 0
    for size, h in zip(sizes, half):
        seg = old_bf[at : at + size]
        params.append(seg.clone() if h else seg.float())
        at += size
    return params, frames, enc.meta, old_bf


@pytest.mark.parametrize(
    "sizes,half",
    [
        ([1000, 2048, 37], [False, False, False]),
        ([1, 4095, 64, 64], [True, False, True, False]),
        ([70_001], [False]),
    ],
)
def test_stepping_each_segment_in_place_gives_the_staged_bits(kernels, sizes, half):
    params, frames, meta, old_bf = _bucket(len(sizes), sizes, half)
    staged = old_bf.float()
    STEPS.decode_add_(staged, frames, meta)
    assert STEPS.decode_add_segments_(params, frames, meta) is True
    got = torch.cat([p.float() for p in params])
    assert torch.equal(got.view(torch.int32), staged.view(torch.int32))


def test_a_reply_that_does_not_add_up_is_refused_before_any_segment_is_written(kernels):
    params, frames, meta, _ = _bucket(3, [500, 700], [False, True])
    before = [p.clone() for p in params]
    codes = frames[0].clone()
    codes.view(torch.int8)[-1] = -128  # one escape more in the codes than the reply announces
    with pytest.raises(ProtocolError, match="escapes"):
        STEPS.decode_add_segments_(params, [codes, frames[1]], meta)
    with pytest.raises(ProtocolError, match="escapes"):
        STEPS.decode_add_segments_(params[:1], frames, meta)  # codes for more weights than held
    for p, b in zip(params, before):
        assert torch.equal(p, b)


def test_targets_the_kernels_cannot_take_are_left_to_the_staging_buffer(kernels):
    params, frames, meta, _ = _bucket(4, [64, 64], [False, False])
    odd = [params[0], torch.zeros(128)[::2]]
    assert STEPS.decode_add_segments_(odd, frames, meta) is False
    assert torch.equal(odd[1], torch.zeros(64))


def _pieces(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(k, generator=g) * 10.0 ** (i % 3) for i, k in enumerate(sizes)]


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize(
    "sizes",
    [[1000], [300, 0, 700], [1, 255, 256, 513], [4096, 4096], [7] * 33, [768, 100, 5], [70_001, 3]],
)
def test_encoding_held_pieces_gives_the_bits_of_encoding_them_copied_together(kernels, name, sizes):
    """A streamed bucket's push encoded from its gradients where they are (bucket_fill): the codes
    and scales of copying them into the bucket first, blocks that span two pieces included."""
    codec = get_codec(name)
    pieces = _pieces(len(sizes), sizes)
    n = sum(sizes)
    want = codec.encode(torch.cat(pieces), codec.alloc(n))
    got = codec.encode_pieces_(pieces, codec.alloc(n))
    assert got is not None and got.meta == want.meta
    for u, v in zip(got.frames, want.frames, strict=True):
        assert torch.equal(u.view(torch.uint8), v.view(torch.uint8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_held_piece_with_a_nan_or_an_infinity_writes_nothing(kernels, bad):
    """The push then copies the pieces into the bucket and goes uncompressed."""
    codec = get_codec("int8")
    pieces = _pieces(9, [500, 600, 40])
    pieces[2][39] = bad
    out = [f.fill_(3) for f in codec.alloc(1140)]
    assert codec.encode_pieces_(pieces, out) is None
    assert all(bool((f == 3).all()) for f in out)


def test_pieces_the_kernels_cannot_take_are_left_to_the_copy(kernels):
    codec = get_codec("int8")
    ok = _pieces(2, [64])
    for pieces in ([ok[0], torch.randn(128)[::2]], [ok[0], torch.randn(64).to(torch.bfloat16)]):
        out = [f.fill_(3) for f in codec.alloc(128)]
        assert codec.encode_pieces_(pieces, out) is None
        assert all(bool((f == 3).all()) for f in out)

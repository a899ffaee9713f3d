"""A streamed bucket's gradient encoded over its own buffer (``_BlockCodec.encode_over_``, the C
kernel ``luwu_block_encode_over``): the frames are those of ``encode`` bit for bit, on the kernels
and on the torch path, and the codes' frame is the buffer's own memory (no frame allocated per push).
"""

from __future__ import annotations

import pytest
import torch

from luwu.gpu_workers.codec_plan import CodecPlan
from luwu.gpu_workers.encoding import GradientEncoder
from luwu.protocol import native
from luwu.protocol.codecs import get_codec
from luwu.protocol.compression import CompressionConfig
from luwu.protocol.layout import ParamSpec, build_layout

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def kernels():
    native.reset()
    if native.kernels() is None:
        pytest.skip(f"the kernels did not load ({native.reason}): encode_over_ is not used")
    yield native.kernels()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() * a.element_size() == b.numel() * b.element_size() and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _gradient(n: int, block: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)
    x[: min(n, block)] = 0.0  # an all-zero block
    x[n // 2 :: 97] = 0.5  # ties of the rounding
    return x


@pytest.mark.parametrize(
    "name,block", [("int8", 256), ("int8", 64), ("int8", 1), ("int4", 64), ("int4", 2)]
)
@pytest.mark.parametrize("n", [1, 7, 255, 256, 1000, (1 << 19) + 77])
def test_codes_over_the_buffer_are_the_bits_of_encode(kernels, monkeypatch, name, block, n):
    codec = get_codec(name, block=block)
    x = _gradient(n, block, n + block)
    want = codec.encode(x.clone())  # kernels
    monkeypatch.setenv("LUWU_NATIVE", "0")
    native.reset()
    torch_path = codec.encode(x.clone())
    monkeypatch.delenv("LUWU_NATIVE")
    native.reset()
    buf = x.clone()
    got = codec.encode_over_(buf, num_summands=2)
    assert got is not None and got.meta == want.meta == torch_path.meta
    assert got.frames[0].data_ptr() == buf.data_ptr()  # the codes are the buffer's own bytes
    for i, (u, v, w) in enumerate(zip(got.frames, want.frames, torch_path.frames)):
        assert _same(u, v) and _same(u, w), f"{name} block {block} n {n}: frame {i} differs"


def test_nonfinite_blocks_over_the_buffer_decode_nonfinite(kernels):
    codec = get_codec("int8")
    x = _gradient(4096, 256, 1)
    x[300], x[1000] = float("nan"), float("inf")
    want = codec.encode(x.clone())
    got = codec.encode_over_(x.clone())
    for u, v in zip(got.frames, want.frames):
        assert _same(u, v)
    out = torch.empty(4096)
    codec.decode_(out, got.frames, got.meta)
    assert not torch.isfinite(out[256:512]).any() and not torch.isfinite(out[768:1024]).any()
    assert torch.isfinite(out[:256]).all()


def test_what_the_kernels_cannot_take_is_left_untouched(kernels):
    codec = get_codec("int8")
    strided = torch.randn(2000)[::2]
    before = strided.clone()
    assert codec.encode_over_(strided) is None
    assert torch.equal(strided, before)


def test_a_streamed_push_carries_its_codes_in_the_borrowed_buffer(kernels):
    """GradientEncoder: a streamed bucket's int8 push is written over its gradient buffer, with
    the frames a resident bucket's push encodes into frames of its own."""
    layout = build_layout([ParamSpec("w", (3000, 7))], 1 << 30, [1.0])
    cfg = CompressionConfig(
        warmup_steps=0, error_feedback=False, rules=[("*", "int8")], link_gbps=1.0
    )
    b = layout.buckets[0]
    x = _gradient(b.numel, 256, 3)
    streamed = GradientEncoder(
        CodecPlan(config_of=lambda node: cfg, streamed=frozenset({b.id})),
        optimizer="adamw",
        world_size=2,
        streamed=frozenset({b.id}),
    )
    resident = GradientEncoder(
        CodecPlan(config_of=lambda node: cfg), optimizer="adamw", world_size=2
    )
    buf = x.clone()
    name, got, _ = streamed.encode(b, buf, 0, 5, {}, True)
    want_name, want, _ = resident.encode(b, x.clone(), 0, 5, {}, True)
    assert name == want_name == "int8"
    assert got.frames[0].data_ptr() == buf.data_ptr()  # no frame of its own
    assert want.frames[0].data_ptr() != x.data_ptr()
    for u, v in zip(got.frames, want.frames):
        assert _same(u, v)

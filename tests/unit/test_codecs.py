"""Codecs, error feedback and the pull-direction delta encoder."""

from __future__ import annotations

import math
import threading
import warnings

import msgpack
import pytest
import torch

from luwu.protocol.codecs import (
    Codec,
    Encoded,
    codec_names,
    get_codec,
    has_nonfinite,
    register_codec,
    topk_indices,
)
from luwu.protocol.errors import ConfigError, ProtocolError
from luwu.protocol.feedback import DeltaEncoder, ErrorFeedback, apply_pull_

pytestmark = pytest.mark.timeout(60)

ALL = ["none", "bf16", "fp16", "int8", "int4", "topk"]
DENSE_LOSSY = ["bf16", "fp16", "int8", "int4"]
SIZES = [0, 1, 7, 255, 256, 257, 1000, 100_003]


def wire(enc: Encoded) -> list[torch.Tensor]:
    """The frames as the receiver sees them: read-only uint8 views over bytes."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer on read-only bytes
        for f in enc.frames:
            data = f.contiguous().view(torch.uint8).numpy().tobytes()
            out.append(
                torch.frombuffer(data, dtype=torch.uint8)
                if data
                else torch.empty(0, dtype=torch.uint8)
            )
    return out


def lengths(frames: list[torch.Tensor]) -> list[int]:
    return [f.numel() for f in frames]


def roundtrip(codec: Codec, x: torch.Tensor, **kw) -> tuple[Encoded, torch.Tensor]:
    enc = codec.encode(x, **kw)
    frames = wire(enc)
    codec.validate(x.numel(), lengths(frames), enc.meta)
    out = torch.full_like(x, 123.0)
    codec.decode_(out, frames, enc.meta)
    return enc, out


def max_error(name: str, x: torch.Tensor, enc: Encoded) -> torch.Tensor:
    """The per-element bound each codec promises."""
    ax = x.abs()
    if name == "none":
        return torch.zeros_like(x)
    if name == "bf16":
        return ax * 2.0**-8
    if name == "fp16":
        return ax * 2.0**-10 + 2.0**-24 / enc.meta["scale"]
    if name in ("int8", "int4"):
        b = enc.meta["block"]
        levels = 127 if name == "int8" else 7
        n = x.numel()
        pad = torch.zeros(-(-n // b) * b)
        pad[:n] = ax
        amax = pad.view(-1, b).amax(dim=1)
        # below the scale floor the step is that of the floor
        per = (amax.clamp(min=2.0**-120) / (2 * levels)).repeat_interleave(b)[:n]
        return per * (1 + 1e-5) + ax * 1e-6
    raise AssertionError(name)


# -- registry -------------------------------------------------------------------


def test_registry_knows_every_codec_and_caches_instances():
    assert set(ALL) <= set(codec_names())
    for name in ALL:
        assert get_codec(name) is get_codec(name)
        assert get_codec(name).name == name
    assert get_codec("int8", block=128) is not get_codec("int8")
    assert get_codec("int8", block=128).block == 128
    assert get_codec("topk:0.05").density == 0.05
    assert get_codec("int4:32").block == 32


def test_unknown_codec_and_bad_params_are_config_errors_naming_them():
    with pytest.raises(ConfigError, match="zstd"):
        get_codec("zstd")
    with pytest.raises(ConfigError, match="block"):
        get_codec("int8", block=0)
    with pytest.raises(ConfigError, match="even"):
        get_codec("int4", block=63)
    with pytest.raises(ConfigError, match="density"):
        get_codec("topk", density=1.5)
    with pytest.raises(ConfigError, match="values"):
        get_codec("topk", values="fp8")
    with pytest.raises(ConfigError, match="colour"):
        get_codec("bf16", colour=1)


def test_register_codec_adds_a_codec(monkeypatch):
    from luwu.protocol.codecs import registry as codecs

    monkeypatch.setattr(codecs, "_FACTORIES", dict(codecs._FACTORIES))  # leave no trace

    class Neg(type(get_codec("none"))):
        name = "test_neg"

    register_codec("test_neg", Neg)
    assert "test_neg" in codec_names()
    assert isinstance(get_codec("test_neg"), Neg)
    with pytest.raises(ConfigError, match="non-empty"):
        register_codec("", Neg)


# -- round trips and error bounds -------------------------------------------------


@pytest.mark.parametrize("name", ["none", *DENSE_LOSSY])
@pytest.mark.parametrize("n", SIZES)
def test_roundtrip_within_error_bound(name, n):
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-3, 3, n) if n else torch.randn(0)
    before = x.clone()
    codec = get_codec(name)
    enc, out = roundtrip(codec, x)
    assert torch.equal(x, before), "encode must not modify its input"
    assert (out - x).abs().le(max_error(name, x, enc)).all()
    assert sum(f.numel() * f.element_size() for f in enc.frames) == codec.wire_bytes(n)
    assert all(f.dim() == 1 and f.is_contiguous() for f in enc.frames)
    assert msgpack.unpackb(msgpack.packb(enc.meta)) == enc.meta


@pytest.mark.parametrize("name", ALL)
def test_encode_into_out_reuses_it_and_decode_add_scales(name):
    torch.manual_seed(1)
    codec = get_codec(name)
    x = torch.randn(70_001)
    out = codec.alloc(x.numel())
    enc = codec.encode(x, out)
    assert [f.data_ptr() for f in enc.frames] == [o.data_ptr() for o in out]
    frames = wire(enc)
    dec = torch.empty_like(x)
    codec.decode_(dec, frames, enc.meta)
    acc = torch.linspace(-1, 1, x.numel())
    expect = acc - 0.5 * dec
    codec.decode_add_(acc, frames, enc.meta, alpha=-0.5)
    torch.testing.assert_close(acc, expect, rtol=1e-6, atol=1e-6)
    # a second encode into the same buffers gives the same payload
    again = codec.encode(x, out)
    assert again.meta == enc.meta and all(
        torch.equal(a.view(torch.uint8), b) for a, b in zip(again.frames, frames)
    )


@pytest.mark.parametrize("name", ALL)
def test_bytes_per_element_matches_wire_bytes(name):
    codec = get_codec(name)
    n = 1 << 20
    assert codec.wire_bytes(n) == pytest.approx(codec.bytes_per_element() * n, rel=1e-3)
    assert codec.wire_bytes(0) == 0
    assert {"none": 4, "bf16": 2, "fp16": 2}.get(
        name, codec.bytes_per_element()
    ) == codec.bytes_per_element()
    assert codec.bytes_per_element() <= 4


def test_compression_ratios():
    assert get_codec("int8").bytes_per_element() == pytest.approx(1 + 4 / 256)
    assert get_codec("int4").bytes_per_element() == pytest.approx(0.5 + 4 / 64)
    assert get_codec("topk").bytes_per_element() == pytest.approx(0.01 * 8)
    assert get_codec("topk", values="bf16").bytes_per_element() == pytest.approx(0.01 * 6)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_all_zero_blocks_stay_zero_and_finite(name):
    codec = get_codec(name)
    b = codec.block
    x = torch.zeros(5 * b + 3)
    x[b : 2 * b] = torch.randn(b) * 1e3  # one loud block among silent ones
    x[3 * b] = 1e-35  # a tiny block
    x[4 * b] = 1e-38  # a block below the scale floor
    enc, out = roundtrip(codec, x)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:b], torch.zeros(b)) and torch.equal(out[2 * b : 3 * b], torch.zeros(b))
    assert torch.equal(out[4 * b + 1 :], torch.zeros(b + 2))
    assert out[3 * b] == pytest.approx(1e-35, rel=0.01)
    assert abs(out[4 * b]) <= 2.0**-120
    assert (out - x).abs().le(max_error(name, x, enc)).all()


@pytest.mark.parametrize("name", ["none", *DENSE_LOSSY])
def test_large_values_stay_finite(name):
    x = torch.tensor([3.0e38, -3.3e38, 1.0, -2.5e37, 0.0] * 100)
    enc, out = roundtrip(get_codec(name), x)
    assert torch.isfinite(out).all()
    assert (out - x).abs().le(max_error(name, x, enc)).all()


def test_fp16_scale_keeps_the_sum_of_summands_finite_and_lifts_tiny_values():
    codec = get_codec("fp16")
    workers = 8
    xs = [torch.randn(10_000) * 1e6 for _ in range(workers)]
    amax = max(x.abs().max().item() for x in xs)
    encs = [codec.encode(x, num_summands=workers) for x in xs]
    for e in encs:
        assert e.frames[0].abs().max() * workers <= 65504
    # summed in fp16 at one scale, as a receiver may: no overflow
    same = [codec.encode(x * (amax / x.abs().max()), num_summands=workers) for x in xs]
    assert len({e.meta["scale"] for e in same}) == 1
    total = torch.stack([e.frames[0] for e in same]).sum(0, dtype=torch.float16)
    assert torch.isfinite(total).all()
    acc = torch.zeros(10_000)
    for e in encs:
        codec.decode_add_(acc, wire(e), e.meta)
    bound = sum(x.abs() for x in xs) * 2.0**-10 + 1e-3
    assert (acc - sum(xs)).abs().le(bound).all()
    # tiny gradients would underflow in plain fp16; the scale lifts them
    tiny = torch.randn(1000) * 1e-9
    enc, out = roundtrip(codec, tiny)
    assert enc.meta["scale"] > 1
    assert ((out - tiny).norm() / tiny.norm()) < 1e-3


def test_fp16_rejects_bad_num_summands():
    with pytest.raises(ValueError, match="num_summands"):
        get_codec("fp16").encode(torch.ones(4), num_summands=0)


# -- top-k --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 100_003, 1 << 20])
@pytest.mark.parametrize("values", ["fp32", "bf16"])
def test_topk_sends_the_largest_magnitudes(n, values):
    torch.manual_seed(n)
    codec = get_codec("topk", values=values)
    x = torch.randn(n)
    enc, out = roundtrip(codec, x)
    k = codec.k_for(n)
    assert enc.meta["k"] == k == (0 if n == 0 else max(1, math.ceil(0.01 * n)))
    sent = out != 0
    assert int(sent.sum()) == k
    if 0 < k < n:
        assert x[sent].abs().min() >= x[~sent].abs().max()
    tol = 2.0**-8 if values == "bf16" else 0.0
    assert (out[sent] - x[sent]).abs().le(x[sent].abs() * tol).all()


def test_fast_topk_matches_exact_selection_and_falls_back_on_hard_inputs():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = 1 << 21
    x = torch.randn(n) * torch.rand(n) ** 4  # heavy-tailed
    for density in (0.01, 0.001, 0.05):
        k = math.ceil(density * n)
        idx = topk_indices(x, k, generator=g)
        assert idx.numel() == k
        assert torch.all(idx[1:] > idx[:-1]), "indices come sorted and unique"
        exact = set(torch.topk(x.abs(), k).indices.tolist())
        assert len(exact.intersection(idx.tolist())) >= 0.999 * k
    # ties everywhere: all equal magnitude, so the sample threshold passes nothing
    ones = torch.ones(n)
    ones[::2] = -1
    assert topk_indices(ones, 1000, generator=g).numel() == 1000
    # a few integer levels: many ties at the k-th magnitude
    levels = torch.randint(-3, 4, (n,)).float()
    idx = topk_indices(levels, 50_000, generator=g)
    assert idx.numel() == 50_000 and idx.unique().numel() == 50_000
    assert levels[idx].abs().min() >= 3
    # almost all zeros: fewer non-zeros than k
    sparse = torch.zeros(n)
    sparse[torch.randperm(n)[:100]] = 1.0
    idx = topk_indices(sparse, 5000, generator=g)
    assert idx.numel() == 5000 and sparse[idx].sum() == 100


def test_topk_rejects_out_of_range_indices_before_touching_acc():
    codec = get_codec("topk")
    x = torch.randn(1000)
    enc = codec.encode(x)
    frames = [f.clone() for f in enc.frames]
    frames[1][0] = 1000
    acc = torch.zeros(1000)
    with pytest.raises(ProtocolError, match="index out of range"):
        codec.decode_add_(acc, [f.view(torch.uint8) for f in frames], enc.meta)
    frames[1][0] = -1
    with pytest.raises(ProtocolError, match="index out of range"):
        codec.decode_add_(acc, [f.view(torch.uint8) for f in frames], enc.meta)
    assert torch.equal(acc, torch.zeros(1000))


# -- validation ---------------------------------------------------------------------


def good(name: str, n: int = 1000) -> tuple[Codec, list[int], dict]:
    codec = get_codec(name)
    enc = codec.encode(torch.randn(n))
    frames = lengths(wire(enc))
    codec.validate(n, frames, enc.meta)
    return codec, frames, enc.meta


@pytest.mark.parametrize("name", ALL)
def test_validate_refuses_wrong_frames(name):
    codec, frames, meta = good(name)
    with pytest.raises(ProtocolError, match="frame"):
        codec.validate(1000, frames + [4], meta)
    with pytest.raises(ProtocolError, match="frame"):
        codec.validate(1000, frames[:-1], meta)
    with pytest.raises(ProtocolError, match="frame 0"):
        codec.validate(1000, [frames[0] + 1, *frames[1:]], meta)
    if name != "topk":  # top-k's k comes from meta, checked below
        with pytest.raises(ProtocolError, match="bytes, expected"):
            codec.validate(1001, frames, meta)
    with pytest.raises(ProtocolError, match="numel"):
        codec.validate(-1, frames, meta)
    with pytest.raises(ProtocolError, match="unknown meta key"):
        codec.validate(1000, frames, {**meta, "evil": 1})
    with pytest.raises(ProtocolError, match="meta must be a dict"):
        codec.validate(1000, frames, [])


@pytest.mark.parametrize(
    "name,meta,match",
    [
        ("fp16", {}, "'scale' missing"),
        ("fp16", {"scale": "2"}, "'scale' must be"),
        ("fp16", {"scale": -1.0}, "positive and finite"),
        ("fp16", {"scale": math.inf}, "positive and finite"),
        ("fp16", {"scale": math.nan}, "positive and finite"),
        ("int8", {"block": True}, "got bool"),
        ("int8", {"block": 0}, "not a valid block"),
        ("int8", {"block": 2.0}, "'block' must be"),
        ("int4", {"block": 63}, "not a valid block"),
        ("int8", {"block": 128}, "frame 1 has"),  # the scale frame no longer matches
        ("topk", {"k": 1001, "values": "fp32"}, "outside"),
        ("topk", {"k": -1, "values": "fp32"}, "outside"),
        ("topk", {"k": 10, "values": "fp8"}, "'values'"),
        ("topk", {"k": 11}, "'values' missing"),
        ("topk", {"k": 9, "values": "fp32"}, "frame 0 has"),
    ],
)
def test_validate_refuses_bad_meta(name, meta, match):
    codec, frames, _ = good(name)
    with pytest.raises(ProtocolError, match=match):
        codec.validate(1000, frames, meta)


# -- non-finite input ---------------------------------------------------------------


def test_has_nonfinite():
    assert not has_nonfinite(torch.randn(1000))
    assert not has_nonfinite(torch.empty(0))
    assert not has_nonfinite(torch.tensor([3.0e38, -3.0e38]))
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(100_000)
        x[77_777] = bad
        assert has_nonfinite(x)


@pytest.mark.parametrize("name", ["none", *DENSE_LOSSY])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_dense_codecs_carry_nonfinite_through(name, bad):
    """A receiver summing payloads still sees that something was not finite."""
    x = torch.randn(1000)
    x[500] = bad
    _, out = roundtrip(get_codec(name), x)
    assert has_nonfinite(out)


# -- memory: no full-size temporaries on the hot paths ---------------------------------


@pytest.mark.parametrize("name", ALL)
def test_decode_add_and_encode_into_out_allocate_no_full_size_temporary(name):
    from torch.profiler import ProfilerActivity, profile

    n = 1 << 23
    torch.manual_seed(0)
    codec = get_codec(name)
    x = torch.randn(n)
    out = codec.alloc(n)
    enc = codec.encode(x, out)
    frames = wire(enc)
    acc = torch.zeros(n)
    codec.decode_add_(acc, frames, enc.meta)  # warm the scratch buffers
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        codec.decode_add_(acc, frames, enc.meta)
        codec.encode(x, out)
    biggest = max([e.cpu_memory_usage for e in prof.events()] + [0])
    assert biggest < n, f"{name}: an allocation of {biggest} bytes for {n} elements"


def test_scratch_buffers_are_per_thread():
    codec = get_codec("int8")
    xs = [torch.randn(300_001) for _ in range(4)]
    expect = [codec.encode(x) for x in xs]
    got: list = [None] * 4

    def run(i):
        for _ in range(5):
            got[i] = codec.encode(xs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for e, g in zip(expect, got):
        assert all(torch.equal(a, b) for a, b in zip(e.frames, g.frames))


# -- error feedback -------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_fused_feedback_equals_encoding_x_plus_residual(name):
    torch.manual_seed(2)
    codec = get_codec(name)
    x, r0 = torch.randn(100_003), torch.randn(100_003) * 0.1
    plain = codec.encode(x + r0)
    r = r0.clone()
    enc = codec.encode_feedback_(x, r)
    assert enc.meta == plain.meta
    assert all(torch.equal(a, b) for a, b in zip(enc.frames, plain.frames))
    dec = torch.zeros_like(x)
    codec.decode_(dec, wire(enc), enc.meta)
    # what was sent plus what was kept is what there was
    torch.testing.assert_close(dec + r, x + r0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_error_feedback_sends_everything_eventually(name):
    """Over T steps, sum(decoded) = sum(x) - final residual: no gradient is lost."""
    torch.manual_seed(3)
    codec = get_codec(name)
    ef = ErrorFeedback()
    n, steps = 20_000, 40
    total_x, total_dec = torch.zeros(n), torch.zeros(n)
    grad = torch.randn(n)
    for _ in range(steps):
        x = grad + 0.1 * torch.randn(n)
        total_x += x
        enc = ef.encode("b", codec, x)
        codec.decode_add_(total_dec, wire(enc), enc.meta)
    torch.testing.assert_close(total_dec + ef.residual("b"), total_x, rtol=0, atol=1e-3)
    # and the mean sent gradient approaches the mean gradient
    no_ef = torch.zeros(n)
    codec.decode_(no_ef, wire(codec.encode(grad)), codec.encode(grad).meta)
    err_ef = (total_dec / steps - total_x / steps).norm()
    err_plain = (no_ef - grad).norm()
    assert err_ef < err_plain


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_a_bf16_residual_loses_only_its_rounding(name):
    """``ErrorFeedback(torch.bfloat16)`` (compression.residual_dtype): half the memory; what is sent plus the
    residual still adds up to what came in, up to the bf16 rounding of the residual each step (2^-9 of it),
    and the flush into a lossless codec sends the residual widened back to fp32."""
    torch.manual_seed(3)
    codec = get_codec(name)
    ef, ef32 = ErrorFeedback(torch.bfloat16), ErrorFeedback()
    n, steps = 20_000, 40
    total_x, total_dec, dec32 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    grad = torch.randn(n)
    lost = torch.zeros(n)
    for _ in range(steps):
        x = grad + 0.1 * torch.randn(n)
        total_x += x
        enc = ef.encode("b", codec, x)
        codec.decode_add_(total_dec, wire(enc), enc.meta)
        lost += (
            ef.residual("b").float().abs() * 2.0**-8
        )  # (bound: a round-to-nearest error is at most half an ulp)
        enc32 = ef32.encode("b", codec, x)
        codec.decode_add_(dec32, wire(enc32), enc32.meta)
    r = ef.residual("b").clone()
    # the residual, and the fp32 scratch it is widened into unless the codec's kernel takes bf16 itself
    scratch = 0 if codec.takes_bf16_residual(grad) else n * 4
    assert r.dtype == torch.bfloat16 and ef.nbytes == n * 2 + scratch
    err = (total_dec + r.float() - total_x).abs()
    assert bool((err <= lost + 1e-3).all()), float((err - lost).max())
    # it still sends the mean gradient about as well as the fp32 residual
    assert (total_dec - total_x).norm() < 1.5 * (dec32 - total_x).norm() + 1e-3 * n**0.5
    none = get_codec("none")
    flushed = ef.encode("b", none, grad)
    torch.testing.assert_close(flushed.frames[0], grad + r.float())
    assert torch.equal(ef.residual("b"), torch.zeros(n, dtype=torch.bfloat16))


def test_error_feedback_refuses_other_residual_dtypes():
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        ErrorFeedback(torch.float16)


def test_error_feedback_skips_nonfinite_and_flushes_into_lossless():
    codec = get_codec("int8")
    ef = ErrorFeedback()
    x = torch.randn(5000)
    ef.encode(7, codec, x)
    r = ef.residual(7).clone()
    assert r.abs().max() > 0
    bad = x.clone()
    bad[3] = math.nan
    enc = ef.encode(7, codec, bad)
    assert torch.equal(ef.residual(7), r), "a non-finite step leaves the residual alone"
    out = torch.zeros(5000)
    codec.decode_(out, wire(enc), enc.meta)
    assert has_nonfinite(out)
    # switching to a lossless codec sends the residual along and clears it
    none = get_codec("none")
    enc = ef.encode(7, none, x)
    torch.testing.assert_close(enc.frames[0], x + r)
    assert torch.equal(ef.residual(7), torch.zeros(5000))
    assert torch.equal(ef.encode(7, none, x).frames[0], x)
    ef.reset()
    assert ef.residual(7) is None and ef.nbytes == 0


def test_momentum_correction_matches_deep_gradient_compression():
    """Lin et al. 2018, Algorithm 1 with momentum factor masking, element by element:
    u = beta u + alpha g; v += u; send top-k of v; clear v and u where sent."""
    torch.manual_seed(4)
    codec = get_codec("topk", density=0.05)
    ef = ErrorFeedback()
    n, beta, alpha = 4000, 0.9, 0.1
    u, v = torch.zeros(n), torch.zeros(n)
    for step in range(12):
        g = torch.randn(n) * (1 + step % 3)
        enc = ef.encode("b", codec, g, momentum=(beta, alpha))
        u = beta * u + alpha * g
        v = v + u
        idx = torch.topk(v.abs(), codec.k_for(n)).indices.sort().values
        assert torch.equal(enc.frames[1].long(), idx), f"step {step}: another selection"
        torch.testing.assert_close(enc.frames[0], v[idx], rtol=1e-6, atol=1e-6)
        v[idx] = 0
        u[idx] = 0
        torch.testing.assert_close(ef.residual("b"), v, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ef.velocity("b"), u, rtol=1e-5, atol=1e-5)
    assert ef.nbytes == 2 * 4 * n


def test_momentum_correction_needs_a_sparse_codec_and_resets_with_the_residual():
    ef = ErrorFeedback()
    x = torch.randn(3000)
    with pytest.raises(ConfigError, match="sparse codec.*'int8'"):
        ef.encode(1, get_codec("int8"), x, momentum=(0.9, 0.1))
    topk = get_codec("topk")
    ef.encode(1, topk, x, momentum=(0.9, 0.1))
    assert ef.velocity(1).abs().max() > 0
    ef.encode(1, topk, x)  # a step without: the velocity is dropped, plain error feedback goes on
    assert ef.velocity(1) is None and ef.residual(1) is not None
    ef.encode(1, topk, x, momentum=(0.9, 0.1))
    ef.encode(
        1, get_codec("none"), x
    )  # a lossless step flushes the residual and drops the velocity
    assert ef.velocity(1) is None
    ef.encode(2, topk, x, momentum=(0.9, 0.1))
    ef.reset(2)
    assert ef.velocity(2) is None and ef.residual(2) is None


# -- pull direction: int8 deltas against a shadow ---------------------------------------


@pytest.mark.parametrize("caller_buffers", [False, True])
def test_delta_encoder_tracks_weights_within_codec_error_and_resyncs_exactly(caller_buffers):
    torch.manual_seed(4)
    n, every = 50_003, 20
    node = DeltaEncoder("int8", resync_every=every)
    outs = [node.codec.alloc(n) for _ in range(2)]
    full_outs = [node.full.alloc(n) for _ in range(2)]
    w = torch.randn(n)
    held = torch.full((n,), math.nan)  # the worker's copy, garbage before the first reply
    m = torch.zeros(n)
    fulls = []
    for step in range(65):
        m.mul_(0.9).add_(torch.randn(n), alpha=1e-3)  # smooth, optimizer-like updates
        w.add_(m)
        if caller_buffers:
            p = node.encode("b0", w, step, out=outs[step & 1], full_out=full_outs[step & 1])
            assert (
                p.encoded.frames[0].data_ptr()
                == (outs if p.delta else full_outs)[step & 1][0].data_ptr()
            )
        else:
            p = node.encode("b0", w, step)
        codec = get_codec(p.codec)
        frames = wire(p.encoded)
        codec.validate(n, lengths(frames), p.encoded.meta)
        apply_pull_(held, p.codec, p.delta, frames, p.encoded.meta)
        assert torch.equal(held, node.shadow("b0")), (
            "the worker's copy is bit-identical to the shadow"
        )
        if not p.delta:
            fulls.append(step)
            assert p.codec == "none" and torch.equal(held, w), "a resync is exact"
        else:
            assert p.codec == "int8"
            scales = p.encoded.frames[1].repeat_interleave(256)[:n]
            assert (held - w).abs().le(scales * 0.5 * (1 + 1e-4) + 1e-6 * w.abs()).all()
    assert fulls == [0, 20, 40, 60]
    node.force_resync("b0")
    assert not node.encode("b0", w, 65).delta


def test_delta_encoder_rejects_bad_settings():
    with pytest.raises(ConfigError, match="resync_every"):
        DeltaEncoder(resync_every=0)
    with pytest.raises(ConfigError, match="lossless"):
        DeltaEncoder(full_codec="bf16")

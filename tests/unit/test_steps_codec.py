"""``bf16_steps`` (the pull direction's bf16 weights as one-byte steps): a worker stepped by it holds the
bf16 rounding of the node's weights bit for bit, through its fused kernels and through the torch path
alike (a node and its workers may run either), and a reply that does not add up is refused before
anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.protocol import native
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import ConfigError, ProtocolError

pytestmark = pytest.mark.timeout(120)
CODEC = get_codec("bf16_steps")
EDGES = [0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0, 1e-30, -1e-30, 3.4e38, -3.4e38, 1.0, -1.0]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    monkeypatch.setenv("LUWU_NATIVE", "1" if request.param == "native" else "0")
    native.reset()
    if request.param == "native" and native.kernels() is None:
        pytest.skip(f"no kernels here ({native.reason}): the torch path is tested")
    yield request.param
    monkeypatch.delenv("LUWU_NATIVE")
    native.reset()


def bf16_of(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16)


def wire(enc) -> list[torch.Tensor]:
    """The frames as a worker receives them: uint8 views."""
    return [f.contiguous().view(torch.uint8) for f in enc.frames]


def pair(n: int, move: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g) * 0.02
    new = old + torch.randn(n, generator=g) * move
    k = min(n, len(EDGES))
    old[:k], new[:k] = (
        torch.tensor(EDGES[:k]),
        torch.tensor(EDGES[::-1][:k]),
    )  # sign flips, zeros, extremes
    return old, new


def step(old: torch.Tensor, new: torch.Tensor, half: bool = False):
    """A worker holding bf16(old) (fp32 or bf16 tensor) stepped by the reply for new; (what it holds, the reply)."""
    enc = CODEC.encode_steps(new, CODEC.snapshot(old))
    CODEC.validate(new.numel(), [f.nbytes for f in enc.frames], enc.meta)
    held = bf16_of(old) if half else bf16_of(old).float()
    CODEC.decode_add_(held, wire(enc), enc.meta)
    return held, enc


@pytest.mark.parametrize("n", [1, 7, 64, 1000, 70_001])
@pytest.mark.parametrize("move", [1e-5, 1e-3, 1.0])
def test_a_stepped_copy_is_the_bf16_rounding_bit_for_bit(path, n, move):
    old, new = pair(n, move)
    for half in (False, True):
        held, enc = step(old, new, half)
        want = bf16_of(new) if half else bf16_of(new).float()
        assert torch.equal(
            held.view(torch.int16 if half else torch.int32),
            want.view(torch.int16 if half else torch.int32),
        )
    codes = enc.frames[0]
    assert enc.meta["escapes"] == int((codes == -128).sum()) == enc.frames[1].numel()
    if (
        move == 1e-5 and n >= 1000
    ):  # less than a bf16 ulp: mostly zero; the edges and weights near 0 escape
        assert enc.meta["escapes"] <= len(EDGES) + n // 1000 and (codes == 0).float().mean() > 0.5
    if move == 1.0:
        assert enc.meta["escapes"] > n // 2


def test_native_and_torch_paths_send_the_same_bytes(monkeypatch):
    old, new = pair(5000, 1e-3, seed=3)
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LUWU_NATIVE", flag)
        native.reset()
        enc = CODEC.encode_steps(new, CODEC.snapshot(old))
        out[flag] = [f.clone() for f in enc.frames], enc.meta
    native.reset()
    (a, ma), (b, mb) = out["0"], out["1"]
    assert ma == mb and all(torch.equal(x, y) for x, y in zip(a, b))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(width=32, allow_nan=False, allow_infinity=False),
            st.floats(width=32, allow_nan=False, allow_infinity=False),
        ),
        min_size=1,
        max_size=200,
    )
)
def test_any_finite_weights_step_exactly(values):
    old = torch.tensor([a for a, _ in values], dtype=torch.float32)
    new = torch.tensor([b for _, b in values], dtype=torch.float32)
    held, _ = step(old, new)
    assert torch.equal(held.view(torch.int32), bf16_of(new).float().view(torch.int32))


def test_non_finite_weights_go_as_escapes(path):
    old = torch.tensor([1.0, 2.0, 3.0, float("inf")])
    new = torch.tensor([float("inf"), -float("inf"), 3.0, 3.0])
    held, enc = step(old, new)
    assert enc.meta["escapes"] == 3  # (inf -> 3.0 is a large step)
    assert (
        held[0] == float("inf") and held[1] == -float("inf") and held[2] == 3.0 and held[3] == 3.0
    )


def test_a_reply_that_does_not_add_up_is_refused_before_anything_is_written(path):
    old, new = pair(300, 1.0)
    enc = CODEC.encode_steps(new, CODEC.snapshot(old))
    k = enc.meta["escapes"]
    assert k > 0
    held = bf16_of(old).float()
    before = held.clone()
    codes = enc.frames[0].clone()
    codes[codes == -128] = 0  # the codes name no escape, the meta names k
    with pytest.raises(ProtocolError, match="escapes"):
        CODEC.decode_add_(
            held, [codes.view(torch.uint8), enc.frames[1].view(torch.uint8)], enc.meta
        )
    assert torch.equal(held, before)
    with pytest.raises(ProtocolError, match="escapes"):
        CODEC.decode_add_(
            held,
            [enc.frames[0].view(torch.uint8), enc.frames[1][1:].contiguous().view(torch.uint8)],
            enc.meta,
        )
    assert torch.equal(held, before)


def test_validation_and_misuse_name_what_is_wrong():
    with pytest.raises(ProtocolError, match="frame 1 has 6 bytes, expected 4"):
        CODEC.validate(10, [10, 6], {"escapes": 2})
    with pytest.raises(ProtocolError, match="not in"):
        CODEC.validate(10, [10, 22], {"escapes": 11})
    with pytest.raises(ProtocolError, match="meta key 'escapes' missing"):
        CODEC.validate(10, [10, 0], {})
    with pytest.raises(ConfigError, match="pull codec"):
        CODEC.encode(torch.zeros(4))
    with pytest.raises(ProtocolError, match="needs the weights it steps from"):
        CODEC.decode_(torch.zeros(4), [], {"escapes": 0})
    with pytest.raises(ValueError, match="not scaled"):
        CODEC.decode_add_(
            torch.zeros(4),
            [torch.zeros(4, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)],
            {"escapes": 0},
            alpha=0.5,
        )
    assert CODEC.pull_only and not get_codec("bf16").pull_only

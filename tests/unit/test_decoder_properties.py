"""The decoder against arbitrary input (hypothesis): it returns a message that satisfies the schema or
raises ProtocolError, nothing else, and its memory is bounded by the input it got, never by the sizes
the input claims. Codec ``validate`` likewise raises only ProtocolError, and what it lets through
decodes without touching memory outside the accumulator."""

from __future__ import annotations

import math
import tracemalloc

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from luwu.protocol import messages as wire
from luwu.protocol.codecs import codec_names, get_codec
from luwu.protocol.errors import ProtocolError
from luwu.protocol.messages import COMMON, OPTIONAL, SCHEMA, Op

JOB = "luwu"
FAST = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- what a valid message of each op looks like --------------------------------------------------

SPEC = [0, 0, 4, [[0, 0, 0, 4]]]
FIELDS: dict[Op, dict] = {
    Op.HELLO: {
        "world_size": 2,
        "layout": "ab12",
        "node_index": 0,
        "buckets": [SPEC],
        "optimizer": "adamw",
        "mode": "sync",
        "param_names": {0: "w"},
    },
    Op.WELCOME: {"layout": "ab12", "versions": {0: 3}, "initialized": [0]},
    Op.INIT: {"bucket": 0, "codec": "none", "cmeta": {}},
    Op.PUSH: {
        "bucket": 0,
        "codec": "none",
        "cmeta": {},
        "hyper": {"lr": 0.01, "betas": [0.9, 0.999]},
        "nograd": [],
        "two_phase": False,
        "pull": "bf16",
    },
    Op.UPDATE: {"bucket": 0, "codec": "none", "cmeta": {}, "skipped": False, "seq": 2},
    Op.PULL: {"bucket": 0, "codec": "none"},
    Op.STATE: {"bucket": 0, "action": "set", "names": ["params", "steps"]},
    Op.CHECKPOINT: {},
    Op.STATS: {"detail": {"step": 1}},
    Op.HEARTBEAT: {},
    Op.ERROR: {"code": "protocol", "message": "no", "ref_op": 4, "bucket": -1},
    Op.NORM: {"bucket": 0, "sqnorm": 1.5, "nonfinite": False},
    Op.COMMIT: {"coef": 0.5, "skip": False, "buckets": [0, 1]},
    Op.ROLLBACK: {},
    Op.EXPORT: {"path": "exports/step-3"},
    Op.BYE: {},
    Op.IMPORT: {"path": "checkpoints/step-3"},
}
PAYLOAD: dict[Op, list[bytes]] = {
    Op.INIT: [b"\0" * 16],
    Op.PUSH: [b"\0" * 16],
    Op.UPDATE: [b"\0" * 16],
    Op.STATE: [b"\0" * 16, b"\0" * 4],
    Op.EXPORT: [b"\x81\x00\x91\x04"],
    Op.IMPORT: [b"\x81\xa6params\x80"],
}


def valid(op: Op) -> tuple[dict, list[bytes]]:
    payload = PAYLOAD.get(op, [])
    header = {
        "v": wire.VERSION,
        "op": int(op),
        "job": JOB,
        "step": 3,
        "worker": 1,
        **FIELDS[op],
        "nbytes": [len(p) for p in payload],
    }
    return header, list(payload)


def test_every_op_has_a_valid_example():
    assert set(FIELDS) == set(Op)
    for op in Op:
        h, p = valid(op)
        msg = wire.decode([msgpack.packb(h), *p], job=JOB)
        assert msg.op == op and msg.header == {**h, "op": op}


# -- the contract ---------------------------------------------------------------------------------


def _is(val, types) -> bool:
    return isinstance(val, types) and (not isinstance(val, bool) or bool in types)


def check_decode(
    frames: list, *, job: str | None = JOB, max_message_bytes: int = 1 << 31
) -> wire.Message | None:
    """Decode ``frames``: a Message that satisfies the schema, or ProtocolError (returns None then)."""
    try:
        msg = wire.decode(frames, job=job, max_message_bytes=max_message_bytes)
    except ProtocolError as exc:
        assert str(exc), "a refusal must say what was wrong"
        return None
    h = msg.header
    assert isinstance(h, dict)
    assert h["v"] == wire.VERSION and _is(h["v"], (int,))
    assert isinstance(h["op"], Op)
    for name, types in (*COMMON.items(), *SCHEMA[h["op"]].items()):
        assert name in h, name
        assert _is(h[name], types), (name, h[name])
    for name, types in OPTIONAL.items():
        assert name not in h or _is(h[name], types), (name, h[name])
    assert set(h) <= set(COMMON) | set(SCHEMA[h["op"]]) | set(OPTIONAL) | {"nbytes"}
    assert h["step"] >= 0 and h["worker"] >= 0
    assert job is None or h["job"] == job
    nbytes = h.get("nbytes", [])
    assert len(nbytes) == len(msg.payload) == len(frames) - 1
    assert all(_is(n, (int,)) and n >= 0 for n in nbytes)
    assert [len(memoryview(p)) for p in msg.payload] == nbytes
    assert sum(nbytes) <= max_message_bytes
    assert [t.numel() for t in msg.tensors()] == nbytes
    return msg


def peak_bytes(fn) -> int:
    """Peak Python-heap bytes allocated while ``fn`` runs (msgpack builds its objects there)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def memory_bound(frames: list) -> int:
    """What decoding may allocate: Python objects for each byte of the header (an empty list costs 56
    bytes for 1 byte of msgpack) plus a constant; never anything proportional to a claimed size."""
    return 80 * len(frames[0]) + (256 << 10)


# -- strategies -----------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from(
    [-(2**63), -(2**31), -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**64 - 1]
)
INTS = st.one_of(st.integers(-(2**63), 2**64 - 1), HUGE_INTS)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=20), st.binary(max_size=20)
)
MSGPACK_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=6),
    ),
    max_leaves=25,
)
OPS = st.sampled_from(list(Op))
FIELD_NAMES = sorted({*COMMON, *OPTIONAL, "nbytes", *(f for s in SCHEMA.values() for f in s)})


@st.composite
def mutated(draw) -> list:
    """A valid message of some op with one to three mutations: field deletion, a value of another type
    (huge numbers, NaN, nested structures), negative or wrong sizes, an extra field, payload frames
    removed / added / resized, then possibly bit flips, truncation or extension of the packed header."""
    op = draw(OPS)
    header, payload = valid(op)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["delete", "retype", "extra", "nbytes", "payload", "op"]))
        if kind == "delete":
            header.pop(draw(st.sampled_from(sorted(header))), None)
        elif kind == "retype":
            header[draw(st.sampled_from(sorted(header)))] = draw(MSGPACK_VALUES)
        elif kind == "extra":
            header[draw(st.sampled_from(FIELD_NAMES + ["zz", ""]))] = draw(MSGPACK_VALUES)
        elif kind == "nbytes":
            header["nbytes"] = draw(st.lists(INTS, max_size=4))
        elif kind == "payload":
            payload = draw(st.lists(st.binary(max_size=40), max_size=4))
        else:
            header["op"] = draw(st.one_of(OPS.map(int), INTS, FLOATS, st.booleans()))
    raw = bytearray(msgpack.packb(header, use_bin_type=True))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << draw(st.integers(0, 7))
    cut = draw(st.one_of(st.none(), st.integers(0, len(raw))))
    if cut is not None:
        raw = raw[:cut]
    raw += draw(st.binary(max_size=8))
    return [bytes(raw), *payload]


# -- properties -------------------------------------------------------------------------------------


@FAST
@given(header=st.binary(max_size=256), payload=st.lists(st.binary(max_size=32), max_size=3))
def test_random_bytes_decode_or_protocol_error(header, payload):
    check_decode([header, *payload])


@FAST
@given(
    value=MSGPACK_VALUES,
    payload=st.lists(st.binary(max_size=32), max_size=3),
    job=st.sampled_from([JOB, None]),
)
def test_random_msgpack_values_decode_or_protocol_error(value, payload, job):
    check_decode([msgpack.packb(value, use_bin_type=True), *payload], job=job)


@settings(FAST, max_examples=1000)
@given(frames=mutated(), job=st.sampled_from([JOB, None]), limit=st.sampled_from([1 << 31, 20, 0]))
def test_mutated_valid_messages_decode_or_protocol_error(frames, job, limit):
    check_decode(frames, job=job, max_message_bytes=limit)


@FAST
@given(op=OPS, name=st.sampled_from(FIELD_NAMES), value=MSGPACK_VALUES)
def test_a_field_of_the_wrong_type_is_refused(op, name, value):
    header, payload = valid(op)
    allowed = {**COMMON, **SCHEMA[op], **OPTIONAL}.get(name)
    assume(name != "nbytes" and (allowed is None or not _is(value, allowed)))
    header[name] = value
    with pytest.raises(ProtocolError):
        wire.decode([msgpack.packb(header, use_bin_type=True), *payload], job=JOB)


@FAST
@given(frames=st.one_of(mutated(), st.lists(st.binary(max_size=64), min_size=1, max_size=3)))
def test_decoding_allocates_in_proportion_to_the_input(frames):
    assert peak_bytes(lambda: check_decode(frames)) <= memory_bound(frames)


@pytest.mark.parametrize("op", [4.0, True, "4", [4], None])
def test_op_must_be_an_int(op):
    """PROTOCOL.md: each field's type is checked and a bool is not an int; ``Op(4.0)`` and ``Op(True)``
    would name PUSH and HELLO."""
    header, payload = valid(Op.PUSH if op != True else Op.HELLO)  # noqa: E712
    header["op"] = op
    with pytest.raises(ProtocolError, match="op"):
        wire.decode([msgpack.packb(header), *payload], job=JOB)


HOSTILE_HEADERS = {
    "array of 2**32 elements announced": b"\xdd\xff\xff\xff\xff",
    "map of 2**32 entries announced": b"\xdf\xff\xff\xff\xff",
    "bin of 4 GiB announced": b"\xc6\xff\xff\xff\xff",
    "str of 4 GiB announced": b"\xdb\xff\xff\xff\xff",
    "ext of 4 GiB announced": b"\xc9\xff\xff\xff\xff\x01",
    "nesting 10000 deep": b"\x91" * 10_000 + b"\x90",
    "64 KiB of empty lists": b"\xdc\x7f\xff" + b"\x90" * 0x7FFF,
    "header over 64 KiB": msgpack.packb({"v": 1, "pad": b"x" * (wire.MAX_HEADER_BYTES + 1)}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_hostile_headers_are_refused_within_bounded_memory(name):
    frames = [HOSTILE_HEADERS[name]]
    assert peak_bytes(lambda: check_decode(frames)) <= memory_bound(frames)
    assert check_decode(frames) is None


@pytest.mark.parametrize("nbytes", [[2**63 - 1], [2**64 - 1], [-1], [2**40, 2**40], [1 << 30]])
def test_sizes_claimed_in_the_header_are_never_allocated(nbytes):
    header, _ = valid(Op.PUSH)
    header["nbytes"] = nbytes
    frames = [msgpack.packb(header), *([b"\0" * 16] * len(nbytes))]
    assert peak_bytes(lambda: check_decode(frames)) <= memory_bound(frames)
    assert check_decode(frames) is None


def test_a_large_payload_is_neither_copied_nor_accepted_over_the_limit():
    big = bytearray(64 << 20)
    header, _ = valid(Op.PUSH)
    header["nbytes"] = [len(big)]
    frames = [msgpack.packb(header), memoryview(big)]
    assert peak_bytes(lambda: check_decode(frames)) < (1 << 20)
    assert check_decode(frames, max_message_bytes=len(big) - 1) is None
    msg = check_decode(frames)
    big[0] = 7  # the payload is a view of the received frame, not a copy
    assert msg.tensors()[0][0] == 7


# -- codecs -----------------------------------------------------------------------------------------

CODECS = codec_names()
META_VALUES = st.one_of(
    INTS,
    FLOATS,
    st.booleans(),
    st.text(max_size=6),
    st.sampled_from(["fp32", "bf16"]),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
META_KEYS = st.sampled_from(["scale", "block", "k", "values", "x", ""])


def valid_meta(name: str, numel: int) -> tuple[dict, list[int]]:
    codec, x = get_codec(name), torch.randn(numel)
    enc = codec.encode_steps(x, codec.snapshot(x * 1.5)) if codec.pull_only else codec.encode(x)
    return dict(enc.meta), [f.numel() * f.element_size() for f in enc.frames]


@st.composite
def codec_inputs(draw):
    """A codec, a numel, and the meta / frame sizes of a valid encoding, mutated (or wholly random)."""
    name = draw(st.sampled_from(CODECS))
    numel = draw(st.integers(1, 300))
    meta, frames = valid_meta(name, numel)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["meta", "delete", "frames", "frame", "numel"]))
        if kind == "meta":
            meta[draw(META_KEYS)] = draw(META_VALUES)
        elif kind == "delete" and meta:
            meta.pop(draw(st.sampled_from(sorted(meta))))
        elif kind == "frames":
            frames = draw(st.lists(INTS, max_size=3))
        elif kind == "frame" and frames:
            frames[draw(st.integers(0, len(frames) - 1))] = draw(INTS)
        elif kind == "numel":
            numel = draw(st.one_of(INTS, st.integers(0, 300)))
    if draw(st.integers(0, 9)) == 0:
        meta = draw(MSGPACK_VALUES)
    return name, numel, meta, frames


@settings(FAST, max_examples=1000)
@given(args=codec_inputs())
@example(
    args=("fp16", 1, {"scale": 2.1894529067278e-121}, [2])
)  # 1/scale overflows fp32 inside decode
def test_codec_validate_raises_only_protocol_error(args):
    name, numel, meta, frames = args
    codec = get_codec(name)
    try:
        codec.validate(numel, frames, meta)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert isinstance(numel, int) and numel >= 0 and all(f >= 0 for f in frames)
    if numel > 4096:
        return  # a node's numel is its own bucket's, never this large in a test
    # what validate lets through must decode into an accumulator of numel without anything else going wrong
    g = torch.Generator().manual_seed(numel)
    payload = [torch.randint(0, 256, (f,), dtype=torch.uint8, generator=g) for f in frames]
    guard = torch.full((numel + 64,), 7.0)
    acc = guard[32 : 32 + numel]
    try:
        codec.decode_add_(acc, payload, meta)
    except ProtocolError:
        pass  # top-k's index range is checked against the payload itself
    assert torch.all(guard[:32] == 7.0) and torch.all(guard[32 + numel :] == 7.0), (
        "decode wrote outside the accumulator"
    )


@pytest.mark.parametrize("scale", [1e-39, 2.0**-127, 1e-300], ids=["1e-39", "2**-127", "1e-300"])
def test_fp16_scale_outside_what_an_encoder_produces_is_refused(scale):
    """``Fp16Codec.scale_for`` keeps scales in [2**-126, 2**126]; beyond that 1/scale is not an fp32
    number and decoding fails with a RuntimeError (or turns the bucket into inf) instead of a refusal."""
    with pytest.raises(ProtocolError, match="scale"):
        get_codec("fp16").validate(4, [8], {"scale": scale})


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 257])
def test_codec_validate_accepts_its_own_encoding(name, numel):
    meta, frames = valid_meta(name, numel)
    get_codec(name).validate(numel, frames, meta)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [-1, -(2**63), True, 1.5, None, "4"])
def test_codec_validate_refuses_bad_numel(name, numel):
    meta, frames = valid_meta(name, 4)
    with pytest.raises(ProtocolError):
        get_codec(name).validate(numel, frames, meta)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", [10, 1000, 1020])
def test_a_deeply_nested_field_is_refused_in_a_short_line(depth):
    """A header field nested as deep as msgpack allows (about 1,000 lists) is a ProtocolError that names
    the field by its type: before, building the message's repr recursed past Python's limit (a
    RecursionError from decode) and would have put up to 64 KiB of brackets in the node's log."""
    job: object = "j"
    for _ in range(depth):
        job = [job]
    raw = msgpack.packb(
        {"v": wire.VERSION, "op": int(Op.HELLO), "job": job, "worker": 0, "step": 0}
    )
    with pytest.raises(ProtocolError, match=r"field 'job' has type list.*job=<list>") as info:
        wire.decode([raw])
    assert len(str(info.value)) < 300

"""The wire: frames round-trip without copies of payloads; every bad field is refused by name."""

import msgpack
import pytest
import torch

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import JobMismatchError, ProtocolError
from luwu.protocol.messages import Op

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]


def push_header(**kw):
    h = {
        "op": Op.PUSH,
        "job": "j",
        "step": 3,
        "worker": 1,
        "bucket": 2,
        "codec": "none",
        "cmeta": {},
        "hyper": {"lr": 0.1},
        "nograd": [],
        "two_phase": False,
        "pull": "none",
    }
    h.update(kw)
    return h


def roundtrip(header, payload=()):
    frames = wire.encode(dict(header), payload)
    return wire.decode([bytes(f) for f in frames], job="j")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (7,), (3, 5)])
def test_payload_roundtrip_every_dtype(dtype, shape):
    t = (torch.arange(int(torch.tensor(shape).prod())) % 100).to(dtype).reshape(shape)
    msg = roundtrip(push_header(), [t])
    (frame,) = msg.tensors()
    back = frame.view(dtype).reshape(shape) if t.numel() else torch.empty(shape, dtype=dtype)
    assert torch.equal(back, t)
    assert msg.header["nbytes"] == [t.numel() * t.element_size()]


def test_non_contiguous_tensor_goes_through_contiguous_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        wire.encode(push_header(), [t])
    msg = roundtrip(push_header(), [t.contiguous()])
    assert torch.equal(msg.tensors()[0].view(torch.float32).reshape(4, 3), t)


def test_payload_frames_are_zero_copy_views():
    t = torch.arange(1000, dtype=torch.float32)
    frames = wire.encode(push_header(), [t])
    assert isinstance(frames[1], memoryview)
    t[0] = 42.0  # the frame sees the tensor's memory
    assert torch.frombuffer(frames[1], dtype=torch.float32)[0] == 42.0


def test_codec_payload_decodes_into_accumulator():
    x = torch.randn(1000)
    enc = get_codec("bf16").encode(x)
    msg = roundtrip(push_header(codec="bf16", cmeta=enc.meta), enc.frames)
    acc = torch.zeros(1000)
    get_codec("bf16").decode_add_(acc, msg.tensors(), msg.header["cmeta"])
    torch.testing.assert_close(acc, x, rtol=1e-2, atol=1e-2)


BAD = [
    ("garbage msgpack", lambda: [b"\xc1\xff\x00garbage"], "msgpack"),
    ("not a map", lambda: [msgpack.packb([1, 2, 3])], "must be a map"),
    ("wrong version", lambda: [msgpack.packb(dict(push_header(), v=99, nbytes=[]))], "version 99"),
    (
        "unknown op",
        lambda: [msgpack.packb(dict(push_header(), v=1, op=77, nbytes=[]))],
        "unknown op 77",
    ),
    (
        "missing field",
        lambda: [
            msgpack.packb(
                {k: v for k, v in dict(push_header(), v=1, nbytes=[]).items() if k != "hyper"}
            )
        ],
        "lacks field 'hyper'",
    ),
    (
        "wrong type",
        lambda: [msgpack.packb(dict(push_header(step="3"), v=1, nbytes=[]))],
        "'step' has type str",
    ),
    (
        "bool for int",
        lambda: [msgpack.packb(dict(push_header(bucket=True), v=1, nbytes=[]))],
        "'bucket' has type bool",
    ),
    (
        "bool for optional int",
        lambda: [msgpack.packb(dict(push_header(seq=False), v=1, nbytes=[]))],
        "'seq' has type bool",
    ),
    (
        "unknown field",
        lambda: [msgpack.packb(dict(push_header(evil=1), v=1, nbytes=[]))],
        "unknown fields",
    ),
    (
        "negative step",
        lambda: [msgpack.packb(dict(push_header(step=-1), v=1, nbytes=[]))],
        "negative",
    ),
    (
        "truncated payload",
        lambda: [msgpack.packb(dict(push_header(), v=1, nbytes=[400])), b"\0" * 399],
        "has 399 bytes, header says 400",
    ),
    (
        "missing frame",
        lambda: [msgpack.packb(dict(push_header(), v=1, nbytes=[4, 4])), b"\0" * 4],
        "announces 2 payload frames",
    ),
    (
        "extra frame",
        lambda: [msgpack.packb(dict(push_header(), v=1, nbytes=[])), b"\0" * 4],
        "announces 0 payload frames",
    ),
    ("bad nbytes", lambda: [msgpack.packb(dict(push_header(), v=1, nbytes=[-4])), b""], "nbytes"),
    ("huge header", lambda: [b"\x00" * (wire.MAX_HEADER_BYTES + 1)], "exceeds"),
    ("empty", lambda: [], "empty message"),
]


@pytest.mark.parametrize("name,frames,match", BAD, ids=[b[0] for b in BAD])
def test_malformed_messages_are_refused_by_name(name, frames, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode(frames(), job="j")


def test_other_job_refused():
    frames = wire.encode(push_header(job="other"))
    with pytest.raises(JobMismatchError, match="job 'other'"):
        wire.decode(frames, job="j")


def test_max_message_size_enforced():
    frames = wire.encode(push_header(), [torch.zeros(1000)])
    with pytest.raises(ProtocolError, match="exceeds the maximum"):
        wire.decode(frames, job="j", max_message_bytes=1000)


def test_no_top_level_protocol_module_loaded():
    import sys

    import luwu  # noqa: F401
    import luwu.gpu_workers.worker  # noqa: F401
    import luwu.switch_nodes.server  # noqa: F401

    for name in ("protocol", "switch_nodes", "gpu_workers"):
        assert name not in sys.modules, (
            f"{name} was imported as a top-level module: import it as luwu.{name}"
        )


def test_an_error_takes_its_facts_in_the_constructor():
    from luwu.protocol.errors import (
        CorruptCheckpointError,
        LuwuError,
        RemoteError,
        RollbackError,
        error_for_code,
    )
    from luwu.switch_nodes.checkpoint import CorruptCheckpointError as FromCheckpoint

    err = error_for_code(
        "rollback",
        "roll back",
        node="tcp://n:1",
        step=4,
        bucket=2,
        detail={"boot": "b"},
        ref_op=int(Op.PUSH),
    )
    assert type(err) is RollbackError and str(err) == "node tcp://n:1: roll back"
    assert (err.node, err.step, err.bucket, err.detail, err.ref_op, err.worker, err.boot) == (
        "tcp://n:1",
        4,
        2,
        {"boot": "b"},
        int(Op.PUSH),
        None,
        None,
    )
    other = error_for_code("no_such_code", "what", step=1)
    assert (
        type(other) is RemoteError
        and other.code == "no_such_code"
        and other.step == 1
        and other.node is None
    )
    assert RollbackError("x", step=3, boot="abc").boot == "abc"
    assert FromCheckpoint is CorruptCheckpointError and issubclass(
        CorruptCheckpointError, LuwuError
    )
    assert type(error_for_code(CorruptCheckpointError.code, "bad")) is CorruptCheckpointError


def test_the_kinds_and_the_node_lines_load_without_torch():
    """The command line names optimizers and reads a node's lines without loading torch."""
    import ast
    import pathlib

    import luwu.switch_nodes.optimizers as package

    root = pathlib.Path(package.__file__).parent
    for path in (root / "kinds.py", root / "__init__.py", root.parent / "lines.py"):
        tree = ast.parse(path.read_text())
        imported = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
        assert not [
            m
            for m in imported
            if m.split(".")[0] in ("torch", "zmq")
            or m.startswith("luwu.protocol.")
            and m != "luwu.protocol.errors"
        ], (path, imported)


def test_a_header_whose_payload_was_dropped_is_checked_alone():
    """header_only (the node's listener dropped a stranger's payload unread): the header is validated as
    ever, the missing payload frames are not held against it."""
    frames = wire.encode(
        {
            "op": Op.PUSH,
            "job": "j",
            "step": 3,
            "worker": 0,
            "bucket": 1,
            "codec": "none",
            "cmeta": {},
            "hyper": {},
            "nograd": [],
            "two_phase": False,
            "pull": "none",
        },
        [torch.zeros(4)],
    )
    with pytest.raises(ProtocolError, match="announces 1 payload frames"):
        wire.decode(frames[:1], job="j")
    msg = wire.decode(frames[:1], job="j", header_only=True)
    assert msg.header["op"] == Op.PUSH and msg.payload == []
    with pytest.raises(JobMismatchError):
        wire.decode(frames[:1], job="other", header_only=True)

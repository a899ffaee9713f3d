"""What each codec costs: the one table that the compression policy and ``luwu plan`` read.

* Bytes per element come from the codec objects themselves
  (:func:`bytes_per_element`), never retyped here.
* The default block of the blockwise codecs is :data:`BLOCK`; the codecs take
  their default from it.
* Throughputs (GB/s of fp32 input, one thread) and the fixed cost of one
  message are measured by ``benchmarks/bench_codecs.py``, which rewrites the
  :data:`MEASURED` block below (``--write-facts``). They are constants, so that
  every process running the policy decides alike.

Importing this module does not import torch: the configuration path reads it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from luwu.protocol.errors import ConfigError

#: Elements per fp32 scale of the blockwise codecs, by default.
BLOCK: dict[str, int] = {"int8": 256, "int4": 64}

#: The codecs the registry builds without any plug-in.
BUILTIN_CODECS = ("none", "bf16", "fp16", "int8", "int4", "topk", "bf16_steps")

#: Codecs whose error is large enough to need error feedback; bf16 and fp16
#: round to nearest (unbiased, ~2**-9 relative), so they go without.
FEEDBACK_CODECS = frozenset({"int8", "int4", "topk"})

#: Codecs that round each element alone (no residual to carry): the warm-up's choice.
ROUNDING_CODECS = ("none", "bf16", "fp16")

#: Codecs that send a subset of the elements.
SPARSE_CODECS = frozenset({"topk"})

#: What the nodes may send the weights back with. ``bf16_steps`` gives the workers what ``bf16`` does, as
#: one-byte steps on the bf16 grid (:mod:`luwu.protocol.codecs.steps`). ``int8_delta`` is not a registry
#: codec: the node runs :class:`luwu.protocol.feedback.DeltaEncoder` (int8 deltas against a shadow).
PULL_CODECS = ("none", "bf16", "fp16", "bf16_steps", "int8_delta")

#: What a streamed unit's large matrices may travel with, both ways, without error feedback (a
#: streamed unit keeps nothing between uses): the rounding codecs and the blockwise integer ones.
STREAM_CODECS = ("none", "bf16", "fp16", "int8", "int4")

#: How much a codec loses, for ranking options: 0 is exact.
LOSSINESS: dict[str, int] = {
    "none": 0,
    "bf16": 1,
    "fp16": 1,
    "bf16_steps": 1,
    "int8": 2,
    "int8_delta": 2,
    "int4": 3,
    "topk": 4,
}

# BEGIN MEASURED (benchmarks/bench_codecs.py --write-facts rewrites this block)
#: Per codec: encode, encode with error feedback and decode-add throughput, GB/s of fp32 input, one
#: thread; overhead_us: fixed cost of one message (encode + decode-add of 1024 elements, less ``none``'s).
MEASURED_ON = "16777216 elements, 1 thread(s), median of 9, loadavg 0.66 1.32 1.62"
MEASURED: dict[str, dict[str, float]] = {
    "none": {
        "encode_gbps": math.inf,
        "encode_ef_gbps": math.inf,
        "decode_gbps": 9.98,
        "overhead_us": 0.0,
    },
    "bf16": {"encode_gbps": 16.2, "encode_ef_gbps": 5.1, "decode_gbps": 9.67, "overhead_us": 6.85},
    "fp16": {"encode_gbps": 6.27, "encode_ef_gbps": 3.13, "decode_gbps": 9.54, "overhead_us": 18.1},
    "int8": {"encode_gbps": 14.1, "encode_ef_gbps": 6.4, "decode_gbps": 14.1, "overhead_us": 8.94},
    "int4": {"encode_gbps": 14.1, "encode_ef_gbps": 8.79, "decode_gbps": 16.8, "overhead_us": 8.2},
    "topk": {"encode_gbps": 1.29, "encode_ef_gbps": 1.09, "decode_gbps": 25.2, "overhead_us": 22.8},
    "int8_delta": {
        "encode_gbps": 2.94,
        "encode_ef_gbps": 2.94,
        "decode_gbps": 17.3,
        "overhead_us": 23.3,
    },
    "bf16_steps": {
        "encode_gbps": 2.96,
        "encode_ef_gbps": 2.96,
        "decode_gbps": 5.24,
        "overhead_us": 14.6,
    },
}
# END MEASURED


class Throughput(NamedTuple):
    encode_gbps: float
    """GB/s of fp32 input as the codec is used: with error feedback for :data:`FEEDBACK_CODECS`."""
    decode_gbps: float
    """Decode-add, GB/s of fp32 output."""
    overhead_s: float
    """Fixed seconds per message beyond what ``none`` costs."""


def base_name(name: str) -> str:
    """``"topk:0.05"`` -> ``"topk"``: the codec without its parameter."""
    return name.partition(":")[0]


def throughput(name: str) -> Throughput | None:
    """The measured cost of codec ``name`` (a parameter after ``:`` is ignored), or None if unmeasured."""
    row = MEASURED.get(base_name(name))
    if row is None:
        return None
    ef = base_name(name) in FEEDBACK_CODECS
    return Throughput(
        row["encode_ef_gbps" if ef else "encode_gbps"],
        row["decode_gbps"],
        row["overhead_us"] * 1e-6,
    )


def codec_for(name: str):
    """The registry codec behind ``name`` (``int8_delta`` sends int8 frames). Imports torch."""
    from luwu.protocol.codecs import get_codec

    return get_codec("int8" if name == "int8_delta" else name)


def bytes_per_element(name: str) -> float:
    """Average wire bytes per fp32 element of codec ``name``, from the codec object."""
    return float(codec_for(name).bytes_per_element())


def wire_bytes(name: str, numel: int) -> int:
    """Exact payload bytes of ``numel`` elements sent with codec ``name``."""
    return codec_for(name).wire_bytes(numel)


def check_codec_name(what: str, name) -> None:
    """Raise ConfigError unless ``name`` names a codec. A built-in name is checked without torch; a
    parametrized or plug-in one is built by the registry, which checks its parameters."""
    if not isinstance(name, str):
        raise ConfigError(f"{what} must be a codec name, got {name!r}")
    if name in BUILTIN_CODECS:
        return
    from luwu.protocol.codecs import get_codec

    try:
        get_codec(name)
    except ConfigError as exc:
        raise ConfigError(f"{what} = {name!r}: {exc}") from None


def is_sparse(name: str) -> bool:
    """Whether codec ``name`` sends a subset of the elements (torch-free for built-in codecs)."""
    if base_name(name) in BUILTIN_CODECS:
        return base_name(name) in SPARSE_CODECS
    from luwu.protocol.codecs import get_codec

    return bool(get_codec(name).sparse)

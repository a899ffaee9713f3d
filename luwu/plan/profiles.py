"""What ``luwu plan`` knows of a codec: bytes and seconds per element, read from the one codec table
(:mod:`luwu.protocol.codec_facts`) that the compression policy reads too."""

from __future__ import annotations

from dataclasses import dataclass

from luwu.protocol import codec_facts
from luwu.protocol.errors import ConfigError

#: Planner names that stand for a codec: ``hybrid`` is the policy's choice for large matrices
#: (nearly all the bytes of a big model), ``fp32`` is ``none``.
ALIASES = {"hybrid": "int8", "fp32": "none"}

#: Push codecs ``recommend`` explores; the pull codecs are :data:`luwu.protocol.codec_facts.PULL_CODECS`.
PUSH_CODECS = ("none", "bf16", "int8", "int4", "topk")
PULL_CODECS = codec_facts.PULL_CODECS


@dataclass(frozen=True, slots=True)
class CodecProfile:
    """What the plan needs to know of one codec."""

    name: str
    bytes_per_elem: float
    encode_s_per_elem: float
    """One thread, one pass (with error feedback where the codec uses it)."""
    decode_s_per_elem: float
    """One thread; for pushes this is decoding into (and so summing into) the fp32 accumulator."""
    lossiness: int
    """0 = exact; higher loses more. The recommendation prefers the least lossy codec that is fast enough."""


def codec_profile(name: str) -> CodecProfile:
    """The profile of a codec by name: any codec of :mod:`luwu.protocol.codec_facts` (``none``,
    ``bf16``, ``fp16``, ``int8``, ``int8_delta``, ``int4``, ``topk``, with a parameter such as
    ``topk:<density>``), or ``hybrid`` / ``fp32``."""
    key = name.strip().lower()
    codec = ALIASES.get(key, key)
    cost = codec_facts.throughput(codec)
    if cost is None:
        known = ", ".join([*codec_facts.MEASURED, *ALIASES, "topk:<density>"])
        raise ConfigError(f"unknown codec {name!r}; known: {known}")
    return CodecProfile(
        name=key,
        bytes_per_elem=codec_facts.bytes_per_element(codec),
        encode_s_per_elem=4.0 / (cost.encode_gbps * 1e9),
        decode_s_per_elem=4.0 / (cost.decode_gbps * 1e9),
        lossiness=codec_facts.LOSSINESS[codec_facts.base_name(codec)],
    )

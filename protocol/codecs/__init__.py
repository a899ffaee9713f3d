"""Tensor compression codecs and their registry.

A codec turns a 1-D fp32 tensor into a small ``meta`` dict (goes in the msgpack
header) and raw frames (sent as ZeroMQ frames with ``copy=False``), and adds a
received payload straight into an fp32 accumulator. :mod:`.base` holds the
contract, :mod:`.dense` the fp32 / bf16 / fp16 codecs, :mod:`.block` the
blockwise int8 / int4 codecs with their native kernels, :mod:`.topk` top-k,
:mod:`.steps` the pull direction's bf16 steps, and :mod:`.registry` the names (``get_codec("int8:128")``). What a codec costs
(bytes, throughput) is in :mod:`luwu.protocol.codec_facts`.
"""

from luwu.protocol.codecs.base import (
    CHUNK,
    FP16_MAX,
    MAX_BLOCK,
    SCALE_FLOOR,
    Codec,
    Encoded,
    copy_finite_,
    has_nonfinite,
)
from luwu.protocol.codecs.block import Int4Codec, Int8Codec
from luwu.protocol.codecs.dense import Bf16Codec, Fp16Codec, NoneCodec
from luwu.protocol.codecs.registry import codec_names, get_codec, register_codec
from luwu.protocol.codecs.steps import Bf16StepsCodec
from luwu.protocol.codecs.topk import TopkCodec, topk_indices

__all__ = [
    "CHUNK",
    "FP16_MAX",
    "MAX_BLOCK",
    "SCALE_FLOOR",
    "Bf16Codec",
    "Bf16StepsCodec",
    "Codec",
    "Encoded",
    "Fp16Codec",
    "Int4Codec",
    "Int8Codec",
    "NoneCodec",
    "TopkCodec",
    "codec_names",
    "copy_finite_",
    "get_codec",
    "has_nonfinite",
    "register_codec",
    "topk_indices",
]

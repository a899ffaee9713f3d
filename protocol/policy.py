"""The hybrid compression policy: which codec each bucket travels with.

Large matrices carry nearly all the bytes and tolerate int8 with error
feedback; small tensors, norms and biases gain nothing from compression and
hurt when compressed, so they go bf16; the first steps go without the
error-feedback codecs (as PowerSGD, DGC and 1-bit Adam warm up), in bf16 by
default (what DDP's bf16 hook sends all along: half of fp32's bytes, rounding
to nearest, no residual). A codec is used only where the wire time
it saves beats the time it costs to encode and decode.

The rule holds per tensor: a bucket holding any small or 1-D parameter goes
bf16 at most. The layout (:mod:`luwu.protocol.layout`) keeps such parameters
in buckets of their own at the default line (:data:`luwu.protocol.layout.SMALL_NUMEL`), so the
large matrices are not dragged down to bf16 by a bias that shares their bucket.

The choice is a pure function of the bucket, the step, the config and the link
speed: told (``compression.link_gbps``), or measured per node link by each worker
(``"auto"``, :mod:`luwu.gpu_workers.links`) and held by :class:`LinkRule`'s
hysteresis. Workers measuring differently may then push the same (step, bucket)
with different codecs: each push names its codec, a node decodes each push by its
own, and its one reply names the codec it went out with. The codecs' costs are the
fixed throughput constants of :mod:`luwu.protocol.codec_facts`.
"""

from __future__ import annotations

import fnmatch
import math

from luwu.protocol import codec_facts
from luwu.protocol.codec_facts import FEEDBACK_CODECS, PULL_CODECS, ROUNDING_CODECS
from luwu.protocol.compression import AUTO, CompressionConfig
from luwu.protocol.layout import Bucket, Segment

__all__ = [
    "FEEDBACK_CODECS",
    "PULL_CODECS",
    "ROUNDING_CODECS",
    "CompressionConfig",
    "LinkRule",
    "choose_codec",
    "choose_fetch_codec",
    "choose_pull_codec",
    "codec_seconds",
    "is_small",
    "link_speed",
    "pays_off",
]

#: Gbit/s the cost rule assumes for ``link_gbps = "auto"`` where no measurement is at hand (``luwu plan``,
#: a worker's start-up pull before its probe).
UNMEASURED_GBPS = 10.0


def link_speed(cfg: CompressionConfig) -> float:
    """The Gbit/s the cost rule decides at: the told ``link_gbps``, or :data:`UNMEASURED_GBPS` for ``auto``
    (a worker resolves ``auto`` per node link to its measurement: :mod:`luwu.gpu_workers.links`)."""
    return UNMEASURED_GBPS if cfg.link_gbps == AUTO else cfg.link_gbps


# -- the decision --------------------------------------------------------------


def _param_numel(seg: Segment) -> int:
    return math.prod(seg.shape)


def is_small(seg: Segment, cfg: CompressionConfig) -> bool:
    """Small or 1-D (biases, norms, scalars): bf16 at most."""
    return len(seg.shape) <= 1 or _param_numel(seg) < cfg.small_numel


def _rule_codec(bucket: Bucket, cfg: CompressionConfig) -> str | None:
    if not cfg.rules or not bucket.segments:
        return None
    largest = max(bucket.segments, key=lambda s: s.numel)  # max keeps the first of ties
    for pattern, codec in cfg.rules:
        if fnmatch.fnmatchcase(largest.name, pattern):
            return codec
    return None


def codec_seconds(name: str, numel: int, link_gbps: float) -> float:
    """Modelled time to send ``numel`` fp32 elements with codec ``name``: encode + wire + decode."""
    cost = codec_facts.throughput(name)
    raw = 4.0 * numel
    wire = codec_facts.wire_bytes(name, numel)
    return (
        raw / (cost.encode_gbps * 1e9)
        + wire * 8.0 / (link_gbps * 1e9)
        + raw / (cost.decode_gbps * 1e9)
        + cost.overhead_s
    )


def pays_off(name: str, numel: int, cfg: CompressionConfig) -> bool:
    """The cost rule: the wire time saved exceeds the extra encode + decode time.

    Measured against sending fp32 (``none``, whose decode is the sum the node
    does anyway), with the fixed throughputs of :mod:`luwu.protocol.codec_facts`.
    """
    if name == "none":
        return True
    if codec_facts.throughput(name) is None:
        return True  # a codec the model does not know: the config asked for it, trust it
    gbps = link_speed(cfg)
    return codec_seconds(name, numel, gbps) < codec_seconds("none", numel, gbps)


def _first_paying(candidates: list[str], numel: int, cfg: CompressionConfig) -> str:
    for name in candidates:
        if pays_off(name, numel, cfg):
            return name
    return "none"


def choose_codec(
    bucket: Bucket,
    step: int,
    cfg: CompressionConfig,
    *,
    residual: bool = True,
    small: bool | None = None,
) -> tuple[str, bool]:
    """(codec name, use error feedback) for pushing ``bucket``'s gradient at ``step``. ``residual=False``
    (a streamed unit's bucket: the worker keeps nothing of it between uses, and an error-feedback residual
    would be a copy of the unit kept for the whole run): where the policy would pick an error-feedback
    codec, ``cfg.stream_codec`` without feedback. ``small``: whether the bucket holds a small or 1-D
    parameter, where its segments do not say (an aggregator knows a bucket's positions, not its
    parameters' shapes: its workers' codec says it)."""
    if not cfg.enabled or bucket.numel == 0:
        return "none", False
    name = _rule_codec(bucket, cfg)
    if step < cfg.warmup_steps:
        return _first_paying(
            [name if name in ROUNDING_CODECS else cfg.warmup_codec], bucket.numel, cfg
        ), False
    if name is None:
        if small if small is not None else any(is_small(s, cfg) for s in bucket.segments):
            candidates = ["bf16"]
        else:
            large = cfg.codec_name(cfg.large_codec)
            candidates = [large] if large in ("bf16", "none") else [large, "bf16"]
        name = _first_paying(candidates, bucket.numel, cfg)
    else:
        name = cfg.codec_name(name)
    ef = cfg.error_feedback and codec_facts.base_name(name) in FEEDBACK_CODECS
    if ef and not residual:
        return _first_paying(_stream_candidates(cfg), bucket.numel, cfg), False
    return name, ef


def _stream_candidates(cfg: CompressionConfig) -> list[str]:
    return [cfg.stream_codec] if cfg.stream_codec in ROUNDING_CODECS else [cfg.stream_codec, "bf16"]


def choose_fetch_codec(bucket: Bucket, step: int, cfg: CompressionConfig) -> str:
    """Codec of a streamed unit's weights fetched at ``step``: full weights, quantized afresh from the fp32
    master at each fetch (no delta: a released unit holds nothing to add one to). ``cfg.stream_codec``
    for large matrices after the warm-up, bf16 at most for small and 1-D parameters, fp32 with
    compression off or ``pull_codec`` ``none``."""
    if not cfg.enabled or bucket.numel == 0 or cfg.pull_codec == "none":
        return "none"
    if step < cfg.warmup_steps:
        return _first_paying(
            [cfg.stream_codec if cfg.stream_codec in ROUNDING_CODECS else cfg.warmup_codec],
            bucket.numel,
            cfg,
        )
    if cfg.stream_codec not in ROUNDING_CODECS and any(is_small(s, cfg) for s in bucket.segments):
        return _first_paying(["bf16"], bucket.numel, cfg)
    return _first_paying(_stream_candidates(cfg), bucket.numel, cfg)


def choose_pull_codec(bucket: Bucket, step: int, cfg: CompressionConfig) -> str:
    """Codec of the weights the node sends back for ``bucket`` at ``step``.

    ``auto`` (the default) picks by the cost rule of the pushes: of ``bf16_steps``, ``bf16`` and
    ``none``, the one whose modelled encode + wire + decode time at ``link_gbps`` is least (bf16 steps
    below ~5 Gbit/s, bf16 at the default 10, fp32 where the link is faster than the codecs).
    ``bf16_steps`` gives every bucket exactly what ``bf16`` gives (small and 1-D parameters too) for
    about half the bytes, with no state on the node, so it serves the default bf16 warm-up too; a
    warm-up in fp16 or fp32 (``warmup_codec``) pulls that way. ``int8_delta`` (not a registry codec:
    the node runs :class:`luwu.protocol.feedback.DeltaEncoder`) only when asked for, for buckets of
    large matrices and after the warm-up; small and 1-D parameters then get bf16 at most.
    """
    if not cfg.enabled or bucket.numel == 0 or cfg.pull_codec == "none":
        return "none"
    want = cfg.pull_codec
    if want == "auto" and (step >= cfg.warmup_steps or cfg.warmup_codec == "bf16"):
        return min(
            ("bf16_steps", "bf16", "none"),
            key=lambda name: codec_seconds(name, bucket.numel, link_speed(cfg)),
        )
    if want == "bf16_steps":
        return _first_paying([want, "bf16"], bucket.numel, cfg)
    if step < cfg.warmup_steps and want not in ROUNDING_CODECS:
        want = cfg.warmup_codec  # int8_delta starts after the warm-up, with a full resync
    if want == "int8_delta" and any(is_small(s, cfg) for s in bucket.segments):
        want = "bf16"
    candidates = ["int8_delta", "bf16"] if want == "int8_delta" else [want]
    return _first_paying(candidates, bucket.numel, cfg)


# -- the link speed decided at, with hysteresis ----------------------------------


#: A measured link speed moves the decision only outside [decided / LINK_BAND, decided * LINK_BAND] ...
LINK_BAND = 1.5
#: ... at this many step boundaries in a row, on the same side: noise does not flap the codecs.
LINK_PATIENCE = 3


class LinkRule:
    """The link speed one node link's codecs are decided at, from a series of measurements (one per step
    boundary). The first measurement decides at once. After it, a measurement inside the band around the
    decided speed keeps it and clears any streak; ``patience`` measurements in a row outside it, on the same
    side, move the decision to the median of that streak. Pure: no clock, no I/O."""

    __slots__ = ("band", "patience", "decided", "_streak")

    def __init__(self, band: float = LINK_BAND, patience: int = LINK_PATIENCE) -> None:
        if not band > 1.0 or patience < 1:
            raise ValueError(
                f"LinkRule needs band > 1 and patience >= 1, got band={band!r}, patience={patience!r}"
            )
        self.band, self.patience = band, patience
        self.decided: float | None = None
        self._streak: list[float] = []

    def observe(self, gbps: float) -> bool:
        """Take one measurement (Gbit/s, > 0); True when it changed the decided speed."""
        if not (gbps > 0 and math.isfinite(gbps)):
            return False
        if self.decided is None:
            self.decided = gbps
            return True
        if self.decided / self.band <= gbps <= self.decided * self.band:
            self._streak.clear()
            return False
        if self._streak and (self._streak[-1] > self.decided) != (gbps > self.decided):
            self._streak.clear()  # the other side: a new streak
        self._streak.append(gbps)
        if len(self._streak) < self.patience:
            return False
        ranked = sorted(self._streak)
        self.decided, self._streak = ranked[len(ranked) // 2], []
        return True

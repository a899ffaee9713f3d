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
in buckets of their own at the default line (:data:`SMALL_NUMEL`), so the
large matrices are not dragged down to bf16 by a bias that shares their bucket.

Every worker must pick the same codec for the same (bucket, step): the choice
is a pure function of the bucket, the step and the config, and the cost rule
uses fixed throughput constants (:data:`CODEC_GBPS`), never timings taken at
run time.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import SMALL_NUMEL, Bucket, Segment

#: Encode and decode-add throughput, GB/s of fp32 input, one thread, 16M
#: elements (benchmarks/bench_codecs.py on the 2-core dev machine, medians,
#: rounded down). Fixed, so that every process decides alike.
CODEC_GBPS: dict[str, tuple[float, float]] = {
    "none": (math.inf, 12.0),
    "bf16": (15.0, 10.0),
    "fp16": (7.0, 10.0),
    "int8": (6.0, 11.0),
    "int4": (2.8, 4.5),
    "topk": (1.2, 25.0),
    # pull direction: weights - shadow, int8 encode, decode into the shadow
    "int8_delta": (3.0, 11.0),
}
#: Fixed cost of one message, seconds, beyond what ``none`` costs (Python
#: calls on both sides); from the 1024-element rows of the benchmark.
CODEC_OVERHEAD_S: dict[str, float] = {
    "none": 0.0,
    "bf16": 10e-6,
    "fp16": 20e-6,
    "int8": 45e-6,
    "int4": 85e-6,
    "topk": 60e-6,
    "int8_delta": 60e-6,
}

#: Codecs whose error is large enough to need error feedback; bf16 and fp16
#: round to nearest (unbiased, ~2**-9 relative), so they go without.
FEEDBACK_CODECS = frozenset({"int8", "int4", "topk"})

#: Lossy codecs that must not touch small or 1-D tensors unless a rule says so.
AGGRESSIVE_CODECS = frozenset({"int8", "int4", "topk"})

PULL_CODECS = ("none", "bf16", "fp16", "int8_delta")

#: Codecs that round each element alone (no residual to carry): the warm-up's choice.
ROUNDING_CODECS = ("none", "bf16", "fp16")


@dataclass(kw_only=True, slots=True)
class CompressionConfig:
    """The ``[compression]`` section: the hybrid codec policy, both directions."""

    enabled: bool = True
    """Off: every bucket travels as fp32 (``none``) both ways."""
    warmup_steps: int = 10
    """Steps (from 0) sent with ``warmup_codec`` before the error-feedback codecs start."""
    warmup_codec: str = "bf16"
    """Codec of every bucket during the warm-up, both directions: ``bf16`` (round to nearest, like DDP's
    bf16 hook: half the bytes of fp32, no residual), ``fp16``, or ``none`` (fp32). A rule naming one of
    these three still wins for its buckets (``*.bias=none`` stays fp32), and ``pull_codec`` ``none``
    keeps the pull fp32; the cost rule applies as after the warm-up."""
    small_numel: int = SMALL_NUMEL
    """Parameters with fewer elements than this (and all 1-D ones) are sent as bf16. The layout buckets
    parameters apart at the default line; another value still holds per tensor (a bucket with any
    small parameter goes bf16), but buckets may then mix sizes."""
    large_codec: str = "int8"
    """Codec of buckets made only of large matrices (``int8``, ``int4``, ``topk``, ``bf16``...)."""
    error_feedback: bool = True
    """Keep the residual of int8/int4/top-k on the sender and add it to the next step."""
    rules: list[tuple[str, str]] | str = field(default_factory=list)
    """Overrides as (fnmatch pattern on the parameter name, codec) pairs, first match wins; a
    rule applies to a bucket when it matches the bucket's largest parameter segment. As a string
    (env / CLI): ``"*.bias=none,embed*=int4"``. Rules skip the size checks and the cost rule,
    not the warm-up."""
    link_gbps: float = 10.0
    """Link bandwidth in Gbit/s used by the cost rule (compress only where it pays)."""
    pull_codec: str = "bf16"
    """Weights sent back to workers: ``bf16``, ``fp16``, ``none``, or ``int8_delta`` (int8 deltas
    against a shadow of the workers' copy, with error feedback and a periodic full resync)."""
    resync_every: int = 50
    """With ``int8_delta``: full fp32 weights every this many steps."""
    topk_density: float = 0.01
    """Fraction of elements the ``topk`` codec sends."""
    momentum_correction: bool = False
    """Top-k buckets carry each worker's momentum instead of its gradient (Deep Gradient Compression's
    momentum correction and masking, :mod:`luwu.protocol.feedback`); the nodes use it as their momentum.
    Needs sync mode and an update linear in it: AdamW / Adam with ``variance_freeze_step`` at most
    ``warmup_steps`` in every param group (1-bit Adam's frozen variance), or SGD without weight decay."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "small_numel", "resync_every"):
            v = getattr(self, name)
            low = 1 if name == "resync_every" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"compression.{name} must be an int >= {low}, got {v!r}")
        if isinstance(self.link_gbps, bool) or not isinstance(self.link_gbps, (int, float)) or not (
            math.isfinite(self.link_gbps) and self.link_gbps > 0
        ):
            raise ConfigError(f"compression.link_gbps must be a positive finite number, got {self.link_gbps!r}")
        if isinstance(self.topk_density, bool) or not isinstance(self.topk_density, (int, float)) or not (
            0.0 < self.topk_density <= 1.0
        ):
            raise ConfigError(f"compression.topk_density must be in (0, 1], got {self.topk_density!r}")
        self.link_gbps = float(self.link_gbps)
        self.topk_density = float(self.topk_density)
        _check_codec("compression.large_codec", self.large_codec)
        if self.warmup_codec not in ROUNDING_CODECS:
            raise ConfigError(f"compression.warmup_codec must be one of {ROUNDING_CODECS} (no error feedback in the warm-up), got {self.warmup_codec!r}")
        if self.pull_codec not in PULL_CODECS:
            raise ConfigError(f"compression.pull_codec must be one of {PULL_CODECS}, got {self.pull_codec!r}")
        self.rules = _parse_rules(self.rules)
        if not isinstance(self.momentum_correction, bool):
            raise ConfigError(f"compression.momentum_correction must be a bool, got {self.momentum_correction!r}")
        if self.momentum_correction and not any(get_codec(c).sparse for c in [self.large_codec, *(c for _, c in self.rules)]):
            raise ConfigError("compression.momentum_correction applies to top-k buckets, and neither large_codec nor a rule is top-k")

    def codec_name(self, name: str) -> str:
        """The wire name of codec ``name`` with this config's parameters (top-k density)."""
        if name == "topk" and self.topk_density != 0.01:
            return f"topk:{self.topk_density!r}"
        return name


def _check_codec(what: str, name) -> None:
    if not isinstance(name, str):
        raise ConfigError(f"{what} must be a codec name, got {name!r}")
    try:
        get_codec(name)
    except ConfigError as exc:
        raise ConfigError(f"{what} = {name!r}: {exc}") from None


def _parse_rules(rules) -> list[tuple[str, str]]:
    if isinstance(rules, str):
        items = []
        for part in rules.split(","):
            part = part.strip()
            if not part:
                continue
            pattern, eq, codec = part.rpartition("=")
            if not eq or not pattern:
                raise ConfigError(f"compression.rules: {part!r} is not 'pattern=codec'")
            items.append((pattern.strip(), codec.strip()))
        rules = items
    if not isinstance(rules, (list, tuple)):
        raise ConfigError(f"compression.rules must be a list of (pattern, codec) pairs, got {rules!r}")
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, str) or not isinstance(rule, (list, tuple)) or len(rule) != 2:
            raise ConfigError(f"compression.rules[{i}] must be a (pattern, codec) pair, got {rule!r}")
        pattern, codec = rule
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"compression.rules[{i}]: pattern must be a non-empty str, got {pattern!r}")
        _check_codec(f"compression.rules[{i}] codec", codec)
        out.append((pattern, codec))
    return out


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
    base = name.partition(":")[0]
    enc, dec = CODEC_GBPS[base]
    raw = 4.0 * numel
    wire = get_codec("int8" if base == "int8_delta" else name).wire_bytes(numel)
    return raw / (enc * 1e9) + wire * 8.0 / (link_gbps * 1e9) + raw / (dec * 1e9) + CODEC_OVERHEAD_S[base]


def pays_off(name: str, numel: int, cfg: CompressionConfig) -> bool:
    """The cost rule: the wire time saved exceeds the extra encode + decode time.

    Measured against sending fp32 (``none``, whose decode is the sum the node
    does anyway), with the fixed throughputs of :data:`CODEC_GBPS`.
    """
    if name == "none":
        return True
    if name.partition(":")[0] not in CODEC_GBPS:
        return True  # a codec the model does not know: the config asked for it, trust it
    return codec_seconds(name, numel, cfg.link_gbps) < codec_seconds("none", numel, cfg.link_gbps)


def _first_paying(candidates: list[str], numel: int, cfg: CompressionConfig) -> str:
    for name in candidates:
        if pays_off(name, numel, cfg):
            return name
    return "none"


def choose_codec(bucket: Bucket, step: int, cfg: CompressionConfig) -> tuple[str, bool]:
    """(codec name, use error feedback) for pushing ``bucket``'s gradient at ``step``."""
    if not cfg.enabled or bucket.numel == 0:
        return "none", False
    name = _rule_codec(bucket, cfg)
    if step < cfg.warmup_steps:
        return _first_paying([name if name in ROUNDING_CODECS else cfg.warmup_codec], bucket.numel, cfg), False
    if name is None:
        if any(is_small(s, cfg) for s in bucket.segments):
            candidates = ["bf16"]
        else:
            large = cfg.codec_name(cfg.large_codec)
            candidates = [large] if large in ("bf16", "none") else [large, "bf16"]
        name = _first_paying(candidates, bucket.numel, cfg)
    else:
        name = cfg.codec_name(name)
    ef = cfg.error_feedback and name.partition(":")[0] in FEEDBACK_CODECS
    return name, ef


def choose_pull_codec(bucket: Bucket, step: int, cfg: CompressionConfig) -> str:
    """Codec of the weights the node sends back for ``bucket`` at ``step``.

    ``int8_delta`` (not a registry codec: the node runs
    :class:`luwu.protocol.feedback.DeltaEncoder`) only for buckets of large
    matrices; small and 1-D parameters get bf16 at most.
    """
    if not cfg.enabled or bucket.numel == 0 or cfg.pull_codec == "none":
        return "none"
    want = cfg.pull_codec
    if step < cfg.warmup_steps and want not in ROUNDING_CODECS:
        want = cfg.warmup_codec  # int8_delta starts after the warm-up, with a full resync
    if want == "int8_delta" and any(is_small(s, cfg) for s in bucket.segments):
        want = "bf16"
    candidates = ["int8_delta", "bf16"] if want == "int8_delta" else [want]
    return _first_paying(candidates, bucket.numel, cfg)

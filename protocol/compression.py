"""The ``[compression]`` section of the configuration: which codecs the hybrid policy may pick.

Torch-free, so that the configuration tree loads without torch; the decisions
themselves are in :mod:`luwu.protocol.policy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from luwu.protocol.codec_facts import (
    PULL_CODECS,
    ROUNDING_CODECS,
    STREAM_CODECS,
    check_codec_name,
    is_sparse,
)
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import SMALL_NUMEL

#: Storage dtypes of an error-feedback residual (torch's names).
RESIDUAL_DTYPES = ("float32", "bfloat16")

#: ``compression.link_gbps`` that asks each worker to measure its link to each node.
AUTO = "auto"


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
    residual_dtype: str = "bfloat16"
    """Storage of a worker's error-feedback residuals: ``bfloat16`` (2 B per parameter of the buckets
    compressed with error feedback; rounded to bf16 after each encode, which drops at most 2^-9 of each
    residual: no measurable cost on the convergence tasks) or ``float32`` (4 B)."""
    rules: list[tuple[str, str]] | str = field(default_factory=list)
    """Overrides as (fnmatch pattern on the parameter name, codec) pairs, first match wins; a
    rule applies to a bucket when it matches the bucket's largest parameter segment. As a string
    (env / CLI): ``"*.bias=none,embed*=int4"``. Rules skip the size checks and the cost rule,
    not the warm-up."""
    link_gbps: float | str = AUTO
    """Link bandwidth in Gbit/s used by the cost rule (compress only where it pays). ``"auto"`` (the
    default): each worker measures its path to each node (a timed probe of a few MiB when it connects,
    again every few hundred steps, and the bytes its real pushes and replies move per second) and decides
    the codecs per node link, again at step boundaries only when the measurement has left a band around the
    speed decided for a few steps in a row (hysteresis); each decision is logged once and exposed as
    ``luwu_worker_link_gbps{node}`` and ``luwu_worker_link_buckets{node,direction,codec}``. A number is the
    speed told, for every node link: it wins over any measurement. Held replies (``optimizer.hold_replies``
    ``auto``) follow the slowest node link measured at connect."""
    pull_codec: str = "auto"
    """Weights sent back to workers: ``auto`` (by the cost rule at ``link_gbps``, per bucket:
    ``bf16_steps`` below ~5 Gbit/s, bf16 from there to ~50 Gbit/s, fp32 on links faster than the
    codecs), ``bf16_steps`` (the bf16 rounding of the
    weights as one-byte steps on the bf16 grid: what ``bf16`` gives, at about half its bytes, no state on
    the node), ``bf16``, ``fp16``, ``none``, or ``int8_delta`` (int8 deltas against a shadow of the
    workers' copy kept on the node, with error feedback and a periodic full resync)."""
    stream_codec: str = "int8"
    """Streaming mode: codec of the streamed units' large matrices after the warm-up, both ways, without
    error feedback (a streamed unit keeps no residual between uses): the weights each fetch carries,
    quantized afresh from the nodes' fp32 master (their error does not add up over steps), and the
    gradients pushed (ZeRO++'s quantized weights and gradients, blocks of 256). ``int8``, ``int4``,
    ``bf16``, ``fp16`` or ``none``; small and 1-D parameters go bf16 at most, and ``pull_codec``
    ``none`` keeps the fetched weights fp32."""
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
        if isinstance(self.link_gbps, str) and self.link_gbps.strip().lower() != AUTO:
            try:  # (from the environment or a command line: a number as text)
                self.link_gbps = float(self.link_gbps)
            except ValueError:
                pass
        elif isinstance(self.link_gbps, str):
            self.link_gbps = AUTO
        if self.link_gbps != AUTO and (
            isinstance(self.link_gbps, bool)
            or not isinstance(self.link_gbps, (int, float))
            or not (math.isfinite(self.link_gbps) and self.link_gbps > 0)
        ):
            raise ConfigError(
                f'compression.link_gbps must be "auto" (measured) or a positive finite number of Gbit/s, got {self.link_gbps!r}'
            )
        if (
            isinstance(self.topk_density, bool)
            or not isinstance(self.topk_density, (int, float))
            or not (0.0 < self.topk_density <= 1.0)
        ):
            raise ConfigError(
                f"compression.topk_density must be in (0, 1], got {self.topk_density!r}"
            )
        if self.link_gbps != AUTO:
            self.link_gbps = float(self.link_gbps)
        self.topk_density = float(self.topk_density)
        check_codec_name("compression.large_codec", self.large_codec)
        if self.warmup_codec not in ROUNDING_CODECS:
            raise ConfigError(
                f"compression.warmup_codec must be one of {ROUNDING_CODECS} (no error feedback in the warm-up), got {self.warmup_codec!r}"
            )
        if self.pull_codec not in (*PULL_CODECS, "auto"):
            raise ConfigError(
                f"compression.pull_codec must be auto or one of {PULL_CODECS}, got {self.pull_codec!r}"
            )
        if self.stream_codec not in STREAM_CODECS:
            raise ConfigError(
                f"compression.stream_codec must be one of {STREAM_CODECS}, got {self.stream_codec!r}"
            )
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ConfigError(
                f"compression.residual_dtype must be one of {RESIDUAL_DTYPES}, got {self.residual_dtype!r}"
            )
        self.rules = _parse_rules(self.rules)
        if not isinstance(self.momentum_correction, bool):
            raise ConfigError(
                f"compression.momentum_correction must be a bool, got {self.momentum_correction!r}"
            )
        if self.momentum_correction and not any(
            is_sparse(c) for c in [self.large_codec, *(c for _, c in self.rules)]
        ):
            raise ConfigError(
                "compression.momentum_correction applies to top-k buckets, and neither large_codec nor a rule is top-k"
            )

    def codec_name(self, name: str) -> str:
        """The wire name of codec ``name`` with this config's parameters (top-k density)."""
        if name == "topk" and self.topk_density != 0.01:
            return f"topk:{self.topk_density!r}"
        return name


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
        raise ConfigError(
            f"compression.rules must be a list of (pattern, codec) pairs, got {rules!r}"
        )
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, str) or not isinstance(rule, (list, tuple)) or len(rule) != 2:
            raise ConfigError(
                f"compression.rules[{i}] must be a (pattern, codec) pair, got {rule!r}"
            )
        pattern, codec = rule
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(
                f"compression.rules[{i}]: pattern must be a non-empty str, got {pattern!r}"
            )
        check_codec_name(f"compression.rules[{i}] codec", codec)
        out.append((pattern, codec))
    return out

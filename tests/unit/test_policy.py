"""The hybrid policy: which codec each kind of bucket gets, in both directions."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import SMALL_NUMEL, Bucket, ParamSpec, Segment, build_layout
from luwu.protocol.policy import (
    CompressionConfig,
    choose_codec,
    choose_fetch_codec,
    choose_pull_codec,
    codec_seconds,
    pays_off,
)

pytestmark = pytest.mark.timeout(60)

STEP = 100  # well past the warm-up


def bucket_of(*params: tuple[str, tuple[int, ...]]) -> Bucket:
    """One bucket holding all ``params`` whole (built by hand: the layout keeps small and large apart)."""
    segs, off = [], 0
    for i, (name, shape) in enumerate(params):
        n = math.prod(shape)
        segs.append(Segment(i, name, shape, 0, off, n))
        off += n
    return Bucket(0, 0, 0, off, tuple(segs))


LARGE = bucket_of(("layers.0.weight", (1024, 1024)))
CONV = bucket_of(("conv.weight", (256, 256, 3, 3)))
SMALLS = bucket_of(*[(f"block{i}.weight", (200, 200)) for i in range(6)])
MIXED = bucket_of(("layers.0.weight", (1024, 1024)), ("layers.0.bias", (1024,)))
LONG_1D = bucket_of(("pos.scale", (2_000_000,)))
TINY = bucket_of(("norm.weight", (64,)))


def test_defaults_are_the_documented_ones():
    cfg = CompressionConfig()
    assert cfg.enabled and cfg.error_feedback
    assert (cfg.warmup_steps, cfg.warmup_codec, cfg.small_numel, cfg.large_codec) == (
        10,
        "bf16",
        65536,
        "int8",
    )
    assert (
        cfg.link_gbps,
        cfg.pull_codec,
        cfg.resync_every,
        cfg.topk_density,
        cfg.stream_codec,
    ) == ("auto", "auto", 50, 0.01, "int8")
    assert cfg.rules == []


def test_warmup_steps_go_bf16_both_ways_without_feedback():
    cfg = CompressionConfig(pull_codec="int8_delta")
    for b in (LARGE, SMALLS, MIXED):
        assert choose_codec(b, 0, cfg) == ("bf16", False)
        assert choose_codec(b, 9, cfg) == ("bf16", False)
        assert choose_pull_codec(b, 9, cfg) == "bf16"
    assert choose_codec(LARGE, 10, cfg) == ("int8", True)
    assert choose_pull_codec(LARGE, 10, cfg) == "int8_delta"
    assert choose_codec(LARGE, 0, CompressionConfig(warmup_steps=0)) == ("int8", True)


def test_warmup_codec_fp32_and_what_overrides_it():
    fp32 = CompressionConfig(warmup_codec="none", pull_codec="int8_delta")
    assert choose_codec(LARGE, 3, fp32) == ("none", False)
    assert choose_pull_codec(LARGE, 3, fp32) == "none"
    assert choose_codec(LARGE, 3, CompressionConfig(warmup_codec="fp16")) == ("fp16", False)
    # the pull keeps a rounding pull_codec through the warm-up, and fp32 when asked for
    assert choose_pull_codec(LARGE, 3, CompressionConfig(pull_codec="fp16")) == "fp16"
    assert choose_pull_codec(LARGE, 3, CompressionConfig(pull_codec="none")) == "none"
    # a rule naming a rounding codec wins in the warm-up too; one naming int8 waits for its end
    rules = CompressionConfig(rules=[("*.bias", "none"), ("layers.*", "int4")])
    assert choose_codec(bucket_of(("head.bias", (4096,))), 3, rules) == ("none", False)
    assert choose_codec(MIXED, 3, rules) == ("bf16", False)
    assert choose_codec(MIXED, 10, rules) == ("int4", True)
    # the cost rule still holds: on a link fast enough, bf16 costs more than it saves
    assert choose_codec(TINY, 3, CompressionConfig(link_gbps=1e6)) == ("none", False)


def test_disabled_sends_fp32_both_ways():
    cfg = CompressionConfig(enabled=False)
    for b in (LARGE, SMALLS, MIXED, LONG_1D):
        assert choose_codec(b, STEP, cfg) == ("none", False)
        assert choose_pull_codec(b, STEP, cfg) == "none"


def test_large_matrices_get_int8_with_error_feedback():
    cfg = CompressionConfig()
    assert choose_codec(LARGE, STEP, cfg) == ("int8", True)
    assert choose_codec(CONV, STEP, cfg) == ("int8", True)
    assert choose_codec(LARGE, STEP, CompressionConfig(error_feedback=False)) == ("int8", False)


def test_a_streamed_units_push_keeps_no_residual():
    """Streaming mode: no error feedback for a unit's bucket (its residual would be a copy of the unit
    held between uses): ``stream_codec`` (int8) without it; small tensors as usual, bf16 in the warm-up."""
    cfg = CompressionConfig()
    assert choose_codec(LARGE, STEP, cfg, residual=False) == ("int8", False)
    assert choose_codec(LARGE, STEP, CompressionConfig(stream_codec="bf16"), residual=False) == (
        "bf16",
        False,
    )
    assert choose_codec(LARGE, STEP, CompressionConfig(stream_codec="none"), residual=False) == (
        "none",
        False,
    )
    assert choose_codec(LARGE, STEP, CompressionConfig(error_feedback=False), residual=False) == (
        "int8",
        False,
    )
    assert choose_codec(TINY, STEP, cfg, residual=False) == choose_codec(TINY, STEP, cfg)
    assert choose_codec(LARGE, 0, cfg, residual=False) == ("bf16", False)


def test_streamed_weights_are_fetched_in_the_stream_codec():
    """A fetch carries full weights quantized from the fp32 master: int8 blocks for large matrices after
    the warm-up, bf16 at most for small and 1-D ones, fp32 with compression off or pull_codec none."""
    cfg = CompressionConfig()
    assert choose_fetch_codec(LARGE, STEP, cfg) == "int8"
    assert choose_fetch_codec(LARGE, 0, cfg) == "bf16"  # warm-up
    assert choose_fetch_codec(SMALLS, STEP, cfg) == choose_fetch_codec(MIXED, STEP, cfg) == "bf16"
    assert choose_fetch_codec(LARGE, STEP, CompressionConfig(stream_codec="bf16")) == "bf16"
    assert choose_fetch_codec(LARGE, 0, CompressionConfig(stream_codec="none")) == "none"
    assert choose_fetch_codec(LARGE, STEP, CompressionConfig(pull_codec="none")) == "none"
    assert choose_fetch_codec(LARGE, STEP, CompressionConfig(enabled=False)) == "none"
    with pytest.raises(ConfigError, match="stream_codec must be one of"):
        CompressionConfig(stream_codec="topk")


def test_small_and_1d_tensors_get_bf16_without_feedback():
    cfg = CompressionConfig()
    assert choose_codec(SMALLS, STEP, cfg) == ("bf16", False)
    assert choose_codec(LONG_1D, STEP, cfg) == ("bf16", False), (
        "a 1-D tensor is never int8, however long"
    )
    # a bucket mixing a large matrix with a bias: never int8
    assert choose_codec(MIXED, STEP, cfg) == ("bf16", False)
    # small_numel moves the line
    assert choose_codec(SMALLS, STEP, CompressionConfig(small_numel=1000)) == ("int8", True)
    assert choose_codec(LARGE, STEP, CompressionConfig(small_numel=2_000_000)) == ("bf16", False)


def test_other_large_codecs():
    assert choose_codec(LARGE, STEP, CompressionConfig(large_codec="int4")) == ("int4", True)
    assert choose_codec(LARGE, STEP, CompressionConfig(large_codec="topk", link_gbps=1.0)) == (
        "topk",
        True,
    )
    name, ef = choose_codec(
        LARGE, STEP, CompressionConfig(large_codec="topk", topk_density=0.05, link_gbps=1.0)
    )
    assert (name, ef) == ("topk:0.05", True)
    assert get_codec(name).density == 0.05
    assert choose_codec(LARGE, STEP, CompressionConfig(large_codec="bf16")) == ("bf16", False)
    assert choose_codec(SMALLS, STEP, CompressionConfig(large_codec="int4")) == ("bf16", False)


def test_rules_override_first_match_wins_on_the_largest_segment():
    cfg = CompressionConfig(
        rules=[("layers.0.weight", "int4"), ("layers.*", "none"), ("*.bias", "fp16")]
    )
    # the largest segment of MIXED is the weight: the rule forces int4 despite the bias
    assert choose_codec(MIXED, STEP, cfg) == ("int4", True)
    assert choose_codec(LARGE, STEP, cfg) == ("int4", True)
    assert choose_codec(bucket_of(("layers.1.weight", (1024, 1024))), STEP, cfg) == ("none", False)
    assert choose_codec(bucket_of(("head.bias", (4096,))), STEP, cfg) == ("fp16", False)
    assert choose_codec(SMALLS, STEP, cfg) == ("bf16", False), "no rule matches: the default policy"
    assert choose_codec(MIXED, 3, cfg) == ("bf16", False), "rules do not skip the warm-up"
    cheap = CompressionConfig(rules=[("*", "int8")], link_gbps=1e6)
    assert choose_codec(TINY, STEP, cheap) == ("int8", True), "rules skip the cost rule"


def test_rules_from_a_string_and_bad_rules():
    cfg = CompressionConfig(rules="*.bias=none, embed*=int4")
    assert cfg.rules == [("*.bias", "none"), ("embed*", "int4")]
    assert CompressionConfig(rules=[["a*", "bf16"]]).rules == [("a*", "bf16")]
    with pytest.raises(ConfigError, match="zstd"):
        CompressionConfig(rules=[("*.weight", "zstd")])
    with pytest.raises(ConfigError, match=r"rules\[0\]"):
        CompressionConfig(rules=[("*.weight",)])
    with pytest.raises(ConfigError, match="pattern=codec"):
        CompressionConfig(rules="*.weight")
    with pytest.raises(ConfigError, match="pattern"):
        CompressionConfig(rules=[("", "bf16")])


@pytest.mark.parametrize(
    "field,value",
    [
        ("warmup_steps", -1),
        ("warmup_codec", "int8"),
        ("small_numel", "big"),
        ("large_codec", "zstd"),
        ("link_gbps", 0.0),
        ("link_gbps", float("inf")),
        ("pull_codec", "int4"),
        ("resync_every", 0),
        ("topk_density", 0.0),
        ("topk_density", 2.0),
    ],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CompressionConfig(**{field: value})


def test_cost_rule_slow_link_compresses_fast_link_does_not():
    slow, fast = CompressionConfig(link_gbps=1.0), CompressionConfig(link_gbps=10_000.0)
    assert choose_codec(LARGE, STEP, slow) == ("int8", True)
    assert choose_codec(LARGE, STEP, fast) == ("none", False)
    assert choose_codec(SMALLS, STEP, slow) == ("bf16", False)
    assert choose_codec(SMALLS, STEP, fast) == ("none", False)
    assert choose_pull_codec(LARGE, STEP, fast) == "none"
    # a tiny bucket saves less wire time than a codec call costs
    assert choose_codec(TINY, STEP, CompressionConfig()) == ("none", False)
    assert choose_codec(TINY, STEP, CompressionConfig(link_gbps=0.001)) == ("bf16", False)
    assert pays_off("int8", LARGE.numel, slow) and not pays_off("int8", LARGE.numel, fast)
    assert codec_seconds("none", 1 << 20, 1.0) > codec_seconds("int8", 1 << 20, 1.0)


def test_cost_rule_compresses_less_as_the_link_gets_faster():
    """int8 on slow links, then (maybe) bf16, then none: never more compression on a faster link."""
    seen = []
    for gbps in [0.1 * 1.25**i for i in range(60)]:
        name, _ = choose_codec(LARGE, STEP, CompressionConfig(link_gbps=gbps))
        seen.append(get_codec(name).bytes_per_element())
    assert seen == sorted(seen)
    assert seen[0] < 1.1 and seen[-1] == 4.0


def test_pull_codec():
    cfg = CompressionConfig()
    assert choose_pull_codec(LARGE, STEP, cfg) == "bf16"  # auto at the default 10 Gbit/s
    slow = CompressionConfig(link_gbps=1.0)
    assert choose_pull_codec(SMALLS, 0, slow) == "bf16_steps", (
        "bf16's very bits: any tensor, from the first step"
    )
    assert choose_pull_codec(LARGE, 2, CompressionConfig(pull_codec="bf16_steps")) == "bf16_steps"
    delta = CompressionConfig(pull_codec="int8_delta")
    assert choose_pull_codec(LARGE, STEP, delta) == "int8_delta"
    assert choose_pull_codec(MIXED, STEP, delta) == "bf16", (
        "never int8 deltas for small or 1-D tensors"
    )
    assert choose_pull_codec(SMALLS, STEP, delta) == "bf16"
    assert choose_pull_codec(LARGE, 2, delta) == "bf16", "int8 deltas start after the warm-up"
    assert choose_pull_codec(LARGE, STEP, CompressionConfig(pull_codec="none")) == "none"
    assert choose_pull_codec(LARGE, STEP, CompressionConfig(pull_codec="fp16")) == "fp16"


def test_auto_pull_codec_follows_the_cost_rule_of_the_link():
    """``auto``: of bf16 steps, bf16 and fp32, the least modelled encode + wire + decode time: bf16 steps
    on slow links (below ~5 Gbit/s), bf16 at the default 10 Gbit/s, fp32 on links faster than the codecs;
    the same for small and 1-D tensors (bf16 steps are bf16's bits) and in the warm-up (no error
    feedback to warm up). int8 deltas only when asked for."""
    picks = {
        g: choose_pull_codec(LARGE, STEP, CompressionConfig(link_gbps=g))
        for g in (0.1, 1.0, 10.0, 40.0, 1000.0)
    }
    assert picks == {
        0.1: "bf16_steps",
        1.0: "bf16_steps",
        10.0: "bf16",
        40.0: "bf16",
        1000.0: "none",
    }
    slow = CompressionConfig(link_gbps=1.0)
    assert (
        choose_pull_codec(MIXED, STEP, slow)
        == choose_pull_codec(SMALLS, STEP, slow)
        == choose_pull_codec(LARGE, 2, slow)
        == "bf16_steps"
    )
    fp32_warmup = CompressionConfig(link_gbps=1.0, warmup_codec="none")
    assert (
        choose_pull_codec(LARGE, 2, fp32_warmup) == "none"
        and choose_pull_codec(LARGE, STEP, fp32_warmup) == "bf16_steps"
    )
    for g, name in picks.items():  # the pick is the cheapest modelled
        costs = {n: codec_seconds(n, LARGE.numel, g) for n in ("bf16_steps", "bf16", "none")}
        assert costs[name] == min(costs.values())
    with pytest.raises(ConfigError, match="pull_codec must be auto or one of"):
        CompressionConfig(pull_codec="int8")


def test_choice_is_the_same_in_another_process():
    """Workers decide alone: the choice may depend only on bucket, step and config."""
    cases = [(LARGE, 10), (SMALLS, 50), (MIXED, 11), (TINY, 99), (LONG_1D, 12)]
    links = [0.5, 10.0, 25.0, 40.0, 1000.0]
    here = [
        [choose_codec(b, s, CompressionConfig(link_gbps=g))[0] for b, s in cases] for g in links
    ]
    code = f"""
import json, sys
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from test_policy import LARGE, SMALLS, MIXED, TINY, LONG_1D
from luwu.protocol.policy import CompressionConfig, choose_codec
cases = [(LARGE, 10), (SMALLS, 50), (MIXED, 11), (TINY, 99), (LONG_1D, 12)]
print(json.dumps([[choose_codec(b, s, CompressionConfig(link_gbps=g))[0] for b, s in cases] for g in {links!r}]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def transformer_lm_specs(vocab: int = 100, d: int = 256, layers: int = 2) -> list[ParamSpec]:
    """The char LM of benchmarks/convergence.py: embeddings, pre-norm encoder layers, head."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(vocab, d),
            "pos": torch.nn.Embedding(64, d),
            "blocks": torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(d, 4, 2 * d, batch_first=True, norm_first=True)
                for _ in range(layers)
            ),
            "norm": torch.nn.LayerNorm(d),
            "head": torch.nn.Linear(d, vocab),
        }
    )
    return [ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters()]


MLP16M = [
    ParamSpec(f"{i * 2}.{k}", s)
    for i, (a, b) in enumerate(zip([1024, 2048, 2048, 2048, 2048], [2048, 2048, 2048, 2048, 1000]))
    for k, s in (("weight", (b, a)), ("bias", (b,)))
]


@pytest.mark.parametrize("model", ["mlp16m", "charlm"])
@pytest.mark.parametrize("bucket_bytes", [4 << 20, 256 << 10, 25 << 20])
def test_every_bucket_of_a_real_model_gets_its_codec(model, bucket_bytes):
    """Default settings: every matrix of >= 64K elements travels int8 + error feedback (where the cost rule
    says it pays), every small or 1-D tensor bf16 (or fp32 where bf16 does not pay); so the push carries
    > 3x fewer bytes than fp32 whatever the bucket size."""
    specs = MLP16M if model == "mlp16m" else transformer_lm_specs()
    layout = build_layout(specs, bucket_bytes, [1.0, 1.0])
    cfg = CompressionConfig()
    wire = 0
    for b in layout.buckets:
        name, ef = choose_codec(b, STEP, cfg)
        small = [
            s.name for s in b.segments if len(s.shape) <= 1 or math.prod(s.shape) < SMALL_NUMEL
        ]
        if small:
            assert len(small) == len(b.segments), (
                f"bucket {b.id} mixes small {small} with large matrices"
            )
            assert (name, ef) in (("bf16", False), ("none", False)), (b.id, small, name)
        elif pays_off("int8", b.numel, cfg):
            assert (name, ef) == ("int8", True), (b.id, [s.name for s in b.segments], name)
        else:  # the tail of a matrix split across buckets, too short for int8 to pay at 10 Gbit/s
            assert b.numel < 32768 and (name, ef) == ("bf16", False), (b.id, b.numel, name)
        wire += get_codec(name).wire_bytes(b.numel)
    fp32 = 4 * sum(b.numel for b in layout.buckets)
    assert fp32 / wire > 3.0, f"{model}: only {fp32 / wire:.2f}x fewer push bytes"


def test_small_numel_off_the_layout_line_still_holds_per_tensor():
    """The layout buckets apart at SMALL_NUMEL; another small_numel still keeps every small or 1-D
    tensor at bf16: below the line, mid-size matrices share a bucket with biases (bf16 for all)."""
    specs = [
        ParamSpec("a.weight", (100, 100)),
        ParamSpec("a.bias", (100,)),
        ParamSpec("b.weight", (300, 300)),
    ]
    layout = build_layout(specs, 1 << 30, [1.0])
    assert [[s.name for s in b.segments] for b in layout.buckets] == [
        ["b.weight"],
        ["a.bias", "a.weight"],
    ]
    slow = dict(link_gbps=0.1)
    assert [choose_codec(b, STEP, CompressionConfig(**slow)) for b in layout.buckets] == [
        ("int8", True),
        ("bf16", False),
    ]
    lower = CompressionConfig(
        small_numel=1000, **slow
    )  # a.weight is large now, but shares its bucket with a.bias
    assert [choose_codec(b, STEP, lower) for b in layout.buckets] == [
        ("int8", True),
        ("bf16", False),
    ]
    higher = CompressionConfig(small_numel=100_000, **slow)  # b.weight is small now
    assert [choose_codec(b, STEP, higher) for b in layout.buckets] == [
        ("bf16", False),
        ("bf16", False),
    ]


# -- the codec facts table ---------------------------------------------------------


def test_codec_facts_cover_every_codec_and_take_sizes_from_the_codecs():
    from luwu.protocol import codec_facts
    from luwu.protocol.codecs import codec_names

    assert set(codec_facts.BUILTIN_CODECS) == set(codec_names())
    assert set(codec_facts.MEASURED) == {*codec_facts.BUILTIN_CODECS, "int8_delta"}
    assert (
        {n for n in codec_names() if get_codec(n).pull_only}
        == {"bf16_steps"}
        <= set(codec_facts.PULL_CODECS)
    )
    for name, block in codec_facts.BLOCK.items():
        assert get_codec(name).block == block
    assert (
        codec_facts.bytes_per_element("int8")
        == get_codec("int8").bytes_per_element()
        == 1.0 + 4.0 / 256
    )
    assert codec_facts.bytes_per_element("int8_delta") == get_codec("int8").bytes_per_element()
    for name in codec_facts.MEASURED:
        cost = codec_facts.throughput(name)
        assert cost.encode_gbps > 0 and cost.decode_gbps > 0 and cost.overhead_s >= 0


def test_one_list_of_pull_and_feedback_codecs():
    from luwu import plan
    from luwu.protocol import codec_facts, policy

    assert plan.PULL_CODECS is policy.PULL_CODECS is codec_facts.PULL_CODECS
    assert policy.FEEDBACK_CODECS is codec_facts.FEEDBACK_CODECS
    assert not hasattr(policy, "AGGRESSIVE_CODECS") and not hasattr(policy, "CODEC_GBPS")


def test_compression_config_modules_import_no_torch():
    """The configuration tree loads CompressionConfig without torch: its modules import none at load."""
    import ast
    import importlib

    for mod in (
        "luwu.protocol.compression",
        "luwu.protocol.codec_facts",
        "luwu.protocol.layout",
        "luwu.protocol.errors",
    ):
        tree = ast.parse(open(importlib.import_module(mod).__file__).read())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top for a in n.names} | {
            n.module for n in top if isinstance(n, ast.ImportFrom)
        }
        assert not any(n and n.split(".")[0] == "torch" for n in names), mod
        assert not any(n and n.startswith("luwu.protocol.codecs") for n in names), mod
    assert CompressionConfig.__module__ == "luwu.protocol.compression"

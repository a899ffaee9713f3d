"""Compressed training stays on the uncompressed loss curve (real data, 2 workers x 2 nodes, real processes).

The short test trains the digits MLP for 40 steps per variant: two worker
processes run the variants one after the other, each against its own 2-node
cluster (all clusters started at once, to stay well under a minute). It checks
that the large matrix really travelled as int8 and that the eval loss did not
move, also through the switch tier (both ranks summed at one aggregator, which
sends the sum up as int8 with error feedback of its own), while top-k without
error feedback, trained the same way, does miss the bound. The long study of
benchmarks/convergence.py is marked slow.
"""

from __future__ import annotations

import pytest

from benchmarks import convergence as conv

#: |final eval loss / uncompressed - 1| allowed after 30 compressed steps. int8 with error feedback
#: lands ~0.1% away; top-k 1% without it ends tens of percent higher.
BOUND = 0.02

SHORT = conv.TaskRun(
    task="digits", steps=40, lr=5e-3, lr_warmup=5, eval_every=10, task_args={"hidden": 256}
)


@pytest.mark.timeout(170)
def test_short_digits_hybrid_and_int8_keep_the_uncompressed_loss():
    names = ("uncompressed", "hybrid", "int8+EF", "topk1% noEF", "hybrid tier")
    rows = {
        r["variant"]: r
        for r in conv.run_variants(
            SHORT, [conv.VARIANT_BY_NAME[n] for n in names], parallel=len(names), timeout_s=150
        )
    }
    base = rows["uncompressed"]
    assert base["compressed_share"] == 0.0 and base["push_ratio"] == pytest.approx(1.0)
    assert base["final_eval_loss"] < 0.5 * base["evals"][0][1], (
        "uncompressed training did not learn"
    )
    for name in ("hybrid", "int8+EF"):
        r = rows[name]
        # the 256x256 matrix (77% of the bytes) went int8 after warm-up, the rest bf16
        assert r["codec_share"].get("int8", 0.0) > 0.7, r["codec_share"]
        assert set(r["codec_share"]) <= {"int8", "bf16", "none"}, r["codec_share"]
        assert r["push_ratio"] > 2.5
        assert abs(r["rel_diff"]) < BOUND, (
            f"{name}: final eval loss {r['final_eval_loss']:.4f} vs {base['final_eval_loss']:.4f}"
        )
    tier = rows["hybrid tier"]
    # the workers' pushes as flat; the aggregator's one push a bucket to the nodes int8 too
    assert tier["codec_share"].get("int8", 0.0) > 0.7, tier["codec_share"]
    assert tier["push_ratio"] > 2.5 and tier["uplink_ratio"] > 2.5, tier["uplink_ratio"]
    assert tier["blocks_late"] == 0 and tier["aggregator_errors"] == 0
    assert abs(tier["rel_diff"]) < BOUND, (
        f"hybrid tier: final eval loss {tier['final_eval_loss']:.4f} vs {base['final_eval_loss']:.4f}"
    )
    # the bound is one that broken compression misses
    assert rows["topk1% noEF"]["codec_share"].get("topk", 0.0) > 0.7
    assert rows["topk1% noEF"]["rel_diff"] > BOUND


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_study_meets_the_targets():
    """The study of benchmarks/convergence.py (both tasks, all variants): the issue's targets hold,
    and through the tier with compression off the weights are the flat run's."""
    failed = []
    for task, run in conv.STUDY.items():
        for r in conv.run_variants(
            run, conv.variants_for(task, list(conv.VARIANT_BY_NAME)), parallel=2
        ):
            if r["compression"].get(
                "enabled", True
            ):  # the large matrices really went int8 / int4 / top-k
                assert r["compressed_share"] > 0.8, (task, r["variant"], r["codec_share"])
            if r["flat"] and r["compression"].get("enabled", True) is False:
                # through the tier with compression off: the flat run's weights, bit for bit
                assert r["flat_exact"], (task, r["variant"], r["flat_diff"])
            if r["ok"] is False:
                failed.append(
                    f"{task} / {r['variant']}: {r['rel_diff']:+.2%} (target {r['target']:.0%})"
                )
    assert not failed, failed

"""The short version of benchmarks/bench_node_step.py (the README's node-step row): it runs on the node's
own rooms (BucketState, the reply encoder), so a change to their calls breaks it here, in the default
test run, rather than the next time someone measures. Tiny shard; checks that the node's step equals
plain fused AdamW and that every row was timed, not how fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_bench_node_step_runs_on_the_node_and_matches_fused_adamw(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_node_step.py"), "--numel", "262144"]
        + ["--bucket-numel", "65536", "--reps", "1", "--threads", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "bench_node_step.json").read_text())
    text = json.dumps(result)
    assert "max |diff| 0" in (tmp_path / "bench_node_step.md").read_text(), text[:2000]
    assert "NaN" not in text

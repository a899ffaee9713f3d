"""``benchmarks/bench_gpu.py``: its tiny CPU run and the sizes it picks for a GPU.

The tiny run is the GPU head-to-head with a ~1M-parameter GPT on the CPU: every competitor that can
run there (local AdamW, FSDP2 with CPU offload over gloo, LuWu streaming and resident against real
node processes) trains in a process of its own and must come back with timed steps; a competitor
that crashes fails the test. The sizing is checked for the two GPUs the device machine may have,
since no GPU is here: size (a) is past local AdamW's reach and within the host's memory for FSDP2
+ offload and LuWu's nodes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_gpu

SCRIPT = Path(bench_gpu.__file__)
ON_CPU = ("local_adamw", "fsdp2_offload", "luwu_streaming", "luwu_resident")
GIB = 1 << 30


def run_tiny(out: Path, timeout_s: float) -> tuple[int, str]:
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--budget-s", str(timeout_s - 30)]
    cmd += ["--out", str(out)]
    with open(out / "stdout.txt", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                proc.terminate()  # the script ends its running competitor's process group on TERM
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        log.seek(0)
        text = log.read()
    if rc is None:
        pytest.fail(f"bench_gpu.py --tiny ran past {timeout_s} s:\n{text[-4000:]}")
    return rc, text


@pytest.mark.timeout(300)
def test_tiny_cpu_run_has_every_competitor_with_timed_steps(tmp_path):
    rc, out = run_tiny(tmp_path, 270)
    assert rc == 0, out[-4000:]
    result = json.loads((tmp_path / "bench_gpu_cpu_tiny.json").read_text())
    assert (tmp_path / "bench_gpu_cpu_tiny.md").read_text().startswith("# GPU head-to-head")
    rows = {r["competitor"]: r for r in result["rows"]}
    assert set(rows) == set(bench_gpu.COMPETITORS)
    for name in ON_CPU:
        row = rows[name]
        assert row["status"] == "ok", f"{name}: {row.get('message')}\n{row.get('log_tail', '')}"
        assert row["steps_timed"] == 2 and row["tokens_per_s"] > 0, row
        assert row["host_worker_peak_gib"] > 0, row
    for name in ("luwu_streaming", "luwu_resident"):
        assert rows[name]["host_nodes_peak_gib"] > 0, rows[name]
    fsdp2 = {"backend": "gloo", "param_devices": ["cpu"], "pinned": False}
    assert rows["fsdp2_offload"]["info"] == fsdp2
    # the same model, init and batch everywhere: every competitor's first loss is the same
    first = [rows[n]["loss_first"] for n in ON_CPU]
    assert first == pytest.approx([first[0]] * len(first), rel=1e-3), first
    if importlib.util.find_spec("deepspeed") is None:
        assert rows["deepspeed_offload"]["status"] == "skipped"
    assert any(k.startswith("tiny: luwu_streaming / fsdp2_offload") for k in result["ratios"])


@pytest.mark.timeout(60)
def test_the_shape_counts_the_models_parameters():
    for shape in (bench_gpu.TINY, bench_gpu.shape_for(5e6, 256, 4)):
        with torch.device("meta"):
            model = bench_gpu.GPT(shape)
        assert shape.params == sum(p.numel() for p in model.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("total_gib", [79.2, 139.8], ids=["h100", "h200"])
def test_size_a_is_past_local_adamw_and_within_the_host_for_fsdp2_offload(total_gib):
    total, available = int(total_gib * GIB), 124 * GIB  # a 128 GiB host, freshly started
    shapes, cap, why = bench_gpu.plan(total, available, nodes=3)  # 16 cores: 3 nodes
    large, base = shapes["large"], shapes["base"]
    host = bench_gpu.HOST_SHARE * available
    assert cap <= total
    assert bench_gpu.ADAM_B * large.params > 1.1 * cap, why
    for name in ("fsdp2_offload", "luwu_streaming"):
        gpu, host_need = bench_gpu.needs(large, name, 3)
        assert gpu < cap and host_need <= host, (name, why)
        assert bench_gpu.skip_reason("large", name, large, cap, host, 3) == ""
    for name in ON_CPU:  # every competitor fits the baseline
        assert bench_gpu.skip_reason("base", name, base, cap, host, 3) == "", name
    # only the H200's size needs more host memory than the host has: capped
    assert (cap < total) == (total_gib > 100), why


@pytest.mark.timeout(60)
def test_the_profile_counts_training_per_process_and_leaves_setup_out(tmp_path):
    parent = 'process 10:"python3 benchmarks/bench_gpu.py --profile"'
    worker = parent + ';process 11:"python3 benchmarks/bench_gpu.py --child /tmp/b/x.json"'
    node = worker + ';process 12:"python3 -m luwu node --node.index 0"'
    train = "train (benchmarks/bench_gpu.py:372);step (benchmarks/bench_gpu.py:206)"
    lines = [
        f"{worker};{train};write (gpu_workers/landing.py:68);decode_ (protocol/codecs/dense.py:95) 50",
        f"{worker};{train};copy_ (torch/_tensor.py:10) 25",
        f"{worker};run_competitor (benchmarks/bench_gpu.py:426);setup_luwu (benchmarks/bench_gpu.py:305);"
        "encode (protocol/codecs/dense.py:62) 400",  # setup: left out
        f"{worker};_find_and_load (<frozen importlib._bootstrap>:1360) 300",  # an import: left out
        f"{node};run_node (switch_nodes/daemon.py:80);apply_ (switch_nodes/optimizers/adam.py:9) 100",
        f"{parent};main (benchmarks/bench_gpu.py:854) 900",  # the parent: left out
        "garbage without a count",
    ]
    raw = tmp_path / "prof.txt"
    raw.write_text("\n".join(lines) + "\n")
    prof = bench_gpu.profile_summary(raw, steps=5)  # 50 Hz over 5 steps: 250 samples a second
    assert prof["worker"]["cpu_s_per_step"] == pytest.approx(75 / 250)
    assert prof["worker"]["top"][0] == {
        "where": "decode_ (protocol/codecs/dense)",
        "s_per_step": 0.2,
    }
    assert prof["worker"]["top"][1]["where"] == "copy_ (torch/_tensor.py:10)"
    assert prof["nodes"] == {
        "cpu_s_per_step": 0.4,
        "top": [{"where": "apply_ (switch_nodes/optimizers/adam)", "s_per_step": 0.4}],
    }

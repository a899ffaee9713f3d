"""benchmarks/profile_worker.py's table: py-spy's raw stacks attributed to the innermost LuWu module
(a hook that autograd runs counts as LuWu's), to the thread by name, and to the LuWu function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.profile_worker import profile_table  # noqa: E402

MAIN = "thread (11): MainThread;<module> (<string>:1);_worker (benchmarks/profile_worker.py:124)"
RAW = "\n".join(
    [
        # a gradient hook, run by autograd inside backward: LuWu's (gpu_workers/worker), not backward's
        f"{MAIN};Tensor.backward (torch/_tensor.py:623);_engine_run_backward (torch/autograd/graph.py:979);"
        "hook (luwu/optimizer.py:373);Worker.grad_ready (gpu_workers/worker.py:392) 30",
        # the encode under it: the innermost LuWu frame wins
        f"{MAIN};Tensor.backward (torch/_tensor.py:623);hook (luwu/optimizer.py:373);"
        "_BlockCodec._run (protocol/codecs/block.py:88) 10",
        f"{MAIN};Tensor.backward (torch/_tensor.py:623);_engine_run_backward (torch/autograd/graph.py:979) 40",
        f"{MAIN};Module._call_impl (torch/nn/modules/module.py:1884) 15",
        "thread (12): luwu-io-r0;Thread._bootstrap (threading.py:1002);"
        "WorkerClient._run (gpu_workers/client.py:200) 5",
        "not a sample line",
    ]
)


@pytest.mark.timeout(30)
def test_samples_go_to_the_innermost_luwu_module_thread_and_function(tmp_path):
    raw = tmp_path / "profile.txt"
    raw.write_text(RAW + "\n")
    t = profile_table(raw)
    assert t["samples"] == 100
    by_module = {r["where"]: r["share"] for r in t["by_module"]}
    assert by_module == {
        "backward (torch autograd)": 0.40,
        "gpu_workers/worker": 0.30,
        "forward (torch modules)": 0.15,
        "protocol/codecs/block": 0.10,
        "gpu_workers/client": 0.05,
    }
    assert {r["where"]: r["share"] for r in t["by_thread"]} == {
        "main (training loop)": 0.95,
        "luwu-io-r0": 0.05,
    }
    assert t["by_function"][0] == {"where": "Worker.grad_ready (gpu_workers/worker)", "share": 0.30}

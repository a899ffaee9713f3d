"""Out-of-core nodes (node.state_dir, node.state_memory_bytes), real processes: 2 workers train against
a node whose state is at least 4x its memory budget, and the weights equal an in-RAM node's run bit for
bit (compression off), resident and streaming; the state files hold every bucket's last step."""

import json
import time

import pytest
import torch
from harness import ROOT, run_training, start_workers, wait_all

import luwu
from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout
from luwu.switch_nodes.ooc.shard import STEP_SHIFT

STREAM = ROOT / "workers" / "stream.py"
SLOT = 5 * 4096  # an AdamW bucket of at most 1024 elements: params, 3 states, steps, 4 KiB each
BUDGET = 2 * SLOT


def _stream(spec: dict, nodes: list[str], tmp) -> list[dict]:
    spec = dict(spec, nodes=nodes, world_size=2, out=str(tmp / f"result-{time.monotonic_ns()}"))
    wait_all(start_workers(STREAM, spec, 2, tmp), 150)
    return [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]


def _train(spec: dict, streaming: bool, tmp, node_args: list[str] | None = None) -> list:
    with luwu.local_cluster(1, node_args=node_args) as c:
        if streaming:
            return [r["params"] for r in _stream(spec, c.addresses, tmp)]
        return [r["params"] for r in run_training(spec, c.addresses, tmp)]


def _flat(params) -> list[torch.Tensor]:
    return list(params.values()) if isinstance(params, dict) else list(params)


def _committed_steps(folder) -> tuple[dict[int, int], int]:
    """The step each bucket's state files hold (committed), and the bytes of one slot of every bucket."""
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    engine = IOEngine()
    state = StateFile.open(folder, layout, engine)
    try:
        steps = {bid: c.version >> STEP_SHIFT for bid, c in state.committed.items()}
    finally:
        state.close()
        engine.close()
    return steps, sum(b.slot_bytes for b in layout.buckets)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streaming"])
def test_node_with_a_quarter_of_its_state_in_ram_trains_as_the_in_ram_node(streaming, tmp_path):
    steps = 6
    spec = {"steps": steps, "bucket_bytes": 1024 if not streaming else 2048, "hyper": {"lr": 0.01}}
    if streaming:
        spec["hyper"] = {"lr": 0.01, "weight_decay": 0.05}
    want = _train(spec, streaming, tmp_path)
    state_dir = tmp_path / "state"
    args = ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(BUDGET)]
    got = _train(spec, streaming, tmp_path, args)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(_flat(got[rank]), _flat(want[rank]))):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")
    committed, state_bytes = _committed_steps(state_dir / "luwu-node0")
    assert state_bytes >= 4 * BUDGET, (state_bytes, BUDGET)  # the state was 4x the budget at least
    assert committed and set(committed.values()) == {steps}, committed


@pytest.mark.timeout(200)
def test_state_that_fits_the_budget_stays_in_ram_and_writes_no_files(tmp_path):
    spec = {"steps": 4, "bucket_bytes": 1024}
    want = _train(spec, False, tmp_path)
    state_dir = tmp_path / "state"
    args = ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(64 << 20)]
    got = _train(spec, False, tmp_path, args)
    for a, b in zip(_flat(got[0]), _flat(want[0])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not (state_dir / "luwu-node0" / "header.json").exists()


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"state_memory_bytes": -1}, "node.state_memory_bytes must be >= 0"),
        ({"state_memory_bytes": 1 << 20}, "needs node.state_dir"),
        ({"state_dir": "/tmp/s", "checkpoint_dir": "/tmp/c"}, "do not combine"),
    ],
)
def test_state_settings_are_validated(kw, says):
    with pytest.raises(ConfigError, match=says):
        NodeConfig(**kw)


def test_state_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        NodeConfig(state_dir=str(f))
    assert NodeConfig(state_dir=str(tmp_path / "new"), state_memory_bytes=1 << 30).state_dir

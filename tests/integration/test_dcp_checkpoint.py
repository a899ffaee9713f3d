"""Sharded training checkpoints: ``luwu.save_checkpoint`` / ``luwu.load_checkpoint`` (every node writes and
reads its shard of the master weights and optimizer state in one torch.distributed.checkpoint folder),
interchangeable with an FSDP2 job's ``dcp.save`` / ``dcp.load`` + ``set_state_dict``; and DCP metadata
read without running its pickle.

The jobs run in real worker processes (tests/workers/dcp_checkpoint.py): two LuWu ranks, or two FSDP2
ranks over gloo on CPU, on the same model and data.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from pathlib import Path

import msgpack
import pytest
import torch
from harness import ROOT, start_workers, wait_all

import luwu

SCRIPT = ROOT / "workers" / "dcp_checkpoint.py"
LR = 0.02
SAVE_AT, AFTER = 3, 3  # the uninterrupted run: steps before the checkpoint, and after it


def run(spec: dict, tmp: Path, *, env: dict | None = None, timeout_s: float = 150) -> list[dict]:
    """Two worker processes of ``spec``; each rank's record."""
    spec = dict(spec, out=str(tmp / f"out-{time.monotonic_ns()}"))
    wait_all(start_workers(SCRIPT, spec, 2, tmp, env), timeout_s)
    return [torch.load(f"{spec['out']}.rank{r}", weights_only=False) for r in range(2)]


def run_luwu(nodes: int, root: Path, **spec) -> list[dict]:
    with luwu.local_cluster(nodes, node_args=["--node.export_root", str(root)]) as c:
        return run({"role": "luwu", "nodes": c.addresses, "bucket_bytes": 96, **spec}, root)


def run_fsdp(root: Path, **spec) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return run(
        {"role": "fsdp", **spec}, root, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )


def by_name(state: dict, names: list[str]) -> dict:
    """torch's optimizer ``state`` keyed by parameter name (RemoteOptimizer's is keyed by index)."""
    return {names[i] if isinstance(i, int) else i: entry for i, entry in state.items()}


def assert_states_equal(got: dict, want: dict) -> None:
    """Optimizer states by parameter name: the same entries, every tensor bit for bit."""
    assert got.keys() == want.keys()
    for name, entry in want.items():
        assert got[name].keys() == entry.keys(), name
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(got[name][k]), torch.as_tensor(v)), (name, k)


NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two LuWu ranks on 2 nodes: SAVE_AT steps, rank 0 saves a checkpoint, AFTER more steps."""
    root = tmp_path_factory.mktemp("luwu")
    records = run_luwu(
        2, root, seed=0, lr=LR, steps=SAVE_AT + AFTER, save_at=SAVE_AT, save=str(root / "ckpt")
    )
    return root, records


@pytest.mark.timeout(400)
def test_a_checkpoint_of_two_nodes_resumes_on_three_fresh_ones_exactly(uninterrupted):
    root, records = uninterrupted
    saved = records[0]["saved"]
    folder = Path(saved["folder"])
    assert folder == root / "ckpt"
    assert sorted(os.listdir(folder)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__groups_0.distcp",
    ]
    # a new job: other initial weights, another learning rate, 3 nodes; every rank loads
    resumed = run_luwu(3, root, seed=7, lr=0.5, steps=AFTER, load=str(folder))
    for r, rec in enumerate(resumed):
        loaded = rec["loaded"]
        assert loaded["step"] == SAVE_AT and loaded["lr"] == LR
        assert all(torch.equal(loaded["weights"][n], w) for n, w in saved["weights"].items())
        assert_states_equal(
            by_name(loaded["state"]["state"], NAMES), by_name(saved["state"]["state"], NAMES)
        )
        assert all(float(e["step"]) == SAVE_AT for e in loaded["state"]["state"].values())
        for i in range(AFTER):  # every next step equals the uninterrupted run's, bit for bit
            want = records[r]["after"][SAVE_AT + i]
            assert all(torch.equal(rec["after"][i][n], w) for n, w in want.items()), (r, i)


@pytest.mark.timeout(400)
def test_b_an_fsdp2_job_loads_the_luwu_checkpoint(uninterrupted):
    root, records = uninterrupted
    saved = records[0]["saved"]
    fsdp = run_fsdp(root, seed=7, lr=0.5, steps=1, load=saved["folder"])
    for rec in fsdp:
        loaded = rec["loaded"]
        assert all(torch.equal(loaded["weights"][n], w) for n, w in saved["weights"].items())
        assert_states_equal(loaded["state"], by_name(saved["state"]["state"], NAMES))
        assert loaded["groups"][0]["lr"] == LR and loaded["groups"][0]["params"] == NAMES
        for n, w in records[0]["after"][SAVE_AT].items():  # the next step: FSDP2's and LuWu's agree
            torch.testing.assert_close(rec["after"][0][n], w, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(400)
def test_c_luwu_starts_from_an_fsdp2_checkpoint(tmp_path):
    fsdp = run_fsdp(
        tmp_path, seed=3, lr=LR, steps=SAVE_AT + 1, save_at=SAVE_AT, save=str(tmp_path / "fsdp")
    )
    saved = fsdp[0]["saved"]
    resumed = run_luwu(2, tmp_path, seed=7, lr=0.5, steps=1, load=str(tmp_path / "fsdp"))
    for rec in resumed:
        loaded = rec["loaded"]
        assert loaded["step"] == SAVE_AT and loaded["lr"] == LR
        assert all(torch.equal(loaded["weights"][n], w) for n, w in saved["weights"].items())
        assert_states_equal(by_name(loaded["state"]["state"], NAMES), saved["state"])
        for n, w in fsdp[0]["after"][SAVE_AT].items():  # LuWu's next step equals the FSDP2 job's
            torch.testing.assert_close(rec["after"][0][n], w, rtol=1e-6, atol=1e-6)


# -- DCP metadata is read without running its pickle -------------------------------------------------


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_folder(folder: Path, marker: Path) -> Path:
    """A folder whose .metadata would run ``touch marker`` when unpickled (and a data file beside it)."""
    folder.mkdir(parents=True)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    return folder


@pytest.mark.timeout(120)
def test_dcp_metadata_is_read_without_running_its_pickle(tmp_path):
    """A .metadata that would run code is refused by every reader of DCP folders (init_weights, the
    worker's and the node's reading of a checkpoint), naming the file, and runs nothing; so is one that
    points outside its folder; torch's own dcp.save output still loads."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from luwu.gpu_workers.materialize import open_weights
    from luwu.protocol.messages import Op

    marker = tmp_path / "ran"
    folder = crafted_folder(tmp_path / "crafted", marker)
    with pytest.raises(
        luwu.CorruptCheckpointError, match=f"{folder}/.metadata .*global posix.system"
    ):
        open_weights(str(folder))  # optimizer.init_weights
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(luwu.CorruptCheckpointError, match=str(folder)):
        luwu.RemoteOptimizer(
            meta,
            nodes=["tcp://127.0.0.1:9"],
            lr=0.01,
            stream_weights=True,
            rank=0,
            world_size=1,
            init_weights=str(folder),
        )
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with luwu.local_cluster(2, node_args=["--node.export_root", str(tmp_path)]) as c:
        opt = luwu.RemoteOptimizer(
            model, nodes=c.addresses, lr=0.01, compression=False, rank=0, world_size=1
        )
        try:
            with pytest.raises(luwu.CorruptCheckpointError, match=str(folder)):
                luwu.load_checkpoint(opt, folder)  # the worker's reading of step and param groups
            frame = torch.frombuffer(bytearray(msgpack.packb({"params": {}})), dtype=torch.uint8)
            opt.client.send(0, {"op": Op.IMPORT, "step": 0, "path": str(folder)}, [frame])
            (answer,) = opt.client.answers([(Op.IMPORT, 0, 0, -1)], Op.IMPORT, 30.0)
            assert isinstance(answer, luwu.CorruptCheckpointError)  # the node's own reading
            assert "node 0" in str(answer) and f"{folder}/.metadata" in str(answer)
            opt.step()  # the node still serves
        finally:
            opt.close()
    assert not marker.exists()

    want = {"w": torch.randn(5, 3), "b": torch.randn(3), "n": torch.tensor(4)}
    dcp.save(dict(want), checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    source = open_weights(str(tmp_path / "plain"))
    assert source.names() == set(want)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    source.read(got)
    assert all(torch.equal(got[k], v) for k, v in want.items())

    # the same genuine metadata, one chunk pointed outside the folder: refused before any read
    with open(tmp_path / "plain" / ".metadata", "rb") as f:
        md = pickle.load(f)  # (this test's own folder)
    index = next(iter(md.storage_data))
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="../ran")
    with open(tmp_path / "plain" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(luwu.CorruptCheckpointError, match="outside the folder"):
        open_weights(str(tmp_path / "plain"))

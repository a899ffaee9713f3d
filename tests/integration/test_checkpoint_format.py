"""Node checkpoints are ``torch.distributed.checkpoint`` folders: torch reads them, damage is detected,
and old-format files are converted."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from checkpoint_files import assert_resumes_like_adamw, rewrite_manifest, save_small, train_steps

import luwu
from luwu.switch_nodes import legacy_checkpoint
from luwu.switch_nodes.checkpoint import CHECKSUMS, DATA, MANIFEST, CheckpointStore

JOB = "ckpt-format"


def _nested(m) -> bytes:
    return b"[" * 100_000 + b"]" * 100_000


def _forbidden_metadata(folder) -> None:
    """A ``.metadata`` that would run ``os.system`` when unpickled, listed with its checksum."""
    import hashlib

    body = pickle.dumps(os.system)
    (folder / ".metadata").write_bytes(body)
    sums = json.loads((folder / CHECKSUMS).read_bytes())
    sums["files"][".metadata"] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (folder / CHECKSUMS).write_bytes(json.dumps(sums).encode())


DAMAGE = {
    "truncated tensor file": lambda f: (f / DATA).write_bytes((f / DATA).read_bytes()[:-100]),
    "altered manifest": lambda f: (f / MANIFEST).write_bytes(
        (f / MANIFEST).read_bytes().replace(b'"version":20', b'"version":21')
    ),
    "missing tensor file": lambda f: (f / DATA).unlink(),
    "missing metadata": lambda f: (f / ".metadata").unlink(),
    "missing checksums": lambda f: (f / CHECKSUMS).unlink(),
    "nested JSON in the manifest": lambda f: rewrite_manifest(f, _nested),
    "nested JSON in the checksums": lambda f: (f / CHECKSUMS).write_bytes(_nested(None)),
    "manifest naming too much data": lambda f: rewrite_manifest(
        f,
        lambda m: json.dumps(
            {**m, "buckets": [{**m["buckets"][0], "states": m["state_names"]}]}
        ).encode(),
    ),
    "metadata that runs code": _forbidden_metadata,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_folder_is_skipped_for_the_older_one(tmp_path, damage):
    store = CheckpointStore(str(tmp_path), node_index=0, keep=3)
    for step in (10, 20):
        save_small(store, step)
    newest = store.list()[-1][1]
    assert (newest / "luwu_node.json").exists() and json.loads((newest / MANIFEST).read_bytes())[
        "buckets"
    ][0]["version"] == 20
    DAMAGE[damage](newest)
    ck = store.latest()
    assert (
        ck is not None and ck.step == 10 and torch.equal(ck.tensors[0][0], torch.full((10,), 10.0))
    )


@pytest.mark.timeout(60)
def test_a_second_checkpoint_of_one_step_replaces_the_first_and_a_crash_between_keeps_one(tmp_path):
    """Writing step 10 again replaces the folder; a folder set aside by a crash between the two renames
    (``.replaced``) is still a checkpoint of its step; a temporary folder left by a crash is no
    checkpoint and is removed by the next write."""
    store = CheckpointStore(str(tmp_path), node_index=0, keep=3)
    first = save_small(store, 10)
    (first / "marker").write_text("first")
    save_small(store, 10)
    assert [s for s, _ in store.list()] == [10] and not (first / "marker").exists()
    os.rename(
        first, first.with_name(first.name + ".replaced")
    )  # the crash: the new one not yet renamed
    shutil.copytree(first.with_name(first.name + ".replaced"), tmp_path / f".{first.name}.tmp")
    assert store.latest().step == 10
    save_small(store, 20)
    assert [p.name for _, p in store.list()] == [
        first.name + ".replaced",
        "node0-step0000000020.dcp",
    ]
    assert not list(tmp_path.glob(".*"))


def _init() -> dict:
    """A fresh random state dict of :func:`_model`'s network (from torch's current seed)."""
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)
    ).state_dict()


def _model(init: dict) -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    m.load_state_dict(init)
    return m


@pytest.mark.timeout(120)
def test_torch_dcp_loads_a_node_checkpoint_with_the_nodes_weights_and_adam_state(tmp_path):
    """A node's checkpoint folder, read by ``torch.distributed.checkpoint.load`` alone, holds the node's
    fp32 weights and AdamW state (equal to what STATE gathers, and to a local torch AdamW), named as
    exports name them, each flat."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    torch.manual_seed(0)
    data = [torch.randn(8, 16) for _ in range(4)]
    init = _init()
    ckpt = tmp_path / "ck"
    with luwu.local_cluster(
        1, job=JOB, node_args=["--node.checkpoint_dir", str(ckpt), "--node.index", "0"]
    ) as cluster:
        remote, local = _model(init), _model(init)
        opt = luwu.RemoteOptimizer(
            remote,
            "adamw",
            nodes=cluster.addresses,
            job=JOB,
            lr=0.01,
            compression=False,
            timeout_s=30,
        )
        ref = torch.optim.AdamW(local.parameters(), lr=0.01)
        try:
            train_steps(remote, opt, data)
            train_steps(local, ref, data)
            state = opt.state_dict()["state"]
        finally:
            opt.close()
        cluster.stop()  # SIGTERM: the node writes its checkpoint of step 4
    folder = ckpt / "node0-step0000000004.dcp"
    names = [n for n, _ in remote.named_parameters()]
    want = {f"model.{n}" for n in names} | {
        f"optim.state.{n}.{s}" for n in names for s in ("step", "exp_avg", "exp_avg_sq")
    }
    metadata = FileSystemReader(folder).read_metadata()
    assert set(metadata.state_dict_metadata) == want
    sd = {k: torch.empty(tuple(md.size)) for k, md in metadata.state_dict_metadata.items()}
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    for i, ((n, p), q) in enumerate(zip(remote.named_parameters(), local.parameters())):
        assert torch.equal(sd[f"model.{n}"], p.detach().flatten()), n
        torch.testing.assert_close(sd[f"model.{n}"], q.detach().flatten(), rtol=1e-5, atol=1e-6)
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[f"optim.state.{n}.{s}"], state[i][s].flatten()), (n, s)
            torch.testing.assert_close(
                sd[f"optim.state.{n}.{s}"], ref.state[q][s].flatten(), rtol=1e-5, atol=1e-7
            )
        assert float(sd[f"optim.state.{n}.step"]) == float(ref.state[q]["step"]) == 4.0


def _to_legacy(folder, path) -> dict:
    """Write the checkpoint in ``folder`` as an old-format file at ``path`` (the old writer), remove the
    folder; returns its tensors."""
    ck = CheckpointStore(str(folder.parent), 0).load(folder)
    meta = dict(ck.meta)
    meta["buckets"] = [
        {
            "id": b["id"],
            "spec": b["spec"],
            "version": b["version"],
            "initialized": b["initialized"],
            "numels": [t.numel() for t in ck.tensors[b["id"]]],
        }
        for b in ck.meta["buckets"]
    ]
    legacy_checkpoint.write(path, meta, ck.tensors)
    shutil.rmtree(folder)
    return ck.tensors


@pytest.mark.timeout(120)
def test_a_node_starts_from_an_old_format_checkpoint_converts_it_and_trains_on_equal_to_torch(
    tmp_path,
):
    """A node whose checkpoint directory holds a ``LUWUCKP1`` file of step 5 (and nothing newer) restores
    it, writes it as a checkpoint folder with the same tensors bit for bit, removes the file, and a
    resuming worker trains on equal to local AdamW."""
    torch.manual_seed(0)
    data = [torch.randn(8, 16) for _ in range(10)]
    init = _init()
    ckpt = tmp_path / "ck"
    args = ["--node.checkpoint_dir", str(ckpt), "--node.index", "0", "--node.checkpoint_every", "5"]
    with luwu.local_cluster(1, job=JOB, node_args=args) as cluster:
        first = _model(init)
        opt = luwu.RemoteOptimizer(
            first,
            "adamw",
            nodes=cluster.addresses,
            job=JOB,
            lr=0.01,
            compression=False,
            timeout_s=30,
        )
        try:
            train_steps(first, opt, data[:5])
        finally:
            opt.close()
        cluster.stop()
        old = ckpt / "node0-step0000000005.ckpt"
        tensors = _to_legacy(ckpt / "node0-step0000000005.dcp", old)
        assert [p.name for p in ckpt.iterdir()] == [old.name] and old.read_bytes()[
            :8
        ] == b"LUWUCKP1"
        addr = cluster.restart(0)
        assert not old.exists(), "the old-format file was converted and removed"
        converted = CheckpointStore(str(ckpt), 0).load(ckpt / "node0-step0000000005.dcp")
        assert not converted.legacy and converted.tensors.keys() == tensors.keys()
        for bid, ts in tensors.items():
            assert all(
                torch.equal(a, b) for a, b in zip(converted.tensors[bid], ts, strict=True)
            ), bid
        assert_resumes_like_adamw(addr, JOB, lambda: _model(init), data, 5)

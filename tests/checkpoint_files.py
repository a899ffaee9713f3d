"""Node checkpoint folders for tests: a small valid one, and edits that keep the checksums valid."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from luwu.protocol.layout import Bucket, Segment
from luwu.switch_nodes.checkpoint import CHECKSUMS, MANIFEST, CheckpointStore


def save_small(store: CheckpointStore, step: int) -> Path:
    """A checkpoint of ``step``: one bucket holding parameter ``w`` (6 elements) and the first 4 of
    ``b``, weights ``step`` everywhere, ``exp_avg`` 0..9, step counters ``step``."""
    segs = (Segment(0, "", (), 0, 0, 6), Segment(1, "", (), 0, 6, 4))
    meta = {
        "job": "j",
        "node": store.node,
        "layout": "h",
        "world_size": 1,
        "optimizer": "adamw",
        "step": step,
        "step_in_state": True,
        "state_names": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
        "param_names": {"0": "w", "1": "b"},
        "buckets": [
            {
                "id": 0,
                "spec": Bucket(0, -1, 0, 10, segs).to_wire(),
                "version": step,
                "initialized": True,
                "steps": [float(step)] * 2,
                "states": ["exp_avg"],
            }
        ],
    }
    params = torch.full((10,), float(step))
    return store.save(meta, {0: {"params": params, "exp_avg": torch.arange(10.0)}})


def rewrite_manifest(folder: Path, change) -> None:
    """Replace ``luwu_node.json`` by ``change(manifest) -> bytes`` and list its new checksum (a buggy or
    hostile writer: the folder verifies whole)."""
    body = change(json.loads((folder / MANIFEST).read_bytes()))
    (folder / MANIFEST).write_bytes(body)
    sums = json.loads((folder / CHECKSUMS).read_bytes())
    sums["files"][MANIFEST] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (folder / CHECKSUMS).write_bytes(json.dumps(sums).encode())


def train_steps(model, opt, batches) -> None:
    """One step of ``opt`` per batch on the mean square of ``model``'s output."""
    for x in batches:
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()


def assert_resumes_like_adamw(addr: str, job: str, make_model, data: list, at: int) -> None:
    """A worker resuming ``job`` on the node at ``addr`` (restored at step ``at``) starts from the
    weights a local torch AdamW (lr 0.01) has after ``data[:at]``, and trains on equal to it over
    ``data[at:]`` (compression off)."""
    import luwu

    resumed, local = make_model(), make_model()
    ref = torch.optim.AdamW(local.parameters(), lr=0.01)
    train_steps(local, ref, data[:at])
    opt = luwu.RemoteOptimizer(
        resumed,
        "adamw",
        nodes=[addr],
        job=job,
        lr=0.01,
        compression=False,
        timeout_s=30,
        resume=True,
    )
    try:
        opt.synchronize()
        for a, b in zip(resumed.parameters(), local.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        train_steps(resumed, opt, data[at:])
        train_steps(local, ref, data[at:])
        opt.synchronize()
    finally:
        opt.close()
    for a, b in zip(resumed.parameters(), local.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)

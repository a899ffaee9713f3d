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

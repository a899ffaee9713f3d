"""The README's streaming snippet runs as written: a model built on the meta device, trained in
streaming mode on a local cluster, and exported with ``luwu.export_dcp`` into the nodes' export root.

The snippet is taken from README.md itself, so a README that stops working (a missing export root, a
name it never defines) fails here. Only what a reader supplies is filled in: the model class, its
config, the batches, the loss and a temporary folder in place of ``/shared/exports``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from workers.stream import Net

import luwu

README = Path(__file__).resolve().parents[2] / "README.md"


def streaming_snippet() -> str:
    """The README's python block that trains with ``stream_weights=True`` and exports the weights."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "stream_weights=True" in b and "export_dcp" in b]
    assert len(found) == 1, (
        f"README.md should hold one streaming snippet with export_dcp, found {len(found)}"
    )
    return found[0]


@pytest.mark.timeout(180)
def test_the_readme_streaming_snippet_trains_and_exports(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    code = streaming_snippet()
    assert "/shared/exports" in code, "the snippet names its export root /shared/exports"
    code = code.replace("/shared/exports", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)  # one worker, as a reader runs it
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    g = torch.Generator().manual_seed(0)
    scope = {
        "torch": torch,
        "luwu": luwu,
        "MyTransformer": lambda cfg: Net(cfg["blocks"], cfg["width"]),
        "cfg": {"blocks": 3, "width": 16},
        "batches": [
            (torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g))
            for _ in range(3)
        ],
        "loss_fn": torch.nn.functional.cross_entropy,
    }
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 -- the README's own code, on purpose
    folder = tmp_path / "step-1000"
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    fresh = Net(3, 16)
    sd = fresh.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    assert sd.keys() == before.keys()
    for name, w in sd.items():  # every weight came from the folder: trained, not the fresh model's
        assert torch.isfinite(w).all() and not torch.equal(w, before[name]), name

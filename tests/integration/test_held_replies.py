"""The nodes hold a step's new weights until the worker's step() (optimizer.hold_replies, on by default):
on loopback the node answers every bucket while the worker is still between backward and step(), and
the worker receives none of it until step() says it may write them; with the setting off, they all
land before step() and wait in the worker. Either way the weights equal local AdamW's."""

from __future__ import annotations

import time

import pytest
import torch

import luwu


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


def train(m: torch.nn.Module, opt, steps: int, pause_s: float = 0.0) -> list[int]:
    """``steps`` steps of a fixed regression; returns the payload bytes the worker received between the end
    of each forward (which read the last step's weights) and its step(), ``pause_s`` after the backward
    (in which the node answers every push)."""
    got = []
    for s in range(steps):
        torch.manual_seed(100 + s)
        x = torch.randn(32, 64)
        opt.zero_grad()
        loss = ((m(x) - x) ** 2).mean()
        before = opt.client.bytes_received if hasattr(opt, "client") else 0
        loss.backward()
        if hasattr(opt, "client"):
            time.sleep(pause_s)
            got.append(opt.client.bytes_received - before)
        opt.step()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hold", ["auto", "never", "slow link"])
def test_a_steps_weights_reach_the_worker_only_at_its_step(cluster1, monkeypatch, hold):
    """auto (the default, at the default link_gbps of 10) holds; never, and auto told of a 1 Gbit/s link
    (where replies come after step() anyway), do not."""
    if hold == "slow link":
        monkeypatch.setenv("LUWU_COMPRESSION__LINK_GBPS", "1")
    else:
        monkeypatch.setenv("LUWU_OPTIMIZER__HOLD_REPLIES", hold)
    m, local = model(), model()
    opt = luwu.RemoteOptimizer(m, nodes=cluster1.addresses, lr=0.01, compression=False, bucket_bytes=4096)
    ref = torch.optim.AdamW(local.parameters(), lr=0.01)
    try:
        assert len(opt.worker.layout.buckets) >= 6
        got = train(m, opt, 6, pause_s=0.3)
        opt.synchronize()
        train(local, ref, 6)
    finally:
        opt.close()
    weights = sum(p.numel() * 4 for p in m.parameters())
    if hold == "auto":  # from the first step on (the worker says so once connected)
        assert all(g == 0 for g in got), got
    else:
        assert all(g >= weights for g in got), (got, weights)
    for a, b in zip(m.parameters(), local.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)

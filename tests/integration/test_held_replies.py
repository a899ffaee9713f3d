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
    opt = luwu.RemoteOptimizer(
        m, nodes=cluster1.addresses, lr=0.01, compression=False, bucket_bytes=4096
    )
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
    else:  # (from step 1: the first step's update waits on the nodes for the global round, in case clip_grad_norm_ comes)
        assert got[0] == 0 and all(g >= weights for g in got[1:]), (got, weights)
    for a, b in zip(m.parameters(), local.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(30)
def test_held_replies_go_at_the_release_first_layers_first_and_a_closed_connection_frees_them():
    """The node's side alone: held until the worker reaches the step, then sent highest bucket first; a
    reply held for a connection that closed counts as sent (its tracker is done), one for a live connection
    that never says so is not (the node's stuck-worker timeout handles it)."""
    import zmq

    from luwu.switch_nodes.held_replies import HeldReplies

    sent, alive = [], {0: True, 1: True}
    held = HeldReplies(
        lambda w, frames, track, priority: sent.append((w, frames[0])),
        sync=True,
        limit=8,
        alive=lambda w: alive[w],
    )
    assert held.hold(0, 0, 1, [b"b1"], None) is None  # before the worker's first word: at once
    held.release(0, -1)  # connected: holds from step 0 on
    trackers = [held.hold(0, 0, b, [b"b%d" % b], None) for b in (1, 3, 2)]
    assert all(t is not None for t in trackers) and sent == []
    held.release(0, 0)
    assert sent == [(0, b"b3"), (0, b"b2"), (0, b"b1")]
    for t in trackers:
        t.wait(1)
    held.release(1, 4)
    gone, stuck = held.hold(1, 5, 0, [b"x"], None), held.hold(1, 5, 1, [b"y"], None)
    with pytest.raises(zmq.NotDone):
        stuck.wait(0.3)
    alive[1] = False
    gone.wait(2)  # the connection closed: nothing more to wait for
    assert held.count(1) == 2 and len(sent) == 3

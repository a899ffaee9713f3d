"""The initial weights (every resident bucket's, at start-up and after a rejoin) are asked for in
windows of ``PULL_WINDOW_BYTES``, the next while one lands: the replies waiting to be written never
hold a second copy of the model (all at once, they did: +216 MB of transient peak for a 216 MB model
in bench_memory). Checked on real nodes, by watching what the worker asks for and writes."""

from __future__ import annotations

import copy

import pytest
import torch

import luwu
from luwu.gpu_workers import worker as worker_mod
from luwu.gpu_workers.client import WorkerClient
from luwu.protocol.messages import Op

WINDOW = 64 << 10


@pytest.mark.timeout(60)
def test_initial_weights_are_asked_for_in_windows(cluster2, monkeypatch):
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(16)])
    want = copy.deepcopy(model.state_dict())
    asked: dict[int, int] = {}  # bucket -> bytes asked for and not written yet
    most = [0]
    send, land = WorkerClient.send, worker_mod.Worker.land

    def watch_send(self, node, header, *args, **kwargs):
        if header.get("op") == Op.PULL:
            asked[header["bucket"]] = 1
            most[0] = max(most[0], len(asked))
        return send(self, node, header, *args, **kwargs)

    def watch_land(self, bid, msg):
        asked.pop(bid, None)
        return land(self, bid, msg)

    monkeypatch.setattr(worker_mod, "PULL_WINDOW_BYTES", WINDOW)
    monkeypatch.setattr(WorkerClient, "send", watch_send)
    monkeypatch.setattr(worker_mod.Worker, "land", watch_land)
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster2.addresses, lr=0.1, compression=False, bucket_bytes=64 * 65 * 4
    )
    try:
        buckets = opt.layout.buckets
        per_window = WINDOW // buckets[0].nbytes
        assert len(buckets) == 16 and per_window == 3
        assert not asked, f"buckets asked for and never written: {sorted(asked)}"
        assert most[0] <= 2 * per_window, (
            f"{most[0]} buckets' weights were asked for at once (windows of {per_window}: at most "
            f"{2 * per_window}, one landing and one asked)"
        )
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    finally:
        opt.close()

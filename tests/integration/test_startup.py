"""Start-up without silent hangs: a node says which ranks it waits for."""

import subprocess
import sys
import time

import pytest
import torch

import luwu


@pytest.mark.timeout(90)
def test_node_says_which_ranks_it_waits_for():
    node = subprocess.Popen([sys.executable, "-m", "luwu", "node", "--node.bind", "tcp://127.0.0.1:0", "--node.index", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = node.stdout.readline().split()[1]
        opt = luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=[addr], rank=0, world_size=3, timeout_s=10)
        try:
            deadline = time.monotonic() + 30
            line = ""
            while time.monotonic() < deadline and "waiting for worker ranks" not in line:
                line = node.stderr.readline()
            assert "waiting for worker ranks [1, 2]" in line, line
            assert addr in line
        finally:
            opt.close()
    finally:
        node.terminate()
        node.wait(20)


@pytest.mark.timeout(90)
def test_worker_metrics_break_down_the_step(cluster1):
    model = torch.nn.Linear(4, 2)
    data = [torch.randn(3, 4) for _ in range(5)]
    pf = luwu.Prefetcher(data, depth=2)
    opt = luwu.RemoteOptimizer(model, nodes=cluster1.addresses, lr=0.1)
    opt.attach_prefetcher(pf)
    try:
        for x in pf:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        reg = opt.metrics.registry
        assert reg.get_sample_value("luwu_worker_steps_total") == 5
        assert reg.get_sample_value("luwu_worker_bytes_pushed_total") >= 5 * 10 * 4
        assert reg.get_sample_value("luwu_worker_update_wait_seconds_count") == 5
        assert reg.get_sample_value("luwu_worker_data_wait_seconds_count") == 5
        assert reg.get_sample_value("luwu_worker_compute_seconds_count") == 4
    finally:
        opt.close()
        pf.close()

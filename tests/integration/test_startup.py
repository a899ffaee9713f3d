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

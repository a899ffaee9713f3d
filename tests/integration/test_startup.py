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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_a_node_binds_its_entry_of_the_cluster_file(tmp_path):
    """`luwu node --config FILE --node.index i` listens where workers reading FILE will look."""
    ports = [_free_port(), _free_port()]
    nodes = [f"tcp://127.0.0.1:{p}" for p in ports]
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'[cluster]\nnodes = ["{nodes[0]}", "{nodes[1]}"]\n')
    node = subprocess.Popen([sys.executable, "-m", "luwu", "node", "--config", str(cluster), "--node.index", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = node.stdout.readline()
        assert line.split()[:2] == ["LUWU_NODE_READY", nodes[1]], line
    finally:
        node.terminate()
        node.wait(20)


@pytest.mark.timeout(90)
def test_a_busy_port_is_one_line_that_names_the_address():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        r = subprocess.run([sys.executable, "-m", "luwu", "node", "--node.bind", address], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert address in lines[0] and "Address already in use" in lines[0] and "--node.bind" in lines[0], lines[0]


@pytest.mark.timeout(90)
def test_a_dead_node_is_named_with_what_to_do(caplog):
    """Something takes connections at the address but never answers HELLO: the error names it and says
    what to do (no 'step None, bucket -1'), and the wait logs progress lines meanwhile instead of staying
    silent. (An address where nothing listens at all is named at once: test_lifecycle.py.)"""
    import socket

    from luwu.gpu_workers import client
    from luwu.gpu_workers.config import TransportConfig

    caplog.set_level("INFO", logger="luwu.gpu_workers.client")
    old, client.PROGRESS_EVERY_S = client.PROGRESS_EVERY_S, 1.0
    try:
        with socket.socket() as s, pytest.raises(luwu.NodeTimeoutError) as e:  # the kernel accepts, nobody speaks
            s.bind(("127.0.0.1", 0))
            s.listen()
            addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=[addr], rank=0, world_size=1, transport=TransportConfig(connect_timeout_s=3.0))
    finally:
        client.PROGRESS_EVERY_S = old
    msg = str(e.value)
    assert addr in msg and "None" not in msg and "bucket -1" not in msg, msg
    assert "is a node listening there" in msg and "cluster.nodes" in msg
    assert e.value.node == addr
    assert any("still waiting for WELCOME" in r.getMessage() and addr in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_host_that_does_not_resolve_is_named_at_once():
    t0 = time.monotonic()
    with pytest.raises(luwu.NodeTimeoutError, match="does not resolve") as e:
        luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=["tcp://no-such-host.invalid:5555"], rank=0, world_size=1)
    assert "no-such-host.invalid" in str(e.value) and "cluster.nodes" in str(e.value)
    assert time.monotonic() - t0 < 20  # not after the 30 s connect deadline

"""With CURVE keys, only authorized workers get in and traffic is encrypted; other jobs are refused."""

import subprocess
import sys
import tomllib

import pytest
import torch
import zmq

import luwu
from luwu.gpu_workers.config import TransportConfig


@pytest.mark.timeout(120)
def test_curve_authorized_worker_trains_unauthorized_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "luwu", "keys", "--out", str(tmp_path / "keys"), "--workers", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    node = tomllib.loads((tmp_path / "keys" / "node.toml").read_text())["node"]
    worker = tomllib.loads((tmp_path / "keys" / "worker0.toml").read_text())["transport"]
    args = ["--config", str(tmp_path / "keys" / "node.toml")]
    with luwu.local_cluster(1, node_args=args) as cluster:
        model = torch.nn.Linear(4, 2)
        opt = luwu.RemoteOptimizer(model, nodes=cluster.addresses, lr=0.1, transport=TransportConfig(timeout_s=10, **worker))
        try:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        finally:
            opt.close()
        # a stranger with its own key pair, and one without CURVE at all, never get a WELCOME
        pub, sec = zmq.curve_keypair()
        stranger = TransportConfig(connect_timeout_s=2, curve_server_key=node["curve_public_key"], curve_public_key=pub.decode(), curve_secret_key=sec.decode())
        for tc in (stranger, TransportConfig(connect_timeout_s=2)):
            with pytest.raises(luwu.NodeTimeoutError, match="WELCOME"):
                luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=cluster.addresses, transport=tc)


@pytest.mark.timeout(60)
def test_other_job_is_refused(cluster1):
    with pytest.raises(luwu.JobMismatchError, match="job 'intruder'"):
        luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=cluster1.addresses, job="intruder", timeout_s=5)


@pytest.mark.timeout(120)
def test_a_curve_key_is_tied_to_its_rank(tmp_path):
    """The i-th authorized key says HELLO only as rank i: rank 1's key claiming rank 0 is refused, naming
    the rank the key belongs to; rank 0's own key gets in."""
    out = subprocess.run([sys.executable, "-m", "luwu", "keys", "--out", str(tmp_path / "keys"), "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    workers = [tomllib.loads((tmp_path / "keys" / f"worker{r}.toml").read_text())["transport"] for r in range(2)]
    with luwu.local_cluster(1, node_args=["--config", str(tmp_path / "keys" / "node.toml")]) as cluster:
        with pytest.raises(luwu.ProtocolError, match="HELLO as worker rank 0 with a key that is not rank 0's: it is authorized as rank 1"):
            luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=cluster.addresses, lr=0.1, rank=0, world_size=2, transport=TransportConfig(timeout_s=10, connect_timeout_s=10, **workers[1]))
        model = torch.nn.Linear(4, 2)
        opt = luwu.RemoteOptimizer(model, nodes=cluster.addresses, lr=0.1, rank=0, world_size=1, transport=TransportConfig(timeout_s=10, **workers[0]))
        try:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        finally:
            opt.close()

"""With CURVE keys, only authorized workers get in and traffic is encrypted; other jobs are refused."""

import subprocess
import sys
import time
import tomllib

import pytest
import torch
import zmq
from harness import member_socket, proc_status

import luwu
from luwu.gpu_workers.config import TransportConfig


@pytest.mark.timeout(120)
def test_curve_authorized_worker_trains_unauthorized_is_refused(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "luwu", "keys", "--out", str(tmp_path / "keys"), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    node = tomllib.loads((tmp_path / "keys" / "node.toml").read_text())["node"]
    worker = tomllib.loads((tmp_path / "keys" / "worker0.toml").read_text())["transport"]
    args = ["--config", str(tmp_path / "keys" / "node.toml")]
    with luwu.local_cluster(1, node_args=args) as cluster:
        model = torch.nn.Linear(4, 2)
        opt = luwu.RemoteOptimizer(
            model,
            nodes=cluster.addresses,
            lr=0.1,
            transport=TransportConfig(timeout_s=10, **worker),
        )
        try:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        finally:
            opt.close()
        # a stranger with its own key pair, and one without CURVE at all, never get a WELCOME
        pub, sec = zmq.curve_keypair()
        stranger = TransportConfig(
            connect_timeout_s=2,
            curve_server_key=node["curve_public_key"],
            curve_public_key=pub.decode(),
            curve_secret_key=sec.decode(),
        )
        for tc in (stranger, TransportConfig(connect_timeout_s=2)):
            with pytest.raises(luwu.NodeTimeoutError, match="WELCOME"):
                luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=cluster.addresses, transport=tc)


@pytest.mark.timeout(60)
def test_other_job_is_refused(cluster1):
    with pytest.raises(luwu.JobMismatchError, match="job 'intruder'"):
        luwu.RemoteOptimizer(
            torch.nn.Linear(4, 2), nodes=cluster1.addresses, job="intruder", timeout_s=5
        )


@pytest.mark.timeout(120)
def test_a_curve_key_is_tied_to_its_rank(tmp_path):
    """The i-th authorized key says HELLO only as rank i: rank 1's key claiming rank 0 is refused, naming
    the rank the key belongs to; rank 0's own key gets in."""
    out = subprocess.run(
        [sys.executable, "-m", "luwu", "keys", "--out", str(tmp_path / "keys"), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    workers = [
        tomllib.loads((tmp_path / "keys" / f"worker{r}.toml").read_text())["transport"]
        for r in range(2)
    ]
    with luwu.local_cluster(
        1, node_args=["--config", str(tmp_path / "keys" / "node.toml")]
    ) as cluster:
        with pytest.raises(
            luwu.ProtocolError,
            match="HELLO as worker rank 0 with a key that is not rank 0's: it is authorized as rank 1",
        ):
            luwu.RemoteOptimizer(
                torch.nn.Linear(4, 2),
                nodes=cluster.addresses,
                lr=0.1,
                rank=0,
                world_size=2,
                transport=TransportConfig(timeout_s=10, connect_timeout_s=10, **workers[1]),
            )
        model = torch.nn.Linear(4, 2)
        opt = luwu.RemoteOptimizer(
            model,
            nodes=cluster.addresses,
            lr=0.1,
            rank=0,
            world_size=1,
            transport=TransportConfig(timeout_s=10, **workers[0]),
        )
        try:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        finally:
            opt.close()


def _hello(sock: zmq.Socket, worker: int, layout_hash: str, buckets: list) -> dict:
    """A raw HELLO (rank ``worker`` of 2) naming ``buckets`` (wire form) under ``layout_hash``; its answer."""
    from luwu.protocol import messages as wire
    from luwu.protocol.messages import Op

    header = {
        "op": Op.HELLO,
        "job": "luwu",
        "step": 0,
        "worker": worker,
        "world_size": 2,
        "layout": layout_hash,
        "node_index": 0,
        "buckets": buckets,
        "optimizer": "adamw",
        "mode": "sync",
        "param_names": {0: "w"},
    }
    sock.send_multipart(wire.encode(header))
    return wire.decode(sock.recv_multipart(), job="luwu").header


@pytest.mark.timeout(60)
def test_a_known_layout_hash_with_other_buckets_is_refused_before_allocation(cluster1):
    """A second HELLO with the job's layout hash but a bucket the job does not have (here 1 GiB) used to be
    admitted and allocated; it is refused, naming the buckets, and the node's RSS does not move."""
    pid = cluster1.procs[0].pid

    def rss() -> int:
        return proc_status(pid)["VmRSS"]

    ctx = zmq.Context.instance()
    socks = [member_socket(ctx.socket(zmq.DEALER)) for _ in range(2)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(cluster1.addresses[0])
    try:
        small = [0, 0, 64, [[0, 0, 0, 64]]]  # bucket 0: 64 elements of parameter 0
        assert _hello(socks[0], 0, "f" * 16, [small])["op"] == luwu.protocol.messages.Op.WELCOME
        before = rss()
        big = [1, 0, 2**28, [[1, 0, 0, 2**28]]]  # bucket 1: 1 GiB of fp32
        reply = _hello(socks[1], 1, "f" * 16, [small, big])
        assert reply["op"] == luwu.protocol.messages.Op.ERROR, reply
        assert (
            "the job's are [0]" in reply["message"] and "nothing allocated" in reply["message"]
        ), reply
        time.sleep(0.5)
        assert rss() < before + 64 * 2**20
    finally:
        for s in socks:
            s.close(0)

"""A job's lifecycle without silent surprises: resuming is asked for, a closed worker's rank is free at
once, a crashed one's rank says when it frees, and an address where nothing listens is named at once."""

import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import zmq
from harness import assert_params_close, member_socket, tanh_mlp

import luwu
from luwu.protocol import messages as wire
from luwu.protocol.errors import ProtocolError
from luwu.protocol.messages import Op

JOB = "lifecycle"
WIDTH = 8


def ask(addr: str, op: Op) -> dict:
    """One message ``op`` from a connection of its own (as worker 0, without HELLO); the answer's header."""
    s = member_socket(zmq.Context.instance().socket(zmq.DEALER))
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(addr)
    try:
        s.send_multipart(wire.encode({"op": op, "job": JOB, "step": 0, "worker": 0}))
        return wire.decode(s.recv_multipart(), job=JOB).header
    finally:
        s.close(0)


def stats(addr: str) -> dict:
    """The node's STATS, asked from a connection of its own."""
    return ask(addr, Op.STATS)["detail"]


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)) for _ in range(n)
    ]


def train(model, opt, data) -> None:
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if isinstance(opt, luwu.RemoteOptimizer):
        opt.synchronize()


def remote(model, cluster, **kw) -> luwu.RemoteOptimizer:
    kw = {
        "rank": 0,
        "world_size": 1,
        "lr": 0.01,
        "compression": False,
        "bucket_bytes": 512,
        "timeout_s": 20,
    } | kw
    return luwu.RemoteOptimizer(model, "adamw", nodes=cluster.addresses, job=JOB, **kw)


def job_at_step_3(cluster, how: str) -> list[torch.Tensor]:
    """A first run trains 3 steps and closes; the nodes hold the job at step 3 (with ``restored``: after a
    restart from the checkpoint they wrote on SIGTERM). Returns the weights it ended with."""
    model = tanh_mlp(0, width=WIDTH, depth=2)
    opt = remote(model, cluster)
    try:
        train(model, opt, batches(3))
    finally:
        opt.close()
    if how == "restored":
        cluster.procs[0].terminate()
        assert cluster.procs[0].wait(30) == 0
        cluster.restart(0)
    assert stats(cluster.addresses[0])["step"] == 3
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how", ["left", "restored"], ids=["left_by_a_run", "restored_from_checkpoint"]
)
def test_a_new_run_against_nodes_holding_the_job_is_refused_without_resume(tmp_path, how):
    """Nodes at step 3 with nobody training the job: a new worker without resume=True is refused at
    construction, naming the job, the step and both ways on; the nodes are left as they were."""
    with luwu.local_cluster(
        1, job=JOB, node_args=["--node.checkpoint_dir", str(tmp_path / "ckpt")]
    ) as cluster:
        job_at_step_3(cluster, how)
        with pytest.raises(luwu.JobExistsError) as err:
            remote(tanh_mlp(1, width=WIDTH, depth=2), cluster)
        msg = str(err.value)
        assert err.value.step == 3 and err.value.node == cluster.addresses[0], msg
        assert repr(JOB) in msg and "step 3" in msg and "resume=True" in msg, msg
        assert "luwu down && luwu up" in msg and "job=" in msg, msg
        after = stats(cluster.addresses[0])
        assert (after["step"], after["workers"]) == (3, 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how", ["left", "restored"], ids=["left_by_a_run", "restored_from_checkpoint"]
)
def test_resume_continues_from_the_nodes_state_as_an_uninterrupted_run(tmp_path, how, caplog):
    """resume=True: the worker takes the nodes' weights (not its own) and the job goes on from step 3 with
    the nodes' optimizer state, equal to 6 uninterrupted steps of torch's AdamW; each worker says so loudly.
    At step 0, resume=True is a fresh start."""
    caplog.set_level("INFO", logger="luwu.gpu_workers.worker")
    data = batches(6)
    with luwu.local_cluster(
        1, job=JOB, node_args=["--node.checkpoint_dir", str(tmp_path / "ckpt")]
    ) as cluster:
        fresh = remote(tanh_mlp(0, width=WIDTH, depth=2), cluster, resume=True)
        fresh.close()
        assert any(
            r.levelname == "INFO" and "starts fresh" in r.getMessage() for r in caplog.records
        )
        held = job_at_step_3(cluster, how)
        model = tanh_mlp(1, width=WIDTH, depth=2)  # other weights: the nodes' must replace them
        opt = remote(model, cluster, resume=True)
        try:
            assert opt.worker.step_num == 3
            assert_params_close(list(model.parameters()), held, rtol=0, atol=0)
            train(model, opt, data[3:])
        finally:
            opt.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(repr(JOB) in m and "resumes from step 3" in m for m in said), said
    ref = tanh_mlp(0, width=WIDTH, depth=2)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), data)
    assert_params_close(list(model.parameters()), list(ref.parameters()))


WORKER = textwrap.dedent(
    """
    import sys, time, torch, luwu
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = luwu.RemoteOptimizer(model, nodes=[sys.argv[1]], job=sys.argv[2], rank=0, world_size=1, lr=0.1, compression=False, bucket_bytes=512)
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.synchronize()
    print("READY", flush=True)
    if sys.argv[3] == "interrupt":
        raise KeyboardInterrupt  # Ctrl-C: the optimizer is never closed by the script
    time.sleep(120)
    """
)


def start_worker(addr: str, end: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, addr, JOB, end],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = p.stdout.readline()
    assert line.strip() == "READY", line + p.stdout.read()
    return p


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["close", "interrupt"])
def test_a_left_workers_rank_is_free_at_once(end):
    """A worker that closed (or whose script died of Ctrl-C without closing: closed at exit) said BYE: a
    new worker on the same rank connects at once, not after node.worker_timeout_s (60 s)."""
    with luwu.local_cluster(1, job=JOB) as cluster:
        if end == "close":
            model = torch.nn.Linear(4, 2)
            opt = remote(model, cluster)
            train(model, opt, [(torch.randn(3, 4), torch.randn(3, 2))])
            opt.close()
        else:
            p = start_worker(cluster.addresses[0], "interrupt")
            p.wait(30)
            out = (
                p.stdout.read()
            )  # (after readline: communicate() would skip what its buffer holds)
            assert p.returncode != 0 and "KeyboardInterrupt" in out, out
        assert stats(cluster.addresses[0])["workers"] == 0
        t0 = time.monotonic()
        opt = remote(torch.nn.Linear(4, 2), cluster, resume=True)
        took = time.monotonic() - t0
        try:
            assert opt.worker.step_num == 1
        finally:
            opt.close()
        assert took < 2.0, f"the rank took {took:.1f} s to be free"


@pytest.mark.timeout(120)
def test_bye_is_only_a_members_own():
    """BYE for rank 0 from rank 1's connection, or from a connection that never said HELLO, is refused and
    frees nothing; rank 1's own BYE frees rank 1."""
    with luwu.local_cluster(1, job=JOB) as cluster:
        addr = cluster.addresses[0]
        ranks = [remote(torch.nn.Linear(4, 2), cluster, rank=r, world_size=2) for r in range(2)]
        try:
            ranks[1].client.send(0, {"op": Op.BYE, "worker": 0})
            (answer,) = ranks[1].client.answers([(Op.BYE, 0, None, -1)], Op.BYE, timeout_s=10)
            assert isinstance(answer, ProtocolError) and "did not say HELLO as this rank" in str(
                answer
            ), answer
            reply = ask(addr, Op.BYE)
            assert reply["op"] == Op.ERROR and "did not say HELLO" in reply["message"], reply
            assert stats(addr)["workers"] == 2
            with pytest.raises(ProtocolError, match="worker rank 0 is held by a live connection"):
                remote(torch.nn.Linear(4, 2), cluster, rank=0, world_size=2)
            ranks[1].close()
            assert stats(addr)["workers"] == 1
        finally:
            for opt in ranks:
                opt.close()


@pytest.mark.timeout(120)
def test_a_killed_workers_rank_says_when_it_frees():
    """A SIGKILLed worker said no BYE: its rank stays held for node.worker_timeout_s, and the refusal says
    how many seconds remain."""
    with luwu.local_cluster(1, job=JOB, node_args=["--node.worker_timeout_s", "30"]) as cluster:
        p = start_worker(cluster.addresses[0], "sleep")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        with pytest.raises(ProtocolError, match="held by a live connection") as err:
            remote(torch.nn.Linear(4, 2), cluster, resume=True)
        left = float(str(err.value).split("frees in ")[1].split(" s")[0])
        assert 15.0 < left <= 30.0, str(err.value)
        assert "worker_timeout_s = 30" in str(err.value)


@pytest.mark.timeout(60)
def test_an_address_where_nothing_listens_fails_at_once_naming_it():
    make = luwu.RemoteOptimizer
    with (
        socket.socket() as s
    ):  # bound, never listening: connections are refused, nobody else takes the port
        s.bind(("127.0.0.1", 0))
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(luwu.NodeTimeoutError, match="no node listens there") as err:
            make(torch.nn.Linear(4, 2), nodes=[addr], rank=0, world_size=1)
        took = time.monotonic() - t0
    assert took < 2.0, f"{took:.1f} s to name {addr}"
    assert addr in str(err.value) and err.value.node == addr


@pytest.mark.timeout(90)
def test_a_normal_start_logs_no_waiting_warning(monkeypatch):
    """Rank 1 connecting a few seconds after rank 0 is a normal start: the node says nothing at its default
    log level (WARNING) about the ranks it waits for."""
    secret = "0123456789abcdef" * 2
    monkeypatch.setenv("LUWU_NODE__JOIN_SECRET", secret)
    monkeypatch.setenv("LUWU_TRANSPORT__JOIN_SECRET", secret)
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "luwu",
            "node",
            "--node.bind",
            "tcp://127.0.0.1:0",
            "--node.index",
            "0",
            "--cluster.job",
            JOB,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        addr = node.stdout.readline().split()[1]
        first = luwu.RemoteOptimizer(
            torch.nn.Linear(4, 2), nodes=[addr], job=JOB, rank=0, world_size=2
        )
        time.sleep(3.0)  # the watchdog looks every second
        second = luwu.RemoteOptimizer(
            torch.nn.Linear(4, 2), nodes=[addr], job=JOB, rank=1, world_size=2
        )
        first.close()
        second.close()
    finally:
        node.terminate()
        _, err = node.communicate(timeout=30)
    assert "waiting for worker ranks" not in err, err

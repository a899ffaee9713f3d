"""Start-up without silent hangs: a node says which ranks it waits for."""

import subprocess
import sys
import time
import tomllib

import pytest
import torch

import luwu


def _node(*args: str, env: dict | None = None) -> subprocess.Popen:
    """``luwu node`` with ``args``, its stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "luwu", "node", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _stop(*nodes: subprocess.Popen) -> None:
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.wait(20)


def _joining_line(node: subprocess.Popen) -> str:
    """The node's first stderr line that tells how workers join."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = node.stderr.readline()
        if "join" in line or not line:
            return line
    return ""


@pytest.mark.timeout(90)
def test_node_says_which_ranks_it_waits_for(tmp_path, monkeypatch):
    node = _node(
        "--node.bind", "tcp://127.0.0.1:0", "--node.index", "0", "--run-dir", str(tmp_path)
    )
    try:
        addr = node.stdout.readline().split()[1]
        monkeypatch.setenv(
            "LUWU_TRANSPORT__JOIN_SECRET",
            tomllib.loads((tmp_path / "keys" / "join.toml").read_text())["transport"][
                "join_secret"
            ],
        )
        opt = luwu.RemoteOptimizer(
            torch.nn.Linear(4, 2), nodes=[addr], rank=0, world_size=3, timeout_s=10
        )
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
        _stop(node)


@pytest.mark.timeout(120)
def test_a_default_node_asks_every_peer_for_the_jobs_join_secret(tmp_path, monkeypatch):
    """`luwu node` without a secret or keys makes the job's join secret in <run dir>/keys/join.toml (mode
    600, folder 700), says how workers join, and a second node of the job in the same run dir asks for the
    same one. A worker without it is told at once what it lacks and how to get it; a stranger's HELLO never
    reaches the node (no WELCOME, nothing allocated); a worker given the file trains on both nodes."""
    from luwu.config import load_config
    from luwu.protocol import messages as wire

    monkeypatch.delenv("LUWU_TRANSPORT__JOIN_SECRET", raising=False)
    nodes = [
        _node("--node.index", str(i), "--run-dir", str(tmp_path), "--cluster.job", "gated")
        for i in range(2)
    ]
    try:
        addrs = [n.stdout.readline().split()[1] for n in nodes]
        lines = [_joining_line(n) for n in nodes]
        join = tmp_path / "keys" / "join.toml"
        assert all(
            "join secret on" in line and str(join) in line and "--config" in line for line in lines
        ), lines
        assert sorted("made in" in line for line in lines) == [False, True], (
            lines
        )  # one made it, the other read it
        assert (
            join.stat().st_mode & 0o777 == 0o600
            and (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
        )
        secret = tomllib.loads(join.read_text())["transport"]["join_secret"]
        assert len(secret) >= 32

        t0 = time.monotonic()
        with pytest.raises(
            luwu.NodeTimeoutError, match="closed 3 connections at the ZeroMQ handshake"
        ) as e:
            luwu.RemoteOptimizer(
                torch.nn.Linear(4, 2), nodes=addrs, rank=0, world_size=1, job="gated"
            )
        assert (
            time.monotonic() - t0 < 10
            and "keys/join.toml" in str(e.value)
            and "neither a join secret" in str(e.value)
        )

        import zmq

        ctx = zmq.Context()
        try:  # a stranger's HELLO: the connection is cut before its first frame is read
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addrs[0])
            hello = {
                "op": wire.Op.HELLO,
                "job": "gated",
                "worker": 0,
                "world_size": 1,
                "layout": "ab" * 16,
                "buckets": [],
            }
            s.send_multipart(wire.encode(hello))
            assert not s.poll(1500)
            s.close(0)
        finally:
            ctx.term()

        model = torch.nn.Linear(4, 2)
        opt = luwu.RemoteOptimizer(
            model, nodes=addrs, rank=0, world_size=1, config=load_config(str(join)), lr=0.1
        )
        try:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
        finally:
            opt.close()
    finally:
        _stop(*nodes)


@pytest.mark.timeout(240)
def test_strangers_hellos_to_a_default_node_beside_a_job_allocate_nothing(tmp_path, monkeypatch):
    """Issue 32's attack on a default `luwu node`: a HELLO with a made-up layout hash naming a 1 GiB
    bucket, then the same hash with another bucket, used to get WELCOME and take the node from 228 to
    3303 MiB, and the job's workers then failed ("rank held"). Now 20 such HELLOs from fresh
    connections get no reply, the node's RSS moves by less than 16 MiB, and a real 2-worker job beside
    them, given the node's join file, equals local AdamW."""
    import threading

    import zmq
    from harness import assert_params_close, proc_status, run_training
    from workers.train import reference

    from luwu.protocol import messages as wire

    spec = {
        "optimizer": "adamw",
        "hyper": {"lr": 0.01},
        "steps": 40,
        "batch": 8,
        "bucket_bytes": 1024,
        "timeout_s": 60.0,
    }
    node = _node("--node.index", "0", "--run-dir", str(tmp_path), "--cluster.job", "luwu")
    try:
        addr = node.stdout.readline().split()[1]
        secret = tomllib.loads((tmp_path / "keys" / "join.toml").read_text())["transport"][
            "join_secret"
        ]
        monkeypatch.setenv(
            "LUWU_TRANSPORT__JOIN_SECRET", secret
        )  # (the workers: from the node's join file)
        out: dict = {}

        def train() -> None:
            try:
                out["results"] = run_training(spec, [addr], tmp_path, world_size=2, timeout_s=180)
            except BaseException as exc:  # reported below
                out["error"] = f"{type(exc).__name__}: {exc}"

        th = threading.Thread(target=train, daemon=True)
        th.start()
        from luwu.ops.monitor import query_many

        deadline = time.monotonic() + 90
        while query_many([addr], "luwu", 5, join_secret=secret)[0].detail.get("workers", 0) < 2:
            assert th.is_alive() and time.monotonic() < deadline, out.get(
                "error", "the job's workers did not connect"
            )
            time.sleep(0.05)
        before = proc_status(node.pid)["VmRSS"]
        ctx = zmq.Context()
        try:
            for i in range(20):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(addr)
                bucket = (
                    [0, 0, 2**28, [[0, 0, 0, 2**28]]]
                    if i % 2
                    else [1, 0, 2**28, [[1, 0, 0, 2**28]]]
                )  # 1 GiB of fp32
                hello = {
                    "op": wire.Op.HELLO,
                    "job": "luwu",
                    "step": 0,
                    "worker": i % 2,
                    "world_size": 2,
                    "layout": "ab" * 16,
                    "node_index": 0,
                    "buckets": [bucket],
                    "optimizer": "adamw",
                    "mode": "sync",
                    "param_names": {0: "w", 1: "v"},
                }
                s.send_multipart(wire.encode(hello))
                assert not s.poll(300), "a stranger's HELLO was answered"
                s.close(0)
        finally:
            ctx.term()
        grown = proc_status(node.pid)["VmRSS"] - before
        assert grown < 16 * 2**20, f"node RSS grew by {grown / 2**20:.1f} MiB"
        th.join(180)
        assert "error" not in out, out.get("error")
        want, _ = reference(dict(spec, world_size=2))
        for r in out["results"]:
            assert_params_close(r["params"], want)
    finally:
        _stop(node)


@pytest.mark.timeout(90)
def test_an_open_node_is_only_one_told_so_and_it_warns(tmp_path):
    """node.insecure_open = true: no secret is made, the node warns once that anyone may join; with the
    libzmq listener (which cannot ask for a secret) and no keys, a node refuses to start unless told so."""
    node = _node("--node.insecure_open", "true", "--run-dir", str(tmp_path))
    try:
        addr = node.stdout.readline().split()[1]
        opt = luwu.RemoteOptimizer(torch.nn.Linear(4, 2), nodes=[addr], rank=0, world_size=1)
        opt.close()
    finally:
        _stop(node)
    err = node.stderr.read()
    assert err.count("is OPEN (node.insecure_open)") == 1, err
    assert not (tmp_path / "keys").exists()
    r = subprocess.run(
        [sys.executable, "-m", "luwu", "node", "--node.listener", "libzmq"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 2 and "node.insecure_open = true" in r.stderr and "CURVE keys" in r.stderr
    ), r.stderr


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
    node = _node("--config", str(cluster), "--node.index", "1", "--run-dir", str(tmp_path))
    try:
        line = node.stdout.readline()
        assert line.split()[:2] == ["LUWU_NODE_READY", nodes[1]], line
    finally:
        _stop(node)


@pytest.mark.timeout(90)
def test_a_busy_port_is_one_line_that_names_the_address():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "luwu",
                "node",
                "--node.bind",
                address,
                "--node.insecure_open",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert (
        address in lines[0] and "Address already in use" in lines[0] and "--node.bind" in lines[0]
    ), lines[0]


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
        with (
            socket.socket() as s,
            pytest.raises(luwu.NodeTimeoutError) as e,
        ):  # the kernel accepts, nobody speaks
            s.bind(("127.0.0.1", 0))
            s.listen()
            addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            luwu.RemoteOptimizer(
                torch.nn.Linear(4, 2),
                nodes=[addr],
                rank=0,
                world_size=1,
                transport=TransportConfig(connect_timeout_s=3.0),
            )
    finally:
        client.PROGRESS_EVERY_S = old
    msg = str(e.value)
    assert addr in msg and "None" not in msg and "bucket -1" not in msg, msg
    assert "is a node listening there" in msg and "cluster.nodes" in msg
    assert e.value.node == addr
    assert any(
        "still waiting for WELCOME" in r.getMessage() and addr in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.timeout(60)
def test_a_host_that_does_not_resolve_is_named_at_once():
    t0 = time.monotonic()
    with pytest.raises(luwu.NodeTimeoutError, match="does not resolve") as e:
        luwu.RemoteOptimizer(
            torch.nn.Linear(4, 2), nodes=["tcp://no-such-host.invalid:5555"], rank=0, world_size=1
        )
    assert "no-such-host.invalid" in str(e.value) and "cluster.nodes" in str(e.value)
    assert time.monotonic() - t0 < 20  # not after the 30 s connect deadline

"""`luwu up` / `status` / `top` / `down` with real daemons, and deploy/ssh/launch.sh over a local "ssh".

Commands run as separate processes, as a user runs them. Every test cleans up in ``finally``:
``luwu down`` and then SIGKILL of any pid it recorded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cli import luwu as run_luwu

from luwu.cli import main as launcher_main
from luwu.cli import main as status_main
from luwu.config import load_config
from luwu.ops.monitor import query_many, query_stats
from luwu.ops.rundir import pid_alive, read_pid
from luwu.protocol.errors import NodeTimeoutError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "cluster.example.toml"


def luwu(module: str, *args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    """`python -m luwu.launcher up ...` is `luwu up ...` (the CLI registers the same parsers)."""
    return run_luwu(*args, module=module, timeout_s=timeout_s)


def pids_of(run_dir: Path) -> dict[str, int]:
    out = {}
    for f in run_dir.glob("*.pid"):
        pid = read_pid(f)
        if pid is not None:
            out[f.stem] = pid
    return out


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def cleanup(run_dir: Path, seen: set[int]) -> None:
    if run_dir.exists():
        luwu("luwu.launcher", "down", "--run-dir", str(run_dir), "--timeout", "5", timeout_s=60)
    for pid in seen | set(pids_of(run_dir).values()):
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def cli(capsys, main, *args: str) -> tuple[int, str, str]:
    """A command in this process (the same parser and function as `luwu ...`): (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def status_json(capsys, run_dir: Path, timeout: str = "2") -> tuple[int, list[dict]]:
    rc, out, err = cli(
        capsys, status_main, "status", "--run-dir", str(run_dir), "--json", "--timeout", timeout
    )
    assert rc in (0, 1), err
    return rc, json.loads(out)


@pytest.mark.timeout(180)
def test_up_status_restart_top_down(tmp_path, capsys):
    run_dir = tmp_path / "run"
    job = f"launch{os.getpid()}"
    seen: set[int] = set()
    try:
        # The example cluster file's settings, 2 nodes on any free port instead of its fixed addresses.
        r = luwu(
            "luwu.launcher",
            "up",
            "--config",
            str(EXAMPLE),
            "--nodes",
            "2",
            "--run-dir",
            str(run_dir),
            f"--cluster.job={job}",
            "--timeout",
            "60",
            "--stop-timeout",
            "10",
        )
        assert r.returncode == 0, f"up failed:\n{r.stdout}\n{r.stderr}"
        pids = pids_of(run_dir)
        seen |= set(pids.values())
        assert set(pids) == {"supervisor", "node-0", "node-1"}, pids
        assert all(pid_alive(p) for p in pids.values())
        # The resolved cluster file: the bound addresses, the job, and the example's shared settings.
        cfg = load_config(str(run_dir / "cluster.toml"), env={})
        example = load_config(str(EXAMPLE), env={})
        assert cfg.cluster.job == job and len(cfg.cluster.nodes) == 2
        assert all(
            a.startswith("tcp://127.0.0.1:") and not a.endswith(":0") for a in cfg.cluster.nodes
        )
        assert (
            cfg.compression == example.compression and cfg.node.log_every == example.node.log_every
        )
        assert cfg.node.bind == "tcp://127.0.0.1:0", (
            "per-node settings must not leak into the shared file"
        )
        for a in cfg.cluster.nodes:
            assert a in r.stdout
        targets = json.loads((run_dir / "targets.json").read_text())
        assert [t["labels"]["luwu_node"] for t in targets] == ["0", "1"]

        rc, rows = status_json(capsys, run_dir)
        assert rc == 0 and [row["up"] for row in rows] == [True, True], rows
        assert [row["address"] for row in rows] == cfg.cluster.nodes and [
            row["node"] for row in rows
        ] == [0, 1]
        # Loopback nodes ask for the job's join secret, which up made and says how workers get.
        join = run_dir / "keys" / "join.toml"
        assert (
            f"workers use {join}" in r.stdout.replace("\n", "") and f"--config {join}" in r.stdout
        ), r.stdout
        secret = load_config(str(join), env={}).transport.join_secret
        assert (
            len(secret) >= 32
            and join.stat().st_mode & 0o777 == 0o600
            and secret not in (run_dir / "cluster.toml").read_text()
        )
        with pytest.raises(NodeTimeoutError, match="did not answer STATS"):
            query_stats(cfg.cluster.nodes[1], job, timeout_s=1)
        detail = query_stats(cfg.cluster.nodes[1], job, timeout_s=5, join_secret=secret)
        assert detail["node"] == 1 and detail["address"] == cfg.cluster.nodes[1]

        # A second `up` on the same run dir is refused and names the supervisor.
        rc, _, err = cli(
            capsys,
            launcher_main,
            "up",
            "--nodes",
            "2",
            "--run-dir",
            str(run_dir),
            f"--cluster.job={job}",
        )
        assert rc == 2 and "already up" in err and f"supervisor pid {pids['supervisor']}" in err, (
            err
        )

        # SIGKILL a daemon: the supervisor restarts it on the same address.
        os.kill(pids["node-0"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            node0 = state(run_dir)["nodes"][0]
            if node0["state"] == "up" and node0["pid"] not in (None, pids["node-0"]):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(
                f"node 0 not restarted within 60 s: {state(run_dir)}\n{(run_dir / 'supervisor.log').read_text()}"
            )
        seen.add(node0["pid"])
        assert (
            node0["restarts"] == 1
            and "SIGKILL" in node0["last_exit"]
            and node0["address"] == cfg.cluster.nodes[0]
        )
        assert read_pid(run_dir / "node-0.pid") == node0["pid"]
        assert "restart #1" in (run_dir / "supervisor.log").read_text()
        rc, rows = status_json(capsys, run_dir)
        assert rc == 0 and [row["up"] for row in rows] == [True, True], rows
        assert rows[0]["uptime_s"] < rows[1]["uptime_s"], "node 0 is a new process"

        rc, out, err = cli(
            capsys,
            status_main,
            "top",
            "--run-dir",
            str(run_dir),
            "--iterations",
            "2",
            "--interval",
            "0.3",
        )
        assert rc == 0, err
        assert out.count("luwu top") == 2 and out.count("2/2 nodes up") == 2
        for a in cfg.cluster.nodes:
            assert out.count(a) == 2

        rc, out, err = cli(
            capsys, launcher_main, "down", "--run-dir", str(run_dir), "--timeout", "10"
        )
        assert rc == 0 and "stopped the supervisor and 2 node(s)" in err, err
        alive = [p for p in seen if pid_alive(p)]
        assert not alive, f"still running after down: {alive}"
        assert not list(run_dir.glob("*.pid"))
        assert {n["state"] for n in state(run_dir)["nodes"]} == {"stopped"}
        assert "restart #2" not in (run_dir / "supervisor.log").read_text(), (
            "a node stopped by down was restarted"
        )
        rc, rows = status_json(capsys, run_dir, timeout="0.5")
        assert rc == 1 and [row["up"] for row in rows] == [False, False]
        assert all("no answer" in row["error"] for row in rows)
    finally:
        cleanup(run_dir, seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "busy_port, flag, other",
    [
        ("--base-port", "--base-port", "--metrics-port"),
        ("--metrics-port", "--metrics-port", "--base-port"),
    ],
)
def test_up_names_the_node_that_failed(tmp_path, capsys, busy_port, flag, other):
    """A node that cannot bind (its address, or its metrics endpoint): `up` says which one, shows its
    log, names the flag of `up` that moves that port (not the other one), and leaves nothing running."""
    run_dir = tmp_path / "run"
    seen: set[int] = set()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"--base-port": "0", "--metrics-port": "-1", busy_port: str(port)}
        try:
            rc, out, err = cli(
                capsys,
                launcher_main,
                "up",
                "--nodes",
                "1",
                "--run-dir",
                str(run_dir),
                "--timeout",
                "60",
                *(w for kv in ports.items() for w in kv),
            )
            seen |= set(pids_of(run_dir).values())
            assert rc == 1, (out, err)
            assert (
                "node 0 exit code 1" in err
                and "Address already in use" in err
                and "node-0.log" in err
            ), err
            (head,) = [line for line in err.splitlines() if line.startswith("luwu up: node 0")]
            assert f"or with luwu up: {flag} P" in head and other not in head, head
            supervisor = state(run_dir)["supervisor_pid"]
            assert not pid_alive(supervisor) and not list(run_dir.glob("*.pid"))
            assert not (run_dir / "cluster.toml").exists()
        finally:
            cleanup(run_dir, seen)


def _free_port(not_this: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != not_this:
            return port


def _wait_for(path: Path, offset: int, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text()[offset:]:
            return
        time.sleep(0.2)
    raise AssertionError(
        f"{text!r} not in what luwu top printed within {timeout_s:g} s:\n{path.read_text()[offset:][-3000:]}"
    )


@pytest.mark.timeout(240)
def test_top_follows_the_cluster_through_down_and_up(tmp_path):
    """`luwu top --run-dir` polls the nodes of the run dir's current cluster.toml: after `luwu down`
    and `luwu up` on other ports it shows the new nodes UP, not the old addresses DOWN."""
    run_dir, log = tmp_path / "run", tmp_path / "top.out"
    job = f"follow{os.getpid()}"
    seen: set[int] = set()
    top = None

    def up(port: int) -> str:
        r = luwu(
            "luwu",
            "up",
            "--nodes",
            "1",
            "--base-port",
            str(port),
            "--metrics-port",
            "-1",
            "--run-dir",
            str(run_dir),
            f"--cluster.job={job}",
            "--timeout",
            "60",
            "--stop-timeout",
            "10",
        )
        seen.update(pids_of(run_dir).values())
        assert r.returncode == 0, f"up failed:\n{r.stdout}\n{r.stderr}"
        (address,) = load_config(str(run_dir / "cluster.toml"), env={}).cluster.nodes
        return address

    try:
        first = up(0)
        with open(log, "w") as out:  # not a terminal: one table per refresh
            top = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "luwu",
                    "top",
                    "--run-dir",
                    str(run_dir),
                    "--interval",
                    "0.3",
                    "--timeout",
                    "0.5",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        _wait_for(log, 0, "1/1 nodes up")
        assert first in log.read_text()
        r = luwu("luwu", "down", "--run-dir", str(run_dir), "--timeout", "10")
        assert r.returncode == 0, r.stderr
        second = up(_free_port(int(first.rsplit(":", 1)[1])))
        assert second != first
        mark = len(log.read_text())
        _wait_for(log, mark, second)
        _wait_for(log, mark, "1/1 nodes up")
        assert top.poll() is None, log.read_text()[-3000:]
    finally:
        if top is not None:
            top.send_signal(signal.SIGINT)
            try:
                top.wait(10)
            except subprocess.TimeoutExpired:
                top.kill()
                top.wait(10)
        cleanup(run_dir, seen)


@pytest.mark.timeout(30)
def test_status_of_a_dead_address_is_down_not_a_hang(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    (st,) = query_many([dead], "job", timeout_s=0.5)
    assert not st.up and "no answer within 0.5 s" in st.error and st.address == dead
    with pytest.raises(NodeTimeoutError, match=dead):
        query_stats(dead, "job", timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    rc, out, _ = cli(capsys, status_main, "status", f"--cluster.nodes={dead}", "--timeout", "0.5")
    assert rc == 1 and "DOWN" in out and dead in out
    rc, _, err = cli(capsys, status_main, "status", "--run-dir", "/nonexistent/run")
    assert rc == 2 and "cluster.toml" in err


@pytest.mark.timeout(120)
def test_ssh_launcher_with_a_local_ssh(tmp_path):
    """deploy/ssh/launch.sh end to end, with `ssh`/`scp` replaced by shims that run the command here."""
    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')  # ssh HOST COMMAND -> COMMAND, here
    fake_scp = tmp_path / "scp"
    fake_scp.write_text('#!/bin/sh\nexec cp "$1" "${2#*:}"\n')  # scp SRC HOST:DST -> cp SRC DST
    for f in (fake_ssh, fake_scp):
        f.chmod(0o755)
    ports = []
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    hosts = tmp_path / "hosts"
    hosts.write_text(f"# test hosts\nme@127.0.0.1 {ports[0]} 0\n127.0.0.1 {ports[1]}\n")
    base = tmp_path / "base.toml"
    base.write_text('[cluster]\njob = "sshtest"\n\n[node]\nlog_every = 7\n')
    remote = tmp_path / "remote"
    env = dict(
        os.environ,
        LUWU_SSH=str(fake_ssh),
        LUWU_SCP=str(fake_scp),
        LUWU_PYTHON=sys.executable,
        LUWU_REMOTE_PYTHON=sys.executable,
        LUWU_RUN_DIR=str(tmp_path / "here"),
        LUWU_REMOTE_DIR=str(remote),
        LUWU_START_TIMEOUT="60",
        LUWU_STOP_TIMEOUT="10",
        COLUMNS="200",
    )
    script = str(ROOT / "deploy" / "ssh" / "launch.sh")
    pids: list[int] = []
    try:
        r = subprocess.run(
            [script, "start", str(hosts), str(base)],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
        pids = [p for p in (read_pid(remote / f"node-{i}.pid") for i in range(2)) if p is not None]
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        cfg = load_config(str(tmp_path / "here" / "cluster.toml"), env={})
        assert (
            cfg.cluster.nodes == [f"tcp://127.0.0.1:{p}" for p in ports]
            and cfg.cluster.job == "sshtest"
            and cfg.node.log_every == 7
        )
        assert (remote / "cluster.toml").read_text() == (
            tmp_path / "here" / "cluster.toml"
        ).read_text()
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        assert r.stdout.count(" UP ") == 2
        assert (
            "LUWU_METRICS_READY" in (remote / "node-0.log").read_text()
        )  # metrics port 0 for the first host
        assert (
            "LUWU_METRICS_READY" not in (remote / "node-1.log").read_text()
        )  # none given for the second
        st = subprocess.run(
            [script, "status", str(hosts), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert st.returncode == 0 and [row["node"] for row in json.loads(st.stdout)] == [0, 1]
        stop = subprocess.run(
            [script, "stop", str(hosts)], capture_output=True, text=True, timeout=60, env=env
        )
        assert stop.returncode == 0, stop.stderr
        assert not [p for p in pids if pid_alive(p)] and not list(remote.glob("*.pid"))
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


# `ssh TARGET COMMAND` / `scp SRC TARGET:DST` run here, each TARGET in a home folder of its own under
# $HOMES: the "hosts" share no file, as real ones do not (a relative remote path is in that home).
SSH_HOME_SHIM = '#!/bin/sh\nhome="$HOMES/$(printf %s "$1" | tr @ _)"\nshift\nmkdir -p "$home" && cd "$home" && exec sh -c "$*"\n'
SCP_HOME_SHIM = (
    '#!/bin/sh\nhome="$HOMES/$(printf %s "${2%%:*}" | tr @ _)"\ndst=${2#*:}\n'
    'case "$dst" in /*) ;; *) mkdir -p "$home" && dst="$home/$dst" ;; esac\nexec cp "$1" "$dst"\n'
)


@pytest.mark.timeout(240)
def test_ssh_launcher_insecure_gives_every_node_one_join_secret(tmp_path):
    """LUWU_INSECURE_PUBLIC_BIND=1: no keys, but the launcher makes ONE join secret for the job and
    every node reads it from its node.env (each on a "host" of its own, where a node left to itself
    would make a secret of its own); a worker with keys/join.toml trains on both, status uses monitor.toml."""
    homes = tmp_path / "homes"
    for name, text in (("ssh", SSH_HOME_SHIM), ("scp", SCP_HOME_SHIM)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hosts = tmp_path / "hosts"
    hosts.write_text(f"me@127.0.0.1 {ports[0]}\n127.0.0.1 {ports[1]}\n")
    (tmp_path / "base.toml").write_text('[cluster]\njob = "sshjoin"\n')
    here, keys = tmp_path / "here", tmp_path / "here" / "keys"
    remotes = [
        homes / "me_127.0.0.1" / ".luwu-run" / "ssh",
        homes / "127.0.0.1" / ".luwu-run" / "ssh",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")}
    env.update(
        HOMES=str(homes),
        LUWU_SSH=str(tmp_path / "ssh"),
        LUWU_SCP=str(tmp_path / "scp"),
        LUWU_PYTHON=sys.executable,
        LUWU_REMOTE_PYTHON=sys.executable,
        LUWU_RUN_DIR=str(here),
        LUWU_START_TIMEOUT="30",
        LUWU_STOP_TIMEOUT="10",
        LUWU_INSECURE_PUBLIC_BIND="1",
        COLUMNS="200",
    )
    script = str(ROOT / "deploy" / "ssh" / "launch.sh")
    pids: list[int] = []
    try:
        r = subprocess.run(
            [script, "start", str(hosts), str(tmp_path / "base.toml")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        pids = [
            p
            for p in (read_pid(d / f"node-{i}.pid") for i, d in enumerate(remotes))
            if p is not None
        ]
        logs = "\n".join(f"--- {f}\n{f.read_text()[-1500:]}" for f in homes.rglob("node-*.log"))
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs}"
        assert (
            "WARNING: LUWU_INSECURE_PUBLIC_BIND=1" in r.stderr
            and r.stdout.count(" UP ") == 2
            and len(pids) == 2
        )
        assert sorted(f.name for f in keys.iterdir()) == ["join.toml", "monitor.toml", "node.env"]
        assert (
            all(f.stat().st_mode & 0o777 == 0o600 for f in keys.iterdir())
            and keys.stat().st_mode & 0o777 == 0o700
        )
        join = load_config(str(keys / "join.toml"), env={})
        secret, nodes = join.transport.join_secret, join.cluster.nodes
        assert (
            len(secret) >= 32
            and nodes == [f"tcp://127.0.0.1:{p}" for p in ports]
            and join.cluster.job == "sshjoin"
        )
        assert load_config(str(keys / "monitor.toml"), env={}).transport.join_secret == secret
        assert secret not in (here / "cluster.toml").read_text()
        for pid, remote in zip(pids, remotes):  # one secret, on every host, never on a command line
            assert (remote / "node.env").read_text() == f"LUWU_NODE__JOIN_SECRET='{secret}'\n" and (
                remote / "node.env"
            ).stat().st_mode & 0o777 == 0o600
            assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            assert not list(remote.rglob("join.toml")), "the node made a secret of its own"
        assert not any(s.up for s in query_many(nodes, "sshjoin", 1.5)), "no secret, no answer"
        assert all(s.up for s in query_many(nodes, "sshjoin", 10, join_secret=secret))

        worker_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONUNBUFFERED="1")
        w = subprocess.run(
            [
                sys.executable,
                str(ROOT / "deploy" / "train_example.py"),
                "--config",
                str(keys / "join.toml"),
                "--steps",
                "5",
                "--batch",
                "8",
                "--metrics-port",
                "-1",
                "--transport.bucket_bytes=16384",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=worker_env,
        )
        assert w.returncode == 0 and "LUWU_WORKER_DONE rank 0 steps 5" in w.stdout, (
            w.stdout[-2000:] + w.stderr[-3000:]
        )
        st = subprocess.run(
            [script, "status", str(hosts), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert st.returncode == 0, st.stdout + st.stderr
        assert [(row["node"], row["step"]) for row in json.loads(st.stdout)] == [(0, 5), (1, 5)], (
            st.stdout
        )

        again = subprocess.run(
            [script, "start", str(hosts), str(tmp_path / "base.toml")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert again.returncode == 0 and again.stdout.count("already running") == 2, (
            again.stdout + again.stderr
        )
        assert load_config(str(keys / "join.toml"), env={}).transport.join_secret == secret, (
            "a restart keeps the workers' file valid"
        )
        stop = subprocess.run(
            [script, "stop", str(hosts)], capture_output=True, text=True, timeout=60, env=env
        )
        assert stop.returncode == 0, stop.stderr
        assert not [p for p in pids if pid_alive(p)]
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_plan_from_a_cluster_file_and_the_file_written_back(tmp_path):
    """Without --nodes, `up` binds the cluster file's addresses; the file it writes back loads to the same settings."""
    import argparse

    from luwu.ops.cluster_file import cluster_file_text
    from luwu.ops.daemons import plan_nodes as _plan_nodes

    cfg = load_config(str(EXAMPLE), env={}, argv=["--node.mode=async", "--metrics.port=9400"])
    args = argparse.Namespace(
        nodes=None, host="127.0.0.1", base_port=0, metrics_port=None, config=str(EXAMPLE)
    )
    plan = _plan_nodes(args, cfg, ["--node.mode=async"])
    assert [n.bind for n in plan] == cfg.cluster.nodes
    assert [n.metrics_port for n in plan] == [
        9400,
        9401,
    ]  # metrics.port set explicitly: port + index
    assert all(
        n.args[-4:] == ["--node.index", str(n.index), "--cluster.job", "luwu"]
        and "--node.mode=async" in n.args
        for n in plan
    )
    args.nodes, args.base_port, args.metrics_port = 3, 7000, -1
    assert [(n.bind, n.metrics_port) for n in _plan_nodes(args, cfg, [])] == [
        (f"tcp://127.0.0.1:{7000 + i}", -1) for i in range(3)
    ]
    args.base_port = 65535
    with pytest.raises(ValueError, match="base-port"):
        _plan_nodes(args, cfg, [])

    written = tmp_path / "cluster.toml"
    written.write_text(
        cluster_file_text(cfg, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], header="test\nfile")
    )
    back = load_config(str(written), env={})
    assert (
        back.cluster.nodes == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        and back.node.mode == "async"
    )
    assert (
        back.compression == cfg.compression
        and back.prefetch == cfg.prefetch
        and back.transport == cfg.transport
    )
    assert back.metrics.port == -1 and back.node.bind == "tcp://127.0.0.1:0", (
        "per-node settings stay out"
    )


FAKE_SRUN = r"""#!/bin/bash
# A local srun: --ntasks copies of the command here with SLURM_PROCID / SLURM_LOCALID, --output
# with %t per task; SIGTERM is forwarded to the tasks (as srun does) and waited for.
ntasks=1 per_node=1 output=""
while [[ $# -gt 0 && $1 == --* ]]; do
  case "$1" in
    --ntasks=*) ntasks=${1#*=} ;;
    --ntasks-per-node=*) per_node=${1#*=} ;;
    --output=*) output=${1#*=} ;;
  esac
  shift
done
pids=()
for ((i = 0; i < ntasks; i++)); do
  if [ -n "$output" ]; then
    SLURM_PROCID=$i SLURM_LOCALID=$((i % per_node)) "$@" >"${output//%t/$i}" 2>&1 &
  else
    SLURM_PROCID=$i SLURM_LOCALID=$((i % per_node)) "$@" &
  fi
  pids+=("$!")
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
status=0
for p in "${pids[@]}"; do
  while kill -0 "$p" 2>/dev/null; do wait "$p" || status=$?; done
done
exit "$status"
"""
FAKE_SCONTROL = '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 2\ntr , "\\n" <<<"$3"\n'


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "join-secret"])
def test_slurm_batch_script_with_local_srun(tmp_path, insecure):
    """deploy/slurm/luwu.sbatch end to end on a fake two-host allocation (both this machine): 2 node
    daemons via srun, then torchrun workers of train_example.py, then the nodes stopped with SIGTERM.
    With CURVE keys, or (LUWU_INSECURE_PUBLIC_BIND=1) with the one join secret the script makes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ports = []
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    host = socket.gethostname()
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=f"{host},{host}",
        SLURM_SUBMIT_DIR=str(tmp_path),
        LUWU_PYTHON=sys.executable,
        LUWU_NODES_PER_HOST="2",
        LUWU_PORT=str(ports[0]),
        LUWU_METRICS_PORT=str(ports[2]),
        LUWU_RDZV_PORT=str(ports[4]),
        LUWU_GPUS_PER_HOST="2",
        LUWU_START_TIMEOUT="120",
        LUWU_STOP_TIMEOUT="30",
        COLUMNS="200",
        LUWU_INSECURE_PUBLIC_BIND=str(int(insecure)),
    )
    for name in ("LUWU_NODE__JOIN_SECRET", "LUWU_TRANSPORT__JOIN_SECRET"):
        env.pop(name, None)
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "deploy" / "slurm" / "luwu.sbatch"),
            str(ROOT / "deploy" / "train_example.py"),
            "--steps",
            "20",
            "--transport.bucket_bytes=16384",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=tmp_path,
    )
    run = tmp_path / ".luwu-run" / "luwu-4242"
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(run.glob("node-*.log"))
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{logs}"
    cfg = load_config(str(run / "cluster.toml"), env={})
    assert cfg.cluster.job == "luwu-4242" and cfg.cluster.nodes == [
        f"tcp://{host}:{ports[0]}",
        f"tcp://{host}:{ports[0] + 1}",
    ]
    assert (
        r.stdout.count("LUWU_WORKER_DONE") == 2 and "workers finished with exit code 0" in r.stdout
    )
    for i in range(2):  # each node served the job and was stopped by SIGTERM, cleanly
        log = (run / f"node-{i}.log").read_text()
        assert f"node {i} serving job 'luwu-4242'" in log and f"node {i} stopped" in log, log
        assert (
            "join secret on: " if insecure else "CURVE keys on"
        ) in log and "made in" not in log, "the node made no secret of its own"
    keys = sorted(f.name for f in (run / "keys").iterdir())
    assert keys == (
        ["join.toml", "monitor.toml", "node.env"]
        if insecure
        else ["monitor.toml", "node.env", "node.toml", "worker0.toml", "worker1.toml"]
    )  # 1 worker host x 2


def test_cli_registers_the_commands():
    """`luwu up|down|status|top` are these modules' parsers (luwu/cli.py calls their add_arguments)."""
    import argparse

    from luwu import cli
    from luwu.cli import status as status_command
    from luwu.cli import top as top_command
    from luwu.cli import updown as launcher

    status = argparse.Namespace(cmd_status=status_command.cmd_status, cmd_top=top_command.cmd_top)

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    registered = {
        name: sub.choices[name] for name in ("up", "down", "status", "top") if name in sub.choices
    }
    if not registered:
        pytest.skip(
            "luwu/cli.py does not register up/down/status/top yet: it should call luwu.launcher.add_arguments and luwu.status.add_arguments"
        )
    assert set(registered) == {"up", "down", "status", "top"}
    funcs = {name: p.get_default("func") for name, p in registered.items()}
    assert funcs == {
        "up": launcher.cmd_up,
        "down": launcher.cmd_down,
        "status": status.cmd_status,
        "top": status.cmd_top,
    }

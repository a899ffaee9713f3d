"""Secrets on the operator side: never in worker files, plan.json, logs or argv; private file modes;
CURVE made by `luwu up` for nodes other hosts can reach; the checkpoints-off warning.

Each `up` runs real node daemons (one per test, on loopback or 0.0.0.0) and is stopped in ``finally``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import luwu

from luwu.config import load_config
from luwu.ops.cluster_file import reachable
from luwu.ops.keyset import redact_args, split_secrets
from luwu.ops.monitor import query_many
from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def down(run_dir: Path) -> None:
    if run_dir.exists():
        luwu("down", "--run-dir", str(run_dir), "--timeout", "5", timeout_s=60)
    for f in run_dir.glob("*.pid"):
        pid = read_pid(f)
        if pid is not None and pid_alive(pid):
            os.kill(pid, 9)


def test_a_wildcard_bind_is_listed_by_a_reachable_name():
    assert reachable("tcp://0.0.0.0:5555", "n1.example") == "tcp://n1.example:5555"
    assert reachable("http://[::]:9400", "n1.example") == "http://n1.example:9400"
    assert reachable("tcp://10.0.0.7:5555", "n1.example") == "tcp://10.0.0.7:5555"
    assert reachable("tcp://0.0.0.0:5555").split(":")[1] not in ("//0.0.0.0", "//")


def loopback(address: str) -> str:
    """A node bound on 0.0.0.0 as this host reaches it."""
    return address.replace("0.0.0.0", "127.0.0.1")


def test_split_and_redact_secret_flags():
    public, env = split_secrets(
        [
            "--node.curve_secret_key=S1",
            "--node.mode",
            "async",
            "--transport.curve_secret_key",
            "S2",
            "--node.curve_public_key=P",
        ]
    )
    assert public == ["--node.mode", "async", "--node.curve_public_key=P"]
    assert env == {"LUWU_NODE__CURVE_SECRET_KEY": "S1", "LUWU_TRANSPORT__CURVE_SECRET_KEY": "S2"}
    assert redact_args(
        ["x", "--node.curve_secret_key=S1", "--node.curve_secret_key", "S2", "--node.mode=async"]
    ) == [
        "x",
        "--node.curve_secret_key=<hidden>",
        "--node.curve_secret_key",
        "<hidden>",
        "--node.mode=async",
    ]


def test_a_join_secret_has_at_least_128_bits():
    """A join secret chosen by hand is at least 32 characters (128 bits as hex), from any source; `luwu up`'s
    own (32 characters of base64: 192 bits) passes."""
    from secrets import token_hex, token_urlsafe

    from luwu.protocol.errors import ConfigError

    for env in ({"LUWU_NODE__JOIN_SECRET": "s3cr3t"}, {"LUWU_NODE__JOIN_SECRET": "a" * 31}):
        with pytest.raises(ConfigError, match="at least 32 are needed"):
            load_config(None, env=env)
    for secret in (token_hex(16), token_urlsafe(24)):
        assert load_config(None, env={"LUWU_NODE__JOIN_SECRET": secret}).node.join_secret == secret


def test_keys_files_are_private_and_merge_a_cluster_file(tmp_path):
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        '[cluster]\njob = "k"\nnodes = ["tcp://10.0.0.1:5555"]\n[node]\ncheckpoint_dir = "ck"\n'
    )
    out = tmp_path / "keys"
    r = luwu("keys", "--out", str(out), "--workers", "2", "--cluster", str(cluster))
    assert r.returncode == 0, r.stderr
    assert mode(out) == 0o700
    names = sorted(p.name for p in out.iterdir())
    assert names == ["monitor.toml", "node.env", "node.toml", "worker0.toml", "worker1.toml"]
    assert all(mode(out / n) == 0o600 for n in names)
    node = load_config(str(out / "node.toml"), env={}).node
    from_env = load_config(
        None,
        env={
            k: v
            for k, v in (line.split("=", 1) for line in (out / "node.env").read_text().splitlines())
        },
    ).node  # quotes: see read_env_file
    w0, w1 = (load_config(str(out / f"worker{r}.toml"), env={}) for r in range(2))
    assert w0.cluster.nodes == ["tcp://10.0.0.1:5555"] and w0.node.checkpoint_dir == "ck", (
        "the cluster file's settings are in"
    )
    assert (
        w0.transport.curve_server_key == node.curve_public_key
        and w0.transport.curve_public_key != w1.transport.curve_public_key
    )
    assert node.curve_authorized_keys == [
        w0.transport.curve_public_key,
        w1.transport.curve_public_key,
    ], "rank order"
    monitor = load_config(str(out / "monitor.toml"), env={}).transport.curve_public_key
    assert node.curve_monitor_keys == [monitor] and [
        k.strip("'") for k in from_env.curve_monitor_keys
    ] == [monitor], "the monitor's key has a role of its own"
    assert from_env.curve_public_key.strip("'") == node.curve_public_key


@pytest.mark.timeout(240)
def test_up_with_a_node_key_file_and_secret_flags_leaks_nothing(tmp_path):
    keys = tmp_path / "keys"
    assert luwu("keys", "--out", str(keys), "--workers", "1").returncode == 0
    node = load_config(str(keys / "node.toml"), env={}).node
    worker = load_config(str(keys / "worker0.toml"), env={}).transport
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    try:
        # 1. The node's keys from --config: the cluster file for workers gets the public key only.
        r = luwu(
            "up",
            "--config",
            str(keys / "node.toml"),
            "--nodes",
            "1",
            "--run-dir",
            str(run_a),
            "--cluster.job=sa",
            "--timeout",
            "90",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        text = (run_a / "cluster.toml").read_text()
        assert node.curve_secret_key not in text and "secret" not in text
        assert f'curve_server_key = "{node.curve_public_key}"' in text
        assert "checkpoints are off" in r.stderr, "one warning line at start"
        address = json.loads((run_a / "state.json").read_text())["nodes"][0]["address"]
        (st,) = query_many(
            [address],
            "sa",
            10,
            curve=(worker.curve_server_key, worker.curve_public_key, worker.curve_secret_key),
        )
        assert st.up, st.error
        # The worker adds its own keys (here from the environment) to the shared file.
        mine = {
            "LUWU_TRANSPORT__CURVE_PUBLIC_KEY": worker.curve_public_key,
            "LUWU_TRANSPORT__CURVE_SECRET_KEY": worker.curve_secret_key,
        }
        assert (
            load_config(str(run_a / "cluster.toml"), env=mine).transport.curve_server_key
            == node.curve_public_key
        )
        # `luwu status --run-dir` uses the monitor key up added to the nodes' authorized keys.
        assert sorted(p.name for p in (run_a / "keys").iterdir()) == ["monitor.toml"]
        s = luwu("status", "--run-dir", str(run_a))
        assert s.returncode == 0, s.stdout + s.stderr
        assert "checkpoints are off" in s.stdout, "status repeats up's warnings"

        # 2. The same keys as --flags: not in plan.json, the logs, or any process's argv.
        flags = [
            f"--node.curve_public_key={node.curve_public_key}",
            f"--node.curve_secret_key={node.curve_secret_key}",
            f"--node.curve_authorized_keys={','.join(node.curve_authorized_keys)}",
        ]
        r = luwu(
            "up",
            "--nodes",
            "1",
            "--run-dir",
            str(run_b),
            "--cluster.job=sb",
            "--timeout",
            "90",
            *flags,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "given on the command line" in r.stderr
        secret = node.curve_secret_key
        for f in run_b.iterdir():
            if f.is_file() and f.name != "node.env":
                assert secret not in f.read_text(errors="replace"), (
                    f"{f.name} holds the node's secret"
                )
        assert "<hidden>" not in (run_b / "plan.json").read_text(), (
            "secrets never reach the plan, not even redacted"
        )
        assert secret in (run_b / "node.env").read_text()
        pid = read_pid(run_b / "node-0.pid")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert secret not in cmdline and "curve_secret_key" not in cmdline
        sup = read_pid(run_b / "supervisor.pid")
        assert secret not in Path(f"/proc/{sup}/cmdline").read_bytes().decode()
        # CURVE is on: a client with no keys gets no answer, the worker's keys get one.
        address = json.loads((run_b / "state.json").read_text())["nodes"][0]["address"]
        assert not query_many([address], "sb", 1.5)[0].up
        assert query_many(
            [address],
            "sb",
            10,
            curve=(worker.curve_server_key, worker.curve_public_key, worker.curve_secret_key),
        )[0].up
        assert node.curve_authorized_keys[0] not in (run_b / "plan.json").read_text(), (
            "the authorized keys go by node.env too"
        )
        s = luwu("status", "--run-dir", str(run_b), "--json")
        assert s.returncode == 0 and json.loads(s.stdout)[0]["up"], s.stdout + s.stderr

        # 3. Modes: the run dir 0700; plan, state, logs, env file 0600; pid files may be 0644.
        for run in (run_a, run_b):
            assert mode(run) == 0o700
            for name in ("plan.json", "state.json", "node-0.log", "supervisor.log"):
                assert mode(run / name) == 0o600, name
        assert mode(run_b / "node.env") == 0o600
    finally:
        down(run_a)
        down(run_b)


@pytest.mark.timeout(240)
def test_up_on_a_public_address_makes_curve_keys(tmp_path):
    run, plain = tmp_path / "run", tmp_path / "plain"
    try:
        r = luwu(
            "up",
            "--nodes",
            "1",
            "--host",
            "0.0.0.0",
            "--workers",
            "2",
            "--run-dir",
            str(run),
            "--cluster.job=sc",
            "--node.checkpoint_dir",
            str(tmp_path / "ck"),
            "--timeout",
            "90",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "checkpoints are off" not in r.stderr and "WITHOUT encryption" not in r.stderr
        assert sorted(p.name for p in (run / "keys").iterdir()) == [
            "monitor.toml",
            "worker0.toml",
            "worker1.toml",
        ]
        assert mode(run / "keys") == 0o700 and all(
            mode(p) == 0o600 for p in (run / "keys").iterdir()
        )
        cluster = load_config(str(run / "keys" / "worker1.toml"), env={})
        assert "worker$RANK.toml" in r.stdout, "the hint hands each rank its own file"
        assert "curve_secret_key" not in (run / "cluster.toml").read_text()
        assert "0.0.0.0" not in (run / "cluster.toml").read_text(), (
            "workers on other hosts get a name they can reach"
        )
        assert cluster.cluster.nodes[0].startswith(
            f"tcp://{reachable('tcp://0.0.0.0:1').split('//')[1].rsplit(':', 1)[0]}:"
        )
        address = loopback(json.loads((run / "state.json").read_text())["nodes"][0]["address"])
        t = cluster.transport
        assert not query_many([address], "sc", 1.5)[0].up, "no keys, no answer"
        assert query_many(
            [address], "sc", 10, curve=(t.curve_server_key, t.curve_public_key, t.curve_secret_key)
        )[0].up
        node_env = (run / "node.env").read_text()
        assert t.curve_public_key in node_env and "LUWU_NODE__CURVE_SECRET_KEY" in node_env
        # `luwu status --run-dir` uses keys/monitor.toml; on 0.0.0.0 it reaches the node over loopback.
        s = luwu(
            "status",
            "--config",
            str(run / "keys" / "monitor.toml"),
            f"--cluster.nodes={address}",
            "--json",
        )
        assert s.returncode == 0 and json.loads(s.stdout)[0]["up"], s.stdout + s.stderr

        # The explicit opt-out: no encryption, one warning line, and a join secret that only the
        # mode-600 files hold: a client without it gets no answer.
        r = luwu(
            "up",
            "--nodes",
            "1",
            "--host",
            "0.0.0.0",
            "--run-dir",
            str(plain),
            "--cluster.job=sd",
            "--node.insecure_public_bind=true",
            "--timeout",
            "90",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "WITHOUT encryption" in r.stderr and "keys/join.toml" in r.stdout
        assert sorted(p.name for p in (plain / "keys").iterdir()) == ["join.toml", "monitor.toml"]
        assert (
            all(mode(p) == 0o600 for p in (plain / "keys").iterdir())
            and mode(plain / "node.env") == 0o600
        )
        secret = load_config(str(plain / "keys" / "join.toml"), env={}).transport.join_secret
        assert (
            len(secret) >= 24
            and f"LUWU_NODE__JOIN_SECRET='{secret}'" in (plain / "node.env").read_text()
        )
        for public in ("cluster.toml", "plan.json"):
            assert secret not in (plain / public).read_text(), public
        address = loopback(json.loads((plain / "state.json").read_text())["nodes"][0]["address"])
        pid = json.loads((plain / "state.json").read_text())["nodes"][0]["pid"]
        assert secret not in open(f"/proc/{pid}/cmdline").read()
        assert not query_many([address], "sd", 1.5)[0].up, "no join secret, no answer"
        assert query_many([address], "sd", 10, join_secret=secret)[0].up
        s = luwu("status", "--run-dir", str(plain), f"--cluster.nodes={address}", "--json")
        assert s.returncode == 0 and json.loads(s.stdout)[0]["up"], s.stdout + s.stderr
    finally:
        down(run)
        down(plain)


@pytest.mark.timeout(180)
def test_ssh_launcher_runs_curve_with_keys_off_argv(tmp_path):
    """deploy/ssh/launch.sh with ssh/scp shims that run here: keys made, node.env in a 0700 remote dir,
    the node's argv free of keys, a client without keys refused, the monitor's keys answered."""
    import socket

    shims = {
        "ssh": '#!/bin/sh\nshift\nexec sh -c "$*"\n',
        "scp": '#!/bin/sh\nexec cp "$1" "${2#*:}"\n',
    }
    for name, text in shims.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "hosts").write_text(f"127.0.0.1 {port}\n")
    (tmp_path / "base.toml").write_text('[cluster]\njob = "sshkeys"\n')
    here, remote = tmp_path / "here", tmp_path / "remote"
    env = dict(
        os.environ,
        LUWU_SSH=str(tmp_path / "ssh"),
        LUWU_SCP=str(tmp_path / "scp"),
        LUWU_PYTHON=sys.executable,
        LUWU_REMOTE_PYTHON=sys.executable,
        LUWU_RUN_DIR=str(here),
        LUWU_REMOTE_DIR=str(remote),
        LUWU_START_TIMEOUT="60",
        LUWU_STOP_TIMEOUT="10",
        LUWU_WORKERS="2",
        COLUMNS="200",
    )
    script = str(ROOT / "deploy" / "ssh" / "launch.sh")
    pid = None
    try:
        r = subprocess.run(
            [script, "start", str(tmp_path / "hosts"), str(tmp_path / "base.toml")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        pid = read_pid(remote / "node-0.pid")
        assert r.returncode == 0, r.stdout + r.stderr
        assert " UP " in r.stdout
        assert (
            mode(here / "keys") == 0o700
            and mode(remote) == 0o700
            and mode(remote / "node.env") == 0o600
        )
        worker = load_config(str(here / "keys" / "worker1.toml"), env={})
        node_secret = (
            [line for line in (remote / "node.env").read_text().splitlines() if "SECRET" in line][0]
            .split("=", 1)[1]
            .strip("'")
        )
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert node_secret not in cmdline and "insecure" not in cmdline and "curve" not in cmdline
        assert (
            "secret" not in (here / "cluster.toml").read_text()
            and "secret" not in (remote / "cluster.toml").read_text()
        )
        address = worker.cluster.nodes[0]
        assert not query_many([address], "sshkeys", 1.5)[0].up, "no keys, no answer"
        t = worker.transport
        assert query_many(
            [address],
            "sshkeys",
            10,
            curve=(t.curve_server_key, t.curve_public_key, t.curve_secret_key),
        )[0].up
        st = subprocess.run(
            [script, "status", str(tmp_path / "hosts"), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert st.returncode == 0 and json.loads(st.stdout)[0]["up"], st.stdout + st.stderr
        stop = subprocess.run(
            [script, "stop", str(tmp_path / "hosts")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert stop.returncode == 0, stop.stderr
    finally:
        if pid is not None and pid_alive(pid):
            os.kill(pid, 9)

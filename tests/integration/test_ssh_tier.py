"""deploy/ssh/launch.sh with the switch tier, against this machine: ``ssh``/``scp`` are shims that run
the command here (as in test_launcher.py), the base cluster file has two ``[[groups]]`` on loopback,
so ``start`` runs two nodes and one aggregator per group. With CURVE (the default) aggregator i runs
with its own pair (keys/aggregator<i>.env, copied as a mode 600 aggregator-<i>.env and read by its
shell; never node.env), the nodes list its key for its ranks and the workers' files name it; four
``train_example.py`` workers, rank r with ``keys/worker<r>.toml``, train through the aggregators;
``status --json`` shows each aggregator UP with the pushes it summed (read from the /metrics address
the launcher wrote into the cluster file); ``stop`` ends the aggregators and the nodes, and a start
with other groups over the kept keys is refused. (slow) With ``LUWU_INSECURE_PUBLIC_BIND=1`` the
same run with the job's join secret and ``keys/join.toml``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from harness import wait_all

from luwu.config import load_config
from luwu.groups import aggregator_key_for
from luwu.ops.keyset import read_env_file
from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "deploy" / "ssh" / "launch.sh")
NAMES = ["node-0", "node-1", "aggregator-0", "aggregator-1"]


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _launch(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def _train(configs: list[Path], env: dict) -> list[str]:
    """One ``train_example.py`` per rank, rank r with ``--config configs[r]``; their outputs."""
    procs = []
    for rank, config in enumerate(configs):
        e = dict(env, RANK=str(rank), WORLD_SIZE=str(len(configs)), LOCAL_RANK=str(rank))
        cmd = [sys.executable, str(ROOT / "deploy" / "train_example.py"), "--config", str(config)]
        cmd += ["--steps", "5", "--batch", "8", "--metrics-port", "-1"]
        procs.append(
            subprocess.Popen(
                cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return wait_all(procs, 180)


def _environ(pid: int) -> dict[str, str]:
    """The LUWU_* environment process ``pid`` started with (/proc: what its shell exported)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode().partition("=") for item in raw if item.startswith(b"LUWU_"))
    return {k: v for k, _, v in pairs}


def _check_aggregator_keys(here: Path, remote: Path, pids: dict[str, int]) -> None:
    """Aggregator i runs with the pair of keys/aggregator<i>.env (its mode 600 copy on its host),
    which the nodes list for its ranks and its workers' files name; nothing of node.env."""
    keys = here / "keys"
    node_env = read_env_file(keys / "node.env")
    listed = dict(e.split("=", 1) for e in node_env["LUWU_NODE__CURVE_AGGREGATOR_KEYS"].split(","))
    assert list(listed) == ["0-1", "2-3"], listed
    for i, ranks in enumerate(listed):
        copy = remote / f"aggregator-{i}.env"
        assert (
            copy.stat().st_mode & 0o777 == 0o600
            and copy.read_text() == (keys / f"aggregator{i}.env").read_text()
        )
        env = _environ(pids[f"aggregator-{i}"])
        own = read_env_file(copy)
        assert {k: env.get(k) for k in own} == own, "its shell exported its own pair"
        assert env["LUWU_NODE__CURVE_PUBLIC_KEY"] == listed[ranks]
        assert env["LUWU_TRANSPORT__CURVE_SERVER_KEY"] == node_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
        assert env["LUWU_NODE__CURVE_SECRET_KEY"] != node_env["LUWU_NODE__CURVE_SECRET_KEY"]
        assert "LUWU_NODE__CURVE_AGGREGATOR_KEYS" not in env, "node.env was read"
        assert "LUWU_NODE__INSECURE_PUBLIC_BIND" not in env
        first = int(ranks.split("-")[0])
        worker = load_config(str(keys / f"worker{first}.toml"), env={})
        assert aggregator_key_for(worker, first) == listed[ranks]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "insecure", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["curve", "join-secret"]
)
def test_ssh_launcher_starts_one_aggregator_per_group_and_stops_them(tmp_path, insecure):
    for name, text in (
        ("ssh", '#!/bin/sh\nshift\nexec sh -c "$*"\n'),  # ssh HOST COMMAND -> COMMAND, here
        ("scp", '#!/bin/sh\nexec cp "$1" "${2#*:}"\n'),  # scp SRC HOST:DST -> cp SRC DST
    ):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    n0, n1, a0, a1, m0 = _ports(5)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 {n0}\n127.0.0.1 {n1}\n")
    base = tmp_path / "base.toml"
    base.write_text(
        '[cluster]\njob = "sshtier"\nworld_size = 4\n\n'
        f'[[groups]]\nranks = "0-1"\naggregator = "tcp://127.0.0.1:{a0}"\n'
        f'metrics = "http://127.0.0.1:{m0}"\n\n'
        f'[[groups]]\nranks = "2-3"\naggregator = "tcp://127.0.0.1:{a1}"\n'
    )
    remote, here = tmp_path / "remote", tmp_path / "here"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")}
    env.update(
        LUWU_SSH=str(tmp_path / "ssh"),
        LUWU_SCP=str(tmp_path / "scp"),
        LUWU_PYTHON=sys.executable,
        LUWU_REMOTE_PYTHON=sys.executable,
        LUWU_RUN_DIR=str(here),
        LUWU_REMOTE_DIR=str(remote),
        LUWU_START_TIMEOUT="60",
        LUWU_STOP_TIMEOUT="10",
        LUWU_WORKERS="4",
        LUWU_AGGREGATOR_METRICS_PORT=str(_ports(1)[0]),  # for the group that names none
        COLUMNS="200",
    )
    if insecure:
        env["LUWU_INSECURE_PUBLIC_BIND"] = "1"
    pids: dict[str, int] = {}
    try:
        r = _launch(env, "start", str(hosts), str(base))
        pids = {n: p for n in NAMES if (p := read_pid(remote / f"{n}.pid")) is not None}
        logs = "\n".join(f"--- {f}\n{f.read_text()[-1500:]}" for f in remote.glob("*.log"))
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs}"
        assert len(pids) == 4 and all(pid_alive(p) for p in pids.values()), pids
        keys = here / "keys"
        configs = [keys / ("join.toml" if insecure else f"worker{r}.toml") for r in range(4)]
        groups = load_config(str(configs[0]), env={}).cluster.groups
        metrics = [g["metrics"] for g in groups]
        assert metrics == [
            f"http://127.0.0.1:{m0}",
            f"http://127.0.0.1:{env['LUWU_AGGREGATOR_METRICS_PORT']}",
        ], groups
        assert r.stdout.count(" UP ") == 4, r.stdout  # two nodes, two aggregators
        if insecure:
            secret = read_env_file(keys / "node.env")["LUWU_NODE__JOIN_SECRET"]
            agg_env = _environ(pids["aggregator-0"])
            assert agg_env["LUWU_TRANSPORT__JOIN_SECRET"] == secret
            assert not list(keys.glob("aggregator*")) and not list(remote.glob("aggregator-*.env"))
        else:
            _check_aggregator_keys(here, remote, pids)

        outs = _train(configs, env)
        assert all("LUWU_WORKER_DONE" in out for out in outs), outs

        st = _launch(env, "status", str(hosts), "--json")
        assert st.returncode == 0, st.stdout + st.stderr
        tier = [row for row in json.loads(st.stdout) if row.get("role") == "aggregator"]
        assert [(t["ranks"], t["up"], t["metrics_up"]) for t in tier] == [
            ("0-1", True, True),
            ("2-3", True, True),
        ], tier
        assert all(t["totals"]["pushes_summed"] == 2 * t["totals"]["sums_sent"] > 0 for t in tier)

        stop = _launch(env, "stop", str(hosts))
        assert stop.returncode == 0, stop.stderr
        assert "aggregator-0 stopped" in stop.stdout and "node-1 stopped" in stop.stdout, (
            stop.stdout
        )
        assert not [p for p in pids.values() if pid_alive(p)] and not list(remote.glob("*.pid"))
        if insecure:
            return
        other = tmp_path / "other.toml"  # other groups over the kept keys: refused, nothing started
        other.write_text(base.read_text().replace('"2-3"', '"2"').replace("world_size = 4", ""))
        refused = _launch(env, "start", str(hosts), str(other))
        assert refused.returncode == 1 and f"remove {keys}" in refused.stderr, refused.stderr
        assert not list(remote.glob("*.pid"))
    finally:
        for p in pids.values():
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)

"""deploy/ssh/launch.sh with the switch tier, against this machine: ``ssh``/``scp`` are shims that run
the command here (as in test_launcher.py), the base cluster file has two ``[[groups]]`` on loopback,
so ``start`` runs two nodes and one aggregator per group; four ``train_example.py`` workers with
``keys/join.toml`` find their aggregators in it and train; ``status --json`` shows each aggregator
UP with the pushes it summed (read from the /metrics address the launcher wrote into the cluster
file); ``stop`` ends the aggregators and the nodes."""

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
from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "deploy" / "ssh" / "launch.sh")


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


def _train(config: Path, world: int, env: dict) -> list[str]:
    procs = []
    for rank in range(world):
        e = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        cmd = [sys.executable, str(ROOT / "deploy" / "train_example.py"), "--config", str(config)]
        cmd += ["--steps", "5", "--batch", "8", "--metrics-port", "-1"]
        procs.append(
            subprocess.Popen(
                cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return wait_all(procs, 180)


@pytest.mark.timeout(400)
def test_ssh_launcher_starts_one_aggregator_per_group_and_stops_them(tmp_path):
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
        LUWU_INSECURE_PUBLIC_BIND="1",
        LUWU_AGGREGATOR_METRICS_PORT=str(_ports(1)[0]),  # for the group that names none
        COLUMNS="200",
    )
    names = ["node-0", "node-1", "aggregator-0", "aggregator-1"]
    pids: list[int] = []
    try:
        refused = _launch(dict(env, LUWU_INSECURE_PUBLIC_BIND="0"), "start", str(hosts), str(base))
        assert refused.returncode == 1 and "no CURVE keys yet" in refused.stderr, refused.stderr
        assert not remote.exists() or not list(remote.glob("*.pid"))

        r = _launch(env, "start", str(hosts), str(base))
        pids = [p for p in (read_pid(remote / f"{n}.pid") for n in names) if p is not None]
        logs = "\n".join(f"--- {f}\n{f.read_text()[-1500:]}" for f in remote.glob("*.log"))
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{logs}"
        assert len(pids) == 4 and all(pid_alive(p) for p in pids), pids
        join = here / "keys" / "join.toml"
        groups = load_config(str(join), env={}).cluster.groups
        metrics = [g["metrics"] for g in groups]
        assert metrics == [
            f"http://127.0.0.1:{m0}",
            f"http://127.0.0.1:{env['LUWU_AGGREGATOR_METRICS_PORT']}",
        ], groups
        assert r.stdout.count(" UP ") == 4, r.stdout  # two nodes, two aggregators

        outs = _train(join, 4, env)
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
        assert not [p for p in pids if pid_alive(p)] and not list(remote.glob("*.pid"))
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)

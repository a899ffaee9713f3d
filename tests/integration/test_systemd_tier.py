"""deploy/systemd/luwu-aggregator@.service: ``systemd-analyze verify`` passes, and its ExecStart, run
here as systemd would run it (``$$`` as ``$``, ``%i`` as the instance, the venv's python and
/etc/luwu as this machine's, the environment of its one EnvironmentFile), finds its group in the
cluster file and starts a real aggregator on the group's address, serving /metrics on the group's
metrics address, in front of a real CURVE node. Its EnvironmentFile is keys/aggregator<i>.env of
``luwu keys --cluster``, installed as the header says: its own pair (never the nodes' keys.env), the
key the nodes list for its ranks and its workers' files name; two ``train_example.py`` workers with
their keys/worker<r>.toml train through it, the node counting the aggregator's sums. A group the
file does not have exits 3 (RestartPreventExitStatus). The header's join-secret opt-out (the nodes'
node.env plus LUWU_NODE__INSECURE_PUBLIC_BIND=true as that file) starts it with the secret as
transport.join_secret."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from harness import wait_all
from support.node_metrics import scrape

from luwu.cli import main as luwu_main
from luwu.config import load_config
from luwu.groups import aggregator_for, aggregator_key_for
from luwu.ops.keyset import env_file_text, read_env_file
from luwu.switch_nodes.lines import METRICS_LINE, READY_LINE

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "luwu-aggregator@.service"
NODE_UNIT = ROOT / "deploy" / "systemd" / "luwu-node@.service"


def _service(unit: Path = UNIT) -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(unit.read_text())
    return cp["Service"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(text: str, etc: Path) -> str:
    """A unit's line with this machine's paths: the venv's python, ``etc`` for /etc/luwu."""
    return text.replace("/opt/luwu/venv/bin/python", sys.executable).replace("/etc/luwu", str(etc))


def _command(instance: str, etc: Path) -> list[str]:
    line = _local(_service()["ExecStart"].replace("%i", instance), etc)
    return [arg.replace("$$", "$") for arg in shlex.split(line)]


def _environment(instance: str, etc: Path) -> dict[str, str]:
    """What systemd gives the instance: PATH, Environment= and its EnvironmentFile (required)."""
    s = _service()
    env = {"PATH": "/usr/bin:/bin", **dict([s["Environment"].split("=", 1)])}
    return env | read_env_file(_local(s["EnvironmentFile"].replace("%i", instance), etc))


def _install_steps(unit: Path) -> list[tuple[str, str]]:
    """The header's ``install -m 600 keys/FILE /etc/luwu/FILE`` lines: (FILE, where it goes)."""
    return re.findall(r"^#\s+install -m 600 (\S+) (\S+)", unit.read_text(), re.M)


def _environ(pid: int) -> dict[str, str]:
    """The LUWU_* environment process ``pid`` runs with (/proc: what its shell exported)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode().partition("=") for item in raw if item.startswith(b"LUWU_"))
    return {k: v for k, _, v in pairs}


def _start(cmd: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    """``cmd`` started; its output up to its READY line."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(READY_LINE):
            break
    return proc, "".join(lines)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def test_the_aggregator_unit_verifies(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    unit = tmp_path / "luwu-aggregator@0-3.service"
    shutil.copy(UNIT, unit)
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    s = _service()
    assert s["User"] != "root" and s["KillSignal"] == "SIGTERM" and s["Restart"] == "on-failure"
    assert s["RestartPreventExitStatus"] == "3"
    body = UNIT.read_text().split("[Unit]")[1]
    files = re.findall(r"^EnvironmentFile=(.*)$", body, re.M)
    assert files == ["/etc/luwu/aggregator-%i.env"], "its own keys only, and required"
    assert "keys.env" not in body, "never the nodes' keys"


def _cluster(tmp_path: Path, node_port: int, agg_ports: list[int], mport: int) -> Path:
    """The cluster file: one node, groups 0-1 (with metrics) and 2-3. No world_size: the training
    here is ranks 0-1 alone (group 2-3 only shows that each instance finds its own)."""
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[cluster]\njob = "systemd-tier"\nnodes = ["tcp://127.0.0.1:{node_port}"]\n\n'
        f'[[groups]]\nranks = "0-1"\naggregator = "tcp://127.0.0.1:{agg_ports[0]}"\n'
        f'metrics = "http://127.0.0.1:{mport}"\n\n'
        f'[[groups]]\nranks = "2-3"\naggregator = "tcp://127.0.0.1:{agg_ports[1]}"\n'
    )
    return path


def _node(etc: Path, node_env: dict, metrics_port: int) -> tuple[subprocess.Popen, str]:
    """The node unit's ExecStart for index 0, keys.env (keys/node.env) in its environment."""
    argv = shlex.split(_local(_service(NODE_UNIT)["ExecStart"].replace("%i", "0"), etc))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")}
    env.update(node_env, LUWU_METRICS__PORT=str(metrics_port))
    return _start(argv, env)


def _train(keys: Path, env: dict) -> list[str]:
    procs = []
    for rank in range(2):
        e = dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        cmd = [sys.executable, str(ROOT / "deploy" / "train_example.py")]
        cmd += ["--config", str(keys / f"worker{rank}.toml"), "--steps", "3", "--batch", "8"]
        cmd += ["--metrics-port", "-1"]
        procs.append(
            subprocess.Popen(
                cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return wait_all(procs, 180)


@pytest.mark.timeout(300)
def test_the_units_command_runs_the_groups_aggregator_with_its_own_keys(tmp_path):
    node_port, a0, a1, mport, node_mport = (_free_port() for _ in range(5))
    cluster = _cluster(tmp_path, node_port, [a0, a1], mport)
    keys = tmp_path / "keys"
    assert luwu_main(["keys", "--out", str(keys), "--workers", "4", "--cluster", str(cluster)]) == 0
    # the header's step for group 0 (ranks 0-7 there), done for each group of this file
    assert _install_steps(UNIT)[0] == ("keys/aggregator0.env", "/etc/luwu/aggregator-0-7.env")
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(cluster, etc / "cluster.toml")
    for i, g in enumerate(load_config(str(cluster), env={}).cluster.groups):
        shutil.copy(keys / f"aggregator{i}.env", etc / f"aggregator-{g['ranks']}.env")
    node_env = read_env_file(keys / "node.env")
    listed = dict(e.split("=", 1) for e in node_env["LUWU_NODE__CURVE_AGGREGATOR_KEYS"].split(","))
    assert list(listed) == ["0-1", "2-3"], listed

    env = _environment("0-1", etc)
    missing = subprocess.run(
        _command("4-5", etc), env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 3 and "no group" in missing.stderr, missing.stderr
    procs: list[subprocess.Popen] = []
    try:
        node, out = _node(etc, node_env, node_mport)
        procs.append(node)
        assert f"{READY_LINE} tcp://127.0.0.1:{node_port}" in out, out
        for instance, port in (("0-1", a0), ("2-3", a1)):
            env = _environment(instance, etc)
            assert env["LUWU_NODE__CURVE_PUBLIC_KEY"] == listed[instance], "its own pair"
            assert (
                env["LUWU_TRANSPORT__CURVE_SERVER_KEY"] == node_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
            )
            assert env["LUWU_NODE__CURVE_SECRET_KEY"] != node_env["LUWU_NODE__CURVE_SECRET_KEY"]
            assert not {"LUWU_NODE__CURVE_AGGREGATOR_KEYS", "LUWU_NODE__JOIN_SECRET"} & set(env)
            proc, out = _start(_command(instance, etc), env)
            procs.append(proc)
            assert f"{READY_LINE} tcp://127.0.0.1:{port}" in out, out
            if instance == "0-1":
                assert f"{METRICS_LINE} http://127.0.0.1:{mport}" in out, out
        for rank in range(2):  # the workers' files name the aggregator of ranks 0-1 and its key
            worker = load_config(str(keys / f"worker{rank}.toml"), env={})
            assert aggregator_for(worker, rank) == f"tcp://127.0.0.1:{a0}"
            assert aggregator_key_for(worker, rank) == listed["0-1"]
        outs = _train(keys, {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")})
        assert all("LUWU_WORKER_DONE" in o for o in outs), outs
        tier = scrape(mport, "luwu_aggregator_")
        summed = tier["luwu_aggregator_pushes_summed_total"]
        sent = tier["luwu_aggregator_sums_sent_total"]
        assert summed == 2 * sent > 0, tier
        took = scrape(node_mport, "luwu_node_")
        assert took["luwu_node_pushes_total"] == sent, (took, tier)
        for p in procs[1:]:
            p.terminate()
            assert p.wait(20) == 0
    finally:
        _stop(procs)


@pytest.mark.timeout(120)
def test_the_join_secret_opt_out_starts_the_aggregator(tmp_path):
    """The header's opt-out: the nodes' node.env (their join secret) plus
    LUWU_NODE__INSECURE_PUBLIC_BIND=true as the instance's file: the aggregator starts on its group's
    address, with the secret as transport.join_secret, and serves /metrics."""
    import luwu

    port, mport = _free_port(), _free_port()
    with luwu.local_cluster(1) as c:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(
            f'[cluster]\njob = "{c.job}"\nnodes = ["{c.addresses[0]}"]\n\n'
            f'[[groups]]\nranks = "0-1"\naggregator = "tcp://127.0.0.1:{port}"\n'
            f'metrics = "http://127.0.0.1:{mport}"\n'
        )
        etc = tmp_path / "etc"
        etc.mkdir()
        shutil.copy(cluster, etc / "cluster.toml")
        # the header's opt-out for group 0 (ranks 0-7 there): the nodes' node.env, one line added
        assert ("keys/node.env", "/etc/luwu/aggregator-0-7.env") in _install_steps(UNIT)
        added = "echo LUWU_NODE__INSECURE_PUBLIC_BIND=true >> /etc/luwu/aggregator-0-7.env"
        assert added in UNIT.read_text()
        (etc / "aggregator-0-1.env").write_text(
            env_file_text({"LUWU_NODE__JOIN_SECRET": c.join_secret})
            + "LUWU_NODE__INSECURE_PUBLIC_BIND=true\n"
        )
        proc, out = _start(_command("0-1", etc), _environment("0-1", etc))
        try:
            assert f"{READY_LINE} tcp://127.0.0.1:{port}" in out, out
            env = _environ(proc.pid)  # the shell exec'd the aggregator: its pid
            assert env["LUWU_TRANSPORT__JOIN_SECRET"] == c.join_secret, "shown to the nodes"
            assert env["LUWU_NODE__INSECURE_PUBLIC_BIND"] == "true"
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()
            assert b"luwu_aggregator_pushes_summed_total" in text
            proc.terminate()
            assert proc.wait(20) == 0
        finally:
            _stop([proc])

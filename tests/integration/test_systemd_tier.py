"""deploy/systemd/luwu-aggregator@.service: ``systemd-analyze verify`` passes, and its ExecStart, run
here as systemd would run it for instance ``0-1`` (``$$`` as ``$``, ``%i`` as the instance, the venv's
python and /etc/luwu/cluster.toml as this machine's), finds that group in the cluster file and starts
a real aggregator on the group's address, serving /metrics on the group's metrics address, in front
of a real node; a group the file does not have exits 3 (RestartPreventExitStatus)."""

from __future__ import annotations

import configparser
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import luwu
from luwu.switch_nodes.lines import METRICS_LINE, READY_LINE

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "luwu-aggregator@.service"


def _service() -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(UNIT.read_text())
    return cp["Service"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(instance: str, cluster_file: Path) -> list[str]:
    line = _service()["ExecStart"].replace("%i", instance)
    line = line.replace("/opt/luwu/venv/bin/python", sys.executable)
    line = line.replace("/etc/luwu/cluster.toml", str(cluster_file))
    return [arg.replace("$$", "$") for arg in shlex.split(line)]


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
    assert s["EnvironmentFile"].lstrip("-").endswith("aggregator-%i.env")


@pytest.mark.timeout(120)
def test_the_units_command_starts_the_groups_aggregator(tmp_path):
    port, mport = _free_port(), _free_port()
    with luwu.local_cluster(1) as c:
        path = tmp_path / "cluster.toml"
        path.write_text(
            f'[cluster]\njob = "{c.job}"\nnodes = ["{c.addresses[0]}"]\nworld_size = 4\n\n'
            f'[[groups]]\nranks = "0-1"\naggregator = "tcp://127.0.0.1:{port}"\n'
            f'metrics = "http://127.0.0.1:{mport}"\n\n'
            f'[[groups]]\nranks = "2-3"\naggregator = "tcp://127.0.0.1:{_free_port()}"\n'
        )
        env = {"PATH": "/usr/bin:/bin", "LUWU_NODE__JOIN_SECRET": c.join_secret}
        missing = subprocess.run(
            _command("4-5", path), env=env, capture_output=True, text=True, timeout=60
        )
        assert missing.returncode == 3 and "no group" in missing.stderr, missing.stderr
        proc = subprocess.Popen(
            _command("0-1", path),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(READY_LINE):
                    break
            assert f"{READY_LINE} tcp://127.0.0.1:{port}" in "".join(lines), lines
            assert f"{METRICS_LINE} http://127.0.0.1:{mport}" in "".join(lines), lines
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()
            assert b"luwu_aggregator_pushes_summed_total" in text
            proc.terminate()
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)

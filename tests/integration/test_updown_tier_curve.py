"""`luwu up` with the switch tier in front of CURVE nodes (a network bind): real processes.

``luwu up --host 0.0.0.0`` makes the job's CURVE keys, one pair per aggregator among them: each
aggregator gets its own in a mode-600 environment file of its own (never the nodes' secret key),
the nodes list its public key for its group's ranks, and the workers' key files name it in their
``[[groups]]`` entry. Two ``deploy/train_example.py`` workers with ``--config keys/worker<r>.toml``
train through the aggregator; ``luwu down`` ends every process of the run.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import wait_all
from support.cli import luwu

from luwu.config import load_config
from luwu.groups import aggregator_for, aggregator_key_for
from luwu.ops.keyset import read_env_file
from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "train_example.py"


def _pids(run_dir: Path) -> set[int]:
    return {p for f in run_dir.glob("*.pid") if (p := read_pid(f)) is not None}


def _train(run_dir: Path, world: int) -> list[str]:
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        env = {k: v for k, v in env.items() if not k.startswith("LUWU_TRANSPORT__")}
        cmd = [sys.executable, str(EXAMPLE), "--config", str(run_dir / f"keys/worker{rank}.toml")]
        cmd += ["--steps", "3", "--batch", "8", "--metrics-port", "-1"]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return wait_all(procs, 180)


@pytest.mark.timeout(420)
def test_up_runs_the_tier_with_keys_of_its_own_in_front_of_curve_nodes(tmp_path):
    run_dir = tmp_path / "run"
    seen: set[int] = set()
    try:
        r = luwu(
            "up", "--host", "0.0.0.0", "--nodes", "2", "--aggregators", "1", "--world-size", "2",
            "--run-dir", str(run_dir), f"--cluster.job=tierkeys{os.getpid()}",
            "--metrics-port", "-1", "--stop-timeout", "10",
        )  # fmt: skip
        assert r.returncode == 0, f"up failed:\n{r.stdout}\n{r.stderr}"
        seen |= _pids(run_dir)
        assert "CURVE on" in r.stdout, r.stdout
        node_env = read_env_file(run_dir / "node.env")
        agg_env = read_env_file(run_dir / "aggregator-0.env")
        assert stat.S_IMODE((run_dir / "aggregator-0.env").stat().st_mode) == 0o600
        agg_key = agg_env["LUWU_TRANSPORT__CURVE_PUBLIC_KEY"]
        assert node_env["LUWU_NODE__CURVE_AGGREGATOR_KEYS"] == f"0-1={agg_key}"
        assert agg_env["LUWU_NODE__CURVE_SECRET_KEY"] != node_env["LUWU_NODE__CURVE_SECRET_KEY"]
        assert agg_env["LUWU_NODE__CURVE_PUBLIC_KEY"] == agg_key
        assert (
            agg_env["LUWU_TRANSPORT__CURVE_SERVER_KEY"] == node_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
        )
        cfg = load_config(str(run_dir / "keys" / "worker1.toml"), env={})
        assert aggregator_key_for(cfg, 1) == agg_key  # its server key there: not the nodes'
        assert aggregator_for(cfg, 1) and not aggregator_for(cfg, 1).endswith(":0")
        outs = _train(run_dir, 2)
        assert all("loss" in out for out in outs), outs
        log = (run_dir / "aggregator-0.log").read_text()
        assert "ranks 0-1" in log and "Traceback" not in log, log[-2000:]
        r = luwu("down", "--run-dir", str(run_dir), "--timeout", "10")
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in seen):
            time.sleep(0.1)
        assert not [p for p in seen if pid_alive(p)], "a process of the run outlived luwu down"
    finally:
        if run_dir.exists():
            luwu("down", "--run-dir", str(run_dir), "--timeout", "5", timeout_s=60)
        for pid in seen | _pids(run_dir):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

"""deploy/local.sh end to end: up, train (the workers show the job's join secret), status, down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SH = str(ROOT / "deploy" / "local.sh")


@pytest.mark.timeout(240)
def test_local_sh_trains_on_nodes_that_ask_for_the_join_secret(tmp_path):
    """The nodes of `local.sh up` ask for the job's join secret; `local.sh train` gives every rank
    keys/join.toml (the bare cluster.toml is refused), and the step reaches both nodes."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")}
    env.update(
        LUWU_PYTHON=sys.executable, LUWU_RUN_DIR=str(run_dir), LUWU_JOB="localsh", COLUMNS="200"
    )

    def local(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [LOCAL_SH, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=tmp_path,
        )

    try:
        up = local("up", "2")
        assert up.returncode == 0, up.stdout + up.stderr
        assert (run_dir / "keys" / "join.toml").is_file()
        train = local(
            "train",
            "2",
            "--steps",
            "5",
            "--batch",
            "8",
            "--metrics-port",
            "-1",
            "--transport.bucket_bytes=16384",
            timeout_s=180,
        )
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        assert (
            "LUWU_WORKER_DONE rank 0 steps 5" in train.stdout
            and "LUWU_WORKER_DONE rank 1 steps 5" in train.stdout
        )
        status = local("status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        assert [row["step"] for row in json.loads(status.stdout)] == [5, 5], status.stdout
    finally:
        pids = [read_pid(p) for p in run_dir.glob("*.pid")]
        local("down", "--timeout", "5", timeout_s=60)
        for pid in pids:
            if pid is not None and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

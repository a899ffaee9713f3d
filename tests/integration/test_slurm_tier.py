"""deploy/slurm/luwu.sbatch with the switch tier (LUWU_AGGREGATORS=1) on a fake allocation.

``srun`` and ``scontrol`` are the shims of test_launcher (the tasks run on this machine): two hosts,
the first running 2 node daemons, the second an aggregator for its 2 torchrun ranks of
train_example.py. With CURVE the aggregator runs with a key pair of its own (keys/aggregator0.env,
never node.env), the nodes list it for ranks 0-1 and the workers' files name it; with
LUWU_INSECURE_PUBLIC_BIND=1 it asks its workers for the job's join secret. Either way the nodes took
one push a bucket a step (the aggregator's sum), not one per worker.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from integration.test_launcher import FAKE_SCONTROL, FAKE_SRUN

from luwu.config import load_config
from luwu.groups import aggregator_for, aggregator_key_for
from luwu.ops.keyset import read_env_file

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# The training script: train_example.py, then rank 0 (whose last step needed both ranks' pushes)
# prints what the nodes took: pushes and bucket updates, from their /metrics.
TRAIN = f"""import os, runpy, sys
sys.path.insert(0, {str(TESTS)!r})
from support.node_metrics import scrape

example = {str(ROOT / "deploy" / "train_example.py")!r}
sys.argv[0] = example
try:
    runpy.run_path(example, run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
if os.environ["RANK"] == "0":
    got = [scrape(int(os.environ["LUWU_METRICS_PORT"]) + i, "luwu_node_") for i in range(2)]
    pushes = sum(g["luwu_node_pushes_total"] for g in got)
    updates = sum(g["luwu_node_updates_applied_total"] for g in got)
    print(f"NODES_TOOK pushes {{pushes:.0f}} updates {{updates:.0f}}", flush=True)
"""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run_sbatch(tmp_path: Path, insecure: bool) -> tuple[subprocess.CompletedProcess, Path, int]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "train.py").write_text(TRAIN)
    port, metrics, rdzv, agg = _free_ports(4)
    host = socket.gethostname()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LUWU_NODE__", "LUWU_TRANS"))}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="4343",
        SLURM_JOB_NODELIST=f"{host},{host}",
        SLURM_SUBMIT_DIR=str(tmp_path),
        LUWU_PYTHON=sys.executable,
        LUWU_NODES_PER_HOST="2",
        LUWU_PORT=str(port),
        LUWU_METRICS_PORT=str(metrics),
        LUWU_RDZV_PORT=str(rdzv),
        LUWU_GPUS_PER_HOST="2",
        LUWU_AGGREGATORS="1",
        LUWU_AGGREGATOR_PORT=str(agg),
        LUWU_START_TIMEOUT="120",
        LUWU_STOP_TIMEOUT="30",
        LUWU_INSECURE_PUBLIC_BIND=str(int(insecure)),
        COLUMNS="200",
    )
    args = ["--steps", "10", "--transport.bucket_bytes=16384", "--metrics-port", "-1"]
    r = subprocess.run(
        ["bash", str(ROOT / "deploy" / "slurm" / "luwu.sbatch"), str(tmp_path / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=tmp_path,
    )
    return r, tmp_path / ".luwu-run" / "luwu-4343", agg


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "join-secret"])
def test_sbatch_runs_the_tier_with_its_own_keys_or_the_join_secret(tmp_path, insecure):
    r, run, agg_port = _run_sbatch(tmp_path, insecure)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(run.glob("*.log")))
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{logs}"
    assert r.stdout.count("LUWU_WORKER_DONE") == 2, r.stdout[-3000:]
    took = next(line.split() for line in r.stdout.splitlines() if "NODES_TOOK" in line)
    pushes, updates = int(took[2]), int(took[4])
    # one push a bucket a step from the aggregator, where two workers alone would make two each
    assert updates > 0 and updates <= pushes < 1.5 * updates, (pushes, updates)
    host = socket.gethostname()
    cluster = load_config(str(run / "cluster.toml"), env={})
    assert cluster.cluster.groups == [{"ranks": "0-1", "aggregator": f"tcp://{host}:{agg_port}"}]
    log = (run / "aggregator-0.log").read_text()
    assert "ranks 0-1" in log and "Traceback" not in log, log[-2000:]
    keys = run / "keys"
    node_env = read_env_file(keys / "node.env")
    if insecure:
        assert sorted(f.name for f in keys.iterdir()) == ["join.toml", "monitor.toml", "node.env"]
        assert list(node_env) == ["LUWU_NODE__JOIN_SECRET"]
        return
    agg_env = read_env_file(keys / "aggregator0.env")
    agg_key = agg_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
    assert agg_env["LUWU_TRANSPORT__CURVE_PUBLIC_KEY"] == agg_key
    assert agg_env["LUWU_TRANSPORT__CURVE_SERVER_KEY"] == node_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
    assert agg_env["LUWU_NODE__CURVE_SECRET_KEY"] != node_env["LUWU_NODE__CURVE_SECRET_KEY"]
    assert node_env["LUWU_NODE__CURVE_AGGREGATOR_KEYS"] == f"0-1={agg_key}"
    for rank in range(
        2
    ):  # each rank's file names the aggregator and its key (its server key there)
        cfg = load_config(str(keys / f"worker{rank}.toml"), env={})
        assert aggregator_for(cfg, rank) == f"tcp://{host}:{agg_port}"
        assert aggregator_key_for(cfg, rank) == agg_key

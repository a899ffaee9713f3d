"""`luwu up` with the switch tier: aggregators started, supervised, listed and stopped with the nodes.

Real processes as a user runs them: ``luwu up --aggregators 1 --world-size 2`` (one group of both
ranks on loopback), two ``deploy/train_example.py`` workers with ``--config keys/join.toml`` that
find their aggregator in the file's ``[[groups]]``, ``luwu status``, an aggregator SIGKILLed and
restarted at its address, then ``luwu down``: every process of the run ended.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import wait_all
from support.cli import luwu
from support.node_metrics import scrape

from luwu.config import load_config
from luwu.groups import aggregator_for
from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "train_example.py"


def pids_of(run_dir: Path) -> dict[str, int]:
    return {f.stem: p for f in run_dir.glob("*.pid") if (p := read_pid(f)) is not None}


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def train(config: Path, world: int, steps: int = 5) -> list[str]:
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
        )  # what torchrun sets
        cmd = [sys.executable, str(EXAMPLE), "--config", str(config), "--steps", str(steps)]
        cmd += ["--batch", "8", "--metrics-port", "-1"]  # (its aggregator: join.toml's [[groups]])
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return wait_all(procs, 180)


def _node_counts(run_dir: Path) -> tuple[float, float]:
    """(pushes accepted, bucket updates applied) over the nodes, from their /metrics."""
    pushes = updates = 0.0
    for n in state(run_dir)["nodes"]:
        got = scrape(int(n["metrics_url"].rsplit(":", 1)[1]), "luwu_node_")
        pushes += got["luwu_node_pushes_total"]
        updates += got["luwu_node_updates_applied_total"]
    return pushes, updates


@pytest.mark.timeout(420)
def test_up_starts_the_tier_workers_train_through_it_and_down_ends_everything(tmp_path):
    run_dir = tmp_path / "run"
    job = f"tier{os.getpid()}"
    seen: set[int] = set()
    try:
        r = luwu(
            "up", "--nodes", "2", "--aggregators", "1", "--world-size", "2",
            "--run-dir", str(run_dir), f"--cluster.job={job}", "--stop-timeout", "10",
        )  # fmt: skip
        assert r.returncode == 0, f"up failed:\n{r.stdout}\n{r.stderr}"
        pids = pids_of(run_dir)
        seen |= set(pids.values())
        assert set(pids) == {"supervisor", "node-0", "node-1", "aggregator-0"}, pids
        # The workers' file names the group and its bound address; both ranks find it there.
        join = run_dir / "keys" / "join.toml"
        cfg = load_config(str(join), env={})
        agg = state(run_dir)["aggregators"][0]
        # up's table: each column what its header says, for the aggregator's row as for a node's
        table = _table(r.stdout)
        assert table["a0"] == {
            "#": "a0",
            "address": agg["address"],
            "ranks": "0-1",
            "metrics": agg["metrics_url"],
            "pid": str(agg["pid"]),
        }, r.stdout
        node = state(run_dir)["nodes"][1]
        assert table["1"]["ranks"] == "-" and table["1"]["metrics"] == node["metrics_url"]
        assert cfg.cluster.world_size == 2
        assert cfg.cluster.groups == [
            {"ranks": "0-1", "aggregator": agg["address"], "metrics": agg["metrics_url"]}
        ]  # (its /metrics, where luwu top reads it)
        assert (
            load_config(str(run_dir / "cluster.toml"), env={}).cluster.groups == cfg.cluster.groups
        )
        addrs = [aggregator_for(cfg, rank) for rank in range(2)]
        assert addrs == [agg["address"]] * 2 and not agg["address"].endswith(":0")

        outs = train(join, 2)
        assert all("loss" in out for out in outs), outs
        pushes, updates = _node_counts(run_dir)
        # one push a bucket a step from the aggregator, where two workers alone would make two each
        assert updates > 0 and updates <= pushes < 1.5 * updates, (pushes, updates)

        rc, rows = _status(run_dir)
        tier = [row for row in rows if row.get("role") == "aggregator"]
        assert rc == 0 and [(t["ranks"], t["up"], t["pid"]) for t in tier] == [
            ("0-1", True, agg["pid"])
        ], rows

        # SIGKILL the aggregator: the supervisor starts it again at the same address.
        os.kill(agg["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = state(run_dir)["aggregators"][0]
            if now["restarts"] == 1 and now["state"] == "up":
                break
            time.sleep(0.2)
        assert now["restarts"] == 1 and now["state"] == "up", now
        assert now["address"] == agg["address"] and now["pid"] != agg["pid"]
        seen.add(now["pid"])
        assert _status(run_dir)[0] == 0

        pids = pids_of(run_dir)
        seen |= set(pids.values())
        r = luwu("down", "--run-dir", str(run_dir), "--timeout", "10")
        assert r.returncode == 0, r.stderr
        assert "1 aggregator(s)" in r.stderr, r.stderr
        assert not list(run_dir.glob("*.pid"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in seen):
            time.sleep(0.1)
        assert not [p for p in seen if pid_alive(p)], "a process of the run outlived luwu down"
        rc, rows = _status(run_dir)
        assert rc == 1 and not any(t["up"] for t in rows if t.get("role") == "aggregator")
    finally:
        if run_dir.exists():
            luwu("down", "--run-dir", str(run_dir), "--timeout", "5", timeout_s=60)
        for pid in seen | set(pids_of(run_dir).values()):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _table(out: str) -> dict[str, dict[str, str]]:
    """The rows of a table rich printed (cells between ┃ in the header, │ below), by their first
    cell, as {header: cell}."""
    bars = re.compile("[┃│]")
    lines = [[c.strip() for c in bars.split(line)[1:-1]] for line in out.splitlines()]
    lines = [cells for cells in lines if cells]
    header, rows = lines[0], lines[1:]
    return {row[0]: dict(zip(header, row)) for row in rows}


def _status(run_dir: Path) -> tuple[int, list[dict]]:
    r = luwu("status", "--run-dir", str(run_dir), "--json", "--timeout", "2")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)

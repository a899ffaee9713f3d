"""`luwu top` and `luwu status` show the switch tier: real aggregators, real training workers.

Two ways a user runs it: ``luwu up --nodes 2 --aggregators 2 --world-size 4`` (up gives each
aggregator a /metrics port and writes it into the run dir's cluster file as the group's ``metrics``),
four ``deploy/train_example.py`` workers through it, then ``top`` and ``status --json``; and
``luwu.local_cluster(2, aggregators=2, world_size=4)`` with a hand-written cluster file naming each
group's /metrics, ``top`` run while the workers train (rates between refreshes), with one more group
whose aggregator is gone and whose /metrics address takes a connection but never answers: ``top``
shows it and still refreshes within its timeout.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import TRAIN, start_workers, wait_all
from support.cli import luwu
from support.node_metrics import scrape
from support.worker_output import read_until_step

import luwu as luwu_pkg
from luwu.config import load_config
from luwu.ops.rundir import pid_alive, read_pid

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "train_example.py"
ROW = re.compile(
    r"^ (a\d)\s+(tcp://\S+)\s+(\d+-\d+)\s+(UP|DOWN)\s+(\S+)\s+(\S+)\s+(\S+)\s+"
    r"(\S+ \S+)\s+(\S+ \S+)\s+(\S+ \S+)\s+(\S+ \S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+(?: ms| s)?)\s+(\S+)",
    re.M,
)
"""One aggregator row of the wide table: #, address, ranks, state, pid, restarts, conns, from
workers/s, to nodes/s, from nodes/s, to workers/s, summed/s, sums/s, fanned/s, last-push wait,
errors."""


def tier_rows(frame: str) -> dict[str, tuple]:
    return {m[0]: m for m in ROW.findall(frame)}


def amount(text: str) -> float:
    """``'12.3 kB'`` as bytes."""
    number, unit = text.split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]


def train_example(config: Path, world: int, steps: int) -> list[str]:
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        cmd = [sys.executable, str(EXAMPLE), "--config", str(config), "--steps", str(steps)]
        cmd += ["--batch", "8", "--metrics-port", "-1"]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return wait_all(procs, 180)


def top(*args: str, timeout_s: float = 90) -> list[str]:
    r = luwu("top", *args, timeout_s=timeout_s)
    assert r.returncode == 0, f"top failed:\n{r.stdout}\n{r.stderr}"
    frames = r.stdout.split("luwu top - job")[1:]
    assert frames, r.stdout
    return frames


@pytest.mark.timeout(420)
def test_up_gives_aggregators_metrics_and_top_and_status_show_their_traffic(tmp_path):
    run_dir = tmp_path / "run"
    job = f"toptier{os.getpid()}"
    pids: set[int] = set()
    try:
        r = luwu(
            "up", "--nodes", "2", "--aggregators", "2", "--world-size", "4",
            "--run-dir", str(run_dir), f"--cluster.job={job}", "--stop-timeout", "10",
        )  # fmt: skip
        assert r.returncode == 0, f"up failed:\n{r.stdout}\n{r.stderr}"
        pids |= {p for f in run_dir.glob("*.pid") if (p := read_pid(f)) is not None}
        state = json.loads((run_dir / "state.json").read_text())
        groups = load_config(str(run_dir / "keys" / "join.toml"), env={}).cluster.groups
        # each group's /metrics is the one its aggregator serves, written where top looks for it
        assert [(g["ranks"], g["metrics"]) for g in groups] == [
            (a["ranks"], a["metrics_url"]) for a in state["aggregators"]
        ]
        assert all(g["metrics"].startswith("http://127.0.0.1:") for g in groups), groups

        outs = train_example(run_dir / "keys" / "join.toml", 4, steps=6)
        assert all("LUWU_WORKER_DONE" in out for out in outs), outs

        (frame,) = top("--run-dir", str(run_dir), "--iterations", "1", "--interval", "0.5")
        rows = tier_rows(frame)
        assert set(rows) == {"a0", "a1"}, frame
        assert "2/2 aggregators up, 2/2 metrics read" in frame, frame
        for name, ranks in (("a0", "0-1"), ("a1", "2-3")):
            row = rows[name]
            assert row[2] == ranks and row[3] == "UP", row
            # the first refresh: rates since the aggregator started, nonzero after the steps
            assert amount(row[7]) > 0 and amount(row[8]) > 0 and float(row[11]) > 0, row
            assert row[14] != "-" and row[15] == "0", row

        st = luwu("status", "--run-dir", str(run_dir), "--json", "--timeout", "2")
        assert st.returncode == 0, st.stderr
        tier = [t for t in json.loads(st.stdout) if t.get("role") == "aggregator"]
        assert [t["metrics_up"] for t in tier] == [True, True], tier
        node_pushes = 0.0
        for n in state["nodes"]:
            got = scrape(int(n["metrics_url"].rsplit(":", 1)[1]), "luwu_node_pushes_total")
            node_pushes += got["luwu_node_pushes_total"]
        totals = [t["totals"] for t in tier]
        # groups of 2, compression off: two pushes summed into one sum of the same size, sent up
        assert all(t["pushes_summed"] == 2 * t["sums_sent"] > 0 for t in totals), totals
        # ranks 2-3 send only pushes: their sums are half their bytes; a0 passes rank 0's INIT on too
        assert totals[1]["bytes_from_workers"] == 2 * totals[1]["bytes_to_nodes"] > 0, totals
        assert totals[0]["bytes_from_workers"] > totals[0]["bytes_to_nodes"] > 0, totals
        assert sum(t["sums_sent"] for t in totals) == node_pushes, (totals, node_pushes)
        assert all(t["wait_count"] == t["sums_sent"] for t in totals), totals
        assert all(t["group_wait_mean_s"] is not None and t["errors"] == 0 for t in tier), tier
    finally:
        if run_dir.exists():
            luwu("down", "--run-dir", str(run_dir), "--timeout", "10", timeout_s=90)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if pid_alive(p)], "a process of the run outlived luwu down"


def _silent_listener() -> socket.socket:
    """A loopback port that takes connections and never answers (an aggregator's /metrics hung)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_file(path: Path, c, silent: int) -> Path:
    lines = [
        "[cluster]",
        f'job = "{c.job}"',
        "nodes = [" + ", ".join(f'"{a}"' for a in c.addresses) + "]",
    ]
    for addr, group, url in zip(c.aggregators, c.groups, c.aggregator_metrics_urls):
        lines += ["", "[[groups]]", f'ranks = "{group[0]}-{group[-1]}"']
        lines += [f'aggregator = "{addr}"', f'metrics = "{url}"']
    lines += ["", "[[groups]]", 'ranks = "4-5"', f'aggregator = "tcp://127.0.0.1:{_closed_port()}"']
    lines += [f'metrics = "http://127.0.0.1:{silent}"']
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(360)
def test_top_shows_the_rates_while_workers_train_and_a_silent_aggregator_without_hanging(
    tmp_path,
):
    silent = _silent_listener()
    metrics = ["--metrics.port", "0"]
    procs: list[subprocess.Popen] = []
    try:
        with luwu_pkg.local_cluster(2, aggregators=2, world_size=4, aggregator_args=metrics) as c:
            config = _cluster_file(tmp_path / "cluster.toml", c, silent.getsockname()[1])
            spec = {
                "steps": 150, "step_sleep": 0.02, "late_ranks": [1], "nodes": c.addresses,
                "world_size": 4, "aggregators": {str(r): c.aggregator_for(r) for r in range(4)},
                "out": str(tmp_path / "result"),
            }  # fmt: skip
            procs = start_workers(TRAIN, spec, 4, tmp_path)
            read_until_step(procs[0], 5, [], timeout_s=120)
            began = time.monotonic()
            frames = top(
                "--config", str(config), "--iterations", "3", "--interval", "1",
                "--timeout", "1",
            )  # fmt: skip
            took = time.monotonic() - began
            outs = wait_all(procs, 240)
    finally:
        silent.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert all("STEP 149" in out for out in outs)
    assert len(frames) == 3 and took < 60, (took, frames)
    for frame in frames:
        assert "2/3 aggregators up, 2/3 metrics read" in frame, frame
        assert re.search(r"aggregator a2 \(tcp://127\.0\.0\.1:\d+\): no connection", frame), frame
        assert re.search(r"aggregator a2 \(http://127\.0\.0\.1:\d+/metrics\): metrics: ", frame)
    later = [tier_rows(f) for f in frames[1:]]  # rates between refreshes, while the steps ran
    assert any(float(rows["a0"][11]) > 0 and float(rows["a1"][11]) > 0 for rows in later), frames
    busy = next(rows for rows in later if float(rows["a0"][11]) > 0)
    for name in ("a0", "a1"):
        row = busy[name]
        # two ranks, each connected to the two nodes through it
        assert row[6] == "4" and amount(row[7]) > 0 and amount(row[8]) > 0, row
        # two pushes a sum (a sum still waiting for its second push at either refresh: off by one)
        assert abs(float(row[11]) - 2 * float(row[12])) <= 2.1, row
    # rank 1 sleeps 30 ms before each backward: the wait for a0's last push shows it, not a1's
    assert busy["a0"][14].endswith(" ms") and float(busy["a0"][14].split()[0]) >= 15, busy
    assert "a2" not in busy  # no numbers for the aggregator that is gone

"""`luwu top` on a cluster where one node's state is out of core (node.state_dir), real processes: two
streaming workers train against two nodes, node 0 with a state window of two buckets; top, run as a
user runs it, shows node 0's state read and written per second, I/O wait per step and buffer
occupancy, and no such line for node 1 (in RAM)."""

import os
import re
import subprocess
import sys
import time

import pytest
from harness import ROOT, start_workers, wait_all

import luwu
from luwu.units import human_bytes

STREAM = ROOT / "workers" / "stream.py"
BUDGET = 2 * 5 * 4096  # two slots of an AdamW bucket of at most 1024 elements (test_ooc_node.py)
LINE = re.compile(
    r"node (\d+): state out of core: read ([\d.]+ \w+)/s, written ([\d.]+ \w+)/s, "
    r"I/O wait ([\d.]+) s(?:/step| \(no step finished\)), buffers ([\d.]+ \w+) of ([\d.]+ \w+) \((\d+)%\)"
)


@pytest.mark.timeout(300)
def test_top_shows_the_state_traffic_of_the_out_of_core_node_only(tmp_path):
    def state_args(i: int) -> list[str]:
        if i:
            return []
        return [
            "--node.state_dir",
            str(tmp_path / "state"),
            "--node.state_memory_bytes",
            str(BUDGET),
        ]

    with luwu.local_cluster(2, per_node_args=state_args) as c:
        spec = {"steps": 4, "bucket_bytes": 2048, "nodes": c.addresses, "world_size": 2}
        spec["out"] = str(tmp_path / f"result-{time.monotonic_ns()}")
        wait_all(start_workers(STREAM, spec, 2, tmp_path), 150)
        top = subprocess.run(
            [sys.executable, "-m", "luwu", "top", "--cluster.nodes=" + ",".join(c.addresses)]
            + [f"--cluster.job={c.job}", "--iterations", "2", "--interval", "0.3"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=dict(os.environ, COLUMNS="200"),  # the join secret: in the environment while open
        )
    assert top.returncode == 0, top.stderr
    frames = top.stdout.split("luwu top")[1:]
    assert len(frames) == 2 and all("2/2 nodes up" in f for f in frames), top.stdout
    lines = [LINE.findall(f) for f in frames]
    assert [len(x) for x in lines] == [1, 1], top.stdout  # node 0 alone, in both refreshes
    node, read, written, wait, held, budget, pct = lines[0][0]
    assert node == "0" and "node 1: state" not in top.stdout
    # the first refresh has no earlier sample: rates since the node started, wait over its 4 steps
    assert float(read.split()[0]) > 0 and float(written.split()[0]) > 0, lines[0]
    assert float(wait) >= 0 and budget == human_bytes(BUDGET) and 0 <= int(pct) <= 100, lines[0]
    # the second: between the samples, where nothing was read or written
    assert lines[1][0][1:3] == ("0 B", "0 B"), lines[1]

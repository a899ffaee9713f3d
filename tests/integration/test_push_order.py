"""A node that bounds its pushes in flight gets every worker's pushes in the same order, real processes.

Two streaming workers push each step's buckets as backward makes them; a worker whose send queue backs
up would reorder its pushes by priority (the first layers' first), and so each worker would reach the
node in an order of its own. A node with ``node.push_memory_bytes`` says ``in_order`` in its WELCOME
and the workers keep the order pushes were made: the node completes a bucket before it must open many,
so a budget of two buckets' full sets of pushes holds with no overdraft (with the workers' own orders
the same run overdraws about 160 times and peaks near 60 KiB, 3.7x the budget), and the weights equal
an in-RAM node's without a budget bit for bit (compression off).
"""

import socket
import time
import urllib.request

import pytest
import torch
from harness import ROOT, start_workers, wait_all

import luwu

STREAM = ROOT / "workers" / "stream.py"
SPEC = {"steps": 8, "blocks": 8, "width": 32, "bucket_bytes": 2048, "timeout_s": 60}
NEED = 512 * 4 * (2 + 2)  # a 2 KiB bucket's accumulator, 2 workers' fp32 pushes and its reply
PUSHES = 2 * NEED
WINDOW = 2 * 2 * 4 * 4096  # the state window: a few buckets' slots


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inflight_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("luwu_node_inflight")
    }


def _stream(nodes: list[str], tmp) -> list[dict]:
    spec = dict(SPEC, nodes=nodes, world_size=2, out=str(tmp / f"result-{time.monotonic_ns()}"))
    wait_all(start_workers(STREAM, spec, 2, tmp), 200)
    return [torch.load(f"{spec['out']}.rank{r}")["params"] for r in range(2)]


@pytest.mark.timeout(400)
def test_streaming_workers_push_in_one_order_to_a_budgeted_node_and_it_never_overdraws(tmp_path):
    with luwu.local_cluster(1) as c:
        want = _stream(c.addresses, tmp_path)
    port = _free_port()
    args = [
        *("--node.state_dir", str(tmp_path / "state")),
        *("--node.state_memory_bytes", str(WINDOW + PUSHES)),
        *("--node.push_memory_bytes", str(PUSHES)),
        *("--metrics.port", str(port)),
    ]
    with luwu.local_cluster(1, node_args=args) as c:
        got = _stream(c.addresses, tmp_path)
        m = _inflight_metrics(port)
    for rank in range(2):
        for name, w in want[rank].items():
            torch.testing.assert_close(
                got[rank][name], w, rtol=0, atol=0, msg=lambda s, name=name: f"{name}: {s}"
            )
    assert m["luwu_node_inflight_limit_bytes"] == PUSHES, m
    assert m["luwu_node_inflight_overdrafts_total"] == 0, m
    # the peak also counts the replies to the units' weight fetches (PULLs), which the budget does not
    # hold back: a few KiB here; with the workers' own orders it was 3.7x the budget
    assert 0 < m["luwu_node_inflight_peak_bytes"] <= 1.5 * PUSHES, m
    assert m["luwu_node_inflight_blocked_seconds_total"] > 0, m  # the budget did bind

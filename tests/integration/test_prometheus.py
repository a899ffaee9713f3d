"""A real Prometheus server scrapes a short training: node and worker series arrive.

Two node daemons (metrics on) and two worker processes running
deploy/train_example.py (metrics on, kept alive until scraped); Prometheus is
started directly (never as a service) on loopback with a scrape config written
here, and its HTTP API is queried until the luwu series of both nodes and both
workers are there.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import luwu

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "deploy" / "train_example.py"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the `prometheus` binary is not installed: `apt-get install -y prometheus` (Debian package; scripts/setup.sh installs it)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hostport(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def start_worker(
    rank: int, world: int, cluster_file: Path, steps: int
) -> tuple[subprocess.Popen, queue.Queue]:
    env = dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable,
        str(TRAIN),
        "--config",
        str(cluster_file),
        "--steps",
        str(steps),
        "--batch",
        "16",
        "--linger-s",
        "90",
        "--transport.bucket_bytes=16384",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def wait_line(lines: queue.Queue, prefix: str, timeout_s: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            raise AssertionError(
                f"no {prefix} line within {timeout_s} s; output:\n{''.join(seen)[-3000:]}"
            )
        seen.append(line)
        if line.startswith(prefix):
            return line.split(maxsplit=1)[1].strip()


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.timeout(150)
def test_prometheus_scrapes_nodes_and_workers(tmp_path):
    workers: list[subprocess.Popen] = []
    prom = None
    outputs: list[list[str]] = [[], []]
    try:
        with luwu.local_cluster(2, job="promtest", node_args=["--metrics.port", "0"]) as cluster:
            assert len(cluster.metrics_urls) == 2, cluster.metrics_urls
            cluster_file = tmp_path / "cluster.toml"
            cluster_file.write_text(
                f'[cluster]\njob = "promtest"\nnodes = {json.dumps(cluster.addresses)}\n'
            )
            started = [start_worker(r, 2, cluster_file, steps=30) for r in range(2)]
            workers = [p for p, _ in started]
            worker_urls = [
                wait_line(lines, "LUWU_WORKER_METRICS", 60, outputs[r])
                for r, (_, lines) in enumerate(started)
            ]

            node_targets = [hostport(u) for u in cluster.metrics_urls]
            worker_targets = [hostport(u) for u in worker_urls]
            config = {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "scrape_configs": [
                    {"job_name": "luwu-nodes", "static_configs": [{"targets": node_targets}]},
                    {"job_name": "luwu-workers", "static_configs": [{"targets": worker_targets}]},
                ],
            }
            config_file = tmp_path / "prometheus.yml"
            config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            prom_log = open(tmp_path / "prometheus.log", "wb")
            prom = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=prom_log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

            for r, (_, lines) in enumerate(started):  # Prometheus starts up meanwhile
                wait_line(lines, "LUWU_WORKER_DONE", 60, outputs[r])

            # What must arrive, from every node and every worker.
            want = {
                "luwu_node_pushes_total": ("luwu-nodes", node_targets),
                "luwu_node_updates_applied_total": ("luwu-nodes", node_targets),
                "luwu_node_connected_workers": ("luwu-nodes", node_targets),
                "luwu_worker_steps_total": ("luwu-workers", worker_targets),
                "luwu_worker_bytes_pushed_total": ("luwu-workers", worker_targets),
                "luwu_worker_step_seconds_count": ("luwu-workers", worker_targets),
                "luwu_prefetch_batches_consumed_total": ("luwu-workers", worker_targets),
            }
            deadline = time.monotonic() + 60
            got: dict[str, dict[str, float]] = {}
            while time.monotonic() < deadline:
                assert prom.poll() is None, (
                    f"prometheus exited with {prom.returncode}:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}"
                )
                try:
                    for name, (job, _) in want.items():
                        got[name] = {
                            r["metric"]["instance"]: float(r["value"][1])
                            for r in query(base, f'{name}{{job="{job}"}}')
                        }
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.5)  # not listening yet
                    continue
                if all(set(got.get(n, {})) == set(targets) for n, (_, targets) in want.items()):
                    break
                time.sleep(0.5)
            missing = {
                n: sorted(set(t) - set(got.get(n, {})))
                for n, (_, t) in want.items()
                if set(got.get(n, {})) != set(t)
            }
            assert not missing, (
                f"series not scraped within the deadline: {missing}; prometheus log:\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}"
            )
            # Values, not just names: both nodes own buckets (bucket_bytes 16 KiB), so both took pushes from
            # both workers and applied updates; each worker consumed its 30 batches through the Prefetcher.
            for name in ("luwu_node_pushes_total", "luwu_node_updates_applied_total"):
                assert all(v > 0 for v in got[name].values()), f"{name} is 0 on a node: {got[name]}"
            assert sorted(got["luwu_node_connected_workers"].values()) == [2.0, 2.0]
            assert sorted(got["luwu_prefetch_batches_consumed_total"].values()) == [30.0, 30.0]
            up = query(base, "up")
            assert (
                sorted((r["metric"]["job"], r["value"][1]) for r in up)
                == [("luwu-nodes", "1")] * 2 + [("luwu-workers", "1")] * 2
            )

            # Every query of the Grafana dashboard parses and runs on a real server.
            dashboard = json.loads(
                (ROOT / "deploy" / "grafana" / "luwu-dashboard.json").read_text()
            )
            exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
            assert len(exprs) > 20
            for expr in exprs:
                try:
                    query(base, expr.replace("$__rate_interval", "1m"))
                except urllib.error.HTTPError as exc:  # 400: the query does not parse
                    raise AssertionError(
                        f"dashboard query {expr!r}: {exc.read().decode()}"
                    ) from None
            step = query(base, "min(luwu_node_step)")
            assert (
                step and float(step[0]["value"][1]) == 30.0
            )  # the dashboard's first stat: both nodes at step 30
    finally:
        stop(prom)
        for w in workers:
            stop(w)


@pytest.mark.timeout(60)
def test_idle_metrics_connections_are_closed(monkeypatch):
    """A scraper that connects and sends nothing holds a thread only until the idle timeout."""
    from prometheus_client import CollectorRegistry

    from luwu.protocol import metrics

    monkeypatch.setattr(metrics, "IDLE_TIMEOUT_S", 0.5)
    server, port = metrics.serve_metrics(CollectorRegistry(), port=0)
    try:
        base = threading.active_count()
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for c in conns:  # each idle connection is closed by the server after the timeout
            c.settimeout(10)
            assert c.recv(1) == b""
            c.close()
        deadline = time.monotonic() + 10
        while threading.active_count() > base and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= base, "idle connections still hold threads"
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_reach_its_node_exits_with_metrics_on():
    """The constructor fails (no node there) with /metrics served: the process still exits promptly."""
    code = (
        "import torch, luwu\n"
        "from luwu.gpu_workers.config import TransportConfig\n"
        "m = torch.nn.Linear(4, 4)\n"
        "try:\n"
        "    luwu.RemoteOptimizer(m.parameters(), nodes=['tcp://127.0.0.1:9'], lr=0.1, rank=0, world_size=1, metrics_port=0,\n"
        "                        transport=TransportConfig(connect_timeout_s=1.0, timeout_s=1.0))\n"
        "except luwu.NodeTimeoutError as exc:\n"
        "    print('refused:', exc)\n"
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45)
    assert r.returncode == 0 and "refused:" in r.stdout, r.stderr[-2000:]
    assert time.monotonic() - t0 < 30

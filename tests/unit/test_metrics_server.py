"""The /metrics and /healthz endpoint of nodes and workers (``serve_metrics``), over real HTTP on
loopback: its routes, that /metrics is prometheus_client's own exposition (compression, name
filter), that idle connections are closed quietly, and that shutdown is prompt."""

from __future__ import annotations

import gzip
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from luwu.protocol import metrics
from luwu.protocol.metrics import MetricsFactory, serve_metrics


def _get(url: str, headers: dict | None = None):
    """(status, headers, body) of a GET, HTTP errors included."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


@pytest.mark.timeout(30)
def test_healthz_503_with_detail_404_elsewhere_and_prompt_shutdown():
    """Unhealthy: /healthz answers 503 with the detail; other paths 404; shutdown returns within 2 s
    and the port is closed after it."""
    state = {"ok": True}

    def health():
        return state["ok"], {"node": 3, "step": 7}

    server, port = serve_metrics(CollectorRegistry(), port=0, health=health)
    base = f"http://127.0.0.1:{port}"
    try:
        status, headers, body = _get(f"{base}/healthz")
        assert status == 200 and json.loads(body) == {"ok": True, "node": 3, "step": 7}
        state["ok"] = False
        status, headers, body = _get(f"{base}/healthz")
        assert status == 503, body
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body) == {"ok": False, "node": 3, "step": 7}
        for path in ("/", "/metricsx", "/healthz/x", "/favicon.ico"):
            status, _, body = _get(base + path)
            assert status == 404 and b"/metrics" in body, path
    finally:
        t0 = time.monotonic()
        server.shutdown()
        elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"shutdown took {elapsed:.2f} s"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.timeout(30)
def test_metrics_is_prometheus_clients_exposition():
    """/metrics is prometheus_client's app: it gzips for a scraper that accepts it and honours the
    ``name[]`` filter, so only the asked series travel."""
    factory = MetricsFactory("unittest", CollectorRegistry())
    factory.counter("pushes_total", "Pushes seen.").inc(5)
    factory.gauge("step", "Current step.").set(11)
    server, port = serve_metrics(factory.registry, port=0)
    base = f"http://127.0.0.1:{port}"
    try:
        status, headers, body = _get(f"{base}/metrics")
        text = body.decode()
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        assert "luwu_unittest_pushes_total 5.0" in text and "luwu_unittest_step 11.0" in text
        status, headers, body = _get(f"{base}/metrics", {"Accept-Encoding": "gzip"})
        assert status == 200 and headers["Content-Encoding"] == "gzip"
        assert "luwu_unittest_step 11.0" in gzip.decompress(body).decode()
        status, _, body = _get(f"{base}/metrics?name[]=luwu_unittest_step")
        assert "luwu_unittest_step 11.0" in body.decode()
        assert "luwu_unittest_pushes_total" not in body.decode()
    finally:
        server.shutdown()


@pytest.mark.timeout(30)
def test_idle_connection_is_closed_without_a_traceback(monkeypatch, capfd):
    """A client that connects and sends nothing is disconnected after IDLE_TIMEOUT_S, with nothing
    written to stderr (no per-request logging, no traceback for the timeout)."""
    monkeypatch.setattr(metrics, "IDLE_TIMEOUT_S", 0.3)
    server, port = serve_metrics(CollectorRegistry(), port=0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            assert idle.recv(1) == b""
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200
        time.sleep(0.2)  # let the idle connection's thread finish writing, had it anything to write
    finally:
        server.shutdown()
    assert capfd.readouterr().err == ""

"""The one factory every Prometheus metric of LuWu is made with.

Names are ``luwu_<part>_<what>_<unit>``; counters end in ``_total``. Each
component takes a registry (tests pass a fresh ``CollectorRegistry``) and reads
values back with ``registry.get_sample_value``. Recording is a cheap add.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets for latencies from sub-millisecond pushes to multi-second steps.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MetricsFactory:
    """Creates metrics named ``luwu_<part>_...`` in one registry."""

    def __init__(self, part: str, registry: CollectorRegistry | None = None):
        if not part.isidentifier():
            raise ValueError(f"metrics part must be an identifier, got {part!r}")
        self.part = part
        self.registry = registry if registry is not None else CollectorRegistry()
        self.names: list[str] = []

    def _name(self, what: str) -> str:
        name = f"luwu_{self.part}_{what}"
        self.names.append(name)
        return name

    def counter(self, what: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        if not what.endswith("_total"):
            raise ValueError(f"counter {what!r} must end in _total")
        # prometheus_client appends _total itself; give it the bare name.
        return Counter(self._name(what)[: -len("_total")], doc, labels, registry=self.registry)

    def gauge(self, what: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(self._name(what), doc, labels, registry=self.registry)

    def histogram(self, what: str, doc: str, labels: tuple[str, ...] = (), buckets=SECONDS_BUCKETS) -> Histogram:
        return Histogram(self._name(what), doc, labels, registry=self.registry, buckets=buckets)


IDLE_TIMEOUT_S = 10.0
"""Seconds a /metrics connection may stay idle before it is closed (and its thread ends)."""


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, health=None):
    """Serve ``/metrics`` (Prometheus text format) and ``/healthz`` from a daemon thread.

    ``health`` returns (ok, detail dict) for ``/healthz``. Returns (server, bound port); call
    ``server.shutdown()`` to stop: it returns within a couple of seconds even at interpreter exit,
    when the serving thread may be gone already. A connection idle for ``IDLE_TIMEOUT_S`` is closed,
    so idle scrapers hold no thread for long.
    """
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_TIMEOUT_S  # the socket timeout of each connection (StreamRequestHandler)

        def do_GET(self):  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if path == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif path == "/healthz":
                ok, detail = health() if health else (True, {})
                body, ctype, code = json.dumps({"ok": ok, **detail}).encode(), "application/json", 200 if ok else 503
            else:
                body, ctype, code = b"not found: try /metrics or /healthz\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # no per-request logging
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def shutdown(self) -> None:
            """Stop serving without waiting forever for a thread that may have died with the interpreter."""
            self._BaseServer__shutdown_request = True  # what BaseServer.shutdown sets, minus its unbounded wait
            thread.join(timeout=2.0)
            self.server_close()

    server = Server((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="luwu-metrics", daemon=True)
    thread.start()
    return server, server.server_address[1]

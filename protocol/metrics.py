"""The one factory every Prometheus metric of LuWu is made with.

Names are ``luwu_<part>_<what>_<unit>``; counters end in ``_total``. Each
component takes a registry (tests pass a fresh ``CollectorRegistry``) and reads
values back with ``registry.get_sample_value``. Recording is a cheap add.
"""

from __future__ import annotations

import json
import threading
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

# Buckets for latencies from sub-millisecond pushes to multi-second steps.
SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


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

    def histogram(
        self, what: str, doc: str, labels: tuple[str, ...] = (), buckets=SECONDS_BUCKETS
    ) -> Histogram:
        return Histogram(self._name(what), doc, labels, registry=self.registry, buckets=buckets)


IDLE_TIMEOUT_S = 10.0
"""Seconds a /metrics connection may stay idle before it is closed (and its thread ends)."""


class _Handler(_SilentHandler):
    """prometheus_client's silent WSGI handler, with a deadline on idle connections.

    Each connection gets its own thread; a scraper that connects and sends nothing would hold one
    forever, so the socket times out after ``IDLE_TIMEOUT_S`` (read per connection) and the
    connection is closed without a traceback.
    """

    def setup(self) -> None:
        self.timeout = IDLE_TIMEOUT_S  # StreamRequestHandler applies it to the socket
        super().setup()

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:  # idle connection: close it quietly
            pass


class _Server(ThreadingWSGIServer):
    """prometheus_client's thread-per-request WSGI server, with a shutdown that cannot hang."""

    thread: threading.Thread | None = None

    def shutdown(self) -> None:
        """Stop serving without waiting forever for a thread that may have died with the interpreter."""
        self._BaseServer__shutdown_request = (
            True  # what BaseServer.shutdown sets, minus its unbounded wait
        )
        if self.thread is not None:
            self.thread.join(timeout=2.0)
        self.server_close()


def _text(start_response, status: str, ctype: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
    return [body]


def metrics_app(registry: CollectorRegistry, health=None):
    """WSGI app: ``/metrics`` is prometheus_client's own app, ``/healthz`` answers
    ``{"ok": ..., **detail}`` (200 when ok, else 503), any other path 404."""
    prometheus = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return prometheus(environ, start_response)
        if path == "/healthz":
            ok, detail = health() if health else (True, {})
            status = "200 OK" if ok else "503 Service Unavailable"
            body = json.dumps({"ok": ok, **detail}).encode()
            return _text(start_response, status, "application/json", body)
        body = b"not found: try /metrics or /healthz\n"
        return _text(start_response, "404 Not Found", "text/plain", body)

    return app


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, health=None):
    """Serve ``/metrics`` (Prometheus text format) and ``/healthz`` from a daemon thread.

    The server is prometheus_client's (as ``start_http_server`` builds it), serving
    :func:`metrics_app`. ``health`` returns (ok, detail dict) for ``/healthz``. Returns (server,
    bound port); call ``server.shutdown()`` to stop: it returns within a couple of seconds even at
    interpreter exit, when the serving thread may be gone already. A connection idle for
    ``IDLE_TIMEOUT_S`` is closed, so idle scrapers hold no thread for long.
    """
    family, addr = _get_best_family(host, port)
    server_class = type("_MetricsServer", (_Server,), {"address_family": family})
    server = make_server(
        addr, port, metrics_app(registry, health), server_class, handler_class=_Handler
    )
    server.thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="luwu-metrics", daemon=True
    )
    server.thread.start()
    return server, server.server_address[1]

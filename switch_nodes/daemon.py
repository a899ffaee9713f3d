"""Running a node in the foreground: event loop, signals, clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal

from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.lines import METRICS_LINE
from luwu.switch_nodes.server import NodeServer

__all__ = ["METRICS_LINE", "run_node"]

log = logging.getLogger(__name__)


def run_node(cfg: NodeConfig, *, job: str, registry=None, metrics=None, on_start=None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep the node usable without it
        runner = asyncio.run
    server = NodeServer(cfg, job=job, registry=registry)
    http = None
    if metrics is not None and metrics.port >= 0:
        from luwu.protocol.metrics import serve_metrics

        def health():
            st = server.stats()
            return server.address is not None, {"step": st["step"], "workers": st["workers"], "node": st["node"]}

        http, port = serve_metrics(server.metrics.registry, metrics.host, metrics.port, health)
        print(f"{METRICS_LINE} http://{metrics.host}:{port}", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        server.bind()
        if on_start is not None:
            on_start(server)
        await server.serve()

    try:
        runner(main())
    finally:
        if http is not None:
            http.shutdown()
    log.info("node %s stopped", server.index)
    return 0

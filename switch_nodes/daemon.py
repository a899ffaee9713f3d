"""Running a node in the foreground: event loop, signals, clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal

from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.server import NodeServer

log = logging.getLogger(__name__)


def run_node(cfg: NodeConfig, *, job: str, registry=None, metrics=None, on_start=None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep the node usable without it
        runner = asyncio.run
    server = NodeServer(cfg, job=job, registry=registry)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        server.bind()
        if on_start is not None:
            on_start(server)
        await server.serve()

    runner(main())
    log.info("node %s stopped", server.index)
    return 0

"""Running a node in the foreground: event loop, signals, clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal

from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.lines import METRICS_LINE
from luwu.switch_nodes.server import NodeServer

__all__ = ["METRICS_LINE", "check_gate", "run_node"]

log = logging.getLogger(__name__)


def check_gate(cfg: NodeConfig) -> str:
    """Refuse a node that would serve anyone who reaches its port, unless told so: then the warning to
    log once it is bound ('' for a node with a gate)."""
    if cfg.gate:
        return ""
    if not cfg.insecure_open:
        raise ConfigError(
            f"node at {cfg.bind} has no gate: any local user could join the job and make it allocate. Give it a join secret "
            "(LUWU_NODE__JOIN_SECRET, 32+ characters; `luwu node` and `luwu up` make one) or CURVE keys (luwu keys), "
            "or set node.insecure_open = true to serve anyone"
        )
    return "is OPEN (node.insecure_open): anyone who reaches the port may join the job, claim ranks and make the node allocate; use a join secret or CURVE keys unless this machine has one user"


def run_node(cfg: NodeConfig, *, job: str, registry=None, metrics=None, on_start=None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code. A node without a gate (join secret,
    CURVE keys) refuses to start unless ``cfg.insecure_open``, which is warned once."""
    open_warning = check_gate(cfg)
    try:
        import uvloop

        runner = uvloop.run
    except (
        ImportError
    ):  # pragma: no cover - uvloop is a dependency; keep the node usable without it
        runner = asyncio.run
    server = NodeServer(cfg, job=job, registry=registry)
    http = None
    if metrics is not None and metrics.port >= 0:
        from luwu.protocol.metrics import serve_metrics

        def health():
            st = server.stats()
            return server.address is not None, {
                "step": st["step"],
                "workers": st["workers"],
                "node": st["node"],
            }

        http, port = serve_metrics(server.metrics.registry, metrics.host, metrics.port, health)
        print(f"{METRICS_LINE} http://{metrics.host}:{port}", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        server.bind()
        if open_warning:
            log.warning("node at %s %s", server.address, open_warning)
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

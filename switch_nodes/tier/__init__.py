"""The switch tier: aggregators that sum a group's pushes before the nodes (``luwu aggregator``).

A flat node receives every worker's push of its shard and sends every worker its reply. An
aggregator in front of a group of workers sums the group's pushes of each (step, bucket) in the
node's own order (:mod:`.group_sums`) and sends one, and receives each reply once and passes it to
each of its workers (:mod:`.server`): node traffic falls by the group's size, and a job trained
through aggregators has the bits of one trained without them (compression off).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.daemon import check_gate
from luwu.switch_nodes.lines import METRICS_LINE
from luwu.switch_nodes.tier.server import AggregatorServer

__all__ = ["AggregatorServer", "run_aggregator"]

log = logging.getLogger(__name__)


def run_aggregator(
    cfg: NodeConfig,
    *,
    job: str,
    nodes: list[str],
    group: tuple[int, ...],
    upstream_secret: str,
    upstream_curve: tuple[str, str, str] | None = None,
    metrics=None,
    compression=None,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code. Like a node, an aggregator without a
    gate (its listener's join secret ``cfg.join_secret``, or its CURVE keys) refuses to start unless
    ``cfg.insecure_open``. ``upstream_curve``: (the nodes' public key, its own public and secret key) to
    show the nodes instead of ``upstream_secret``.
    ``metrics`` (a ``MetricsConfig``): its ``/metrics`` on ``metrics.port`` (-1: none);
    ``compression``: its uplink's policy (a ``CompressionConfig``)."""
    open_warning = check_gate(cfg)
    server = AggregatorServer(
        cfg,
        job=job,
        nodes=nodes,
        group=group,
        upstream_secret=upstream_secret,
        upstream_curve=upstream_curve,
        compression=compression,
    )
    if metrics is not None and metrics.port >= 0:
        from luwu.protocol.metrics import serve_metrics

        def health():
            return server.address is not None, {"workers": server.num_workers}

        _, port = serve_metrics(server.metrics.registry, metrics.host, metrics.port, health)
        print(f"{METRICS_LINE} http://{metrics.host}:{port}", flush=True)

    async def main() -> None:
        server.bind()
        if open_warning:
            log.warning("aggregator at %s %s", server.address, open_warning)
        serving = asyncio.ensure_future(server.serve())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, serving.cancel)
        try:
            await serving
        except asyncio.CancelledError:
            pass

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(main())
    return 0

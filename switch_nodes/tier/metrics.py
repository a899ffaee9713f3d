"""An aggregator's Prometheus metrics (``luwu_aggregator_*``): what the tier moves and saves.

Bytes are payload bytes, as the nodes count theirs (``luwu_node_bytes_received_total``): from and to
the group's workers (``direction="workers"``) and from and to the nodes (``direction="nodes"``), so
the tier's saving is ``workers / nodes`` of ``bytes_received_total{op="push"}``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from luwu.protocol.metrics import MetricsFactory

__all__ = ["AggregatorMetrics"]


class AggregatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        f = MetricsFactory("aggregator", registry)
        self.registry = f.registry
        self.bytes_in = f.counter(
            "bytes_received_total",
            "Payload bytes received, by op and from whom",
            ("op", "direction"),
        )
        self.bytes_out = f.counter(
            "bytes_sent_total", "Payload bytes sent, by op and to whom", ("op", "direction")
        )
        self.summed = f.counter("pushes_summed_total", "Workers' pushes folded into a group's sum")
        self.sums = f.counter("sums_sent_total", "Summed pushes sent to the nodes (one per block)")
        self.passed = f.counter(
            "pushes_passed_total",
            "Workers' pushes passed to the nodes as they came (a block of one)",
        )
        self.late = f.counter(
            "blocks_late_total",
            "Blocks sent up as what they had (partial sums, pushes as they came): a rank was late",
        )
        self.fetches_shared = f.counter(
            "fetches_shared_total",
            "Workers' PULLs answered with another's in flight (streaming fetches sent up once)",
        )
        self.fanned = f.counter(
            "replies_fanned_out_total", "Replies received once and passed to several workers"
        )
        self.group_wait = f.histogram(
            "group_wait_seconds",
            "Seconds from the first to the last push of a block of a (step, bucket)",
        )
        self.workers = f.gauge(
            "connected_workers", "Worker connections welcomed through this aggregator"
        )
        self.errors = f.counter("errors_total", "Messages refused, by error code", ("code",))

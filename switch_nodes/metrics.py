"""Prometheus metrics of a node (``luwu_node_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from luwu.protocol.metrics import MetricsFactory


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        f = MetricsFactory("node", registry)
        self.registry = f.registry
        self.bytes_in = f.counter(
            "bytes_received_total", "Payload bytes received (on the wire)", ("op",)
        )
        self.bytes_out = f.counter("bytes_sent_total", "Payload bytes sent (on the wire)", ("op",))
        self.raw_in = f.counter(
            "raw_bytes_received_total", "fp32 bytes the received payloads stand for", ("op",)
        )
        self.raw_out = f.counter(
            "raw_bytes_sent_total", "fp32 bytes the sent payloads stand for", ("op",)
        )
        self.pushes = f.counter("pushes_total", "Gradient pushes accepted")
        self.duplicates = f.counter(
            "duplicate_pushes_total", "Retried pushes recognised and not counted again"
        )
        self.updates = f.counter("updates_applied_total", "Bucket updates applied by the optimizer")
        self.skipped = f.counter(
            "steps_skipped_total", "Bucket steps skipped (non-finite gradient)"
        )
        self.errors = f.counter("errors_total", "Messages refused, by error code", ("code",))
        self.opt_seconds = f.histogram(
            "optimizer_step_seconds", "Seconds of one bucket's optimizer step (incl. reply encode)"
        )
        self.agg_wait = f.histogram(
            "aggregation_wait_seconds",
            "Seconds from the first to the last push of a (step, bucket)",
        )
        self.workers = f.gauge("connected_workers", "Workers that said HELLO and are alive")
        self.step = f.gauge("step", "Lowest bucket version held by this node (steps applied)")
        self.staleness = f.gauge(
            "staleness_steps", "Steps between the fastest and the slowest worker (async mode)"
        )
        self.checkpoint_age = f.gauge(
            "checkpoint_age_seconds", "Seconds since the last checkpoint was written"
        )
        self.checkpoint_step = f.gauge("checkpoint_step", "Step of the last checkpoint written")
        self.dropped_workers = f.counter(
            "dropped_workers_total", "Workers dropped from a step (elastic mode)"
        )
        # out-of-core state (node.state_dir): what the window moved, waited for and holds
        self.state_read = f.counter(
            "state_bytes_read_total", "Bytes of the shard's state read from node.state_dir"
        )
        self.state_written = f.counter(
            "state_bytes_written_total", "Bytes of the shard's state written to node.state_dir"
        )
        self.state_stall = f.counter(
            "state_io_wait_seconds_total",
            "Seconds the optimizer thread waited for a bucket's state to be read (or for memory)",
        )
        self.state_resident = f.gauge(
            "state_buffer_bytes", "Bytes of the state window's buffers holding buckets' state"
        )
        self.state_budget = f.gauge(
            "state_memory_bytes",
            "node.state_memory_bytes: the state window's and the pushes' budget (0: in RAM)",
        )
        self._inflight(f)
        self.names = list(f.names)

    def _inflight(self, f: MetricsFactory) -> None:
        """The pushes in flight (node.push_memory_bytes): what they hold, how long pushes waited."""
        self.inflight = f.gauge(
            "inflight_bytes",
            "Bytes the pushes in flight hold: open (step, bucket)s (accumulator, pushes, reply) and replies not yet sent",
        )
        self.inflight_peak = f.gauge(
            "inflight_peak_bytes",
            "The most inflight_bytes held at once (a two-phase step on a node that does not spill its "
            "sums holds all its buckets until COMMIT, past node.push_memory_bytes)",
        )
        self.inflight_limit = f.gauge(
            "inflight_limit_bytes", "node.push_memory_bytes resolved (0: no bound)"
        )
        self.inflight_blocked = f.counter(
            "inflight_blocked_seconds_total",
            "Seconds a push waited unread for node.push_memory_bytes to have room",
        )
        self.spill_written = f.counter(
            "spill_bytes_written_total",
            "Bytes of two-phase gradient sums written to the scratch file under node.state_dir while "
            "they wait for COMMIT",
        )
        self.spill_read = f.counter(
            "spill_bytes_read_total", "Bytes of two-phase gradient sums read back at COMMIT"
        )
        self.inflight_overdrafts = f.counter(
            "inflight_overdrafts_total",
            "Memory let in past node.push_memory_bytes because nothing in flight could be released "
            "without it, by what: push (a worker's push, workers pushing in different orders), fetch "
            "(the answer to a weight fetch) or sum (a spilled two-phase sum the optimizer needs now)",
            ("why",),
        )
        for why in ("push", "fetch", "sum"):
            self.inflight_overdrafts.labels(why)  # (each shown from the start, at 0)

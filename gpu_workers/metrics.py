"""Prometheus metrics of a worker (``luwu_worker_*``) and of its data prefetch (``luwu_prefetch_*``)."""

from __future__ import annotations

import threading
import time
import types
import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from luwu.protocol.metrics import MetricsFactory


@dataclass(slots=True)
class StepReport:
    """What one step found out: whether the nodes skipped it and the gradient norm (the same on every
    worker), and how long this worker waited for the nodes."""

    step: int
    skipped: bool = False
    grad_norm: float | None = None
    """Norm of the unscaled averaged gradient (only with the two-phase round: clipping or AMP)."""
    push_wait_s: float = 0.0
    """Seconds waited for the partial gradient norms (two-phase round)."""
    update_wait_s: float = 0.0
    """Seconds waited for the new weights (writing them in excluded)."""
    delayed: bool = False
    """The step's delayed buckets land a step late (delayed update past its warm-up)."""
    fetch_wait_s: float = 0.0
    """Streaming mode: seconds forward and backward waited for streamed units' weights this step."""


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, rank: int = 0):
        f = MetricsFactory("worker", registry)
        self.registry = f.registry
        self.bytes_pushed = f.counter(
            "bytes_pushed_total", "Gradient payload bytes pushed (on the wire)"
        )
        self.raw_pushed = f.counter(
            "raw_bytes_pushed_total", "fp32 bytes the pushed gradients stand for"
        )
        self.bytes_pulled = f.counter(
            "bytes_pulled_total", "Weight payload bytes received (on the wire)"
        )
        self.raw_pulled = f.counter(
            "raw_bytes_pulled_total", "fp32 bytes the received weights stand for"
        )
        self.pushes = f.counter("pushes_total", "Bucket pushes sent")
        self.steps = f.counter("steps_total", "Optimizer steps completed")
        self.skipped = f.counter(
            "steps_skipped_total", "Steps the nodes skipped (non-finite gradient somewhere)"
        )
        self.encode_seconds = f.counter(
            "encode_seconds_total", "Seconds spent compressing gradients"
        )
        self.decode_seconds = f.counter("decode_seconds_total", "Seconds spent decoding weights")
        self.compression_ratio = f.gauge(
            "compression_ratio", "raw / wire bytes of the pushes of the last step"
        )
        # per-step breakdown (seconds of the last step and histograms)
        self.compute = f.histogram(
            "compute_seconds",
            "Seconds of forward+backward per step (between step() calls, minus waits)",
        )
        self.push_wait = f.histogram(
            "push_wait_seconds", "Seconds step() waited for pushes / global norms"
        )
        self.update_wait = f.histogram(
            "update_wait_seconds", "Seconds step() waited for the new weights"
        )
        self.data_wait = f.histogram(
            "data_wait_seconds", "Seconds the training loop waited for data (from the Prefetcher)"
        )
        self.step_seconds = f.histogram("step_seconds", "Wall seconds per training step")
        self.staleness = f.gauge(
            "staleness_steps",
            "Steps between the weights used and the newest (delayed update / async)",
        )
        self.errors = f.counter(
            "errors_total", "Errors raised to the training loop, by code", ("code",)
        )
        self._stream_and_link_metrics(f)
        self.names = list(f.names)
        # the I/O thread's byte totals and the time at the last step's record
        self._last = (0, 0, None)

    def _stream_and_link_metrics(self, f: MetricsFactory) -> None:
        """Streaming mode's waits for weights, and the node links as the codec policy sees them."""
        # streaming mode: how long forward and backward waited for the weights of streamed units
        self.fetch_wait = f.histogram(
            "fetch_wait_seconds",
            "Seconds per step forward and backward waited for streamed units' weights",
        )
        self.unit_fetch_wait = f.counter(
            "unit_fetch_wait_seconds_total",
            "Seconds waited for the weights of each streamed unit",
            ("unit",),
        )
        self.unit_fetches = f.counter(
            "unit_fetches_total",
            "Weight fetches of each streamed unit (forward and backward)",
            ("unit",),
        )
        # the link to each node as the compression policy decides at it (luwu.gpu_workers.links)
        self.link_gbps = f.gauge(
            "link_gbps",
            "Gbit/s the compression policy decides each node link's codecs at: told, or measured (compression.link_gbps = auto)",
            ("node",),
        )
        self.link_measured = f.gauge(
            "link_measured_gbps",
            "Last measurement of each node link, Gbit/s: the probe, or the real traffic where faster (auto only)",
            ("node",),
        )
        self.link_buckets = f.gauge(
            "link_buckets",
            "Buckets of each node link by the codec decided for them after the warm-up, pushes and replies",
            ("node", "direction", "codec"),
        )

    def record_step(
        self, report, sent: int, received: int, raw: int, data_wait_s: float | None
    ) -> None:
        """One step's metrics: the byte counters from the I/O thread's totals (``sent``, ``received``), ``raw``
        fp32 bytes each way, and the step-time breakdown from its ``StepReport`` (``data_wait_s``: from a
        Prefetcher, None without one)."""
        now = time.perf_counter()
        prev_sent, prev_received, prev_t = self._last
        self.bytes_pushed.inc(sent - prev_sent)
        self.bytes_pulled.inc(received - prev_received)
        self.raw_pushed.inc(raw)
        self.raw_pulled.inc(raw)
        if sent > prev_sent:
            self.compression_ratio.set(raw / (sent - prev_sent))
        self.steps.inc()
        if report.skipped:
            self.skipped.inc()
        if data_wait_s is not None:
            self.data_wait.observe(data_wait_s)
        self.push_wait.observe(report.push_wait_s)
        self.update_wait.observe(report.update_wait_s)
        self.staleness.set(1 if report.delayed else 0)
        if prev_t is not None:
            step_s = now - prev_t
            self.step_seconds.observe(step_s)
            self.compute.observe(
                max(0.0, step_s - report.push_wait_s - report.update_wait_s - (data_wait_s or 0.0))
            )
        self._last = (sent, received, now)


class PrefetchMetrics:
    """The prefetch metrics of one registry; loaders sharing it differ by the ``loader`` label."""

    def __init__(self, registry: CollectorRegistry):
        f = MetricsFactory("prefetch", registry)
        label = ("loader",)
        self.wait = f.histogram(
            "data_wait_seconds", "Seconds the training loop waited in next() for a batch.", label
        )
        self.stall = f.gauge(
            "stall_fraction",
            "Share of the step time spent waiting for data, over the current epoch.",
            label,
        )
        self.depth = f.gauge("queue_depth_batches", "Batches fetched ahead and ready.", label)
        self.bytes = f.gauge("queue_bytes", "Bytes of the batches fetched ahead and ready.", label)
        self.produced = f.counter(
            "batches_produced_total", "Batches fetched from the source.", label
        )
        self.consumed = f.counter(
            "batches_consumed_total", "Batches handed to the training loop.", label
        )

    def child(self, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            **{k: getattr(self, k).labels(loader=name) for k in vars(self)}
        )


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, PrefetchMetrics] = (
    weakref.WeakKeyDictionary()
)
_METRICS_LOCK = threading.Lock()


def prefetch_metrics_for(registry: CollectorRegistry, name: str) -> types.SimpleNamespace:
    """The prefetch metrics of loader ``name`` in ``registry`` (created once per registry)."""
    with _METRICS_LOCK:
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = _METRICS[registry] = PrefetchMetrics(registry)
    return metrics.child(name)

"""Prometheus metrics of a worker (``luwu_worker_*``) and of its data prefetch (``luwu_prefetch_*``)."""

from __future__ import annotations

import threading
import types
import weakref

from prometheus_client import CollectorRegistry

from luwu.protocol.metrics import MetricsFactory


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, rank: int = 0):
        f = MetricsFactory("worker", registry)
        self.registry = f.registry
        self.bytes_pushed = f.counter("bytes_pushed_total", "Gradient payload bytes pushed (on the wire)")
        self.raw_pushed = f.counter("raw_bytes_pushed_total", "fp32 bytes the pushed gradients stand for")
        self.bytes_pulled = f.counter("bytes_pulled_total", "Weight payload bytes received (on the wire)")
        self.raw_pulled = f.counter("raw_bytes_pulled_total", "fp32 bytes the received weights stand for")
        self.pushes = f.counter("pushes_total", "Bucket pushes sent")
        self.steps = f.counter("steps_total", "Optimizer steps completed")
        self.skipped = f.counter("steps_skipped_total", "Steps the nodes skipped (non-finite gradient somewhere)")
        self.encode_seconds = f.counter("encode_seconds_total", "Seconds spent compressing gradients")
        self.decode_seconds = f.counter("decode_seconds_total", "Seconds spent decoding weights")
        self.compression_ratio = f.gauge("compression_ratio", "raw / wire bytes of the pushes of the last step")
        # per-step breakdown (seconds of the last step and histograms)
        self.compute = f.histogram("compute_seconds", "Seconds of forward+backward per step (between step() calls, minus waits)")
        self.push_wait = f.histogram("push_wait_seconds", "Seconds step() waited for pushes / global norms")
        self.update_wait = f.histogram("update_wait_seconds", "Seconds step() waited for the new weights")
        self.data_wait = f.histogram("data_wait_seconds", "Seconds the training loop waited for data (from the Prefetcher)")
        self.step_seconds = f.histogram("step_seconds", "Wall seconds per training step")
        self.staleness = f.gauge("staleness_steps", "Steps between the weights used and the newest (delayed update / async)")
        self.errors = f.counter("errors_total", "Errors raised to the training loop, by code", ("code",))
        # streaming mode: how long forward and backward waited for the weights of streamed units
        self.fetch_wait = f.histogram("fetch_wait_seconds", "Seconds per step forward and backward waited for streamed units' weights")
        self.unit_fetch_wait = f.counter("unit_fetch_wait_seconds_total", "Seconds waited for the weights of each streamed unit", ("unit",))
        self.unit_fetches = f.counter("unit_fetches_total", "Weight fetches of each streamed unit (forward and backward)", ("unit",))
        self.names = list(f.names)


class PrefetchMetrics:
    """The prefetch metrics of one registry; loaders sharing it differ by the ``loader`` label."""

    def __init__(self, registry: CollectorRegistry):
        f = MetricsFactory("prefetch", registry)
        label = ("loader",)
        self.wait = f.histogram("data_wait_seconds", "Seconds the training loop waited in next() for a batch.", label)
        self.stall = f.gauge(
            "stall_fraction", "Share of the step time spent waiting for data, over the current epoch.", label
        )
        self.depth = f.gauge("queue_depth_batches", "Batches fetched ahead and ready.", label)
        self.bytes = f.gauge("queue_bytes", "Bytes of the batches fetched ahead and ready.", label)
        self.produced = f.counter("batches_produced_total", "Batches fetched from the source.", label)
        self.consumed = f.counter("batches_consumed_total", "Batches handed to the training loop.", label)

    def child(self, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(**{k: getattr(self, k).labels(loader=name) for k in vars(self)})


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, PrefetchMetrics] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


def prefetch_metrics_for(registry: CollectorRegistry, name: str) -> types.SimpleNamespace:
    """The prefetch metrics of loader ``name`` in ``registry`` (created once per registry)."""
    with _METRICS_LOCK:
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = _METRICS[registry] = PrefetchMetrics(registry)
    return metrics.child(name)

"""What an aggregator of the switch tier moves, read from its own ``/metrics`` (``luwu_aggregator_*``).

An aggregator answers nothing but its workers' HELLO on its ZeroMQ address, so ``luwu top`` and
``luwu status`` read its numbers where Prometheus does: the ``/metrics`` endpoint that
``luwu aggregator --metrics.port P`` serves, found in the cluster file's ``[[groups]]`` table
(``metrics = "http://HOST:PORT"``) or, under ``luwu up``, in the run dir's state. All are read at
once with one deadline; one that does not answer in time is shown as such, never waited for twice.

Rates are taken between two samples of the same aggregator life, else averaged since it started
(the ``_created`` timestamp its counters carry); the wait for a block's last push is the mean of the
``group_wait_seconds`` histogram over the same span (its sum over its count).
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field

PREFIX = "luwu_aggregator_"
MAX_BYTES = 1 << 20
"""An answer longer than this is not an aggregator's /metrics: it is refused, not read to its end."""

COUNTERS = {
    "bytes_from_workers": ("bytes_received_total", "workers"),
    "bytes_to_nodes": ("bytes_sent_total", "nodes"),
    "bytes_from_nodes": ("bytes_received_total", "nodes"),
    "bytes_to_workers": ("bytes_sent_total", "workers"),
    "pushes_summed": ("pushes_summed_total", None),
    "pushes_passed": ("pushes_passed_total", None),
    "sums_sent": ("sums_sent_total", None),
    "replies_fanned_out": ("replies_fanned_out_total", None),
    "wait_sum_s": ("group_wait_seconds_sum", None),
    "wait_count": ("group_wait_seconds_count", None),
    "errors": ("errors_total", None),
}
"""What is read, as (sample name less the prefix, the ``direction`` label or None): summed over the
other labels (bytes over their ops, errors over their codes)."""
RATES = tuple(k for k in COUNTERS if not k.startswith("wait_") and k != "errors")
"""The counters shown per second."""


@dataclass(slots=True)
class TierSample:
    """One read of one aggregator's /metrics (or why there is none)."""

    url: str
    """Its /metrics address (``http://HOST:PORT/metrics``); '' when no one said where it is."""
    up: bool = False
    values: dict[str, float] = field(default_factory=dict)
    """The :data:`COUNTERS` totals, ``workers`` (connected now) and ``started`` (wall clock)."""
    error: str = ""
    at: float = 0.0
    """time.monotonic() when the answer came."""


def metrics_url(address: str) -> str:
    """``http://HOST:PORT`` (or with ``/metrics``) as the URL to read."""
    return address.rstrip("/").removesuffix("/metrics") + "/metrics"


def parse(text: str) -> dict[str, float]:
    """The numbers :class:`TierSample` keeps, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == PREFIX + "connected_workers":
                out["workers"] = s.value
            elif s.name == PREFIX + "pushes_summed_created":
                out["started"] = s.value
            for key, (name, direction) in COUNTERS.items():
                if s.name == PREFIX + name and direction in (None, s.labels.get("direction")):
                    out[key] += s.value
    if "started" not in out:
        raise ValueError(f"no {PREFIX}* metrics in the answer (is it an aggregator's /metrics?)")
    return out


def _read(url: str, timeout_s: float) -> TierSample:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(MAX_BYTES + 1)
        if len(body) > MAX_BYTES:
            raise ValueError(f"an answer over {MAX_BYTES} bytes")
        return TierSample(url, up=True, values=parse(body.decode()), at=time.monotonic())
    except Exception as exc:  # an aggregator's fault is shown, never raised
        return TierSample(url, error=f"metrics: {type(exc).__name__}: {exc}")


def scrape_many(urls: list[str], timeout_s: float) -> list[TierSample]:
    """Read every ``/metrics`` (``http://HOST:PORT``, or with ``/metrics``) at once (one thread each, ``timeout_s`` on every socket operation and
    for all together); ``''`` is an aggregator whose address no one gave. Never raises."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    urls = [metrics_url(u) if u else "" for u in urls]
    out = [
        TierSample(u, error="" if u else "metrics: no address (a metrics key in its [[groups]])")
        for u in urls
    ]
    todo = [(i, u) for i, u in enumerate(urls) if u]
    if not todo:
        return out
    pool = ThreadPoolExecutor(max_workers=min(16, len(todo)), thread_name_prefix="luwu-tier")
    try:
        futures = {pool.submit(_read, u, timeout_s): i for i, u in todo}
        done, late = wait_all(futures, timeout=timeout_s + 0.5)
        for f in done:
            out[futures[f]] = f.result()
        for f in late:
            out[futures[f]].error = f"metrics: no answer within {timeout_s:g} s"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def rates(cur: TierSample, prev: TierSample | None) -> tuple[dict, str]:
    """Per second of each of :data:`RATES`, ``wait_s`` (mean wait for a block's last push, None when
    no block finished) and ``errors`` (the total): between two samples of the same aggregator life,
    else since it started. Returns (rates, 'between samples' or 'since start')."""
    d = cur.values
    p = prev.values if prev is not None and prev.up and cur.up and cur.at > prev.at else None
    if p is not None and (
        p.get("started") != d.get("started") or any(d[k] < p.get(k, 0.0) for k in COUNTERS)
    ):
        p = None  # it restarted between the samples
    if p is not None:
        span, base, how = cur.at - prev.at, p, "between samples"
    else:
        span, base, how = time.time() - d.get("started", 0.0), {}, "since start"
    span = max(span, 1e-9)
    out: dict = {k: (d[k] - base.get(k, 0.0)) / span for k in RATES}
    blocks = d["wait_count"] - base.get("wait_count", 0.0)
    out["wait_s"] = (d["wait_sum_s"] - base.get("wait_sum_s", 0.0)) / blocks if blocks else None
    out["errors"] = d["errors"]
    return out, how


def metrics_row(cur: TierSample, prev: TierSample | None = None) -> dict:
    """What ``luwu status --json`` adds to an aggregator's row: ``metrics`` (its URL),
    ``metrics_up``, ``metrics_error``, and when it answered its totals, ``worker_connections`` (one
    per worker and node it reaches through the aggregator) and rates."""
    out: dict = {"metrics": cur.url or None, "metrics_up": cur.up, "metrics_error": cur.error}
    if not cur.up:
        return out
    r, how = rates(cur, prev)
    d = cur.values
    out.update(
        worker_connections=int(d.get("workers", 0)),
        uptime_s=max(0.0, time.time() - d.get("started", time.time())),
        totals={k: d[k] for k in COUNTERS},
        **{f"{k}_per_s": r[k] for k in RATES},
        group_wait_mean_s=r["wait_s"],
        errors=int(r["errors"]),
        rate_over=how,
    )
    return out

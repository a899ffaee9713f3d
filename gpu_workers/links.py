"""The link to each node as the compression policy sees it: told, or measured per node link.

The cost rule of :mod:`luwu.protocol.policy` compresses only where the wire time saved beats the codec's
time, so it needs the link speed. ``compression.link_gbps`` told as a number holds for every node link.
``"auto"`` (the default) measures each link from this worker:

* when it connects, a **probe**: STATS messages (answered at once, header only) sent with no payload and
  with a payload of 1 MiB and more (:func:`probe_gbps`), :data:`PROBE_REPS` times each, one at a time
  through the real socket; the quickest of each size is kept (queues and scheduling only ever add time),
  and their difference is the time the payload took, upward (the pushes' direction). Again every
  :data:`REPROBE_EVERY_STEPS` steps, so that a link that slows down is seen;
* as training runs, the **real traffic**: the payload bytes this worker sent to and received from each node
  (the I/O thread counts them) over windows of :data:`TRAFFIC_WINDOW_STEPS` steps. That rate is a lower
  bound of what the link carries (the window also holds compute), so it raises the measurement where it is
  faster than the probe and never lowers it.

Each window closes with one measurement per node link, max(probe, traffic), fed to that link's
:class:`~luwu.protocol.policy.LinkRule` (hysteresis); the codecs change only when the rule moves, at a step
boundary (:meth:`LinkSpeeds.at_step`, called between ``step()`` and the next backward), so every push of a
step goes with the codec decided before it. Each decision is logged once and exposed on ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch

from luwu.gpu_workers.codec_plan import CodecPlan
from luwu.protocol.compression import AUTO, CompressionConfig
from luwu.protocol.layout import Layout
from luwu.protocol.messages import Op
from luwu.protocol.policy import UNMEASURED_GBPS, LinkRule

log = logging.getLogger(__name__)

#: Payload of the first probe message, bytes; doubled up to :data:`PROBE_BYTES` (capped at half of
#: ``transport.max_message_bytes``) until its payload takes :data:`PROBE_MIN_S` (1 Gbit/s: 4 MiB).
PROBE_MIN_BYTES = 1 << 20
PROBE_BYTES = 16 << 20
PROBE_MIN_S = 0.02
#: Probe messages of each size per probe: the quickest counts.
PROBE_REPS = 5
#: A measurement is capped here, Gbit/s: past it every codec decision is the same (fp32), and a probe
#: whose payload took no measurable time says only "faster than the codecs".
MAX_GBPS = 400.0
#: Steps between two probes of a link during training.
REPROBE_EVERY_STEPS = 200
#: Steps per window of real traffic; each window closes with one measurement per node link.
TRAFFIC_WINDOW_STEPS = 10
#: Payload bytes a window must move (one direction) to count as a traffic measurement.
MIN_TRAFFIC_BYTES = 4 << 20


def probe_gbps(
    client,
    node: int,
    max_bytes: int = PROBE_BYTES,
    reps: int = PROBE_REPS,
    timeout_s: float | None = None,
) -> float:
    """Upward Gbit/s from this worker to ``node`` through ``client``'s socket (see the module docstring): the
    payload doubles from :data:`PROBE_MIN_BYTES` until it takes :data:`PROBE_MIN_S` or ``max_bytes``."""
    payload = torch.zeros(max_bytes, dtype=torch.uint8)
    key = [(Op.STATS, node, None, -1)]

    def quickest(size: int) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            client.send(node, {"op": Op.STATS}, [payload[:size]] if size else [])
            client.wait(
                key, timeout_s, what="answer to the link probe (STATS)", errors_of=(Op.STATS,)
            )
            best = min(best, time.perf_counter() - t0)
        return best

    empty, size = quickest(0), min(PROBE_MIN_BYTES, max_bytes)
    while True:
        wire_s = quickest(size) - empty
        if wire_s >= PROBE_MIN_S or size >= max_bytes:
            break
        size = min(2 * size, max_bytes)
    return MAX_GBPS if wire_s <= 0 else min(MAX_GBPS, size * 8 / wire_s / 1e9)


@dataclasses.dataclass(slots=True)
class _Link:
    """What this worker knows of its link to one node."""

    rule: LinkRule
    cfg: CompressionConfig
    probe: float = 0.0
    traffic: float | None = None
    window: tuple[int, int, int, float] = (
        0,
        0,
        0,
        0.0,
    )  # (step, bytes sent, bytes received, time) at its start
    shown: dict = dataclasses.field(
        default_factory=dict
    )  # (direction, codec) -> buckets, as on /metrics


class LinkSpeeds:
    """The compression config of each node link: ``cfg`` itself where ``link_gbps`` is told, else ``cfg``
    at the speed this worker's :class:`~luwu.protocol.policy.LinkRule` of that link decided."""

    def __init__(
        self,
        client,
        cfg: CompressionConfig,
        layout: Layout,
        metrics=None,
        *,
        rank: int = 0,
        before: LinkSpeeds | None = None,
    ) -> None:
        """``before``: the links of the optimizer this one rebuilds (same nodes): their decisions carry
        over, so weights pulled at the new start come in the codecs training used (the hysteresis goes on)."""
        self.client, self.cfg, self.layout, self.metrics, self.rank = (
            client,
            cfg,
            layout,
            metrics,
            rank,
        )
        # measured with compression off too: held replies follow the link
        self.auto = cfg.link_gbps == AUTO
        self.links = [_Link(LinkRule(), cfg) for _ in range(layout.num_nodes)]
        if before is not None and before.cfg == cfg and len(before.links) == len(self.links):
            # a rebuild (recover, add_param_group): the start-up pull goes in the codecs training used
            self.links = [_Link(old.rule, old.cfg, probe=old.probe) for old in before.links]
        self._probed_at = 0
        self._streamed = layout.streamed_buckets()

    def config(self, node: int) -> CompressionConfig:
        """The config the policy decides ``node``'s buckets with (read by the gradient hooks)."""
        return self.links[node].cfg

    def gbps(self, node: int) -> float:
        """The Gbit/s the codecs of ``node``'s link are decided at."""
        return self.cfg.link_gbps if not self.auto else self.links[node].rule.decided or 0.0

    def slowest_gbps(self) -> float:
        """The slowest node link's decided speed (held replies: ``optimizer.hold_replies`` ``auto``)."""
        return min(self.gbps(n) for n in range(len(self.links)))

    def codec_plan(self, half: frozenset[int] = frozenset()) -> CodecPlan:
        """The :class:`CodecPlan` of the worker: each bucket by its node link's config, read when
        asked (so a link whose rule moves moves its buckets' codecs); ``half``: indices of bf16
        parameters."""
        config_of = self.config if self.cfg.enabled else None
        return CodecPlan(config_of, self._streamed, half)

    # ----------------------------------------------------------------- measuring and deciding
    def start(self, step: int) -> None:
        """After the connection (HELLO answered): probe every node link and decide (``auto``); show the
        decisions on /metrics either way."""
        if self.auto:
            self._probe(step)
        for n, link in enumerate(self.links):
            if self.auto and link.rule.observe(link.probe):
                self._decide(n, step)
            self._show(n, step)

    def at_step(self, step: int) -> None:
        """A step boundary (``step``: the next step): re-probe when due, close traffic windows, and move the
        codecs of a link whose rule moved."""
        if not self.auto:
            return
        if step - self._probed_at >= REPROBE_EVERY_STEPS:
            self._probe(step)
        for n, link in enumerate(self.links):
            start, sent0, recv0, t0 = link.window
            if step - start < TRAFFIC_WINDOW_STEPS:
                continue
            sent, recv = self.client.node_bytes[n]
            now = time.perf_counter()
            moved = max(sent - sent0, recv - recv0)
            link.traffic = (
                moved * 8 / (now - t0) / 1e9 if moved >= MIN_TRAFFIC_BYTES and now > t0 else None
            )
            link.window = (step, sent, recv, now)
            measured = max(link.probe, link.traffic or 0.0)
            if self.metrics is not None:
                self.metrics.link_measured.labels(node=str(n)).set(measured)
            if link.rule.observe(measured):
                self._decide(n, step)
                self._show(n, step)

    def _probe(self, step: int) -> None:
        for n, link in enumerate(self.links):
            # Never larger than the node's largest bucket: a message the node surely takes (one past its
            # node.max_message_bytes would cost this worker its connection, and the job its rank).
            largest = max((b.nbytes for b in self.layout.buckets_of(n)), default=0)
            nbytes = min(PROBE_BYTES, self.client.cfg.max_message_bytes // 2, largest)
            # Below PROBE_MIN_BYTES the timing is the messages' overhead, not the link: such a link's
            # buckets are too small for the speed to change a codec, so it is decided at the unmeasured
            # default (real traffic may still raise it).
            link.probe = (
                probe_gbps(self.client, n, nbytes) if nbytes >= PROBE_MIN_BYTES else UNMEASURED_GBPS
            )
            sent, recv = self.client.node_bytes[n]  # (the probe's own bytes are no traffic)
            link.window = (step, sent, recv, time.perf_counter())
            if self.metrics is not None:
                self.metrics.link_measured.labels(node=str(n)).set(link.probe)
        self._probed_at = step

    def _decide(self, node: int, step: int) -> None:
        """The rule of ``node``'s link moved: its config follows, and one log line says what it picks."""
        link = self.links[node]
        link.cfg = dataclasses.replace(self.cfg, link_gbps=link.rule.decided)
        counts = self._codecs(node, step) if self.cfg.enabled else Counter()
        said = "; ".join(
            f"{d}: " + ", ".join(f"{c} x{k}" for (dd, c), k in sorted(counts.items()) if dd == d)
            for d in ("push", "reply")
        )
        log.info(
            "worker %d: link to node %d (%s) decided at %.3g Gbit/s (probe %.3g, traffic %s) from step %d: %s",
            self.rank,
            node,
            self.client.nodes[node],
            link.rule.decided,
            link.probe,
            "-" if link.traffic is None else f"{link.traffic:.3g}",
            step,
            said,
        )

    def _codecs(self, node: int, step: int) -> Counter:
        """(direction, codec) -> how many of ``node``'s buckets go so after the warm-up."""
        plan = self.codec_plan()
        after = max(step, self.cfg.warmup_steps)
        out: Counter = Counter()
        for b in self.layout.buckets_of(node):
            out["push", plan.push(b, after)[0]] += 1
            out["reply", (plan.fetch if b.id in self._streamed else plan.pull)(b, after)] += 1
        return out

    def _show(self, node: int, step: int) -> None:
        if self.metrics is None or not self.cfg.enabled:
            return
        link, m = self.links[node], self.metrics
        m.link_gbps.labels(node=str(node)).set(self.gbps(node))
        counts = self._codecs(node, step)
        for key in set(link.shown) | set(counts):
            m.link_buckets.labels(node=str(node), direction=key[0], codec=key[1]).set(
                counts.get(key, 0)
            )
        link.shown = dict(counts)

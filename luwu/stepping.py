"""The end of each training step on one worker, after torch's side of ``step()``.

In order: tell the nodes they may send this step's held replies (``optimizer.hold_replies``),
end the worker's step (pushes, the global round, the new weights; a delayed update's weights a
step late), let the link speeds re-decide their codecs between this step's pushes and the next's,
end the streamed units' step, decide whether the next step's pushes ask for the global round
(:class:`~luwu.clipping.RoundPolicy`), and record the step's metrics.
"""

from __future__ import annotations

from luwu.clipping import RoundPolicy
from luwu.config import LuwuConfig
from luwu.gpu_workers.links import LinkSpeeds
from luwu.gpu_workers.metrics import StepReport, WorkerMetrics
from luwu.gpu_workers.worker import Worker


class StepDriver:
    """Ends the steps of one (connected) worker. ``step``: the step the worker starts at."""

    def __init__(
        self,
        worker: Worker,
        links: LinkSpeeds,
        metrics: WorkerMetrics,
        cfg: LuwuConfig,
        round_policy: RoundPolicy,
        step: int,
    ):
        self.worker, self.links, self.metrics, self.cfg = worker, links, metrics, cfg
        self.round = round_policy
        # (whether it starts the job with the others: known once connected)
        worker.two_phase = round_policy.wants_round(worker.step_num)
        hold = cfg.optimizer.hold_replies
        self.hold_replies = not worker.streamed and (
            hold == "always" or hold == "auto" and links.slowest_gbps() >= 10
        )
        if self.hold_replies:  # from the first step on: as if the step before it had just begun
            worker.client.release(step - 1)

    def step(self, inv_scale: float, max_norm: float | None, prefetcher=None) -> StepReport:
        """End the worker's current step (see the module docstring); ``prefetcher``: where the
        step's data wait is read (None: not recorded)."""
        w = self.worker
        if self.hold_replies:  # the nodes may send this step's weights now
            w.client.release(w.step_num)
        report = w.step(delay=self.delaying(w.step_num), inv_scale=inv_scale, max_norm=max_norm)
        self.links.at_step(w.step_num)  # (between this step's pushes and the next's)
        if w.streamer is not None:
            w.streamer.end_step(report)
        self.round.stepped = True
        w.two_phase = self.round.wants_round(w.step_num)
        raw = sum(b.numel for b in w.layout.buckets) * 4
        data_wait = prefetcher.last_wait_s if prefetcher is not None else None
        sent, received = w.client.bytes_sent, w.client.bytes_received
        self.metrics.record_step(report, sent, received, raw, data_wait)
        return report

    def delaying(self, step: int) -> bool:
        """Whether ``step``'s weights land a step late (delayed update, past its warm-up)."""
        o = self.cfg.optimizer
        return o.delayed_update and step >= o.delayed_update_warmup

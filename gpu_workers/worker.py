"""The step protocol on a worker: buckets of gradients out, weights back in.

A :class:`Worker` knows the layout and the parameters. Gradient hooks call :meth:`grad_ready`;
when every segment of a bucket is filled it is encoded (:class:`GradientEncoder`) and handed to
the I/O thread at once, so pushes overlap the rest of backward. :meth:`step` ends a step:
:meth:`finish` pushes what the hooks did not (parameters without a gradient are marked "no
gradient" on the wire), :meth:`global_round` runs the global norm / found-inf round when clipping
or AMP asks for it, and :meth:`wait` writes the new weights into the parameters in forward order
(:meth:`land`, the one way a reply reaches the weights). The worker owns its step counter and what
a delayed update still owes; :meth:`step` returns a :class:`StepReport`.

Once connected, the worker owns the collaborators that follow its buckets: the per-layer waits
(:mod:`~luwu.gpu_workers.layer_waits`), the gradient views (:mod:`~luwu.gpu_workers.grad_views`)
and, in streaming mode, the :class:`~luwu.gpu_workers.streamer.Streamer` of its units. Streamed
buckets borrow a gradient buffer from a :class:`BufferPool` until the node acknowledges the push
(an ``ack`` reply, or one with the weights, which :meth:`wait` hands to the unit).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from luwu.gpu_workers import global_round, join
from luwu.gpu_workers.bucket_fill import BucketBuf
from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.encoding import GradientEncoder
from luwu.gpu_workers.grad_marks import GradMarks
from luwu.gpu_workers.grad_views import GradViews, bucket_buffers
from luwu.gpu_workers.landing import WRITTEN, WeightWriter
from luwu.gpu_workers.layer_waits import LayerWaits
from luwu.gpu_workers.metrics import StepReport, WorkerMetrics
from luwu.gpu_workers.pool import BufferPool
from luwu.gpu_workers.streamer import Streamer, StreamSettings
from luwu.protocol.errors import LuwuError, StepMismatchError
from luwu.protocol.layout import Bucket, Layout
from luwu.protocol.messages import PULL_ACK, Op

log = logging.getLogger(__name__)

PULL_WINDOW_BYTES = 32 << 20  #: initial weights asked for at once (Worker.pull_all)


class Worker:
    def __init__(
        self,
        params: list[torch.Tensor],
        layout: Layout,
        client: WorkerClient,
        encoder: GradientEncoder,
        *,
        rank: int,
        world_size: int,
        mode: str = "sync",
        delayed: frozenset[int] = frozenset(),
        hyper_of=None,
        two_phase: bool = False,
        streamed: frozenset[int] = frozenset(),
        pool: BufferPool | None = None,
        initialize=None,
        stream: StreamSettings | None = None,
        metrics: WorkerMetrics | None = None,
        model: torch.nn.Module | None = None,
        grad_views: bool = False,
    ):
        """``encoder``: the gradients' codecs (its :class:`CodecPlan` gives the replies' too);
        ``delayed``: buckets whose weights land a step late; ``streamed``, ``pool``, ``stream``:
        streaming mode's buckets, their buffer pool and units; ``initialize(buckets, send_init)``:
        a meta-device start, run at :meth:`connect`; ``model``: the per-layer waits' hooks go on
        its modules (None: ``step()`` waits for every reply); ``grad_views``: gradients as views
        of the bucket buffers."""
        self.params, self.layout, self.client, self.encoder = params, layout, client, encoder
        self.codecs, self.optimizer = encoder.codecs, encoder.optimizer
        self.rank, self.world_size, self.mode = rank, world_size, mode
        self.delayed, self.streamed = frozenset(delayed), frozenset(streamed)
        if self.streamed and (pool is None or self.streamed & self.delayed):
            raise ValueError("streamed buckets need a buffer pool and cannot be delayed")
        self._hyper_of = hyper_of or (lambda group: {})
        self.two_phase = two_phase  # norms and found-inf decided across all shards, then the update
        self.pool, self.initialize, self._stream, self._metrics = pool, initialize, stream, metrics
        self._model, self._grad_views = model, grad_views
        # built at connect(), once the weights are seeded (and a meta-device model materialized)
        self.streamer: Streamer | None = None
        self.defer: LayerWaits | None = None
        self.views: GradViews | None = None
        self._unacked: set[int] = set()  # streamed buckets pushed this step, buffer still lent
        self.accumulating = False  # no_sync() in streaming mode: partial sums for the node to add
        self.last_error: LuwuError | None = None  # of a wait outside step(), for recover()
        # the others' buffers: slices of one flat buffer per dtype (grad_views)
        held = [b for b in layout.buckets if b.id not in self.streamed | self.delayed]
        self.flat_grads, single = bucket_buffers(held, params)
        self.bufs = [BucketBuf(b, self._own_buffers(b, single)) for b in layout.buckets]
        self.writer = WeightWriter(params, layout, client.nodes, self.streamed, pool, self._reclaim)
        self.where: dict[int, list[tuple[int, int]]] = {}  # param -> [(bucket, segment index)]
        for b in layout.buckets:
            for si, s in enumerate(b.segments):
                self.where.setdefault(s.param, []).append((b.id, si))
        self.node_buckets = [[b.id for b in layout.buckets_of(n)] for n in range(layout.num_nodes)]
        self.channels = client.channels.open([(b.node, b.id) for b in layout.buckets])
        self.step_num = 0  # the step the next push belongs to
        self._pending: int | None = None  # delayed update: the step whose weights are to come
        self._lock = threading.Lock()
        self.grad_marks = GradMarks(self)  # each gradient as copied out: a change is refused
        self._round: tuple[int, tuple[bool, float, float]] | None = None  # a round before step()

    def _own_buffers(self, b: Bucket, single: dict) -> list[torch.Tensor]:
        """A streamed bucket borrows; a delayed bucket's push of t is in flight while t + 1's fills."""
        if b.id in self.streamed:
            return []
        if b.id in self.delayed:
            return [torch.zeros(b.numel) for _ in range(2)]
        return [single[b.id]]

    # ----------------------------------------------------------------- start-up
    def connect(self, step: int = 0, resume: bool = False) -> list[dict]:
        """HELLO every node; rank 0 seeds uninitialized buckets; everyone pulls the current weights.
        ``step``: the job's step when a layout is extended (add_param_group) mid-training.
        ``resume``: continue from the step the nodes hold (without it, nodes holding the job past
        step 0 refuse). A model started on the meta device is initialized here, one unit at a
        time (``self.initialize``); then the streamed units are released."""
        welcomes = self.hello(step, resume)
        versions, todo = {}, set()
        for n, w in enumerate(welcomes):
            versions.update({int(k): v for k, v in w["versions"].items()})
            if self.rank == 0:
                todo |= set(self.node_buckets[n]) - set(w["initialized"])
        if self.initialize is not None:
            self.initialize(todo, self.send_init)
        else:
            for bid in sorted(todo):
                self.send_init(bid)
        self.pull_all()
        self.step_num = min(versions.values(), default=0)
        if resume and step == 0:  # (not when add_param_group extends the layout mid-training)
            said = (
                f"resumes from step {self.step_num}: the nodes' weights and optimizer state go on"
                if self.step_num
                else "starts fresh: the nodes hold no step"
            )
            (log.warning if self.step_num else log.info)(
                "worker %d: job %r %s (resume=True)", self.rank, self.client.job, said
            )
        self._attach()
        return welcomes

    def _attach(self) -> None:
        """The collaborators that follow the connected worker's buckets: streaming mode's units
        (released from now on), the per-layer waits' hooks on the model's modules, the gradient
        views of the bucket buffers."""
        if self._stream is not None:
            self.streamer = Streamer(self, self.params, self._stream, self._metrics)
        if self._model is not None:
            self.defer = LayerWaits(self, self._model)
        self.views = GradViews(self) if self._grad_views else None

    def send_init(self, bid: int) -> None:
        """INIT: the bucket's weights as they are in the parameters, fp32, to its node (rank 0)."""
        g = self.bufs[bid].grads
        join.send_init(self.client, self.layout.buckets[bid], self.params, g[0] if g else None)

    def recover(self, rollback_to: int | None, boot: str = "") -> int:
        """Rejoin after a node restart (roll every node back to ``rollback_to``) or after being
        dropped (elastic mode); returns the step to resume from."""
        self.client.reset()
        if self.defer is not None:
            self.defer.reset()
        self._pending, self.last_error, self._round = None, None, None
        self.grad_marks.clear()
        for buf in self.bufs:
            buf.reset()
            buf.pushed_step, buf.partials = -1, 0
        for bid in [b.bucket.id for b in self.bufs if b.bucket.id in self.streamed and b.grads]:
            self._give_back(bid)
        if self.streamer is not None:
            self.streamer.forget()
        if self.encoder.feedback is not None:
            self.encoder.feedback.reset()
        welcomes = self.hello(self.step_num, resume=True)
        if rollback_to is not None:
            join.rollback(self.client, self.layout.num_nodes, rollback_to, boot)
            self.step_num = rollback_to
        else:
            versions = (v for w in welcomes for v in w["versions"].values())
            self.step_num = min(versions, default=self.step_num)
        self.pull_all()
        return self.step_num

    def hello(self, step: int, resume: bool = False) -> list[dict]:
        """HELLO every node, wait for the WELCOMEs (:func:`luwu.gpu_workers.join.hello`)."""
        who = {"world_size": self.world_size, "optimizer": self.optimizer, "mode": self.mode}
        return join.hello(self.client, self.layout, step=step, resume=resume, **who)

    def pull_all(self) -> None:
        """Fetch every resident bucket's current weights (fp32) and write them into the parameters
        (streamed buckets are fetched when their unit runs), in windows of :data:`PULL_WINDOW_BYTES`
        (the next asked while one lands: the replies never hold a second copy of the model)."""
        bids = [b.id for b in self.layout.buckets if b.id not in self.streamed]
        windows = self.layout.windows(bids, PULL_WINDOW_BYTES) + [[]]
        self.request_weights(windows[0], exact=True)
        for window, ahead in zip(windows, windows[1:]):
            self.request_weights(ahead, exact=True)
            self.receive_weights(window, what="initial weights")

    # ----------------------------------------------------------------- weights in
    def request_weights(self, bids: list[int], *, exact: bool = False) -> None:
        """Ask the owners for the current weights of these buckets (answered behind queued steps):
        as the parameters hold them when ``exact`` (fp32; bf16 for a bucket of bf16 ones, rounded
        as writing fp32 into them would), else in the fetch codec of streamed units (bf16 when
        compression is on)."""
        for bid in bids:
            b, g = self.layout.buckets[bid], self.bufs[bid].grads
            if exact:
                codec = "bf16" if g and g[0].dtype == torch.bfloat16 else "none"
            else:
                codec = self.codecs.fetch(b, self.step_num)
            self.channels[bid].pull(codec)

    def receive_weights(
        self, bids: list[int], what: str = "weights", have: dict | None = None
    ) -> dict:
        """Write the weights of ``bids`` into the parameters (their storage must be allocated), each
        as it arrives: those in ``have`` (bucket -> a reply already here: it came with the answer
        to a push, or was kept) first, then the answers to :meth:`request_weights` of the others.
        Returns bucket -> the message each was written from."""
        have = have or {}
        fetches = [self.channels[bid].fetched() for bid in bids if bid not in have]
        got = {bid: have[bid] for bid in bids if bid in have}
        with self._noting_errors():
            for bid, m in got.items():
                self.land(bid, m)
            for r in self.client.arrivals(fetches, what=what):
                self.land(r.bucket, r.msg)
                got[r.bucket] = r.msg
        return got

    def discard_weights(self, bids: list[int]) -> None:
        """Wait for and drop the answers to :meth:`request_weights` (a prefetch that was not used)."""
        with self._noting_errors():
            fetches = [self.channels[b].fetched() for b in bids]
            for _ in self.client.arrivals(fetches, what="prefetched weights"):
                pass

    def land(self, bid: int, msg) -> None:
        """A reply with bucket ``bid``'s new weights landed: write it into the parameters (the one
        way a reply reaches them; on the I/O thread too, for a per-layer wait). Its push's frame
        is free from now on."""
        if self.views is not None and not msg.header.get(WRITTEN):
            self.views.landed(bid)
        self.writer.write(bid, msg)

    @contextlib.contextmanager
    def _noting_errors(self):
        """Keep the error of a wait made outside :meth:`step` (in a hook) for ``recover()``."""
        try:
            yield
        except LuwuError as exc:
            self.last_error = exc
            raise

    # ----------------------------------------------------------------- pushes
    def grad_ready(self, param: int, grad: torch.Tensor) -> None:
        """Gradient hook: copy the parameter's gradient into its buckets; push every bucket it
        completes."""
        flat = grad.detach().reshape(-1)
        full, partial = [], self.accumulating
        with self._lock:
            for bid, si in self.where.get(param, ()):
                buf = self.bufs[bid]
                if partial and bid not in self.streamed:
                    continue  # (under no_sync() a resident bucket's gradient adds up in .grad)
                s = buf.bucket.segments[si]
                if buf.pushed_step == self.step_num:
                    raise StepMismatchError(
                        f"step {self.step_num}: a second gradient of {s.name} (bucket {bid}) "
                        "after its push: backward passes adding up before one step() run under "
                        "opt.no_sync(), all but the last (a parameter used inside and outside "
                        "torch.utils.checkpoint(use_reentrant=True) gets two in one backward: use "
                        "use_reentrant=False)"
                    )
                if not buf.filled and not partial and bid not in self.delayed:
                    buf.pieces = (
                        {} if self.encoder.takes_pieces(buf.bucket, self.step_num) else None
                    )
                src = flat.narrow(0, s.param_offset, s.numel)
                if not buf.hold(si, src):  # (held: a streamed push encodes it where it is)
                    dst = buf.buffer(self._parity(bid), self._lend)
                    buf.copy_in(dst.narrow(0, s.offset, s.numel), src)
                buf.filled.add(si)
                if len(buf.filled) == len(buf.bucket.segments):
                    buf.pushed_step = buf.pushed_step if partial else self.step_num
                    full.append(buf)
        if self.views is not None and not partial:  # (a held gradient's param has no view)
            self.views.adopt(param)  # the bucket's slice becomes .grad: autograd's is freed now
        if not partial:
            self.grad_marks.note(param, self.params[param].grad)
        with self.client.wake.batched():  # (the buckets it completes: one wake-up)
            for buf in full:
                self._push(buf, self._parity(buf.bucket.id), (), partial=partial)

    def _lend(self, numel: int) -> torch.Tensor:
        """A buffer of the pool for a streamed bucket, until the node has its push."""
        return self.pool.take(numel, self._reclaim)

    def _reclaim(self) -> bool:
        """Wait until the node has received one of the streamed pushes still holding a buffer (its
        ack, or in the two-phase round its NORM) and give those buffers back; the replies stay
        for :meth:`wait` and :meth:`global_round`. False when no push holds a buffer."""
        step, norm = self.step_num, self.two_phase
        replies = [self.channels[b].reply(step, False, norm) for b in sorted(self._unacked)]
        if not replies:
            return False
        with self._noting_errors():
            what = "acknowledgement of a streamed push"
            for r in next(self.client.batches(replies, what=what)):
                self._give_back(r.bucket)
        return True

    def _give_back(self, bid: int) -> None:
        buf = self.bufs[bid]
        for t in buf.grads:
            self.pool.give(t)
        buf.grads = []
        self._unacked.discard(bid)

    def _priority(self, b: Bucket) -> int:
        """P3: pushes queued together go out in the order the next forward needs their weights, as
        the last forward read them (per-layer waits), else by their first parameter."""
        order = self.defer.order if self.defer is not None else {}
        return order.get(b.id, len(self.bufs) + min(s.param for s in b.segments))

    def _parity(self, bucket: int) -> int:
        """Which gradient buffer of ``bucket`` this step fills: delayed buckets alternate."""
        return self.step_num & 1 if bucket in self.delayed else 0

    def finish(self) -> None:
        """Push every bucket the hooks did not complete, from ``param.grad`` (None = no gradient)."""
        todo = []
        with self._lock:
            for buf in self.bufs:
                if buf.pushed_step != self.step_num:
                    buf.pushed_step = self.step_num
                    todo.append(buf)
        for buf in todo:
            nograd, parity = [], self._parity(buf.bucket.id)
            g = buf.buffer(parity, self._lend)
            buf.reset()  # (every segment written again)
            for si, s in enumerate(buf.bucket.segments):
                grad = self.params[s.param].grad
                view = g.narrow(0, s.offset, s.numel)
                if grad is None:
                    view.zero_()
                    if not buf.partials:  # (after micro-batch pushes: the last one adds nothing)
                        nograd.append(si)
                else:
                    src = grad.detach().reshape(-1).narrow(0, s.param_offset, s.numel)
                    buf.copy_in(view, src)
                    self.grad_marks.note(s.param, grad)
            self._push(buf, parity, tuple(nograd))

    def _push(self, buf: BucketBuf, parity: int, nograd: tuple, partial: bool = False) -> None:
        b, step, x = buf.bucket, self.step_num, buf.buffer(parity, self._lend)
        name, enc, hyper = buf.encode(self.encoder, parity, step, self._hyper_of(b.group))
        streamed = b.id in self.streamed
        pull = self.streamer.reply_codec(b, step) if streamed else self.codecs.pull(b, step)
        header = {
            "op": Op.PUSH,
            "step": step,
            "bucket": b.id,
            "codec": name,
            "cmeta": enc.meta,
            "hyper": hyper,
            "nograd": list(nograd),
            "two_phase": self.two_phase,
            "pull": pull,
        }
        if streamed:  # (pushed without error feedback: an aggregator keeps no residual of it)
            header["streamed"] = True
        if partial:  # unanswered, and the next micro-batch refills the buffers: the frames copied
            header["partial"], header["micro"] = True, buf.partials
        frames = [f.clone() for f in enc.frames] if partial else enc.frames
        self.channels[b.id].push(header, frames, priority=self._priority(b))
        if self.views is not None:  # (a zero-copy frame is the buffer: changing it is refused)
            self.views.note_push(b.id, enc.frames[0] is x and not partial)
        buf.reset()
        buf.partials = buf.partials + 1 if partial else 0
        if streamed:
            self._give_back(b.id) if partial else self._unacked.add(b.id)
            self.streamer.pushed(b)

    # ----------------------------------------------------------------- the end of a step
    def step(
        self, *, delay: bool = False, inv_scale: float = 1.0, max_norm: float | None = None
    ) -> StepReport:
        """End the current step: push what is left, run the two-phase round if asked, wait for the
        new weights and move to the next step. ``delay``: the delayed buckets' weights of this
        step land at the next one (those of the previous step land now); ``inv_scale``: 1 / the
        GradScaler's scale; ``max_norm``: clip by the global norm."""
        step = self.step_num
        self.end_pushes()
        skipped, norm, push_wait = False, None, 0.0
        if self._round is not None and self._round[0] == step:  # clip_grad_norm_ ran it already
            skipped, norm, push_wait = self._round[1]
        elif self.two_phase:
            skipped, norm, push_wait = self.global_round(step, inv_scale, max_norm)
        self._round = None
        self.grad_marks.clear()
        if delay:
            # the buckets not delayed (partial delay) land now, the delayed ones bring the last step's
            late, update_wait = self.wait(step, self._pending)
            self._pending = step
        else:
            late, update_wait = self.wait(step, step)
        if self.defer is not None:  # the forward's waits (a skip without the round: found late)
            waited, skips = self.defer.take_counts()
            update_wait, late = update_wait + waited, late or (skips > 0 and not self.two_phase)
        self.step_num = step + 1
        return StepReport(step, skipped or late, norm, push_wait, update_wait, delay)

    def end_pushes(self) -> None:
        """Every gradient of the step leaves: refuse one changed after it was copied out, settle
        what the last step still owes, push what the hooks did not (idempotent within a step)."""
        self.grad_marks.check(self.step_num)
        if self.views is not None:
            self.views.check()
        if self.defer is not None:  # what no forward waited for: before finish() refills buffers
            self.defer.settle()
        with self.client.wake.batched():  # (what is left goes out in one wake-up)
            self.finish()

    def clip_round(self, inv_scale: float, max_norm: float | None) -> tuple[bool, float]:
        """The global round of the current step run before ``step()`` (``clip_grad_norm_``): push
        what is left, gather the norm, COMMIT with the clip coefficient. Returns (nonfinite, grad
        norm); ``step()`` then only waits for the weights."""
        step = self.step_num
        if self._round is not None and self._round[0] == step:
            raise StepMismatchError(
                f"step {step}: the gradients were clipped already this step (the nodes have the "
                "coefficient)",
                step=step,
            )
        self.end_pushes()
        self._round = (step, self.global_round(step, inv_scale, max_norm))
        return self._round[1][0], self._round[1][1]

    def synchronize(self) -> None:
        """Wait for the weights a delayed step or the per-layer waits still owe."""
        if self.defer is not None:
            self.defer.settle()
        if self._pending is not None:
            self.wait(None, self._pending)
            self._pending = None

    def global_round(
        self, step: int, inv_scale: float, max_norm: float | None
    ) -> tuple[bool, float, float]:
        """Two-phase step (:func:`luwu.gpu_workers.global_round.run`): (skipped, norm, waited s)."""
        norms = [self.channels[b.id].reply(step, norm=True) for b in self.layout.buckets]
        return global_round.run(self.client, norms, self.node_buckets, step, inv_scale, max_norm)

    def wait(self, step: int | None, delayed_step: int | None) -> tuple[bool, float]:
        """Wait for the weights after ``step`` of the buckets not delayed and after
        ``delayed_step`` of the delayed ones (None: nothing to wait for) and write each bucket
        into the parameters as it arrives (asked for in forward order), so writing overlaps
        receiving and each reply's buffer is freed for reuse at once. Returns whether the nodes
        skipped ``step`` in a bucket waited for at ``step`` (what a delayed bucket says of
        ``delayed_step`` is not counted, as with full delay), and the seconds spent waiting
        (writing excluded)."""
        replies, owed = [], []
        for b in reversed(self.layout.buckets):
            s = delayed_step if b.id in self.delayed else step
            if s is None:
                continue
            # per-layer waits: written when the next forward reaches it (or as it lands)
            deferred = self.defer is not None and s == step and self.defer.takes(b.id)
            (owed if deferred else replies).append(self.channels[b.id].reply(s))
        if owed:
            self.defer.owe(owed)
        waited, skipped, t0 = 0.0, False, time.perf_counter()
        for r in self.client.arrivals(replies, what="updated weights"):
            t1 = time.perf_counter()
            waited += t1 - t0
            bid, m = r.bucket, r.msg
            if r.step == step:
                skipped |= m.header["skipped"]
            if bid in self.streamed:
                self._give_back(bid)  # the node has the push: the buffer is free
                if m.header["codec"] != PULL_ACK:  # with the new weights: for the unit's next use
                    self.streamer.came_with_ack(bid, m)
            else:
                self.land(bid, m)
            t0 = time.perf_counter()
        return skipped, waited

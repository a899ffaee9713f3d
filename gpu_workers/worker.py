"""The step protocol on a worker: buckets of gradients out, weights back in.

A :class:`Worker` knows the layout and the parameters. Gradient hooks call :meth:`grad_ready`; when every
segment of a bucket is filled it is encoded and handed to the I/O thread at once, so pushes overlap the rest of
backward. :meth:`step` ends a step: :meth:`finish` pushes what the hooks did not (parameters without a gradient
are marked "no gradient" on the wire), :meth:`global_round` runs the global norm / found-inf round when clipping
or AMP asks for it, and :meth:`wait` writes the new weights into the parameters in forward order. The worker owns its step
counter and what a delayed update still owes; :meth:`step` returns a :class:`StepReport`. Buffers are allocated once and reused.

Streamed buckets (streaming mode, :mod:`luwu.gpu_workers.streaming`) have no buffer of their own: they borrow
one from a :class:`BufferPool` when their first gradient arrives and give it back when the node acknowledges the
push (an ``ack`` reply without weights); their weights are fetched with :meth:`request_weights` /
:meth:`receive_weights` just before use, and :meth:`wait` writes nothing for them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from luwu.gpu_workers import global_round
from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.grad_marks import GradMarks
from luwu.gpu_workers.grad_views import bucket_buffers, copy_in
from luwu.gpu_workers.metrics import StepReport
from luwu.gpu_workers.pool import BufferPool
from luwu.gpu_workers.segments import gather, scatter
from luwu.protocol.codecs import get_codec, has_nonfinite
from luwu.protocol.errors import LayoutMismatchError, LuwuError, StepMismatchError
from luwu.protocol.feedback import WORKER_MOMENTUM, worker_momentum
from luwu.protocol.layout import Bucket, Layout
from luwu.protocol.messages import PULL_ACK, Op

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _BucketBuf:
    bucket: Bucket
    grads: list[
        torch.Tensor
    ]  # flat, one per parity in flight (fp32; bf16 for bf16 parameters alone; streamed: borrowed, or none)
    staging: (
        torch.Tensor | None
    )  # for multi-segment buckets: decode target before scattering (shared; streamed: borrowed)
    multi: bool = (
        False  # several segments, or a non-contiguous parameter: written through a staging buffer
    )
    filled: set = field(
        default_factory=set
    )  # segments whose gradient is in (a hook firing twice counts once)
    pushed_step: int = -1
    partials: int = (
        0  # micro-batch pushes this step (no_sync() in streaming mode: summed on the node)
    )
    out: dict = field(default_factory=dict)  # (codec, parity) -> preallocated encode frames
    version: int = (
        -1
    )  # the node's version of the weights written last: a delta reply must step from it


class Worker:
    def __init__(
        self,
        params: list[torch.Tensor],
        layout: Layout,
        client: WorkerClient,
        *,
        rank: int,
        world_size: int,
        optimizer: str,
        mode: str = "sync",
        delayed: frozenset[int] = frozenset(),
        codec_for=None,
        pull_codec_for=None,
        feedback=None,
        hyper_of=None,
        momentum_correction: bool = False,
        two_phase: bool = False,
        streamed: frozenset[int] = frozenset(),
        pool: BufferPool | None = None,
        fetch_codec_for=None,
        initialize=None,
    ):
        self.params, self.layout, self.client = params, layout, client
        self.rank, self.world_size, self.optimizer, self.mode = rank, world_size, optimizer, mode
        self.delayed = frozenset(
            delayed
        )  # ids of the buckets whose weights land a step late (delayed update)
        self._codec_for = codec_for or (lambda bucket, step: ("none", False))
        self._pull_codec_for = pull_codec_for or (lambda bucket, step: "none")
        self._feedback = feedback
        self._hyper_of = hyper_of or (lambda group: {})
        self.momentum_correction = (
            momentum_correction  # DGC's, on sparse-codec buckets (luwu.protocol.feedback)
        )
        self.streamed = frozenset(streamed)  # ids of the buckets of streamed units (streaming mode)
        if self.streamed and (pool is None or self.streamed & self.delayed):
            raise ValueError("streamed buckets need a buffer pool and cannot be delayed")
        self.pool = pool
        self._fetch_codec_for = fetch_codec_for or (
            lambda bucket, step: "none"
        )  # streamed units' weights
        self.on_pushed = None  # streaming mode: called with each streamed bucket once pushed
        self.on_reset = (
            None  # streaming mode: called when recover() abandons the step (its replies are gone)
        )
        self.initialize = (
            initialize  # meta-device start: initialize(buckets to seed, send_init) at connect()
        )
        self.defer, self.views = (
            None,
            None,
        )  # per-layer waits (layer_waits: the replies the next forward waits for); grad_views
        self._unacked: set[int] = (
            set()
        )  # streamed buckets pushed this step whose buffer is still lent
        self.accumulating = False  # no_sync() in streaming mode: streamed buckets push partial sums for the node to add
        self.fetch_with_reply: frozenset[int] = (
            frozenset()
        )  # streamed buckets whose push asks the node for the new weights
        self.prefetched: dict[
            int, object
        ] = {}  # bucket -> the reply that brought them, kept for the unit's next use
        self.last_error: LuwuError | None = (
            None  # raised by a wait outside step() (streaming: in hooks), for recover()
        )
        self.bufs: list[_BucketBuf] = []
        multi = [
            len(b.segments) > 1 or not params[b.segments[0].param].is_contiguous()
            for b in layout.buckets
        ]
        staging = torch.zeros(
            max(
                (b.numel for b, m in zip(layout.buckets, multi) if m and b.id not in self.streamed),
                default=0,
            )
        )
        # the others' buffers: slices of one flat buffer per dtype (bf16 for a bucket of bf16 parameters alone: its gradient
        # as backward made it), a parameter split over buckets one slice of it (grad_views)
        self.flat_grads, single = bucket_buffers(
            [b for b in layout.buckets if b.id not in self.streamed and b.id not in self.delayed],
            params,
        )
        for b, m in zip(
            layout.buckets, multi
        ):  # (resident weights are written one bucket at a time: one staging serves all)
            # a streamed bucket borrows; a delayed bucket's push of t is in flight while t + 1's fills
            grads = (
                []
                if b.id in self.streamed
                else [torch.zeros(b.numel) for _ in range(2)]
                if b.id in self.delayed
                else [single[b.id]]
            )
            self.bufs.append(_BucketBuf(b, grads, staging[: b.numel] if m and grads else None, m))
        self.where: dict[int, list[tuple[int, int]]] = {}  # param -> [(bucket, segment index)]
        for b in layout.buckets:
            for si, s in enumerate(b.segments):
                self.where.setdefault(s.param, []).append((b.id, si))
        self.node_buckets = [[b.id for b in layout.buckets_of(n)] for n in range(layout.num_nodes)]
        self.step_num = 0  # the step the next push belongs to
        self._pending: int | None = (
            None  # delayed update: the step whose delayed buckets' weights are still to come
        )
        self._lock, self._write_lock = threading.Lock(), threading.Lock()
        self.two_phase = (
            two_phase  # gradient norms and found-inf decided across all shards before the update
        )
        self.grad_marks = GradMarks(
            self
        )  # each gradient as it was copied out: a later change is refused at step()
        self._round: tuple[int, tuple[bool, float, float]] | None = (
            None  # (step, the global round's result) when run before step()
        )

    # ----------------------------------------------------------------- start-up
    def connect(self, step: int = 0, resume: bool = False) -> list[dict]:
        """HELLO every node; rank 0 seeds uninitialized buckets; everyone pulls the current weights.
        ``step``: the job's step when a layout is extended (add_param_group) mid-training. ``resume``: continue
        from the step the nodes hold (without it, nodes holding the job past step 0 refuse). A model
        started on the meta device is initialized here, one unit at a time (``self.initialize``)."""
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
        return welcomes

    def send_init(self, bid: int) -> None:
        """INIT: the bucket's weights as they are in the parameters, fp32, to its node (rank 0)."""
        buf = self.bufs[bid]
        # a streamed bucket has no buffer of its own: a one-off copy, kept alive by its frame
        flat = (
            buf.grads[0]
            if buf.grads and buf.grads[0].dtype == torch.float32
            else torch.empty(buf.bucket.numel)
        )
        gather(buf.bucket, self.params, flat)
        enc = get_codec("none").encode(flat)
        self.client.send(
            buf.bucket.node,
            {"op": Op.INIT, "bucket": bid, "codec": "none", "cmeta": enc.meta},
            enc.frames,
        )

    def recover(self, rollback_to: int | None, boot: str = "") -> int:
        """Rejoin after a node restart (roll every node back to ``rollback_to``) or after being dropped
        (elastic mode); returns the step to resume from."""
        self.client.reset()
        self.prefetched.clear()
        if self.defer is not None:
            self.defer.reset()
        self._pending = None
        self.last_error = None
        self._round = None
        self.grad_marks.clear()
        for buf in self.bufs:
            buf.filled, buf.pushed_step, buf.partials = set(), -1, 0
        for bid in [b.bucket.id for b in self.bufs if b.bucket.id in self.streamed and b.grads]:
            self._give_back(bid)
        if self.on_reset is not None:
            self.on_reset()
        if self._feedback is not None:
            self._feedback.reset()
        welcomes = self.hello(self.step_num, resume=True)
        if rollback_to is not None:
            for n in range(self.layout.num_nodes):
                self.client.send(
                    n, {"op": Op.ROLLBACK, "step": rollback_to, "detail": {"boot": boot}}
                )
            self.client.wait(
                [(Op.ROLLBACK, n, None, -1) for n in range(self.layout.num_nodes)],
                what="rollback acknowledgement",
            )
            self.step_num = rollback_to
        else:
            self.step_num = min(
                (v for w in welcomes for v in w["versions"].values()), default=self.step_num
            )
        self.pull_all()
        return self.step_num

    def hello(self, step: int, resume: bool = False) -> list[dict]:
        """HELLO every node, wait for the WELCOMEs. ``resume``: go on from the nodes' step (resume=True, recover())."""
        for n in range(self.layout.num_nodes):
            mine = self.layout.buckets_of(n)
            self.client.send(
                n,
                {
                    "op": Op.HELLO,
                    "step": step,
                    "param_names": {s.param: s.name for b in mine for s in b.segments},
                    "world_size": self.world_size,
                    "layout": self.layout.hash,
                    "node_index": n,
                    "buckets": [b.to_wire() for b in mine],
                    "optimizer": self.optimizer,
                    "mode": self.mode,
                    "resume": resume,
                },
            )
        keys = [(Op.WELCOME, n, None, -1) for n in range(self.layout.num_nodes)]
        welcomes = [
            m.header
            for m in self.client.wait(
                keys, self.client.cfg.connect_timeout_s, what="WELCOME", errors_of=(Op.HELLO,)
            )
        ]
        for n, w in enumerate(welcomes):
            if w["layout"] != self.layout.hash:
                raise LayoutMismatchError(
                    f"node {self.client.nodes[n]} accepted layout {w['layout']}, this worker has {self.layout.hash}"
                )
        return welcomes

    def pull_all(self) -> None:
        """Fetch every resident bucket's current weights (fp32) and write them into the parameters
        (streamed buckets are fetched when their unit runs)."""
        bids = [b.id for b in self.layout.buckets if b.id not in self.streamed]
        self.request_weights(bids, exact=True)
        self.receive_weights(bids, what="initial weights")

    def request_weights(self, bids: list[int], *, exact: bool = False) -> None:
        """Ask the owners for the current weights of these buckets (answered behind queued steps): as the
        parameters hold them when ``exact`` (fp32; bf16 for a bucket of bf16 ones, rounded as writing fp32 into
        them would), else in the fetch codec of streamed units (bf16 when compression is on)."""
        for bid in bids:
            b, g = self.layout.buckets[bid], self.bufs[bid].grads
            codec = (
                ("bf16" if g and g[0].dtype == torch.bfloat16 else "none")
                if exact
                else self._fetch_codec_for(b, self.step_num)
            )
            self.client.send(b.node, {"op": Op.PULL, "bucket": bid, "codec": codec})

    def receive_weights(
        self, bids: list[int], what: str = "weights", kept: dict | None = None
    ) -> None:
        """Wait for the weights asked for with :meth:`request_weights` (or that came with the answer to a
        push, :attr:`prefetched`) and write each bucket into the parameters as it arrives (their storage
        must be allocated); ``kept``: where each bucket's message goes after its write (bucket -> message)."""
        keys = [
            (Op.UPDATE, self.layout.buckets[bid].node, -1, bid)
            for bid in bids
            if bid not in self.prefetched
        ]
        ready = [(bid, self.prefetched.pop(bid)) for bid in bids if bid in self.prefetched]
        with self._noting_errors():
            for bid, m in itertools.chain(
                ready, ((key[3], m) for key, m in self.client.arrivals(keys, what=what))
            ):
                self._write(self.bufs[bid], m)
                if kept is not None:
                    kept[bid] = m

    def discard_weights(self, bids: list[int]) -> None:
        """Wait for and drop the answers to :meth:`request_weights` (a prefetch that was not used)."""
        with self._noting_errors():
            self.client.wait(
                [
                    (Op.UPDATE, self.layout.buckets[b].node, -1, b)
                    for b in bids
                    if self.prefetched.pop(b, None) is None
                ],
                what="prefetched weights",
            )

    @contextlib.contextmanager
    def _noting_errors(self):
        """Keep the error of a wait made outside :meth:`step` (in a hook) for ``recover()`` to act on."""
        try:
            yield
        except LuwuError as exc:
            self.last_error = exc
            raise

    # ----------------------------------------------------------------- pushes
    def grad_ready(self, param: int, grad: torch.Tensor) -> None:
        """Gradient hook: copy the parameter's gradient into its buckets; push every bucket it completes."""
        flat = grad.detach().reshape(-1)
        full, partial = [], self.accumulating
        with self._lock:
            for bid, si in self.where.get(param, ()):
                buf = self.bufs[bid]
                if partial and bid not in self.streamed:
                    continue  # (under no_sync() a resident bucket's gradient adds up in .grad, as in torch)
                s = buf.bucket.segments[si]
                if buf.pushed_step == self.step_num:
                    raise StepMismatchError(
                        f"step {self.step_num}: a second gradient of {s.name} (bucket {bid}) after its push: backward passes adding up before one step() run under opt.no_sync(), all but the last "
                        f"(a parameter used inside and outside torch.utils.checkpoint(use_reentrant=True) gets two in one backward: use use_reentrant=False)"
                    )
                copy_in(
                    self._grad_buffer(buf, self._parity(bid)).narrow(0, s.offset, s.numel),
                    flat.narrow(0, s.param_offset, s.numel),
                )
                buf.filled.add(si)
                if len(buf.filled) == len(buf.bucket.segments):
                    buf.pushed_step = buf.pushed_step if partial else self.step_num
                    full.append(buf)
        if self.views is not None and not partial:
            self.views.adopt(
                param
            )  # the bucket's slice becomes .grad: autograd's tensor is freed now
        if not partial:
            self.grad_marks.note(param, self.params[param].grad)
        for buf in full:
            self._push(buf, self._parity(buf.bucket.id), (), partial=partial)

    def _grad_buffer(self, buf: _BucketBuf, parity: int) -> torch.Tensor:
        """The gradient buffer of ``buf`` this step fills (a streamed bucket borrows one from the pool)."""
        if not buf.grads:
            buf.grads.append(self.pool.take(buf.bucket.numel, self._reclaim))
        return buf.grads[parity]

    def _reclaim(self) -> bool:
        """Wait until the node has received one of the streamed pushes still holding a buffer (its ack,
        or in the two-phase round its NORM) and give those buffers back; the replies stay filed for
        :meth:`wait` and :meth:`global_round`. False when no push holds a buffer."""
        op = Op.NORM if self.two_phase else Op.UPDATE
        keys = [
            (op, self.layout.buckets[bid].node, self.step_num, bid) for bid in sorted(self._unacked)
        ]
        if not keys:
            return False
        with self._noting_errors():
            for key in self.client.filed(keys, what="acknowledgement of a streamed push"):
                self._give_back(key[3])
        return True

    def _give_back(self, bid: int) -> None:
        buf = self.bufs[bid]
        for t in buf.grads:
            self.pool.give(t)
        buf.grads = []
        self._unacked.discard(bid)

    def _priority(self, b: Bucket) -> int:
        """P3: pushes queued together go out in the order the next forward needs their weights, as the last
        forward read them (per-layer waits), else by their first parameter (registration order)."""
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
            nograd = []
            parity = self._parity(buf.bucket.id)
            g = self._grad_buffer(buf, parity)
            for si, s in enumerate(buf.bucket.segments):
                grad = self.params[s.param].grad
                view = g.narrow(0, s.offset, s.numel)
                if grad is None:
                    view.zero_()
                    if not buf.partials:  # (after micro-batch pushes: the last one adds nothing)
                        nograd.append(si)
                else:
                    copy_in(view, grad.detach().reshape(-1).narrow(0, s.param_offset, s.numel))
                    self.grad_marks.note(s.param, grad)
            self._push(buf, parity, tuple(nograd))

    def _push(self, buf: _BucketBuf, parity: int, nograd: tuple, partial: bool = False) -> None:
        b, step = buf.bucket, self.step_num
        x = buf.grads[parity]
        name, ef = (
            self._codec_for(b, step) if x.dtype == torch.float32 else ("bf16", False)
        )  # (a bf16 gradient as is: lossless)
        if name not in ("none", "bf16") and has_nonfinite(x):
            name, ef = "none", False  # let the node see the inf/nan and decide globally
        codec = get_codec(name)
        out = buf.out.get(key := (name, parity))
        if (
            out is None and name != "none" and x.dtype == torch.float32
        ):  # a streamed bucket's frames are its message's own: nothing kept per unit
            buf.out = {
                k: v for k, v in buf.out.items() if k[1] != parity
            }  # (another codec's frames: the warm-up's bf16, once int8 takes over)
            out = (
                codec.alloc(b.numel)
                if b.id in self.streamed
                else buf.out.setdefault(key, codec.alloc(b.numel))
            )
        hyper = self._hyper_of(b.group)
        if x.dtype == getattr(codec, "dtype", None):
            # zero-copy: the frame is the bucket buffer, next written after the node's answer (delayed: two steps)
            enc = codec.encode(x)
        elif ef and self._feedback is not None:
            momentum = None
            if self.momentum_correction and codec.sparse:
                momentum = worker_momentum(self.optimizer, hyper)
                hyper = hyper | {WORKER_MOMENTUM: codec.density}
            # x is finite (checked above): no second pass over it
            enc = self._feedback.encode(
                b.id,
                codec,
                x,
                out,
                num_summands=self.world_size,
                momentum=momentum,
                nonfinite=False,
            )
        else:
            enc = codec.encode(x, out, num_summands=self.world_size)
        header = {
            "op": Op.PUSH,
            "step": step,
            "bucket": b.id,
            "codec": name,
            "cmeta": enc.meta,
            "hyper": hyper,
            "nograd": list(nograd),
            "two_phase": self.two_phase,
        }
        if (
            b.id in self.streamed
        ):  # the next forward's first units: the node sends their new weights as it applies the step
            header["pull"] = (
                self._fetch_codec_for(b, step + 1) if b.id in self.fetch_with_reply else PULL_ACK
            )
        else:
            header["pull"] = self._pull_codec_for(b, step)
        if (
            partial
        ):  # unanswered, and the next micro-batch refills the buffers: the frames go out as copies
            header["partial"] = True
        self.client.send(
            b.node,
            header,
            [f.clone() for f in enc.frames] if partial else enc.frames,
            priority=self._priority(b),
        )
        if (
            self.views is not None
        ):  # (a zero-copy frame is the buffer: an in-place change before the reply is refused)
            self.views.note_push(b.id, enc.frames[0] is x and not partial)
        buf.filled, buf.partials = set(), buf.partials + 1 if partial else 0
        if b.id in self.streamed:
            self._give_back(b.id) if partial else self._unacked.add(b.id)
            if self.on_pushed is not None:
                self.on_pushed(b)

    # ----------------------------------------------------------------- the end of a step
    def step(
        self, *, delay: bool = False, inv_scale: float = 1.0, max_norm: float | None = None
    ) -> StepReport:
        """End the current step: push what is left, run the two-phase round if asked, wait for the new
        weights and move to the next step. ``delay``: the delayed buckets' weights of this step land at
        the next one (those of the previous step land now); ``inv_scale``: 1 / the GradScaler's scale;
        ``max_norm``: clip by the global norm."""
        step = self.step_num
        self.end_pushes()
        skipped, norm, push_wait = False, None, 0.0
        if (
            self._round is not None and self._round[0] == step
        ):  # clip_grad_norm_ ran the round already
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
        if (
            self.defer is not None
        ):  # the forward's per-layer waits (a skip without the two-phase round: found late)
            waited, skips = self.defer.take_counts()
            update_wait, late = update_wait + waited, late or (skips > 0 and not self.two_phase)
        self.step_num = step + 1
        return StepReport(step, skipped or late, norm, push_wait, update_wait, delay)

    def end_pushes(self) -> None:
        """Every gradient of the step leaves: refuse one changed after it was copied out, settle what the
        last step still owes, push what the hooks did not (idempotent within a step)."""
        self.grad_marks.check(self.step_num)
        if self.views is not None:
            self.views.check()
        if (
            self.defer is not None
        ):  # what no forward waited for: written before finish() refills the buffers
            self.defer.settle()
        self.finish()

    def clip_round(self, inv_scale: float, max_norm: float | None) -> tuple[bool, float]:
        """The global round of the current step run before ``step()`` (``clip_grad_norm_``): push what is
        left, gather the norm, COMMIT with the clip coefficient. Returns (nonfinite, grad norm); ``step()``
        then only waits for the weights."""
        step = self.step_num
        if self._round is not None and self._round[0] == step:
            raise StepMismatchError(
                f"step {step}: the gradients were clipped already this step (the nodes have the coefficient)",
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
        """Two-phase step (:func:`luwu.gpu_workers.global_round.run`): (skipped, grad norm, seconds waited)."""
        return global_round.run(
            self.client, self.layout, self.node_buckets, step, inv_scale, max_norm
        )

    def wait(self, step: int | None, delayed_step: int | None) -> tuple[bool, float]:
        """Wait for the weights after ``step`` of the buckets not delayed and after ``delayed_step`` of
        the delayed ones (None: nothing to wait for) and write each bucket into the parameters as it
        arrives (asked for in forward order), so writing overlaps receiving and each reply's buffer is
        freed for reuse at once. Returns whether the nodes skipped ``step`` in a bucket waited for at
        ``step`` (what a delayed bucket says of ``delayed_step`` is not counted, as with full delay),
        and the seconds spent waiting (writing excluded)."""
        keys, owed = [], []
        for b in reversed(self.layout.buckets):
            s = delayed_step if b.id in self.delayed else step
            if (
                s is not None
            ):  # per-layer waits: written when the next forward reaches it (or as it lands)
                (
                    owed
                    if self.defer is not None and s == step and self.defer.takes(b.id)
                    else keys
                ).append((Op.UPDATE, b.node, s, b.id))
        if owed:
            self.defer.owe(owed)
        waited, skipped, t0 = 0.0, False, time.perf_counter()
        for key, m in self.client.arrivals(keys, what="updated weights"):
            t1 = time.perf_counter()
            waited += t1 - t0
            if key[2] == step:
                skipped |= m.header["skipped"]
            if key[3] in self.streamed:
                self._give_back(key[3])  # the node has the push: the buffer is free
                if (
                    m.header["codec"] != PULL_ACK
                ):  # with the new weights: kept as received for the unit's next use
                    self.prefetched[key[3]] = m
            else:
                self._write(self.bufs[key[3]], m)
            t0 = time.perf_counter()
        return skipped, waited

    def _write(self, buf: _BucketBuf, msg) -> None:
        with self._write_lock:  # (per-layer waits write on the I/O thread too; resident buckets share one staging buffer)
            self._write_locked(buf, msg)

    def _write_locked(self, buf: _BucketBuf, msg) -> None:
        b, h = buf.bucket, msg.header
        codec = get_codec(h["codec"])
        codec.validate(b.numel, h.get("nbytes", []), h["cmeta"])
        delta = h.get("delta", False)  # int8 deltas / bf16 steps from the weights this worker holds
        if (
            delta and buf.version != h["step"] - 1
        ):  # (a reply of an abandoned timeline, one missed): nothing changes
            raise StepMismatchError(
                f"node {self.client.nodes[b.node]} sent bucket {b.id}'s weights of step {h['step']} as {h['codec']} from those of "
                f"step {h['step'] - 1}, this worker holds step {buf.version}'s: nothing written (recover() pulls them whole)",
                node=self.client.nodes[b.node],
                step=h["step"],
                bucket=b.id,
            )
        if self.views is not None:  # (the push's frame is free now)
            self.views.landed(b.id)
        frames = msg.tensors()
        with (
            torch.no_grad(),
            torch._C.DisableTorchFunctionSubclass(),
        ):  # (a parameter owing other buckets' weights: no wait)
            if not buf.multi:
                s = b.segments[0]
                target = self.params[s.param].data.view(-1).narrow(0, s.param_offset, s.numel)
                (codec.decode_add_ if delta else codec.decode_)(target, frames, h["cmeta"])
            else:
                staging = (
                    buf.staging
                    if buf.staging is not None
                    else self.pool.take(b.numel, self._reclaim)
                )
                try:
                    if delta:
                        gather(b, self.params, staging)
                        codec.decode_add_(staging, frames, h["cmeta"])
                    else:
                        codec.decode_(staging, frames, h["cmeta"])
                    scatter(b, self.params, staging)
                finally:
                    if buf.staging is None:
                        self.pool.give(staging)
        buf.version = h["step"]

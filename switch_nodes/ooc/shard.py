"""The out-of-core shard: a node's buckets whose weights and optimizer state live in state files.

:class:`OocShard` is the second :class:`~luwu.switch_nodes.shard.Shard` (the node builds it when
``node.state_dir`` is set). Its buckets (:class:`OocBucket`) carry no tensors of their size: between
:meth:`~OocShard.load` and :meth:`~OocShard.store` their weights, optimizer state and step counters
are views into a :class:`~.window.StateWindow` of ``node.state_memory_bytes`` over the files
(:class:`~.state_file.StateFile` in ``<state_dir>/<job>-node<index>``), which reads the next
buckets of the step order ahead and writes stepped ones back behind. Gradient accumulators and
replies stay in RAM: they are in flight anyway, within ``node.push_memory_bytes``; the sums of a
two-phase step that wait for COMMIT go to a scratch file meanwhile (:mod:`.spill`).

The shard's size is known once the first worker said HELLO, so the files are opened at the first
load (a seed or a step). The files are the checkpoint: a node started on a folder of an earlier run
(:meth:`OocShard.reopen`) puts every bucket at the newest step all of them hold (the window keeps one
by construction, :meth:`StateWindow` ``keep_step``) and restarts from there as an in-RAM node from its
checkpoint; ROLLBACK puts them at the step named (:meth:`OocShard.roll_back`); the rest of the job's
description is ``job.json`` (:mod:`.recovery`). When the whole state fits the budget (or the budget is 0), the buckets
are allocated in RAM for good and no state goes to ``state_dir`` (only the scratch file of the
two-phase sums, with a push budget): the node then runs as an in-RAM one (the same code path,
zero-copy replies included), with no durability of its own.

A reply outside a step (a PULL: a streaming worker fetches a unit's weights before its forward and
again before its backward) reads the bucket's weights alone, not its whole slot
(:class:`~.weights.WeightsReader`). Out of core, a step's reply is encoded before its bucket is
stored; its fp32 frames, views of the window, go zero-copy from there in sync mode (the window
lends that memory until the reply lets go of it: :mod:`.lend`); otherwise they are copied (the
window reuses that memory once the bucket is released), into the buffers a budgeted node keeps for
reuse (:mod:`..kept_frames`), as the weights-only reads are: pages already touched, not fresh ones. A
bucket whose load failed half-way is discarded from the window, so the disk's version stays.

The journal version of a write is ``version << STEP_SHIFT`` for a step to ``version``, and one past
the bucket's last write for a change outside a step (a seed, STATE set, IMPORT), so the versions only
grow.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from luwu.protocol.errors import ConfigError, RollbackError
from luwu.protocol.layout import Bucket
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.ooc import disk_probe
from luwu.switch_nodes.ooc.bucket import OocBucket, WindowState
from luwu.switch_nodes.ooc.io import IOEngine
from luwu.switch_nodes.ooc.layout import STEP_SHIFT
from luwu.switch_nodes.ooc.lend import Lender
from luwu.switch_nodes.ooc.recovery import (
    file_state,
    folder_of,
    has_state,
    held_of,
    layout_of,
    missing_state,
    open_files,
    read_meta,
    write_meta,
)
from luwu.switch_nodes.ooc.relay import finish_swap, relay
from luwu.switch_nodes.ooc.spill import AlignedPool, Spill
from luwu.switch_nodes.ooc.state_file import StateFile
from luwu.switch_nodes.ooc.weights import WeightsReader, take_kept
from luwu.switch_nodes.ooc.window import StateWindow
from luwu.switch_nodes.optimizers import OptimizerKind
from luwu.switch_nodes.replies import Payload, PullCodec, encode_reply
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.store import Accumulator, BucketState

__all__ = ["OocBucket", "OocShard", "WindowState"]

log = logging.getLogger(__name__)


class OocShard(Shard):
    """The shard on disk, RAM a window over it (see the module's doc)."""

    def __init__(self, ctx: NodeContext, on_stuck: Callable[[set[int]], None]) -> None:
        super().__init__(ctx, on_stuck)
        # accumulators page-aligned: O_DIRECT writes and reads them in place (to the scratch file)
        self.accumulators = AlignedPool(self.accumulators.keep_bytes)
        self.spill = Spill(ctx, self.accumulators, lambda: list(self.buckets.values()))
        if ctx.cfg.push_budget:  # two-phase sums wait for COMMIT in a scratch file, not in RAM
            ctx.inflight.use_spill(self.spill)
        self.window: StateWindow | None = None
        self._weights: WeightsReader | None = None
        self._files: StateFile | None = None
        self._engine: IOEngine | None = None
        self._opened = False  # decided: in RAM (window None) or out of core
        self._open_lock = threading.Lock()
        self._written: dict[int, int] = {}  # bucket -> journal version of its last write
        self._stepped: dict[int, int] = {}  # bucket -> its step once released (written back)
        self._held: tuple[str, ...] | None = None  # the optimizer state the files hold
        self._reported = (0, 0, 0.0)  # bytes read, written, stall seconds given to the metrics

    @property
    def in_ram(self) -> bool:
        """Whether the buckets are in RAM for good (the state fits the budget)."""
        return self._opened and self.window is None

    # ----------------------------------------------------------------- buckets
    def make(self, spec: Bucket, kind: OptimizerKind) -> BucketState:
        b = OocBucket(spec.id, spec.group, spec.numel, list(spec.segments), kind, self.accumulators)
        b.spill = self.spill
        if self.in_ram:
            b.make_resident()
        return b

    def add(self, spec: Bucket, kind: OptimizerKind, version: int) -> BucketState:
        """A bucket added mid-training (add_param_group): with the state files open, they are laid out
        again with it appended (:mod:`.relay`), on the optimizer thread (called from the event loop)."""
        b = super().add(spec, kind, version)
        if self.window is not None:
            self.ctx.queue.call(lambda: self._relay(kind, set(self._held)), self.window.timeout_s)
        return b

    def replace(self, buckets: dict[int, BucketState]) -> None:
        raise ConfigError(  # (node.checkpoint_dir with node.state_dir is refused by NodeConfig)
            f"node {self.ctx.index}: restoring a checkpoint into out-of-core state is not supported"
        )

    @property
    def durable(self) -> bool:
        return self.window is not None

    def set_order(self, order: Iterable[int]) -> None:
        super().set_order(order)
        if self.window is not None:
            self.window.set_order([b.id for b in self.in_step_order()])

    # ----------------------------------------------------------------- opening the state
    def _ensure_open(self) -> None:
        if not self._opened:
            with self._open_lock:
                if not self._opened:
                    self._open()
                    self._opened = True

    def _open(self) -> None:
        """Decide where the state lives, now that the buckets are known; open the files if on disk."""
        ctx, cfg = self.ctx, self.ctx.cfg
        order = self.in_step_order()
        self.set_order([b.id for b in order])
        kind = ctx.kind or (order[0].kind if order else None)
        self._held = file_state(kind) if kind else ()
        layout = layout_of(ctx, order, kind, self._held)
        total = sum(s.slot_bytes for s in layout.buckets)
        budget = ctx.inflight.window_bytes  # (state_memory_bytes less the pushes' share)
        ctx.metrics.state_budget.set(cfg.state_memory_bytes)
        if not budget or total <= budget:
            for b in order:
                b.make_resident()
            if ctx.inflight.spill is not None:  # (an engine of its own: no state files)
                self.spill.open(folder_of(ctx), None)
            log.info(
                "node %s: state of %d buckets (%d B) fits its window of node.state_memory_bytes (%d B): held in RAM, "
                "no state files in %s",
                ctx.index,
                len(order),
                total,
                budget,
                cfg.state_dir,
            )
            return
        folder = folder_of(ctx)
        if has_state(folder):
            raise ConfigError(
                f"node {ctx.index}: {folder} holds the state of an earlier run, which a node restores "
                "when it starts (with node.index set): restart the node, or remove that folder"
            )
        write_meta(folder, ctx, order)  # before the header: a folder with a header has its job.json
        self._engine = IOEngine()
        self._log_disk(folder)
        self._files = StateFile.open(folder, layout, self._engine)
        self._start_window(order)

    def _log_disk(self, folder: Path) -> None:
        """Log what the state folder's disk moves (:mod:`.disk_probe`), once, as the files open."""
        got = disk_probe.measure(self._engine, folder)
        if got is None:
            log.info(
                "node %s: %s refuses O_DIRECT: its disk bandwidth not measured",
                self.ctx.index,
                folder,
            )
        else:
            log.info(
                "node %s: state disk at %s: O_DIRECT writes %.0f MB/s, reads %.0f MB/s "
                "(%d MiB, %d requests of %d KiB in flight)",
                self.ctx.index,
                folder,
                *got,
                disk_probe.PROBE_BYTES >> 20,
                self._engine.num_threads,
                self._engine.request_bytes >> 10,
            )

    def _start_window(self, order: list[BucketState], spill: bool = True) -> None:
        ctx, files = self.ctx, self._files
        total = sum(s.slot_bytes for s in files.layout.buckets)
        budget = ctx.inflight.window_bytes or total
        self.window = StateWindow(
            files,
            [b.id for b in order],
            budget,
            timeout_s=max(60.0, ctx.cfg.worker_timeout_s),
            keep_step=ctx.cfg.mode == "sync",
        )
        if self._weights is not None:  # (a rollback's new window)
            self._weights.close()
        self._weights = WeightsReader(self.window, files, self._take)
        self._lender = Lender(self.window)
        self._written = {bid: c.version for bid, c in files.committed.items() if c is not None}
        self._stepped = {b.id: b.version for b in order}
        if ctx.inflight.spill is not None and spill:
            self.spill.open(files.folder, self._engine)
        log.info(
            "node %s: state out of core in %s: %d buckets, %d B on disk (two slots each: %d B), "
            "a window of %d B (%.1fx smaller than the state; node.state_memory_bytes less node.push_memory_bytes)",
            ctx.index,
            files.folder,
            len(order),
            total,
            files.layout.data_bytes,
            budget,
            total / budget,
        )

    # ----------------------------------------------------------------- restart and rollback
    def reopen(self) -> dict | None:
        """At start, before serving: the state files of an earlier run of this node, if its folder holds
        them, with every bucket put at the newest step all of them hold; returns ``job.json`` (None: no
        earlier run, or no node.index to name the folder by)."""
        ctx = self.ctx
        folder = folder_of(ctx)
        if ctx.index < 0:
            return None
        finish_swap(folder)
        if not has_state(folder):
            return None
        meta, kind, specs = read_meta(folder, ctx)
        self._held = held_of(meta, kind)
        ctx.inflight.check(-1, specs, meta.get("world_size") or 1)  # (sizes the window's share)
        order = [self.make(spec, kind) for spec in specs]
        self._engine = IOEngine()
        self._log_disk(folder)
        try:
            self._files = open_files(
                folder, ctx, layout_of(ctx, order, kind, self._held), self._engine
            )
            step = self._files.bring_to() or 0
            self._settle(order, step)
        except BaseException:
            self.close()
            raise
        self._opened = True
        ctx.metrics.state_budget.set(ctx.cfg.state_memory_bytes)
        log.warning(
            "node %s: restarting from its state files in %s at step %d (every bucket holds it)",
            ctx.index,
            folder,
            step,
        )
        return meta

    def roll_back(self, step: int) -> None:
        """Put every bucket at ``step`` from the state files (ROLLBACK: another node restarted from that
        step); refused (RollbackError) when a bucket's slots no longer hold it. On the optimizer thread."""
        if self.window is None:
            raise RollbackError(
                f"node {self.ctx.index} cannot roll back to step {step}: its state fits "
                "node.state_memory_bytes and is held in RAM only (no state files)",
                step=step,
            )
        order = [self.make(Bucket.from_wire(b.to_wire()), b.kind) for b in self.in_step_order()]
        self.spill.reset()
        self.window.close()
        self.window = None
        try:
            self._files.bring_to(step)
        except Exception as exc:
            self._start_window(self.in_step_order())
            raise RollbackError(
                f"node {self.ctx.index} cannot roll back to step {step}: {exc} (an out-of-core node "
                "holds two steps a bucket: it cannot go back further than one step behind its own)",
                step=step,
            ) from exc
        self._settle(order, step)

    def _settle(self, order: list[OocBucket], step: int) -> None:
        """Hold ``order``'s buckets at ``step`` (the files put there), over a new window."""
        for b in order:
            b.version, b.initialized = step, self._files.committed[b.id] is not None
        self.buckets, self._lent = {b.id: b for b in order}, {}
        self._order = [b.id for b in order]
        self._start_window(order)

    # ----------------------------------------------------------------- the tensors
    def load(self, bid: int) -> BucketState:
        self._ensure_open()
        b = self.buckets[bid]
        if self.window is not None:
            b.attach(self.window.acquire(bid).tensors)
        return b

    def store(self, bid: int, version: int | None = None, *, changed: bool = False) -> None:
        b = self.buckets[bid]
        if version is not None:
            b.version = version
        if self.window is None:
            return
        b.detach()
        if version is None and not changed:
            self.window.release(bid)
        else:
            last = self._written.get(bid, -1)
            jv = version << STEP_SHIFT if version is not None else last + 1
            jv = max(jv, last + 1, b.version << STEP_SHIFT)
            self._written[bid] = jv
            self.window.release(bid, jv)
            self._stepped[bid] = b.version
        self._report()

    def discard(self, bid: int) -> None:
        if self.window is not None:
            self.buckets[bid].detach()
            self.window.discard(bid)

    def commit(self) -> None:
        """Make every stored version durable, with the job's description (``job.json``)."""
        if self.window is not None:
            self.window.flush()
            write_meta(self._files.folder, self.ctx, self.in_step_order(), self._held)

    def make_durable(self) -> int | None:
        """Commit every write-back released so far (from any thread); returns the step every bucket is
        durably at from then on (None: no state files, or a rollback replaced them meanwhile)."""
        window = self.window
        if window is None:
            return None
        stepped = dict(self._stepped)  # (a copy: the optimizer thread releases meanwhile)
        floor = min(stepped.values(), default=0)
        window.flush()
        return floor if window is self.window else None

    def close(self) -> None:
        """Commit what was written and close the files (the node stops)."""
        self.spill.close()
        if self.window is not None:
            try:
                self.window.close()
                write_meta(self._files.folder, self.ctx, self.in_step_order(), self._held)
            finally:
                self.window = None
                if self._weights is not None:
                    self._weights.close()
                    self._weights = None
        if self._files is not None:
            self._files.close()
            self._files = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def apply(
        self, b: BucketState, step: int, acc: Accumulator, divisor: float, skip: bool
    ) -> None:
        self._ensure_open()
        if not skip and self.window is not None:
            self._check_state(b, step, acc.hyper)
        self.load(b.id)
        try:
            if not skip:
                self.before_write(b.id)
                b.apply(acc, divisor)
        except BaseException:
            self.discard(b.id)
            raise
        self.store(b.id, step + 1)

    def step_bucket(
        self,
        b: BucketState,
        step: int,
        acc: Accumulator,
        divisor: float,
        skip: bool,
        codec: PullCodec,
    ) -> Payload:
        self._ensure_open()
        if self.window is None:
            return super().step_bucket(b, step, acc, divisor, skip, codec)
        if not skip:
            self._check_state(b, step, acc.hyper)
        self.load(b.id)
        was = b.version
        try:
            codec.before_step(b)
            if not skip:
                self.before_write(b.id)  # (its last reply may go zero-copy from the window still)
                b.apply(acc, divisor)
            b.version = step + 1
            payload = self._owned(encode_reply(b, codec, self.lent(b.id)), b.id)
        except BaseException:
            b.version = was
            self.discard(b.id)
            raise
        self.store(b.id, step + 1)
        return payload

    def hold_state(self, b: BucketState, names: Iterable[str]) -> None:
        """A state set (``load_state_dict``) that carries state the files leave out (amsgrad's
        maximum, say): before any bucket has stepped, the files are laid out again to hold it, as a
        first step naming it does; after, the set is refused (:class:`.bucket.WindowState`)."""
        self._ensure_open()
        want = [n for n in names if n not in self._held]
        if want and self.window is not None and all(x.version == 0 for x in self.buckets.values()):
            self._relay(b.kind, set(self._held) | set(want))

    def _check_state(self, b: BucketState, step: int, hyper: dict | None) -> None:
        """Refuse a step whose hyperparameters need optimizer state the files leave out (such as
        ``amsgrad``'s), unless no bucket has stepped yet: then the files are laid out again to hold it
        (:mod:`.relay`; zeros, as torch starts it)."""
        want = [n for n in b.kind.state_for(hyper or {}) if n not in self._held]
        if want and all(x.version == 0 for x in self.buckets.values()):
            self._relay(b.kind, set(self._held) | set(want))
        missing_state(self.ctx, b, step, hyper, self._held)

    def _relay(self, kind: OptimizerKind, held: set[str]) -> None:
        """Lay the state files out again for the shard's buckets, holding ``held`` (on the optimizer
        thread, nothing loaded)."""
        names = tuple(n for n in kind.state_names if n in held)
        order = self.in_step_order()
        self.window.close()
        self.window = None
        layout = layout_of(self.ctx, order, kind, names)
        folder = self._files.folder
        meta = lambda p: write_meta(p, self.ctx, order, names)  # noqa: E731
        self._files = relay(folder, self._files, layout, self._engine, meta)
        self._held = names
        log.warning(
            "node %s: state files in %s laid out again: %d buckets, holding %s",
            self.ctx.index,
            folder,
            len(order),
            ", ".join(names),
        )
        self._start_window(order, spill=False)

    def encode(self, b: BucketState, codec: PullCodec) -> Payload:
        self._ensure_open()
        if self.window is None:
            return super().encode(b, codec)
        params = self._weights.read(b.id)  # the weights alone, not the whole slot
        if params is not None:
            b.params = params
            try:
                return encode_reply(b, codec, self.lent(b.id))
            finally:
                b.params = None
                self._report()
        self.load(b.id)
        try:
            return self._owned(encode_reply(b, codec, self.lent(b.id)))
        finally:
            self.store(b.id)

    def _owned(self, p: Payload, lend_from: int | None = None) -> Payload:
        """``p`` with its frames that are views of the window (they change once released) lent from
        bucket ``lend_from``'s slot (a step's reply in sync mode: :mod:`.lend`), or else copied."""
        lend = lend_from if self.ctx.cfg.mode == "sync" else None
        return self._lender.own(p, lend, self._copy)

    def _take(self, nbytes: int) -> torch.Tensor | None:
        """Memory for what leaves in a reply (:func:`.weights.take_kept`)."""
        return take_kept(self.ctx.listener, nbytes)

    def _copy(self, f: torch.Tensor) -> torch.Tensor:
        """A copy of ``f`` (a view of the window) that a reply may keep, in kept memory."""
        raw = self._take(f.numel() * f.element_size()) if f.is_contiguous() else None
        return f.clone() if raw is None else raw.view(f.dtype).view(f.shape).copy_(f)

    def _report(self) -> None:
        """The window's counters into the node's metrics (what moved since the last report)."""
        s, m = self.window.stats, self.ctx.metrics
        with (
            self._open_lock
        ):  # (a seed stores from the event loop, a step from the optimizer thread)
            r, w, stall = self._reported
            self._reported = (s.bytes_read, s.bytes_written, s.stall_s)
        m.state_read.inc(max(0, s.bytes_read - r))
        m.state_written.inc(max(0, s.bytes_written - w))
        m.state_stall.inc(max(0.0, s.stall_s - stall))
        m.state_resident.set(self.window.resident_bytes)

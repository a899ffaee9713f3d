"""Durability: checkpoints, restore, rollback, and a bucket's state read or written whole.

A node checkpoints every ``checkpoint_every`` steps (each bucket waits at that
step until all have reached it, so one file holds one step), on CHECKPOINT and
on shutdown; it restores the newest valid checkpoint when it starts. Workers
of a restarted node are told to roll back (RollbackError with the step and the
node's boot id); ROLLBACK then brings every other node to the same checkpoint,
once per (step, boot). At start-up a checkpoint that cannot be read or
restored, whatever the reason, is skipped and the next older one is tried: one
file never stops a node. A checkpoint of the old file format restored at
start-up is written again as a checkpoint folder (:mod:`.checkpoint`) and the
file removed. An out-of-core shard's state files are its checkpoint (no second
copy): it restarts from them (:meth:`Shard.reopen`), a checkpoint commits them, and
a rollback puts its buckets at the step from them (:meth:`Shard.roll_back`). STATE
gets or sets a bucket's weights and optimizer state (``state_dict`` /
``load_state_dict``). Everything touching the shard runs on the optimizer thread.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from luwu.protocol import messages as wire
from luwu.protocol.errors import (
    ConfigError,
    LuwuError,
    ProtocolError,
    RollbackError,
    StepMismatchError,
)
from luwu.protocol.layout import Bucket
from luwu.protocol.messages import Op
from luwu.switch_nodes.checkpoint import Checkpoint
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.effects import Answer, Effect, GetState, Ready, Reply, Reset
from luwu.switch_nodes.optimizers import get_kind
from luwu.switch_nodes.replies import PullCodecs
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.store import BucketState

log = logging.getLogger(__name__)


class Durability:
    """Checkpoints of the shard, restore and rollback, STATE. ``codecs``: what the workers hold of
    each bucket, forgotten when its weights change outside a step."""

    def __init__(self, ctx: NodeContext, shard: Shard, codecs: PullCodecs) -> None:
        self.ctx, self.shard, self.codecs = ctx, shard, codecs
        self._rollbacks_done: set[tuple[int, str]] = set()
        self._parked: list[Ready] = []  # steps held for a periodic checkpoint
        self._committed_step = 0  # out of core: the last step whose periodic checkpoint committed
        self._failed_step = (
            0  # the last periodic checkpoint that could not be written (not tried again)
        )
        self._durable_step = -1  # out of core, sync mode: every bucket's writes of it are committed
        self._durable_lock = asyncio.Lock()

    # ----------------------------------------------------------------- a step durable before it ends
    async def settle(self, b: BucketState) -> None:
        """Out of core, sync mode: before a reply carries ``b`` at the step all the shard's buckets have
        reached (the last reply of a step, or a weight fetch after it), wait until every bucket's write of
        that step is committed to the state files. No worker pushes step t + 1 before it has every
        node's last reply of step t, so then every node has committed step t: a node restarted from its
        files is at most one step behind the others, which their two slots a bucket still hold (ROLLBACK).
        The other replies of a step go as they are ready; the writes commit meanwhile."""
        shard, step = self.shard, b.version
        if not shard.durable or self.ctx.cfg.mode != "sync" or step <= self._durable_step:
            return
        if any(x.version < step for x in list(shard.buckets.values())):
            return  # not the step's last reply: another bucket is still behind
        async with self._durable_lock:
            while self._durable_step < step:
                floor = await asyncio.to_thread(shard.make_durable)
                if floor is None:
                    return  # a rollback replaced the files meanwhile: this reply is dropped anyway
                if floor < step:  # a bucket's write-back is being handed to the window right now
                    await asyncio.sleep(0.001)
                self._durable_step = max(self._durable_step, floor)

    # ----------------------------------------------------------------- checkpoints
    def restore_latest(self) -> None:
        """At start: restore the newest checkpoint that reads and restores whole; one that does not (any
        exception but another job's checkpoint, which is the operator's to fix) is skipped, logged, and the
        next older one tried."""
        ctx = self.ctx
        if ctx.ckpt is None:
            meta = self.shard.reopen()
            if meta is not None:
                self._reopened(meta)
            return
        for ckpt in ctx.ckpt.candidates():
            try:
                self.restore(ckpt)
            except ConfigError:
                raise
            except Exception as exc:
                ctx.metrics.errors.labels("checkpoint_corrupt").inc()
                log.error(
                    "node %s: skipping checkpoint %s: it cannot be restored (%s: %s); trying the next older one",
                    ctx.index,
                    ckpt.path,
                    type(exc).__name__,
                    str(exc)[:300],
                )
                continue
            ctx.ckpt.used(ckpt)
            self.ctx.restored_step = self.shard.step
            log.warning(
                "node %s restored step %d from %s", ctx.index, self.ctx.restored_step, ckpt.path
            )
            if ckpt.legacy:
                self._convert(ckpt)
            return

    def _reopened(self, meta: dict) -> None:
        """The shard took up its own files (checked by it): the job as they describe it."""
        ctx = self.ctx
        ctx.kind, ctx.layout_hash = get_kind(meta["optimizer"]), meta["layout"]
        ctx.world_size, ctx.members = meta["world_size"], set(range(meta["world_size"]))
        ctx.param_names = {int(k): v for k, v in meta["param_names"].items()}
        ctx.restored_step = self.shard.step
        ctx.metrics.step.set(ctx.restored_step)
        ctx.metrics.checkpoint_step.set(ctx.restored_step)

    def _convert(self, ckpt: Checkpoint) -> None:
        """An old-format checkpoint was restored: write the node's state (just restored from it) as a
        checkpoint folder, then remove the file, so it is read once. A write that fails leaves the file."""
        try:
            self.write_checkpoint()
        except OSError as exc:
            log.error(
                "node %s could not convert checkpoint %s to a checkpoint folder: %s (it stays, and is read again at the next start)",
                self.ctx.index,
                ckpt.path,
                exc,
            )
            return
        ckpt.path.unlink(missing_ok=True)
        log.warning(
            "node %s converted checkpoint %s into a checkpoint folder of step %d",
            self.ctx.index,
            ckpt.path,
            self.shard.step,
        )

    def write_checkpoint(self) -> None:
        """Runs on the optimizer thread (nothing else touches the shard meanwhile). Out of core: commits
        the state files."""
        ctx = self.ctx
        if ctx.ckpt is None:
            self.shard.commit()
            ctx.metrics.checkpoint_step.set(self.shard.step)
            return
        kind = ctx.kind
        meta = {
            **ctx.job_description(),
            "step": self.shard.step,
            "step_in_state": kind.step_in_state if kind else True,
            "state_names": list(kind.state_names) if kind else [],
            "buckets": [self._saved(b) for b in self.shard.buckets.values()],
        }
        tensors = {
            b.id: {"params": b.params, **{n: b.state.read(n) for n in self._states(b)}}
            for b in self.shard.buckets.values()
        }
        path = ctx.ckpt.save(meta, tensors)
        ctx.metrics.checkpoint_step.set(meta["step"])
        log.info("node %s wrote checkpoint of step %d: %s", ctx.index, meta["step"], path)

    @staticmethod
    def _states(b: BucketState) -> list[str]:
        """The state tensors of ``b`` in use (allocated), in the kind's order; the others are zero."""
        used = set(b.state.allocated())
        return [n for n in b.kind.state_names if n in used]

    def _saved(self, b: BucketState) -> dict:
        """A bucket's entry in the checkpoint manifest."""
        return {
            "id": b.id,
            "spec": b.to_wire(),
            "version": b.version,
            "initialized": b.initialized,
            "steps": [float(x) for x in b.steps],
            "states": self._states(b),
        }

    def restore(self, ckpt: Checkpoint) -> None:
        """Replace the job's buckets by the checkpoint's (on the optimizer thread, or before serving). Every
        field is checked and the buckets are built before the node changes: a checkpoint that does not
        describe a job this node can hold raises and leaves the node as it was."""
        ctx, m = self.ctx, ckpt.meta
        if not isinstance(m, dict):
            raise ProtocolError(
                f"checkpoint {ckpt.path}: its header is a {type(m).__name__}, not a table"
            )
        if m["job"] != ctx.job:
            raise ConfigError(
                f"checkpoint {ckpt.path} belongs to job {m['job']!r}, this node serves {ctx.job!r}"
            )
        try:
            kind = get_kind(m["optimizer"])
        except ConfigError as exc:  # (only another job's checkpoint is the operator's to fix)
            raise ProtocolError(f"checkpoint {ckpt.path}: {exc}") from None
        world, layout = m["world_size"], m["layout"]
        if (
            type(world) is not int
            or not 1 <= world <= ctx.cfg.max_world_size
            or not isinstance(layout, str)
        ):
            raise ProtocolError(
                f"checkpoint {ckpt.path}: world size {str(world)[:40]} / layout {str(layout)[:40]} are not a job's"
            )
        names = {int(k): v for k, v in m.get("param_names", {}).items()}
        if not all(isinstance(v, str) for v in names.values()):
            raise ProtocolError(f"checkpoint {ckpt.path}: parameter names that are not strings")
        buckets = {}
        for saved in m["buckets"]:
            b = self._bucket(ckpt, saved, kind)
            if b.id in buckets:
                raise ProtocolError(f"checkpoint {ckpt.path}: bucket {b.id} twice")
            buckets[b.id] = b
        ctx.kind, ctx.layout_hash, ctx.world_size, ctx.param_names = kind, layout, world, names
        ctx.members = set(range(world))
        self.shard.replace(buckets)
        ctx.metrics.step.set(self.shard.step)
        ctx.metrics.checkpoint_step.set(self.shard.step)

    def _bucket(self, ckpt: Checkpoint, saved: dict, kind) -> BucketState:
        """One saved bucket, checked against its tensors before anything of its size is allocated."""
        spec = Bucket.from_wire(saved["spec"])
        ts = ckpt.tensors[saved["id"]]
        version, initialized = saved["version"], saved["initialized"]
        sizes = [t.numel() for t in ts]
        if (
            saved["id"] != spec.id
            or sizes != [spec.numel] * (len(sizes) - 1) + [len(spec.segments)]
            or len(sizes) != 2 + len(kind.state_names)
        ):
            raise ProtocolError(
                f"checkpoint {ckpt.path}: bucket {spec.id}'s tensors ({sizes[:6]}) do not match its spec"
            )
        if type(version) is not int or version < 0 or type(initialized) is not bool:
            raise ProtocolError(
                f"checkpoint {ckpt.path}: bucket {spec.id} has version {str(version)[:40]}, initialized {str(initialized)[:40]}"
            )
        b = self.shard.make(spec, kind)
        b.load(ts)
        b.version, b.initialized = version, initialized
        return b

    async def hold(self, ready: Ready) -> list[Effect] | None:
        """A periodic checkpoint is due at the ready step: hold it (not None) until every bucket has
        reached that step, then write the checkpoint and let the held steps go on (the effects
        returned). None: not held, it goes on now."""
        ctx, every, step = self.ctx, self.ctx.cfg.checkpoint_every, ready.step
        if ctx.ckpt is None and self.shard.durable and every and step > 0 and step % every == 0:
            if step > self._committed_step:  # (out of core: commit, nothing to hold; once per step)
                self._committed_step = step
                await ctx.queue.run(self.write_checkpoint)
            return None
        if (
            ctx.ckpt is None
            or not every
            or step % every != 0
            or step <= 0
            or max(ctx.ckpt.last_step or 0, self._failed_step) >= step
        ):
            return None
        self._parked.append(ready)
        if not all(x.version >= step for x in self.shard.buckets.values()):
            return []
        await self._write_periodic(step)
        parked, self._parked = self._parked, []
        out: list[Effect] = []
        for p in parked:
            if p.then.acc.workers >= ctx.members:
                out.append(p.then)
            else:  # a rank rejoined meanwhile: the step waits for its push (it completes it again)
                p.then.acc.started = p.then.acc.norm_sent = False
        return out

    async def _write_periodic(self, step: int) -> None:
        """The periodic checkpoint of ``step``; one that cannot be written is logged, not retried."""
        ctx = self.ctx
        try:
            await ctx.queue.run(self.write_checkpoint)
        except OSError as exc:  # a full or broken disk: training goes on from the last one written
            self._failed_step = step
            ctx.metrics.errors.labels("checkpoint_failed").inc()
            log.error(
                "node %s could not write the checkpoint of step %d into %s: %s; training goes on, a restart would "
                "roll back to step %s (free space or fix node.checkpoint_dir)",
                ctx.index,
                step,
                ctx.cfg.checkpoint_dir,
                exc,
                ctx.ckpt.last_step,
            )

    async def on_checkpoint(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        if self.ctx.ckpt is None and not self.shard.durable:
            raise ConfigError(
                f"node {self.ctx.index} has no checkpoint_dir (and a node index) configured"
            )
        try:
            await self.ctx.queue.run(self.write_checkpoint)
        except OSError as exc:
            raise LuwuError(
                f"node {self.ctx.index} could not write its checkpoint into {self.ctx.cfg.checkpoint_dir}: {exc} (free space or fix node.checkpoint_dir)"
            ) from None
        return [Answer(ident, Op.CHECKPOINT, msg.header["worker"])]

    async def on_rollback(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """Roll this node back to its checkpoint of ``step`` (once per (step, boot of the restarted node))."""
        ctx, h = self.ctx, msg.header
        step = h["step"]
        boot = str((h.get("detail") or {}).get("boot", ""))
        out: list[Effect] = []
        if (step, boot) not in self._rollbacks_done and not (
            self.ctx.restored_step == step and boot == ctx.boot
        ):
            ctx.queue.gen += 1  # queued steps and replies of the abandoned timeline are dropped
            self._durable_step = -1
            if ctx.ckpt is None and self.shard.durable:
                await ctx.queue.run(self.shard.roll_back, step)
                ctx.metrics.step.set(self.shard.step)
            else:
                await self._restore_step(step)
            self._parked = []
            log.warning(
                "node %s rolled back to step %d (restart of boot %s)", ctx.index, step, boot
            )
            out.append(Reset())
        self._rollbacks_done.add((step, boot))
        return [*out, Answer(ident, Op.ROLLBACK, h["worker"])]

    async def _restore_step(self, step: int) -> None:
        """Restore the checkpoint of ``step`` (a rollback), keeping who is connected."""
        ctx = self.ctx
        if ctx.ckpt is None:
            raise ConfigError(f"node {ctx.index} cannot roll back: no checkpoint_dir configured")
        ckpt = await ctx.queue.run(ctx.ckpt.latest, step)
        if ckpt is None:
            raise RollbackError(
                f"node {ctx.index} has no valid checkpoint of step {step} to roll back to",
                step=step,
            )
        peers = dict(ctx.peers)
        await ctx.queue.run(self.restore, ckpt)
        ctx.peers = peers

    # ----------------------------------------------------------------- STATE
    async def on_state(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """Get or set a bucket's weights and optimizer state (``state_dict`` / ``load_state_dict``)."""
        ctx, h = self.ctx, msg.header
        b = self.shard.bucket(h["bucket"])
        names = ["params", *b.kind.state_names, "steps"]
        reply = {
            "op": Op.STATE,
            "job": ctx.job,
            "step": b.version,
            "worker": h["worker"],
            "bucket": b.id,
            "action": h["action"],
            "names": names,
        }
        if h["action"] == "get":
            return [GetState(ident, b, reply)]  # behind the steps queued before it
        if h["action"] == "set":
            self._check_state_set(b, h, names)
            frames = [t.view(torch.float32) for t in msg.tensors()]

            def work():
                nonzero = [n for n, t in zip(names[1:-1], frames[1:-1]) if bool(t.any())]
                self.shard.hold_state(b, nonzero)
                with self.shard.loaded(b.id, write=True):
                    self.shard.before_write(b.id)
                    b.load(frames)
                b.initialized = True
                self.codecs.resync(b.id)

            await ctx.queue.run(work)
            return [Reply(ident, wire.encode(reply))]
        else:
            raise ProtocolError(f"STATE action must be 'get' or 'set', got {h['action']!r}")

    @staticmethod
    def _check_state_set(b: BucketState, h: dict, names: list[str]) -> None:
        if h["names"] != names:
            raise ProtocolError(f"STATE set of bucket {b.id} must carry {names}, got {h['names']}")
        want = [b.numel * 4] * (len(names) - 1) + [len(b.steps) * 4]
        if h["nbytes"] != want:
            raise ProtocolError(
                f"STATE set of bucket {b.id}: frame sizes {h['nbytes']}, expected {want}"
            )
        if b.accs:
            raise StepMismatchError(
                f"STATE set of bucket {b.id} while step {sorted(b.accs)} is being aggregated"
            )

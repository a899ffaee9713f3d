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
file removed. STATE gets or sets a bucket's weights and optimizer
state (``state_dict`` / ``load_state_dict``). Everything touching the shard
runs on the optimizer thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

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
from luwu.switch_nodes.optimizers import get_kind
from luwu.switch_nodes.store import BucketState

if TYPE_CHECKING:
    from luwu.switch_nodes.server import NodeServer

log = logging.getLogger(__name__)


class Durability:
    def __init__(self, node: NodeServer):
        self.node = node
        self.restored_step: int | None = None
        self._rollbacks_done: set[tuple[int, str]] = set()
        self._parked: list[
            tuple[BucketState, int]
        ] = []  # completions held for a periodic checkpoint
        self._failed_step = (
            0  # the last periodic checkpoint that could not be written (not tried again)
        )

    # ----------------------------------------------------------------- checkpoints
    def restore_latest(self) -> None:
        """At start: restore the newest checkpoint that reads and restores whole; one that does not (any
        exception but another job's checkpoint, which is the operator's to fix) is skipped, logged, and the
        next older one tried."""
        node = self.node
        if node.ckpt is None:
            return
        for ckpt in node.ckpt.candidates():
            try:
                self.restore(ckpt)
            except ConfigError:
                raise
            except Exception as exc:
                node.metrics.errors.labels("checkpoint_corrupt").inc()
                log.error(
                    "node %s: skipping checkpoint %s: it cannot be restored (%s: %s); trying the next older one",
                    node.index,
                    ckpt.path,
                    type(exc).__name__,
                    str(exc)[:300],
                )
                continue
            node.ckpt.used(ckpt)
            self.restored_step = node.step
            log.warning(
                "node %s restored step %d from %s", node.index, self.restored_step, ckpt.path
            )
            if ckpt.legacy:
                self._convert(ckpt)
            return

    def _convert(self, ckpt: Checkpoint) -> None:
        """An old-format checkpoint was restored: write the node's state (just restored from it) as a
        checkpoint folder, then remove the file, so it is read once. A write that fails leaves the file."""
        try:
            self.write_checkpoint()
        except OSError as exc:
            log.error(
                "node %s could not convert checkpoint %s to a checkpoint folder: %s (it stays, and is read again at the next start)",
                self.node.index,
                ckpt.path,
                exc,
            )
            return
        ckpt.path.unlink(missing_ok=True)
        log.warning(
            "node %s converted checkpoint %s into a checkpoint folder of step %d",
            self.node.index,
            ckpt.path,
            self.node.step,
        )

    def write_checkpoint(self) -> None:
        """Runs on the optimizer thread (nothing else touches the shard meanwhile)."""
        node = self.node
        kind = node.kind
        meta = {
            "job": node.job,
            "node": node.index,
            "layout": node.layout_hash,
            "world_size": node.world_size,
            "optimizer": kind.name if kind else None,
            "step": node.step,
            "step_in_state": kind.step_in_state if kind else True,
            "state_names": list(kind.state_names) if kind else [],
            "param_names": {str(k): v for k, v in node.param_names.items()},
            "buckets": [self._saved(b) for b in node.buckets.values()],
        }
        tensors = {
            b.id: {"params": b.params, **{n: b.state.read(n) for n in self._states(b)}}
            for b in node.buckets.values()
        }
        path = node.ckpt.save(meta, tensors)
        node.metrics.checkpoint_step.set(meta["step"])
        log.info("node %s wrote checkpoint of step %d: %s", node.index, meta["step"], path)

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
        node, m = self.node, ckpt.meta
        if not isinstance(m, dict):
            raise ProtocolError(
                f"checkpoint {ckpt.path}: its header is a {type(m).__name__}, not a table"
            )
        if m["job"] != node.job:
            raise ConfigError(
                f"checkpoint {ckpt.path} belongs to job {m['job']!r}, this node serves {node.job!r}"
            )
        try:
            kind = get_kind(m["optimizer"])
        except ConfigError as exc:  # (only another job's checkpoint is the operator's to fix)
            raise ProtocolError(f"checkpoint {ckpt.path}: {exc}") from None
        world, layout = m["world_size"], m["layout"]
        if (
            type(world) is not int
            or not 1 <= world <= node.cfg.max_world_size
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
        node.kind, node.layout_hash, node.world_size, node.param_names = kind, layout, world, names
        node.members = set(range(world))
        node.buckets = buckets
        node.replies.reset()
        for bid in buckets:
            node.replies.add(bid)
        node.metrics.step.set(node.step)
        node.metrics.checkpoint_step.set(node.step)

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
        b = BucketState(
            spec.id, spec.group, spec.numel, list(spec.segments), kind, self.node.accumulators
        )
        b.load(ts)
        b.version, b.initialized = version, initialized
        return b

    async def park_for_checkpoint(self, b: BucketState, step: int) -> bool:
        """A periodic checkpoint is due at ``step``: hold this bucket's step (True) until every bucket
        has reached it, then write the checkpoint and let the held steps go on."""
        node, every = self.node, self.node.cfg.checkpoint_every
        if (
            node.ckpt is None
            or not every
            or step % every != 0
            or step <= 0
            or max(node.ckpt.last_step or 0, self._failed_step) >= step
        ):
            return False
        self._parked.append((b, step))
        if all(x.version >= step for x in node.buckets.values()):
            try:
                await node.run(self.write_checkpoint)
            except OSError as exc:  # a full or broken disk: training goes on, from the last checkpoint that was written
                self._failed_step = step
                node.metrics.errors.labels("checkpoint_failed").inc()
                log.error(
                    "node %s could not write the checkpoint of step %d into %s: %s; training goes on, a restart would "
                    "roll back to step %s (free space or fix node.checkpoint_dir)",
                    node.index,
                    step,
                    node.cfg.checkpoint_dir,
                    exc,
                    node.ckpt.last_step,
                )
            parked, self._parked = self._parked, []
            for pb, pstep in parked:
                pacc = pb.accs.get(pstep)
                if pacc is not None and pacc.workers >= node.members:
                    await node.aggregation.complete(pb, pstep, pacc)
        return True

    async def on_checkpoint(self, ident: bytes, msg: wire.Message) -> None:
        if self.node.ckpt is None:
            raise ConfigError(
                f"node {self.node.index} has no checkpoint_dir (and a node index) configured"
            )
        try:
            await self.node.run(self.write_checkpoint)
        except OSError as exc:
            raise LuwuError(
                f"node {self.node.index} could not write its checkpoint into {self.node.cfg.checkpoint_dir}: {exc} (free space or fix node.checkpoint_dir)"
            ) from None
        self.node.answer(ident, Op.CHECKPOINT, msg.header["worker"])

    async def on_rollback(self, ident: bytes, msg: wire.Message) -> None:
        """Roll this node back to its checkpoint of ``step`` (once per (step, boot of the restarted node))."""
        node, h = self.node, msg.header
        step = h["step"]
        boot = str((h.get("detail") or {}).get("boot", ""))
        if (step, boot) not in self._rollbacks_done and not (
            self.restored_step == step and boot == node.boot
        ):
            node.gen += 1  # queued steps and replies of the abandoned timeline are dropped
            if node.ckpt is None:
                raise ConfigError(
                    f"node {node.index} cannot roll back: no checkpoint_dir configured"
                )
            ckpt = await node.run(node.ckpt.latest, step)
            if ckpt is None:
                raise RollbackError(
                    f"node {node.index} has no valid checkpoint of step {step} to roll back to",
                    step=step,
                )
            peers = dict(node.peers)
            await node.run(self.restore, ckpt)
            node.peers = peers
            self._parked = []
            log.warning(
                "node %s rolled back to step %d (restart of boot %s)", node.index, step, boot
            )
        self._rollbacks_done.add((step, boot))
        node.answer(ident, Op.ROLLBACK, h["worker"])

    # ----------------------------------------------------------------- STATE
    async def on_state(self, ident: bytes, msg: wire.Message) -> None:
        """Get or set a bucket's weights and optimizer state (``state_dict`` / ``load_state_dict``)."""
        node, h = self.node, msg.header
        b = node.bucket(h)
        names = ["params", *b.kind.state_names, "steps"]
        reply = {
            "op": Op.STATE,
            "job": node.job,
            "step": b.version,
            "worker": h["worker"],
            "bucket": b.id,
            "action": h["action"],
            "names": names,
        }
        if h["action"] == "get":

            def snapshot():
                reply["step"] = b.version  # as of the snapshot, behind the steps queued before it
                return [t.clone() for t in b.tensors()]

            async def get():
                node.send(ident, wire.encode(reply, await node.run(snapshot)))

            node.submit(get)
        elif h["action"] == "set":
            self._check_state_set(b, h, names)
            frames = [t.view(torch.float32) for t in msg.tensors()]

            def work():
                node.replies.wait_sent(b.id)
                b.load(frames)
                b.initialized = True
                node.replies.resync(b.id)

            await node.run(work)
            node.send(ident, wire.encode(reply))
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

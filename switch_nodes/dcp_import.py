"""IMPORT: a node reads its shard of a training checkpoint (a ``torch.distributed.checkpoint`` folder).

The folder holds the key layout of torch's distributed state dicts (``model.<name>``,
``optim.state.<name>.<state>``; :mod:`.export`), written by LuWu nodes of any count and layout or
by an FSDP2 job. The node reads, for each segment of its buckets, the boxes of the segment's range
of the parameter and of each state tensor the folder has, with DCP's reader and the folder's chunk
list (:class:`luwu.protocol.dcp_files.DcpFolder`: metadata read without running its pickle), and
installs master weights, optimizer state and step counters; every bucket's version becomes the
step in the header (the job's step the checkpoint was taken at).

Every rank of the job sends IMPORT (it is collective, as ``dcp.load`` is), and each then pulls the
weights; the node reads the folder once per round: at the first rank's IMPORT of a folder, and again
only when a rank that asked already asks again (a new round). Everything is checked against the
folder's metadata before the first bucket changes; a bucket is read into new tensors and then
installed, so a node never holds a second copy of its shard.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from luwu.protocol import messages as wire
from luwu.protocol.dcp_files import DcpFolder
from luwu.protocol.errors import ConfigError, LuwuError, ProtocolError, StepMismatchError
from luwu.protocol.messages import Op
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.effects import Effect, Reply, Seeded
from luwu.switch_nodes.export import MODEL, OPTIM_STATE, Request, box_views, boxes
from luwu.switch_nodes.replies import PullCodecs
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.torch_state import slot, step_of

if TYPE_CHECKING:
    from luwu.switch_nodes.export import Exports
    from luwu.switch_nodes.store import BucketState

log = logging.getLogger(__name__)


class Imports:
    """IMPORT rounds: which ranks of the job asked for which folder."""

    def __init__(self, ctx: NodeContext, shard: Shard, codecs: PullCodecs, exports: Exports):
        self.ctx, self.shard, self.codecs, self.exports = ctx, shard, codecs, exports
        # folder -> (step, the ranks that asked this round)
        self._rounds: dict[Path, tuple[int, set[int]]] = {}

    async def on_import(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        ctx, h = self.ctx, msg.header
        folder = self.exports.target(h["path"])
        request = Request.parse(Op.IMPORT, msg.tensors())
        step, w = h["step"], h["worker"]
        current = self._rounds.get(folder)
        out: list[Effect] = []
        if current is None or current[0] != step or w in current[1]:
            self._rounds.pop(folder, None)
            was = {b.id for b in self.shard.buckets.values() if b.initialized}
            await ctx.queue.run(self.load, folder, request, step)
            # PULLs that waited for a seed
            out += [Seeded(b) for b in self.shard.buckets.values() if b.id not in was]
            ctx.metrics.step.set(self.shard.step)
            current = self._rounds[folder] = (step, set())
        current[1].add(w)
        if current[1] >= ctx.members:
            del self._rounds[folder]
        header = {"op": Op.IMPORT, "job": ctx.job, "step": step, "worker": w, "path": str(folder)}
        return [*out, Reply(ident, wire.encode(header))]

    def load(self, folder: Path, request: Request, step: int) -> None:
        """On the optimizer thread: check the folder against every bucket, then read and install each."""
        ctx = self.ctx
        what = f"node {ctx.index}: checkpoint {folder}"
        try:
            source = DcpFolder(folder, what)
        except LuwuError as exc:
            raise type(exc)(f"node {ctx.index}: {exc}") from None
        buckets = sorted(self.shard.buckets.values(), key=lambda b: b.id)
        for b in buckets:
            if b.accs:
                raise StepMismatchError(
                    f"{what}: bucket {b.id} is aggregating step {sorted(b.accs)}: load between steps",
                    bucket=b.id,
                )
            source.plan(self._boxes(source, b, request))
        for b in buckets:
            tensors = [torch.zeros(b.numel) for _ in range(1 + len(b.kind.state_names))] + [
                torch.zeros(len(b.segments))
            ]
            try:
                self._read(source, b, request, tensors)
            except LuwuError as exc:
                raise type(exc)(
                    f"{exc} (bucket {b.id}; the buckets before it are loaded already: load again)",
                    bucket=b.id,
                ) from None
            with self.shard.loaded(b.id, write=True):
                self.shard.before_write(b.id)
                b.load(tensors)
                b.initialized, b.version, b.held = True, step, []
            # async mode: every worker has pushed up to the step before the loaded one
            b.worker_steps = {r: step - 1 for r in range(ctx.world_size or 0)}
            self.codecs.resync(b.id)
        log.info(
            "node %s loaded %d buckets of step %d from %s", ctx.index, len(buckets), step, folder
        )

    def _keys(self, source: DcpFolder, b: BucketState, request: Request):
        """Per segment: its index, the segment, its parameter's name and shape, and the (state index, name,
        key, shape) of each state tensor the folder has for it, its shape checked."""
        for si, s in enumerate(b.segments):
            try:
                name, shape = request.param(s)
            except ProtocolError as exc:
                raise ProtocolError(f"{source.what}, bucket {b.id}: {exc}") from None
            size = source.size(MODEL + name)
            if size is not None and size != shape:
                raise ConfigError(
                    f"{source.what}: {MODEL}{name} has shape {size}, the model's is {shape}: load a checkpoint of this model"
                )
            states = []
            for n, state_shape in b.kind.state_shapes(shape).items():
                key = f"{OPTIM_STATE}{name}.{n}"
                size = source.size(key)
                if size is None:
                    continue
                if size != tuple(state_shape):
                    raise ConfigError(
                        f"{source.what}: {key} has shape {size}, torch's for this model is {tuple(state_shape)}"
                    )
                states.append((b.kind.state_names.index(n) + 1, n, key, tuple(state_shape)))
            yield si, s, name, shape, states

    def _boxes(self, source: DcpFolder, b: BucketState, request: Request) -> dict[str, list]:
        """Every box bucket ``b`` reads, by key (for :meth:`DcpFolder.plan`)."""
        wants: dict[str, list] = {}
        for _si, s, name, shape, states in self._keys(source, b, request):
            wants.setdefault(MODEL + name, []).extend(
                boxes(shape, s.param_offset, s.param_offset + s.numel)
            )
            for _, _, key, state_shape in states:
                start, length = slot(shape, state_shape, s.param_offset, s.numel)
                wants.setdefault(key, []).extend(boxes(state_shape, start, start + length))
            step_key = f"{OPTIM_STATE}{name}.step"
            if b.kind.step_in_state and states and source.size(step_key) is None:
                raise ProtocolError(
                    f"{source.what} has optimizer state of {name} and no {step_key}"
                )
        return wants

    def _read(
        self, source: DcpFolder, b: BucketState, request: Request, tensors: list[torch.Tensor]
    ) -> None:
        """Bucket ``b``'s weights, state and step counters from the folder into ``tensors`` ([params,
        *state, steps], as ``BucketState.load`` takes them)."""
        wants: dict[str, list] = {}
        steps = {}
        for si, s, name, shape, states in self._keys(source, b, request):
            wants.setdefault(MODEL + name, []).extend(
                box_views(tensors[0].narrow(0, s.offset, s.numel), shape, s.param_offset)
            )
            for k, _, key, state_shape in states:
                start, length = slot(shape, state_shape, s.param_offset, s.numel)
                wants.setdefault(key, []).extend(
                    box_views(tensors[k].narrow(0, s.offset, length), state_shape, start)
                )
            step_key = f"{OPTIM_STATE}{name}.step"
            if b.kind.step_in_state and source.size(step_key) is not None:
                steps[si] = torch.zeros(())
                wants.setdefault(step_key, []).append(((), steps[si]))
            else:
                tensors[-1][si] = step_of(b.kind, None, bool(states))
        source.read(wants)
        for si, value in steps.items():
            tensors[-1][si] = value

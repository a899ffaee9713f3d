"""EXPORT and IMPORT: a node writes (reads) its shard into (from) a ``torch.distributed.checkpoint`` folder.

EXPORT: every node writes the pieces of the parameters it holds, in parallel, into one data file
of its own (``__<node index>_0.distcp``, as torch's ``FileSystemWriter`` names a rank's file), in
torch's own format: each piece ``torch.save``-d at a recorded offset. A bucket holds flat ranges of
parameters; DCP stores n-d boxes, so each range is cut into boxes (:func:`boxes`: a partial first
row, whole rows, a partial last row, recursively). The node answers with what it wrote: per piece
the key, the tensor's size, the box (offsets and sizes), the file offset and length; the worker that
asked writes the folder's ``.metadata`` from every node's answer (:mod:`luwu.model_io`). The folder
must be one filesystem the nodes and that worker share.

Two layouts: the weights alone, by parameter name (``export_dcp``); or a training checkpoint in the
key layout of torch's distributed state dicts (``get_state_dict(model, optimizer)`` flattened by
DCP): ``model.<name>`` for the fp32 master weights and ``optim.state.<name>.<state>`` for torch's
per-parameter optimizer state (:mod:`.torch_state`: ``step``, ``exp_avg``...), which FSDP2 loads
with ``dcp.load`` + ``set_state_dict``. IMPORT reads such a checkpoint back (:mod:`.dcp_import`).

A node writes and reads only below its export root (``node.export_root``, else its
``checkpoint_dir``; neither: refused), never over an existing file, and publishes its file by an
atomic rename once it is complete and synced.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from luwu.protocol import messages as wire
from luwu.protocol.dcp_files import save_tensor
from luwu.protocol.errors import ConfigError, ProtocolError
from luwu.protocol.messages import Op
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.effects import Effect, Reply
from luwu.switch_nodes.replies import PullCodecs
from luwu.switch_nodes.shard import Shard
from luwu.switch_nodes.store import BucketState
from luwu.switch_nodes.torch_state import slot, torch_param_state

#: The key prefixes of a training checkpoint (torch's ``get_state_dict`` as DCP flattens it).
MODEL, OPTIM_STATE = "model.", "optim.state."


def boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The n-d boxes ``(offsets, sizes)``, in order, that the row-major flat range ``[start, stop)`` of a
    tensor of ``shape`` covers; each box is itself one contiguous flat range."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)
    rest = tuple(shape[1:])
    if r0 == r1:  # inside one row
        return [((r0, *o), (1, *s)) for o, s in boxes(rest, c0, c1)]
    out = []
    if c0:
        out += [((r0, *o), (1, *s)) for o, s in boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * len(rest))), (r1 - r0, *rest)))
    if c1:
        out += [((r1, *o), (1, *s)) for o, s in boxes(rest, 0, c1)]
    return out


def flat_index(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The row-major flat index of element ``offsets`` of a tensor of ``shape``."""
    index = 0
    for o, d in zip(offsets, shape):
        index = index * d + o
    return index


def box_views(
    flat: torch.Tensor, shape: tuple[int, ...], start: int
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``flat`` holds elements ``start`` to ``start + flat.numel()`` of a tensor of ``shape``: the boxes of
    that range, each with the view of ``flat`` that holds it (shaped as the box)."""
    out = []
    for offsets, sizes in boxes(tuple(shape), start, start + flat.numel()):
        out.append(
            (
                offsets,
                flat.narrow(0, flat_index(offsets, shape) - start, math.prod(sizes)).view(sizes),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Request:
    """What an EXPORT or IMPORT asks, from its frame: each parameter's name and shape; with ``groups``
    (each param group's hyperparameters) the training-checkpoint layout, else the weights by name."""

    params: dict[int, tuple[str, tuple[int, ...]]]
    groups: list[dict] | None

    @classmethod
    def parse(cls, op: Op, frames: list[torch.Tensor]) -> Request:
        """The frame: a msgpack map ``{"params": {index: [name, shape]}, "groups": [hyperparameters] | None}``."""
        if len(frames) != 1:
            raise ProtocolError(f"{op.name} carries one frame: the parameters' names and shapes")
        try:
            body = msgpack.unpackb(frames[0].numpy().tobytes(), strict_map_key=False)
            params = {
                int(k): (str(v[0]), tuple(int(d) for d in v[1])) for k, v in body["params"].items()
            }
            groups = body.get("groups")
        except (
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            AttributeError,
            msgpack.ExtraData,
            msgpack.FormatError,
            msgpack.StackError,
        ) as exc:
            raise ProtocolError(
                f"{op.name} frame is not a msgpack map of parameter names and shapes: {type(exc).__name__}: {exc}"
            ) from None
        if any(d < 0 for _, shape in params.values() for d in shape) or any(
            len(name) > 1024 for name, _ in params.values()
        ):
            raise ProtocolError(
                f"{op.name}: a parameter shape is negative or a name over 1024 characters"
            )
        if groups is not None and not (
            isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
        ):
            raise ProtocolError(f"{op.name}: groups must be a list of hyperparameter maps")
        return cls(params, groups)

    def param(self, s) -> tuple[str, tuple[int, ...]]:
        """The name and shape of segment ``s``'s parameter, checked to hold the segment."""
        got = self.params.get(s.param)
        if got is None or math.prod(got[1]) < s.param_offset + s.numel:
            raise ProtocolError(
                f"no valid shape for parameter {s.param} (got {got and list(got[1])})"
            )
        return got

    def hyper(self, b: BucketState) -> dict:
        if self.groups is None or not 0 <= b.group < len(self.groups):
            raise ProtocolError(f"no hyperparameters for param group {b.group} of bucket {b.id}")
        return self.groups[b.group]


class Exports:
    """EXPORT and IMPORT. ``codecs``: what the workers hold of each bucket, forgotten on IMPORT."""

    def __init__(self, ctx: NodeContext, shard: Shard, codecs: PullCodecs) -> None:
        self.ctx, self.shard, self.codecs = ctx, shard, codecs
        self._imports = None

    def root(self) -> Path:
        cfg = self.ctx.cfg
        root = cfg.export_root or cfg.checkpoint_dir
        if not root:
            raise ConfigError(
                f"node {self.ctx.index} has no export root: set node.export_root (or node.checkpoint_dir)"
            )
        return Path(root).resolve()

    def target(self, path: str) -> Path:
        """The folder ``path`` names, checked to lie inside the export root."""
        root = self.root()
        folder = Path(path) if os.path.isabs(path) else root / path
        folder = folder.resolve()
        if folder != root and root not in folder.parents:
            raise ProtocolError(
                f"export path {path!r} is outside node {self.ctx.index}'s export root {root}"
            )
        return folder

    async def on_export(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """Write this node's pieces into the folder the header names; answer with what was written (a
        msgpack frame)."""
        ctx, h = self.ctx, msg.header
        folder = self.target(h["path"])
        request = Request.parse(Op.EXPORT, msg.tensors())
        try:
            entries = await ctx.queue.run(self.write, folder, request)
        except OSError as exc:
            raise ConfigError(
                f"node {ctx.index} could not write its shard into {folder}: {exc}"
            ) from None
        body = torch.frombuffer(bytearray(msgpack.packb(entries)), dtype=torch.uint8)
        header = {
            "op": Op.EXPORT,
            "job": ctx.job,
            "step": self.shard.step,
            "worker": h["worker"],
            "path": str(folder),
        }
        return [Reply(ident, wire.encode(header, [body]))]

    async def on_import(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """Read this node's shard from the training checkpoint the header names (:mod:`.dcp_import`)."""
        if self._imports is None:
            from luwu.switch_nodes.dcp_import import Imports

            self._imports = Imports(self.ctx, self.shard, self.codecs, self)
        return await self._imports.on_import(ident, msg)

    def write(self, folder: Path, request: Request) -> list[list]:
        """On the optimizer thread: every piece of this node's shard into ``__<index>_0.distcp``."""
        index = self.ctx.index
        name = f"__{index}_0.distcp"
        final, tmp = folder / name, folder / f".{name}.tmp"
        folder.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise ProtocolError(f"export {final} exists: export into a new folder")
        entries = []
        try:
            with open(tmp, "xb") as f:
                for b in sorted(self.shard.buckets.values(), key=lambda b: b.id):
                    try:
                        with self.shard.loaded(b.id):
                            entries += self._bucket(f, b, request)
                    except ProtocolError as exc:
                        raise ProtocolError(
                            f"EXPORT to node {index}, bucket {b.id}: {exc}"
                        ) from None
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return entries

    def _bucket(self, f, b: BucketState, request: Request) -> list[list]:
        """The pieces of bucket ``b``: its weights, and with a checkpoint request torch's optimizer state of
        each parameter it holds (the step and derived scalars written by the segment that starts it)."""
        out = []
        if request.groups is None:
            for s in b.segments:
                name, shape = request.param(s)
                out += self._pieces(
                    f, name, shape, b.params.narrow(0, s.offset, s.numel), s.param_offset
                )
            return out
        hyper, kind = request.hyper(b), b.kind
        flats = {n: b.state.read(n) for n in kind.state_for(hyper)}
        for si, s in enumerate(b.segments):
            name, shape = request.param(s)
            out += self._pieces(
                f, MODEL + name, shape, b.params.narrow(0, s.offset, s.numel), s.param_offset
            )
            scalars, shapes = torch_param_state(kind, shape, float(b.steps[si]), hyper)
            for n, state_shape in shapes.items():
                start, length = slot(shape, state_shape, s.param_offset, s.numel)
                out += self._pieces(
                    f,
                    f"{OPTIM_STATE}{name}.{n}",
                    state_shape,
                    flats[n].narrow(0, s.offset, length),
                    start,
                )
            if s.param_offset == 0:
                for n, value in scalars.items():
                    out += self._pieces(f, f"{OPTIM_STATE}{name}.{n}", (), value.reshape(1), 0)
        return out

    @staticmethod
    def _pieces(f, key: str, shape: tuple[int, ...], flat: torch.Tensor, start: int) -> list[list]:
        """``flat``: elements ``start``... of tensor ``key`` of ``shape``; each of its boxes ``torch.save``-d
        into ``f``. Returns ``[key, size, offsets, sizes, file offset, length]`` per piece."""
        out = []
        for offsets, view in box_views(flat, shape, start):
            at, length = save_tensor(f, view)
            out.append([key, list(shape), list(offsets), list(view.shape), at, length])
        return out

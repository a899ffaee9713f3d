"""EXPORT: a node writes its shard of the weights into a ``torch.distributed.checkpoint`` directory.

Every node writes the pieces of the parameters it holds, in parallel, into one
data file of its own (``__<node index>_0.distcp``, as torch's ``FileSystemWriter``
names a rank's file), in torch's own format: each piece ``torch.save``-d at a
recorded offset. A bucket holds flat ranges of parameters; DCP stores n-d boxes,
so each range is cut into boxes (:func:`boxes`: a partial first row, whole rows,
a partial last row, recursively). The node answers with what it wrote: per piece
the parameter name, the box (offsets and sizes), the file offset and length; the
worker that asked writes the directory's ``.metadata`` from every node's answer
(:mod:`luwu.model_io`). The folder must be one filesystem the nodes and that
worker share.

A node writes only below its export root (``node.export_root``, else its
``checkpoint_dir``; neither: exports are refused), never over an existing file,
and publishes its file by an atomic rename once it is complete and synced.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import torch

from luwu.protocol import messages as wire
from luwu.protocol.errors import ConfigError, ProtocolError
from luwu.protocol.messages import Op

if TYPE_CHECKING:
    from luwu.switch_nodes.server import NodeServer


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
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


def _flat_index(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for o, d in zip(offsets, shape):
        index = index * d + o
    return index


class Exports:
    def __init__(self, node: NodeServer):
        self.node = node

    def root(self) -> Path:
        cfg = self.node.cfg
        root = cfg.export_root or cfg.checkpoint_dir
        if not root:
            raise ConfigError(f"node {self.node.index} has no export root: set node.export_root (or node.checkpoint_dir)")
        return Path(root).resolve()

    def target(self, path: str) -> Path:
        """The folder ``path`` names, checked to lie inside the export root."""
        root = self.root()
        folder = Path(path) if os.path.isabs(path) else root / path
        folder = folder.resolve()
        if folder != root and root not in folder.parents:
            raise ProtocolError(f"export path {path!r} is outside node {self.node.index}'s export root {root}")
        return folder

    async def on_export(self, ident: bytes, msg: wire.Message) -> None:
        """Write this node's pieces of every parameter into the folder the header names; answer with what was
        written (a msgpack frame). The payload frame maps each of its parameters to its shape."""
        node, h = self.node, msg.header
        folder = self.target(h["path"])
        frames = msg.tensors()
        if len(frames) != 1:
            raise ProtocolError("EXPORT carries one frame: the parameters' shapes")
        try:
            shapes = {int(k): tuple(int(d) for d in v) for k, v in msgpack.unpackb(frames[0].numpy().tobytes(), strict_map_key=False).items()}
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ProtocolError(f"EXPORT shapes frame is not a msgpack map of shapes: {exc}") from None
        entries = await node.run(self.write, folder, shapes)
        body = torch.frombuffer(bytearray(msgpack.packb(entries)), dtype=torch.uint8)
        node.send(ident, wire.encode({"op": Op.EXPORT, "job": node.job, "step": node.step, "worker": h["worker"], "path": str(folder)}, [body]))

    def write(self, folder: Path, shapes: dict[int, tuple[int, ...]]) -> list[list]:
        """On the optimizer thread: every piece of this node's parameters into ``__<index>_0.distcp``."""
        node = self.node
        name = f"__{node.index}_0.distcp"
        final, tmp = folder / name, folder / f".{name}.tmp"
        folder.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise ProtocolError(f"export {final} exists: export into a new folder")
        entries = []
        try:
            with open(tmp, "xb") as f:
                for b in sorted(node.buckets.values(), key=lambda b: b.id):
                    for s in b.segments:
                        entries += self._pieces(f, b.params.narrow(0, s.offset, s.numel), s, shapes)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return entries

    def _pieces(self, f, flat: torch.Tensor, s, shapes: dict[int, tuple[int, ...]]) -> list[list]:
        shape = shapes.get(s.param)
        if shape is None or math.prod(shape) < s.param_offset + s.numel:
            raise ProtocolError(f"EXPORT: no valid shape for parameter {s.param} (got {shape})")
        name = self.node.param_names.get(s.param, f"param{s.param}")
        out = []
        for offsets, sizes in boxes(shape, s.param_offset, s.param_offset + s.numel):
            start = _flat_index(offsets, shape) - s.param_offset
            piece = flat.narrow(0, start, math.prod(sizes)).clone().view(sizes)  # a copy: torch.save writes a view's whole storage
            at = f.tell()
            torch.save(piece, f)
            out.append([name, list(offsets), list(sizes), at, f.tell() - at])
        return out

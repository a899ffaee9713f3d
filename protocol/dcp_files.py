"""``torch.distributed.checkpoint`` folders, read without trusting them: the metadata, boxes of tensors.

A DCP folder is a ``.metadata`` file (a pickle: which tensors and objects the folder holds, their
chunks, and where each chunk lies in which data file) and data files (each piece ``torch.save``-d at
an offset). torch reads ``.metadata`` with plain ``pickle.load`` (``FileSystemReader.read_metadata``),
so a crafted folder would run code in whoever opens it. :func:`read_metadata` unpickles it with
only DCP's own metadata classes, ``torch.Size``, dtypes and paths allowed (anything else is refused,
naming the global and the file), and checks that every data file it names lies inside the folder.
torch's weights-only unpickler (``torch.load(weights_only=True)``) cannot be used for this: it reads
protocol 2 only, and DCP writes ``.metadata`` with the default protocol (FRAME, STACK_GLOBAL).

:class:`DcpFolder` reads what a caller asks for through DCP's own ``FileSystemReader``: boxes of
tensors (any chunking on either side; DCP's resharding computes what to read) and pickled objects
(``optim.param_groups`` values), these with ``torch.load(weights_only=True)``. Every place LuWu opens
a DCP folder goes through this module: a worker's ``optimizer.init_weights``, its reading of a
checkpoint's step and param groups, a node's IMPORT, a node restoring its own checkpoint.

Writing: :func:`save_tensor` puts one tensor piece into a data file as DCP's ``FileSystemWriter``
does (``torch.save`` at a recorded offset), without copying it; :func:`write_metadata` writes the
``.metadata`` naming every piece. Exports (:mod:`luwu.switch_nodes.export`) and node checkpoints
(:mod:`luwu.switch_nodes.checkpoint`) write their folders with these two.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePath
from typing import Any

import torch

from luwu.protocol.errors import CorruptCheckpointError, ProtocolError

__all__ = ["DcpFolder", "read_metadata", "save_tensor", "write_metadata"]

_ALLOWED: dict[tuple[str, str], Any] | None = None
_ALLOWED_LOCK = threading.Lock()


def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> the object, for every global a DCP ``.metadata`` may name."""
    global _ALLOWED
    with _ALLOWED_LOCK:
        if _ALLOWED is None:
            from torch.distributed.checkpoint import metadata as md
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            classes = [
                md.Metadata, md.TensorStorageMetadata, md.ChunkStorageMetadata, md.BytesStorageMetadata,
                md.TensorProperties, md._MEM_FORMAT_ENCODING, md.MetadataIndex, md.StorageMeta, _StorageInfo,
                torch.Size, Path, type(Path()), PurePath, type(PurePath()),
            ]  # fmt: skip
            out = {(c.__module__, c.__qualname__): c for c in classes}
            for name in dir(torch):  # dtypes pickle as the global torch.<name>
                value = getattr(torch, name)
                if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                    out[("torch", name)] = value
            out[("torch.serialization", "_get_layout")] = (
                torch.serialization._get_layout
            )  # a layout by name
            _ALLOWED = out
        return _ALLOWED


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: a global outside :func:`_allowed` is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed().get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def read_metadata(folder: str | os.PathLike) -> Any:
    """The ``Metadata`` of the DCP folder ``folder``, unpickled with DCP's metadata classes only; raises
    CorruptCheckpointError naming the file for anything else (a pickle that would run code among
    them) and for data files outside the folder."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    path = Path(folder) / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{folder} is not a torch.distributed.checkpoint folder: it has no .metadata"
        ) from None
    except Exception as exc:  # pickle raises many types on a crafted or truncated file
        raise CorruptCheckpointError(
            f"{path} is not torch.distributed.checkpoint metadata LuWu can read: {type(exc).__name__}: {exc}"
        ) from None
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(metadata.state_dict_metadata, dict)
        or not isinstance(metadata.storage_data, dict)
    ):
        raise CorruptCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata"
        )
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(
                f"{path}: storage entry {index!r} is not a (MetadataIndex, _StorageInfo) pair"
            )
        rel = PurePath(str(info.relative_path))
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise CorruptCheckpointError(
                f"{path}: {index.fqn} lies in {info.relative_path!r}, outside the folder"
            )
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            raise CorruptCheckpointError(
                f"{path}: {index.fqn} has a bad file offset or length ({info.offset}, {info.length})"
            )
    if metadata.storage_meta is not None:
        metadata.storage_meta.checkpoint_id = (
            None  # (a path of the writer's machine, never used to read)
        )
    return metadata


@functools.cache
def _reader_classes():
    """DCP's ``FileSystemReader`` with :func:`read_metadata`, and a planner that reads into given boxes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

    class Reader(FileSystemReader):
        def __init__(self, path: str | os.PathLike, metadata: Any):
            super().__init__(path)
            self._metadata = metadata
            self.set_up_storage_reader(metadata, True)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self._metadata

    class Planner(LoadPlanner):
        """Resolves each read item to its box's target tensor (``targets[fqn][local index]``); pickled
        objects are read weights-only into ``objects``."""

        def __init__(self, items: list, targets: dict[str, list[torch.Tensor]]):
            self.items, self.targets, self.objects = items, targets, {}

        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            self.metadata = metadata

        def create_local_plan(self) -> LoadPlan:
            return LoadPlan(self.items)

        def create_global_plan(self, global_plan: list) -> list:
            return global_plan

        def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
            return central_plan

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            self.objects[read_item.dest_index.fqn] = torch.load(
                value, map_location="cpu", weights_only=True
            )

        def resolve_tensor(self, read_item) -> torch.Tensor:
            box = self.targets[read_item.dest_index.fqn][read_item.dest_index.index]
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                box = box.narrow(dim, offset, length)
            return box

        def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
            pass  # resolve_tensor handed out a view of the target: the data is in place

    return Reader, Planner


def save_tensor(f: Any, tensor: torch.Tensor) -> tuple[int, int]:
    """``torch.save`` a contiguous CPU tensor (a view into a larger one, e.g. a box of a bucket) at
    ``f``'s position, as DCP stores a tensor piece; returns (offset, length) in ``f``. No copy is made:
    ``torch.save`` writes a tensor's whole storage, so the view is saved through a tensor over just
    its own memory (``torch.from_numpy`` of the view's array), which ``torch.save`` hands to ``f.write``
    as memoryviews."""
    at = f.tell()
    torch.save(torch.from_numpy(tensor.detach().contiguous().numpy()), f)
    return at, f.tell() - at


def write_metadata(
    folder: str | os.PathLike,
    pieces: Sequence[tuple[str, Sequence]],
    objects: dict[str, tuple[str, int, int]] | None = None,
    paths: dict | None = None,
) -> Path:
    """Write the folder's ``.metadata`` (synced, by an atomic rename): ``pieces`` are (data file name,
    entries ``[key, size, offsets, sizes, file offset, length]``) of fp32 tensor pieces written with
    :func:`save_tensor`; ``objects`` key -> (file name, offset, length) of ``torch.save``-d objects;
    ``paths`` each key's place in the nested state dict (DCP's ``planner_data``, which
    ``dcp_to_torch_save`` unflattens with). Returns the file's path; a key given two sizes raises
    ProtocolError."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )  # fmt: skip

    entries: dict = {}
    storage: dict = {}
    for file, file_pieces in pieces:
        for key, size, offsets, sizes, at, length in file_pieces:
            md = entries.setdefault(
                key,
                TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), []),
            )
            if tuple(md.size) != tuple(size):
                raise ProtocolError(f"two shapes for {key}: {list(md.size)} and {list(size)}")
            md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(file, at, length)
    for key, (file, at, length) in (objects or {}).items():
        entries[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(file, at, length)
    planner_data = {k: paths[k] for k in entries} if paths is not None else None
    metadata = Metadata(
        state_dict_metadata=entries,
        planner_data=planner_data,
        storage_data=storage,
        version=CURRENT_DCP_VERSION,
    )
    final = Path(folder) / ".metadata"
    tmp = final.with_name(".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


class DcpFolder:
    """A DCP folder opened for reading (its metadata read by :func:`read_metadata`). ``what`` names it in
    errors (e.g. ``"optimizer.init_weights '/ckpt'"``, ``"node 1: checkpoint /ckpt"``)."""

    def __init__(self, path: str | os.PathLike, what: str | None = None):
        self.path = Path(path)
        self.what = what or str(path)
        self.metadata = read_metadata(path)
        self.entries = self.metadata.state_dict_metadata

    def size(self, key: str) -> tuple[int, ...] | None:
        """The shape of tensor ``key`` (None: the folder has no such key); an object there is refused."""
        md = self.entries.get(key)
        if md is None:
            return None
        if not hasattr(md, "chunks"):
            raise CorruptCheckpointError(f"{self.what}: {key} is a pickled object, not a tensor")
        return tuple(md.size)

    def plan(self, wants: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> list:
        """DCP's read items for boxes ``(offsets, sizes)`` of tensors by key, checked to be covered
        exactly by the folder's chunks (a missing key, a box outside its tensor or a gap is refused)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for key, boxes in wants.items():
            size = self.size(key)
            if size is None:
                raise CorruptCheckpointError(f"{self.what} has no {key}")
            for offsets, sizes in boxes:
                if len(offsets) != len(size) or any(
                    o < 0 or o + s > d for o, s, d in zip(offsets, sizes, size)
                ):
                    raise CorruptCheckpointError(
                        f"{self.what}: {key} has shape {size}, a box at {offsets} of {sizes} is outside it"
                    )
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
            mine = create_read_items_for_chunk_list(key, self.entries[key], chunks)
            covered = [0] * len(boxes)
            for ri in mine:
                covered[ri.dest_index.index] += math.prod(ri.lengths)
            for (offsets, sizes), n in zip(boxes, covered):
                if n != math.prod(sizes):
                    raise CorruptCheckpointError(
                        f"{self.what}: the chunks of {key} cover {n} of the {math.prod(sizes)} elements of the box at {offsets} of {sizes}"
                    )
            items += mine
        return items

    def read(self, wants: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
        """Fill each target (a tensor shaped as its box, e.g. a view into a bucket) with box ``(offsets,
        target.shape)`` of tensor ``key``; converted to the target's dtype."""
        items = self.plan(
            {key: [(tuple(o), tuple(t.shape)) for o, t in boxes] for key, boxes in wants.items()}
        )
        self._run(items, {key: [t for _, t in boxes] for key, boxes in wants.items()})

    def objects(self, keys: Iterable[str]) -> dict[str, Any]:
        """The pickled objects (DCP's ``BytesStorageMetadata`` entries) under ``keys``, loaded weights-only."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        keys = list(keys)
        for key in keys:
            if key not in self.entries or hasattr(self.entries[key], "chunks"):
                raise CorruptCheckpointError(f"{self.what} has no object {key}")
        zero = torch.Size([0])
        items = [
            ReadItem(LoadItemType.BYTE_IO, MetadataIndex(k), zero, MetadataIndex(k), zero, zero)
            for k in keys
        ]
        return self._run(items, {})

    def _run(self, items: list, targets: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
        from torch.distributed.checkpoint.planner import LoadPlan

        Reader, Planner = _reader_classes()
        planner = Planner(items, targets)
        try:
            Reader(self.path, self.metadata).read_data(LoadPlan(items), planner).wait()
        except CorruptCheckpointError:
            raise
        except (
            OSError,
            RuntimeError,
            pickle.UnpicklingError,
            EOFError,
            AssertionError,
            KeyError,
            ValueError,
        ) as exc:
            raise CorruptCheckpointError(
                f"{self.what}: reading failed: {type(exc).__name__}: {exc}"
            ) from None
        return planner.objects

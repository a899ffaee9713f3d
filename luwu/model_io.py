"""Weights out of the nodes for models no worker can hold: a ``torch.distributed.checkpoint`` folder.

``export_dcp(opt, path)`` has every node write its shard of the weights, in parallel,
into ``path`` (see :mod:`luwu.switch_nodes.export`), and then writes the folder's
``.metadata`` from what the nodes report. The result is an ordinary DCP checkpoint of
the model's parameters by name (fp32, as the nodes hold them): FSDP2 / torchtitan
load it with ``torch.distributed.checkpoint.load`` on any number of ranks, a plain
model loads it in one process, and ``torch.distributed.checkpoint.format_utils.
dcp_to_torch_save`` turns it into a ``torch.save`` file. No worker ever holds more
than the list of pieces.

The folder must be on a filesystem the nodes and this worker share, below each
node's export root (``node.export_root``, else ``checkpoint_dir``); a relative
``path`` is taken relative to that root. Buffers (running statistics) are not on
the nodes: they are in the model's own ``state_dict()``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import msgpack
import torch

from luwu.protocol.errors import LuwuError, ProtocolError
from luwu.protocol.messages import Op

__all__ = ["export_dcp"]


def export_dcp(opt, path: str | os.PathLike, timeout_s: float | None = None) -> Path:
    """Write the job's current weights as a DCP checkpoint into the new folder ``path`` (the nodes write
    the data, this worker the metadata); returns the folder. Call it on one rank, between steps."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata

    opt.synchronize()  # delayed update: the weights a step still owes land first
    layout, client = opt.layout, opt.client
    nodes = [n for n in range(layout.num_nodes) if layout.buckets_of(n)]
    for n in nodes:
        shapes = {s.param: list(layout.params[s.param].shape) for b in layout.buckets_of(n) for s in b.segments}
        frame = torch.frombuffer(bytearray(msgpack.packb(shapes)), dtype=torch.uint8)
        client.send(n, {"op": Op.EXPORT, "step": opt.worker.step_num, "path": os.fspath(path)}, [frame])
    msgs = client.answers([(Op.EXPORT, n, None, -1) for n in nodes], Op.EXPORT, timeout_s or max(client.cfg.timeout_s, 600.0), what="exported shard")
    for m in msgs:  # every node has answered: nothing is left behind for a later request
        if isinstance(m, LuwuError):
            raise m
    folders = {m.header["path"] for m in msgs}
    if len(folders) != 1:
        raise ProtocolError(f"the nodes wrote the export into different folders {sorted(folders)}: give them one export root on a shared filesystem")
    folder = Path(folders.pop())
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    shape_of = {p.name: p.shape for p in layout.params}
    for n, m in zip(nodes, msgs):  # node n wrote __<n>_0.distcp (its index in the layout)
        for name, offsets, sizes, at, length in msgpack.unpackb(m.tensors()[0].numpy().tobytes()):
            md = tensors.setdefault(name, TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape_of[name]), []))
            md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(name, torch.Size(offsets))] = _StorageInfo(f"__{n}_0.distcp", at, length)
    metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)
    tmp = folder / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / ".metadata")
    return folder

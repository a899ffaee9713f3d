"""Weights and training state out of the nodes and back, as ``torch.distributed.checkpoint`` folders.

``export_dcp(opt, path)`` has every node write its shard of the weights, in parallel, into
``path`` (see :mod:`luwu.switch_nodes.export`), and then writes the folder's ``.metadata`` from
what the nodes report. The result is an ordinary DCP checkpoint of the model's parameters by name
(fp32, as the nodes hold them): FSDP2 / torchtitan load it with ``torch.distributed.checkpoint.load``
on any number of ranks, a plain model loads it in one process, and
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into a ``torch.save`` file.

``save_checkpoint(opt, path)`` writes the training state the same way: the fp32 master weights and
the optimizer state, every node its shard, in the key layout of torch's distributed state dicts
(``get_state_dict(model, optimizer)``); ``load_checkpoint(opt, path)`` has every node read its
shard back, whatever node count and layout wrote it (or an FSDP2 job). No worker ever holds more
than the list of pieces, the param groups and one step count per parameter.

The folder must be on a filesystem the nodes and this worker share, below each node's export root
(``node.export_root``, else ``checkpoint_dir``). Buffers (running statistics) are not on the
nodes: they are in the model's own ``state_dict()``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import msgpack
import torch

from luwu.protocol.dcp_files import DcpFolder, write_metadata
from luwu.protocol.errors import ConfigError, LuwuError, ProtocolError
from luwu.protocol.messages import Op
from luwu.switch_nodes.export import MODEL, OPTIM_STATE
from luwu.switch_nodes.optimizers import EXTRA_HYPER
from luwu.switch_nodes.torch_state import torch_param_state

__all__ = ["export_dcp", "load_checkpoint", "save_checkpoint"]

GROUPS = "optim.param_groups."
_GROUPS_FILE = "__groups_0.distcp"  # the param groups, written by the worker (the nodes write __<node>_0.distcp)


def state_dict_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model.state_dict()``: the same keys (buffers, and every name of a tied parameter), one
    copy per tensor, so tied names share it as they do in the model and it loads back."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in copies:
            copies[id(v)] = v.detach().clone()
        out[k] = copies[id(v)]
    return out


def export_dcp(opt, path: str | os.PathLike, timeout_s: float | None = None) -> Path:
    """Write the job's current weights as a DCP checkpoint into the new folder ``path`` (the nodes write
    the data, this worker the metadata); returns the folder. Call it on one rank, between steps.

    Args:
        opt: the job's ``RemoteOptimizer``.
        path: a new folder below every node's export root; a relative path is taken from that root.
        timeout_s: how long to wait for the nodes (default: ``transport.timeout_s``, at least 600 s).
    """
    opt.synchronize()  # delayed update: the weights a step still owes land first
    keys = {s.name: (s.name,) for s in opt.layout.params}
    folder, pieces = _export(opt, path, None, keys, timeout_s)
    write_metadata(folder, pieces)
    return folder


def save_checkpoint(opt, path: str | os.PathLike, timeout_s: float | None = None) -> Path:
    """Write the job's training state into the new folder ``path``: every node its shard of the fp32
    master weights and of the optimizer state (step counts included), in parallel; this worker the
    param groups and the folder's ``.metadata``. Returns the folder (absolute).

    The folder is a ``torch.distributed.checkpoint`` checkpoint of ``{"model": ..., "optim": ...}`` as
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` makes it (keys
    ``model.<name>``, ``optim.state.<name>.exp_avg``, ``optim.param_groups.0.lr``...): an FSDP2 job
    loads it with ``dcp.load`` and ``set_state_dict``, and :func:`load_checkpoint` on any number of
    nodes. Call it on one rank, between steps; in async mode hold the other ranks meanwhile.

    Args:
        opt: the job's ``RemoteOptimizer``.
        path: a new folder below every node's export root (``node.export_root``, else
            ``checkpoint_dir``) on a filesystem the nodes and this worker share; a relative path is
            taken from the export root.
        timeout_s: how long to wait for the nodes (default: ``transport.timeout_s``, at least 600 s).
    """
    opt.synchronize()
    kind, groups = opt.kind, _hyper(opt)
    keys = {}
    for s in opt.layout.params:
        keys[MODEL + s.name] = ("model", s.name)
        scalars, _ = torch_param_state(kind, s.shape, 1, groups[s.group])
        for n in (*kind.state_names, *scalars):
            keys[f"{OPTIM_STATE}{s.name}.{n}"] = ("optim", "state", s.name, n)
    folder, pieces = _export(opt, path, groups, keys, timeout_s)
    values = {}
    for i, group in enumerate(_torch_groups(opt)):
        for k, v in group.items():
            values[f"{GROUPS}{i}.{k}"], keys[f"{GROUPS}{i}.{k}"] = (
                v,
                ("optim", "param_groups", i, k),
            )
    write_metadata(folder, pieces, _write_objects(folder / _GROUPS_FILE, values), keys)
    return folder


def load_checkpoint(opt, path: str | os.PathLike, timeout_s: float | None = None) -> int:
    """Start the job from the training checkpoint in folder ``path``: every node reads its shard of the
    master weights and optimizer state, this worker takes the weights and the param groups'
    hyperparameters; returns the step the job goes on from (rewind the data to it).

    The folder may come from :func:`save_checkpoint` of a job on any number of nodes, or from an
    FSDP2 job (``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict(model, optimizer)``).
    The step is the checkpoint's optimizer step (the largest per-parameter ``step``; for an optimizer
    without one in its state, such as SGD, the job's current step). Call it on every rank between
    steps, as ``dcp.load``: the nodes read the folder once, every rank takes the weights.

    Args:
        opt: the job's ``RemoteOptimizer``: the same parameters (names and shapes) and param groups.
        path: the checkpoint folder, below every node's export root, on a filesystem the nodes and this
            worker share; a relative path is taken from this process's working directory.
        timeout_s: how long to wait for the nodes (default: ``transport.timeout_s``, at least 600 s).
    """
    opt.synchronize()
    folder = Path(path).absolute()
    source = DcpFolder(folder, f"checkpoint {folder}")
    layout = opt.layout
    for s in layout.params:
        size = source.size(MODEL + s.name)
        if size is None:
            raise ConfigError(
                f"checkpoint {folder} has no {MODEL}{s.name}: load a training checkpoint of this model (save_checkpoint's, or FSDP2's)"
            )
        if size != tuple(s.shape):
            raise ConfigError(
                f"checkpoint {folder}: {MODEL}{s.name} has shape {size}, the model's is {tuple(s.shape)}"
            )
    groups = _read_groups(opt, source)
    keys = [
        f"{OPTIM_STATE}{s.name}.step"
        for s in layout.params
        if source.size(f"{OPTIM_STATE}{s.name}.step") is not None
    ]
    steps = {k: torch.zeros(()) for k in keys}
    source.read({k: [((), t)] for k, t in steps.items()})
    step = int(max(float(t) for t in steps.values())) if steps else opt.worker.step_num
    nodes = [n for n in range(layout.num_nodes) if layout.buckets_of(n)]
    for n in nodes:
        opt.client.send(
            n, {"op": Op.IMPORT, "step": step, "path": str(folder)}, [_frame(layout, n, None)]
        )
    _raise_first(
        opt.client.answers(
            [(Op.IMPORT, n, step, -1) for n in nodes],
            Op.IMPORT,
            _timeout(opt, timeout_s),
            what="checkpoint loaded",
        )
    )
    for g, saved in zip(opt.param_groups, groups):
        g.update(
            {
                k: v
                for k, v in saved.items()
                if k in opt.kind.defaults or k in EXTRA_HYPER[opt.kind.name]
            }
        )
    return opt.worker.recover(None)  # every rank takes the loaded weights and the step


# ----------------------------------------------------------------------------- the parts


def _timeout(opt, timeout_s: float | None) -> float:
    return timeout_s or max(opt.client.cfg.timeout_s, 600.0)


def _raise_first(answers: list) -> list:
    for m in answers:  # every node has answered: nothing is left behind for a later request
        if isinstance(m, LuwuError):
            raise m
    return answers


def _frame(layout, node: int, groups: list[dict] | None) -> torch.Tensor:
    """The EXPORT / IMPORT frame for ``node``: its parameters' names and shapes (and the groups' hyperparameters)."""
    params = {
        s.param: [s.name, list(layout.params[s.param].shape)]
        for b in layout.buckets_of(node)
        for s in b.segments
    }
    return torch.frombuffer(
        bytearray(msgpack.packb({"params": params, "groups": groups})), dtype=torch.uint8
    )


def _plain(v):
    """A hyperparameter as msgpack carries it: tensors as floats, pairs as lists."""
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return float(v.item()) if isinstance(v, torch.Tensor) else v


def _hyper(opt) -> list[dict]:
    """Each param group's hyperparameters, as the nodes read them (which state it keeps, NAdam's scalars)."""
    known = (*opt.kind.defaults, *EXTRA_HYPER[opt.kind.name])
    return [{k: _plain(g[k]) for k in known if g.get(k) is not None} for g in opt.param_groups]


def _group_names(opt) -> list[list[str]]:
    names: list[list[str]] = [[] for _ in opt.param_groups]
    for s in opt.layout.params:
        names[s.group].append(s.name)
    return names


def _torch_groups(opt) -> list[dict]:
    """The param groups as torch's ``get_state_dict`` has them: every key torch's optimizer class of this
    kind keeps (its implementation switches too: an FSDP2 job's optimizer asks for them), LuWu's values,
    ``params`` as the parameters' names."""
    classes = {
        name.lower(): c
        for name, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    }
    cls = classes.get(opt.kind.name)
    out = []
    for g, names in zip(opt.param_groups, _group_names(opt)):
        group = {}
        if cls is not None:
            group = dict(
                cls(
                    [torch.zeros(1, requires_grad=True)],
                    **{k: g[k] for k in opt.kind.defaults if k in g},
                ).param_groups[0]
            )
        out.append(group | {k: v for k, v in g.items() if k != "params"} | {"params": names})
    return out


def _read_groups(opt, source: DcpFolder) -> list[dict]:
    """The checkpoint's param groups (weights-only), checked against this optimizer's: [] when it has none."""
    keys = [k for k in source.entries if k.startswith(GROUPS)]
    if not keys:
        return []
    groups: dict[int, dict] = {}
    for key, value in source.objects(keys).items():
        index, _, name = key[len(GROUPS) :].partition(".")
        groups.setdefault(int(index), {})[name] = value
    mine = _group_names(opt)
    if sorted(groups) != list(range(len(mine))):
        raise ConfigError(
            f"checkpoint {source.path} has {len(groups)} param groups, this optimizer {len(mine)}: build it with the same groups"
        )
    for i, names in enumerate(mine):
        saved = groups[i].get("params")
        if saved is not None and list(saved) != names:
            raise ConfigError(
                f"checkpoint {source.path}: param group {i} holds {list(saved)[:6]}, this optimizer's {names[:6]}: build it with the same groups"
            )
    return [groups[i] for i in range(len(mine))]


def _export(
    opt, path, groups: list[dict] | None, keys: dict, timeout_s: float | None
) -> tuple[Path, list[tuple[str, list]]]:
    """EXPORT to every node holding buckets; returns the folder and, per node, its file and its pieces
    (each checked to be one of ``keys`` with one size)."""
    layout, client = opt.layout, opt.client
    nodes = [n for n in range(layout.num_nodes) if layout.buckets_of(n)]
    for n in nodes:
        client.send(
            n,
            {"op": Op.EXPORT, "step": opt.worker.step_num, "path": os.fspath(path)},
            [_frame(layout, n, groups)],
        )
    msgs = _raise_first(
        client.answers(
            [(Op.EXPORT, n, None, -1) for n in nodes],
            Op.EXPORT,
            _timeout(opt, timeout_s),
            what="exported shard",
        )
    )
    folders = {m.header["path"] for m in msgs}
    if len(folders) != 1:
        raise ProtocolError(
            f"the nodes wrote into different folders {sorted(folders)}: give them one export root on a shared filesystem"
        )
    pieces = []
    for n, m in zip(nodes, msgs):  # node n wrote __<n>_0.distcp (its index in the layout)
        entries = msgpack.unpackb(m.tensors()[0].numpy().tobytes())
        unknown = sorted({e[0] for e in entries} - set(keys))
        if unknown:
            raise ProtocolError(
                f"node {client.nodes[n]} wrote tensors this job does not have: {unknown[:4]}"
            )
        pieces.append((f"__{n}_0.distcp", entries))
    folder = Path(folders.pop())
    if not folder.is_dir():
        raise ConfigError(
            f"the nodes wrote into {folder}, which this worker cannot see: put the export root on a filesystem the nodes and the workers share"
        )
    return folder, pieces


def _write_objects(file: Path, objects: dict[str, object]) -> dict[str, tuple[str, int, int]]:
    """``torch.save`` each object into ``file`` (new, synced), as DCP stores non-tensor values; returns
    key -> (file name, offset, length)."""
    out = {}
    with open(file, "xb") as f:
        for key, value in objects.items():
            buf = io.BytesIO()
            torch.save(value, buf)
            out[key] = (file.name, f.tell(), buf.tell())
            f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    return out

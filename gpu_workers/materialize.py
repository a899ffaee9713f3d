"""Models that never exist whole on a worker: a streaming start from the meta device.

A model built under ``torch.device("meta")`` has shapes and no storage. Streaming mode
takes it as it is (the FSDP2 / torchtitan convention):

1. :func:`empty_model`, before the optimizer sees the parameters: each streamed unit is
   given CPU parameters (``to_empty``) whose storage is released at once, unit by unit,
   so the model is never allocated whole; the root (parameters outside every unit) is
   allocated and stays resident.
2. :class:`Initializer`, when the worker first connects: every module's
   ``reset_parameters()`` runs in ``model.modules()`` order, a unit's modules with the
   unit's storage allocated just for them; rank 0 then sends the unit's buckets to the
   nodes (INIT) and the unit is released again. Every rank runs the pass, so buffers
   (running statistics, masks) are initialized alike everywhere; the other ranks take
   the weights from the nodes as usual.

Random numbers are drawn in ``model.modules()`` order from the global generator, as eager
construction draws them when each module initializes itself in ``__init__`` and modules
are registered in the order they are built (true of torch's layers and of models that
build their submodules in ``__init__`` in order): the same seed then gives the same
weights as an eager start. A module with parameters of its own and no
``reset_parameters()`` cannot be initialized and is refused, by name.

**Weights in** (``optimizer.init_weights``): the same pass, with each unit's (and the
root's) parameters then read from a torch state-dict file opened with ``mmap`` or from
a ``torch.distributed.checkpoint`` folder (:func:`open_weights`), one unit at a time, so
a model larger than the worker starts from trained weights; buffers are read too where
the source has them. Nodes that already hold weights (a resumed job) keep theirs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from luwu.gpu_workers.units import Unit, alloc_storage, free_storage
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import Layout


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` has parameters on the meta device (built under ``torch.device("meta")``)."""
    return any(p.is_meta for p in model.parameters())


def _unit_of_modules(model: torch.nn.Module, units: list[Unit]) -> dict[int, Unit]:
    """``id(module)`` -> the unit it belongs to, for every module inside a unit."""
    out = {}
    for u in units:
        for m in u.module.modules():
            out.setdefault(id(m), u)
    return out


def _holds_tensors(m: torch.nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False)) or any(
        True for _ in m.buffers(recurse=False)
    )


def check_initializable(model: torch.nn.Module) -> None:
    """Refuse a meta model with a module that holds parameters and has no ``reset_parameters()``."""
    for name, m in model.named_modules():
        if _holds_tensors(m) and not callable(getattr(m, "reset_parameters", None)):
            raise ConfigError(
                f"module {name or '(root)'!r} ({type(m).__name__}) has parameters or buffers on the meta device and no reset_parameters(): "
                "LuWu cannot initialize it one unit at a time; give it a reset_parameters() (as torch's layers have) or build the model eagerly"
            )


def empty_model(model: torch.nn.Module, units: list[Unit]) -> None:
    """Give a meta ``model`` CPU parameters: each unit's are released as soon as they exist (one unit
    allocated at a time), the root's stay allocated. Contents are undefined until :class:`Initializer`."""
    check_initializable(model)
    for u in units:
        u.module.to_empty(device="cpu")
        with torch.no_grad():
            for p in u.module.parameters():
                free_storage(p)
    in_unit = _unit_of_modules(model, units)
    for m in model.modules():
        if id(m) not in in_unit:
            m.to_empty(device="cpu", recurse=False)


class StateDictFile:
    """Weights from a ``torch.save``-d state dict, opened with ``mmap``: a unit reads only its pages."""

    def __init__(self, path: str):
        self.path = path
        self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(self.tensors, dict):
            raise ConfigError(
                f"optimizer.init_weights {path!r} holds a {type(self.tensors).__name__}, not a state dict"
            )

    def names(self) -> set[str]:
        return set(self.tensors)

    def read(self, into: dict[str, torch.Tensor]) -> None:
        for name, t in into.items():
            src = self.tensors[name]
            if src.shape != t.shape:
                raise ConfigError(
                    f"optimizer.init_weights {self.path!r}: {name} has shape {tuple(src.shape)}, the model's is {tuple(t.shape)}"
                )
            t.copy_(src)


class DcpFolder:
    """Weights from a ``torch.distributed.checkpoint`` folder, read one unit's tensors at a time. Its
    metadata is read without running its pickle (:mod:`luwu.protocol.dcp_files`). The weights of a
    training checkpoint (``luwu.save_checkpoint``, an FSDP2 job's ``{"model": ..., "optim": ...}``) are
    under ``model.<name>``: read from there when the folder has no plain ``<name>``."""

    def __init__(self, path: str):
        from luwu.protocol.dcp_files import DcpFolder as Folder

        self.path = path
        self.folder = Folder(path, f"optimizer.init_weights {path!r}")
        keys = self.folder.entries
        self.keys = {k[len("model.") :]: k for k in keys if k.startswith("model.")} | {
            k: k for k in keys
        }  # name -> key

    def names(self) -> set[str]:
        return set(self.keys)

    def read(self, into: dict[str, torch.Tensor]) -> None:
        for name, t in into.items():
            size = self.folder.size(self.keys[name])
            if size != tuple(t.shape):
                raise ConfigError(
                    f"optimizer.init_weights {self.path!r}: {name} has shape {size}, the model's is {tuple(t.shape)}"
                )
        self.folder.read(
            {self.keys[name]: [((0,) * t.dim(), t)] for name, t in into.items()}
        )  # in place, only these keys


def open_weights(path: str) -> StateDictFile | DcpFolder | None:
    """The source ``optimizer.init_weights`` names (None when empty): a DCP folder or a state-dict file."""
    if not path:
        return None
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise ConfigError(
                f"optimizer.init_weights {path!r} is a folder without a .metadata: not a torch.distributed.checkpoint"
            )
        return DcpFolder(path)
    if not os.path.exists(path):
        raise ConfigError(f"optimizer.init_weights {path!r} does not exist")
    return StateDictFile(path)


class Initializer:
    """The worker's ``initialize`` for a model that started on the meta device (see the module docstring).
    Runs once; a later connect (a grown layout) seeds from the parameters as they are."""

    def __init__(
        self,
        model: torch.nn.Module,
        units: list[Unit],
        source: StateDictFile | DcpFolder | None = None,
    ):
        self.model, self.units, self.done, self.source = model, units, False, source
        if source is not None:
            missing = [n for n, _ in model.named_parameters() if n not in source.names()]
            if missing:
                raise ConfigError(
                    f"optimizer.init_weights {source.path!r} lacks {len(missing)} of the model's parameters: {', '.join(missing[:5])}"
                )
        self.in_unit = _unit_of_modules(model, units)
        self.unit_buckets: dict[int, list[int]] = {}

    def for_layout(self, layout: Layout) -> Initializer:
        """This initializer, seeding the buckets of ``layout`` (the worker's current one)."""
        self.unit_buckets = layout.unit_buckets()
        return self

    def __call__(self, todo: set[int], send_init: Callable[[int], None]) -> None:
        if self.done:
            for bid in sorted(todo):
                send_init(bid)
            return
        seeded: set[int] = set()
        started: set[int] = set()
        for name, m in self.model.named_modules():
            u = self.in_unit.get(id(m))
            if u is None:
                if _holds_tensors(m):
                    with torch.no_grad():
                        m.reset_parameters()
                        self._read(m, name, recurse=False)
            elif u.index not in started:
                started.add(u.index)
                seeded |= self._unit(u, todo, send_init)
        for bid in sorted(todo - seeded):  # the root's buckets
            send_init(bid)
        self.done = True

    def _unit(self, u: Unit, todo: set[int], send_init: Callable[[int], None]) -> set[int]:
        """Allocate unit ``u``, initialize its modules, seed its buckets in ``todo``, release it."""
        params = list(u.module.parameters())
        with torch.no_grad():
            for p in params:
                alloc_storage(p)
            for m in u.module.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
            self._read(u.module, u.name, recurse=True)
        mine = [bid for bid in self.unit_buckets.get(u.index, []) if bid in todo]
        for bid in mine:
            send_init(bid)  # copies the weights into the message's own buffer
        with torch.no_grad():
            for p in params:
                free_storage(p)
        return set(mine)

    def _read(self, module: torch.nn.Module, prefix: str, *, recurse: bool) -> None:
        """Overwrite ``module``'s parameters (and the buffers the source has) from :attr:`source`."""
        if self.source is None:
            return
        have = self.source.names()
        named = [
            *module.named_parameters(prefix=prefix, recurse=recurse),
            *module.named_buffers(prefix=prefix, recurse=recurse),
        ]
        into = {n: t.data for n, t in named if n in have}
        if into:
            self.source.read(into)

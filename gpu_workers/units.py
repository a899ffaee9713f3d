"""Which submodules of a model are streaming units, and which parameters each holds.

A **unit** is a submodule whose weights a streaming worker fetches as one piece
before its forward (and again before its backward) and releases after: a block
of layers, like the modules FSDP2's ``fully_shard`` is applied to. Units are
chosen, as FSDP's wrap policy does, by module class or by fnmatch pattern on the
module's qualified name (``"layers.*"``); by default they are the children of the
largest ``nn.ModuleList`` / ``nn.Sequential`` (the repeated blocks), largest
by parameter count. Only the outermost match counts: a unit never contains
another. Parameters outside every unit (embeddings, the final norm and head of a
transformer) form the **root**, which stays resident on the worker and is
updated by ``step()`` as in resident mode; so is a parameter shared by two units
(tied weights), since a unit's weights must be its own to be released.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from luwu.protocol.errors import ConfigError
from luwu.protocol.memory import advise_huge_pages


@dataclass(frozen=True, slots=True)
class Unit:
    index: int
    name: str  # the module's qualified name in the model
    module: torch.nn.Module


class Units(list):
    """The units of one model (a list of :class:`Unit`, in registration order) and the model they belong
    to; ``initializer``: set when the model started on the meta device (:mod:`~luwu.gpu_workers.materialize`)."""

    def __init__(self, units: list[Unit], model: torch.nn.Module):
        super().__init__(units)
        self.model = model
        self.initializer = None


def _matches(name: str, module: torch.nn.Module, spec) -> bool:
    for item in spec:
        if isinstance(item, str):
            if fnmatch.fnmatchcase(name, item) or fnmatch.fnmatchcase(type(module).__name__, item):
                return True
        elif isinstance(module, item):
            return True
    return False


def _default_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The children holding parameters of the largest ModuleList / Sequential (by parameter count)."""
    best, best_numel = None, 0
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = [
                (f"{name}.{k}" if name else k, c)
                for k, c in m.named_children()
                if any(True for _ in c.parameters())
            ]
            numel = sum(p.numel() for _, c in kids for p in c.parameters())
            if len(kids) >= 2 and numel > best_numel:
                best, best_numel = kids, numel
    if best is None:
        raise ConfigError(
            f"stream_weights: {type(model).__name__} has no nn.ModuleList / nn.Sequential of at least two blocks with "
            "parameters to stream; name the units with stream_units (module classes or fnmatch patterns on module names)"
        )
    return best


def select_units(model: torch.nn.Module, spec=None) -> list[Unit]:
    """The streaming units of ``model``, in registration order. ``spec``: None (the repeated blocks), or
    a list of module classes and fnmatch patterns on qualified module names or class names."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"stream_weights needs the model (an nn.Module) as the optimizer's params, got {type(model).__name__}"
        )
    if spec is None:
        found = _default_units(model)
    else:
        spec = [spec] if isinstance(spec, (str, type)) else list(spec)
        if not spec or any(not isinstance(s, (str, type)) for s in spec):
            raise ConfigError(
                f"stream_units must be module classes or fnmatch patterns, got {spec!r}"
            )
        found, inside = [], []
        for name, m in model.named_modules():
            if not name or any(name.startswith(p + ".") for p in inside):
                continue
            if _matches(name, m, spec):
                inside.append(name)
                if any(True for _ in m.parameters()):
                    found.append((name, m))
        if not found:
            raise ConfigError(
                f"stream_units {spec!r} match no submodule with parameters of {type(model).__name__}"
            )
    return [Unit(i, name, m) for i, (name, m) in enumerate(found)]


def unit_of_params(units: list[Unit]) -> dict[int, int]:
    """``id(parameter)`` -> the index of the unit that owns it; a parameter of several units is left out
    (it stays resident with the root)."""
    seen: dict[int, int] = {}
    shared: set[int] = set()
    for u in units:
        for p in u.module.parameters():
            if id(p) in seen and seen[id(p)] != u.index:
                shared.add(id(p))
            seen.setdefault(id(p), u.index)
    return {k: v for k, v in seen.items() if k not in shared}


def alloc_storage(p: torch.Tensor) -> None:
    """Give ``p`` back its storage (contents undefined), as FSDP2's ``alloc_storage``."""
    size = p.numel() * p.itemsize
    if (storage := p.untyped_storage()).size() != size:
        storage.resize_(size)
        advise_huge_pages(
            storage
        )  # fresh pages, about to be written whole: fault them in 2 MiB at a time


def free_storage(p: torch.Tensor) -> None:
    """Release ``p``'s storage, keeping the tensor (its shape, its identity, autograd's references)."""
    if (storage := p.untyped_storage()).size() != 0:
        storage.resize_(0)

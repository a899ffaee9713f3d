"""LuWu: an in-network optimizer runtime for data-parallel training.

``RemoteOptimizer`` replaces a ``torch.optim`` optimizer; ``local_cluster``
starts node daemons on loopback; ``Prefetcher`` keeps workers fed. The names
load on first use, so that the command line (``luwu --help``, ``luwu status``)
does not import torch.
"""

from __future__ import annotations

import importlib
import os
import typing

from luwu.protocol.memory import TORCH_HUGE_PAGES_ENV

# Before torch's first allocation, which reads it once: its blocks of 2 MiB and up are then advised
# for transparent huge pages, so a fresh gradient or activation faults in 512x fewer pages
# (luwu.protocol.memory.check_torch_huge_pages says so when it came too late). =0 keeps torch's way.
os.environ.setdefault(TORCH_HUGE_PAGES_ENV, "1")

DISTRIBUTION = "luwu-runtime"
"""The name LuWu is installed under (``luwu`` itself is taken on PyPI)."""
_ERRORS = "luwu.protocol.errors"
_LAZY = {
    "RemoteOptimizer": "luwu.optimizer",
    "Prefetcher": "luwu.gpu_workers.prefetch",
    "local_cluster": "luwu.cluster",
    "LocalCluster": "luwu.cluster",
    "export_dcp": "luwu.model_io",
    "save_checkpoint": "luwu.model_io",
    "load_checkpoint": "luwu.model_io",
    "LuwuError": _ERRORS,
    "ConfigError": _ERRORS,
    "CorruptCheckpointError": _ERRORS,
    "ProtocolError": _ERRORS,
    "JobMismatchError": _ERRORS,
    "JobExistsError": _ERRORS,
    "LayoutMismatchError": _ERRORS,
    "NodeTimeoutError": _ERRORS,
    "RemoteError": _ERRORS,
    "RollbackError": _ERRORS,
    "NodeStateLostError": _ERRORS,
    "StepMismatchError": _ERRORS,
    "WorkerLostError": _ERRORS,
}

__all__ = [*_LAZY, "__version__"]

if typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time these load on first use
    from luwu.cluster import LocalCluster, local_cluster
    from luwu.gpu_workers.prefetch import Prefetcher
    from luwu.model_io import export_dcp, load_checkpoint, save_checkpoint
    from luwu.optimizer import RemoteOptimizer
    from luwu.protocol.errors import (
        ConfigError,
        CorruptCheckpointError,
        JobExistsError,
        JobMismatchError,
        LayoutMismatchError,
        LuwuError,
        NodeStateLostError,
        NodeTimeoutError,
        ProtocolError,
        RemoteError,
        RollbackError,
        StepMismatchError,
        WorkerLostError,
    )


def __getattr__(name: str):
    if name == "__version__":  # from the installed distribution's metadata
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version(DISTRIBUTION)
        except PackageNotFoundError:  # a bare checkout, never installed
            value = "unknown"
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'luwu' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, "__version__"])

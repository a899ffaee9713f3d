"""LuWu: an in-network optimizer runtime for data-parallel training.

``RemoteOptimizer`` replaces a ``torch.optim`` optimizer; ``local_cluster``
starts node daemons on loopback; ``Prefetcher`` keeps workers fed.
"""

from luwu.cluster import LocalCluster, local_cluster
from luwu.gpu_workers.prefetch import Prefetcher
from luwu.optimizer import RemoteOptimizer
from luwu.protocol.errors import (
    ConfigError,
    JobMismatchError,
    LayoutMismatchError,
    LuwuError,
    NodeTimeoutError,
    ProtocolError,
    RemoteError,
    RollbackError,
    StepMismatchError,
    WorkerLostError,
)

__all__ = [
    "RemoteOptimizer",
    "Prefetcher",
    "local_cluster",
    "LocalCluster",
    "LuwuError",
    "ConfigError",
    "ProtocolError",
    "JobMismatchError",
    "LayoutMismatchError",
    "NodeTimeoutError",
    "RemoteError",
    "RollbackError",
    "StepMismatchError",
    "WorkerLostError",
]
__version__ = "0.1.0"

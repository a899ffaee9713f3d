"""Out-of-core state: a node's shard larger than its memory (DESIGN.md, "Out-of-core state").

The fp32 master weights and optimizer state of each bucket live in files under
``node.state_dir`` (:mod:`.state_file`: two slots per bucket and a journal of
commits, which is also the checkpoint); ``node.state_memory_bytes`` of RAM is a
window over them (:mod:`.window`) that reads buckets ahead of their step and
writes them back behind it, through aligned buffers and ``O_DIRECT`` requests
in flight (:mod:`.io`).
"""

from __future__ import annotations

from luwu.switch_nodes.ooc.io import BufferPool, Extent, IOEngine, Transfer
from luwu.switch_nodes.ooc.layout import BucketSpec, StateLayout, TensorSpec
from luwu.switch_nodes.ooc.state_file import Commit, StateFile
from luwu.switch_nodes.ooc.window import BucketView, StateWindow, WindowStats

__all__ = [
    "BucketSpec",
    "BucketView",
    "BufferPool",
    "Commit",
    "Extent",
    "IOEngine",
    "StateFile",
    "StateLayout",
    "StateWindow",
    "TensorSpec",
    "Transfer",
    "WindowStats",
]

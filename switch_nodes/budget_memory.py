"""What a node whose memory is budgeted (``node.push_memory_bytes``, or ``node.state_memory_bytes``
with ``node.state_dir``) needs besides counting its pushes (:mod:`.inflight`): an allocator that
gives freed buffers back, and the error for a budget too small for one bucket.

A node that keeps freed memory for reuse (``node.retain_freed_memory``: glibc serves blocks up to
32 MiB from its heaps and trims them at 1 GiB free) holds, after a while, the peak of every heap
(one per thread that allocates: the event loop reads pushes and seeds, the optimizer thread sums and
encodes replies, the I/O threads) plus their fragmentation, none of it counted: measured on an
out-of-core node of 34M parameters (4 MiB buckets, 96 MiB of node.state_memory_bytes), 64 MiB more
in the event loop's heap and 32 MiB in the optimizer thread's than the budget's peak. With a budget,
blocks of :data:`MMAP_THRESHOLD` or more (every push payload, accumulator and reply of a bucket) are
mapped on their own and unmapped when freed, and a heap's free top is trimmed past
:data:`TRIM_THRESHOLD`: the node's memory follows what the budget counts, at the cost of faulting in
fresh pages for each of them, but for those kept for reuse within the budget (:mod:`.kept_frames`).
"""

from __future__ import annotations

from luwu.protocol.errors import ConfigError
from luwu.protocol.memory import retain_freed_memory
from luwu.switch_nodes.kept_frames import Kept, KeptFrames

__all__ = [
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "arrange_memory",
    "give_back_freed_memory",
    "too_small",
]

MMAP_THRESHOLD = 256 << 10
"""Blocks of this size or more are mapped on their own (unmapped when freed) on a budgeted node."""
TRIM_THRESHOLD = 1 << 20
"""Free memory at the top of a heap beyond this goes back to the system on a budgeted node."""


def arrange_memory(ctx, accumulators) -> None:
    """The node's allocator policy (at start, its listener bound): with a push budget, freed memory
    goes back and the buffers kept for reuse live in the budget's room (:mod:`.kept_frames`: the
    accumulators and the frames' buffers); without, freed memory is kept (``node.retain_freed_memory``)."""
    if ctx.cfg.push_budget:
        give_back_freed_memory()
        accumulators.mapped = True
        ctx.listener.frames = frames = KeptFrames()
        ctx.inflight.kept = Kept(accumulators, frames)
    elif ctx.cfg.retain_freed_memory:
        retain_freed_memory()


def give_back_freed_memory() -> bool:
    """Set the allocator of a budgeted node (see the module's doc); whether glibc took it."""
    return retain_freed_memory(MMAP_THRESHOLD, TRIM_THRESHOLD)


def too_small(ctx, worker: int, big, world_size: int, need: int, limit: int) -> ConfigError:
    """The refusal of a HELLO whose largest bucket's full set of pushes does not fit the budget."""
    cfg = ctx.cfg
    how = (
        f"raise node.push_memory_bytes to at least {need}"
        if cfg.push_memory_bytes or not cfg.state_memory_bytes
        else f"raise node.state_memory_bytes to well above {need} (the pushes in flight take at least "
        f"that of it, the state window the rest)"
    )
    return ConfigError(
        f"HELLO of worker {worker}: node {ctx.index}'s pushes in flight may hold {limit} B "
        f"(node.push_memory_bytes resolved), less than one bucket's full set of pushes: bucket {big.id} "
        f"of {big.numel} parameters needs {need} B (its accumulator, {world_size} workers' pushes and its "
        f"reply, 4 B a parameter each): {how}, or use a smaller bucket_bytes"
    )

"""Out-of-core nodes in ``luwu plan``: a node's state on its disks, its RAM a window over it.

A node keeps, per parameter of its shard, the fp32 master and the optimizer's state
(:func:`state_bytes_per_param`: AdamW 12 B, Adafactor a little over 4 B). When that state is larger
than the RAM the node gives it (``node.state_memory_bytes``), it lives in files on the node's disks
and streams through the window every step (DESIGN.md, "Out-of-core state"). The terms, per node j
(``k`` disks, each reading at ``r`` and writing at ``w`` GB/s, and a 50/50 mix at ``m`` GB/s where
measured)::

    S_j     = P_j * s                          node j's state, bytes (s: state bytes per parameter)
    M       = state_memory_bytes               RAM for the state (None: all of it fits)
    in RAM        if S_j <= M: nothing on disk, the node is today's in-RAM node
    out of core   otherwise: the whole state is read and written once per step
    D_j     = S_j / (k r) + S_j / (k w)                  no mixed rate: reads and writes share the disks
    D_j     = max(S_j / (k r), S_j / (k w), 2 S_j / (k m))   with the measured rate of the mix

Where the disk time goes (the overlap, an assumption of the model): the node knows the order in
which its buckets step, so it reads a bucket's state ahead of its last push and writes it back
behind its step. Before the first gradient of a step arrives, while forward runs, the disk reads
ahead as much as the window holds; the rest streams while the gradients arrive, bucket by bucket,
pipelined with the pushes exactly as the optimizer is. So the node's stage of the step pipeline
(``node`` in :mod:`.model`) becomes::

    ahead_j = min(M / (k r), (1 - f) * C')     read ahead into the window during forward
    node_j  = max(cpu_j, D_j - ahead_j)        the disk time not hidden behind the gradients' arrival

and, since the disk is busy ``D_j`` every step whatever overlaps it, the step is never shorter than
``D_j`` (a resource of its own, ``node j disk``, that can be the bottleneck).

What a node must have for this to work: a window of at least one bucket's state (the node refuses
less), and, with ``disk_bytes`` given, room on its disks for two slots of every bucket (the state
files are the checkpoint: a step is written into the slot that does not hold the committed
version).

Not modelled: reads saved by buckets that stay in the window from one step to the next when the state
is only a little larger than the budget (bench_ooc, at 4x, reads every bucket every pass), the
per-bucket step counters (one aligned block per bucket), the node's memory bandwidth and PCIe lanes
shared by many disks, and what a streaming fetch costs the disk (fetches are served from the replies
held in RAM).
"""

from __future__ import annotations

import math
from typing import Any

from luwu.protocol.errors import ConfigError

#: The shape Adafactor's factored state is counted on: a width-4096 MLP matrix, whose row and column
#: statistics add 4 * (1/4096 + 1/16384) B per parameter (any large matrix adds next to nothing).
ADAFACTOR_MATRIX = (4096, 16384)

MASTER_BYTES_PER_PARAM = 4.0
"""The fp32 master weight a node keeps of every parameter of its shard."""


def state_bytes_per_param(optimizer: str) -> float:
    """Bytes a node keeps per parameter with ``optimizer`` at torch's defaults: the fp32 master plus the
    state tensors the node's kind keeps (:mod:`luwu.switch_nodes.optimizers.kinds`). Elementwise state
    counts 4 B per tensor; Adafactor's row and column statistics are counted on :data:`ADAFACTOR_MATRIX`.
    SGD at its defaults keeps no momentum (4 B): with momentum, pass the bytes (8) instead of a name."""
    from luwu.switch_nodes.optimizers.kinds import get_kind

    kind = get_kind(optimizer)
    kept = kind.state_for(kind.defaults)
    shapes = kind.state_shapes(ADAFACTOR_MATRIX)
    numel = math.prod(ADAFACTOR_MATRIX)
    state = sum(4.0 * math.prod(shapes[name]) for name in kept if name in shapes)
    return MASTER_BYTES_PER_PARAM + state / numel


def disk_stream_s(
    read_bytes: float,
    write_bytes: float,
    disks: int,
    read_gb_s: float,
    write_gb_s: float,
    mixed_gb_s: float | None = None,
) -> float:
    """Seconds ``disks`` disks take to read ``read_bytes`` and write ``write_bytes`` (spread evenly over
    them): one after the other on each disk, or, with the rate of a 50/50 mix measured, at that rate,
    but never faster than reading alone or writing alone."""
    if read_bytes + write_bytes == 0:
        return 0.0
    if disks < 1:
        raise ConfigError(f"{read_bytes + write_bytes:.0f} bytes to stream with no disks")
    read_s = read_bytes / (disks * read_gb_s * 1e9)
    write_s = write_bytes / (disks * write_gb_s * 1e9)
    if mixed_gb_s is None:
        return read_s + write_s
    return max(read_s, write_s, (read_bytes + write_bytes) / (disks * mixed_gb_s * 1e9))


def node_disk_terms(spec: Any, shards: tuple[float, ...], compute_s: float, f: float) -> dict:
    """Per node: its state, whether it is out of core and fits, its disk seconds per step, and the part
    of them read ahead during forward (the module docstring's ``S_j``, ``D_j``, ``ahead_j``)."""
    state = tuple(s * spec.state_bytes_per_param for s in shards)
    budget = spec.state_memory_bytes
    one_bucket = spec.bucket_bytes / 4 * spec.state_bytes_per_param
    out_of_core = tuple(budget is not None and s > budget for s in state)
    fits = tuple(
        not ooc
        or (
            spec.disks >= 1
            and budget >= min(one_bucket, s)
            and (spec.disk_bytes is None or spec.disks * spec.disk_bytes >= 2 * s)
        )
        for s, ooc in zip(state, out_of_core)
    )
    disk_s, ahead_s = [], []
    for s, ooc in zip(state, out_of_core):
        if not ooc or spec.disks < 1:
            disk_s.append(0.0)
            ahead_s.append(0.0)
            continue
        rates = (spec.disks, spec.disk_read_gb_s, spec.disk_write_gb_s, spec.disk_mixed_gb_s)
        d = disk_stream_s(s, s, *rates)
        disk_s.append(d)
        ahead_s.append(
            min(d, budget / (spec.disks * spec.disk_read_gb_s * 1e9), (1 - f) * compute_s)
        )
    return {
        "state_bytes": state,
        "out_of_core": out_of_core,
        "fits": fits,
        "disk_s": tuple(disk_s),
        "ahead_s": tuple(ahead_s),
    }

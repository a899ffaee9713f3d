"""`luwu plan`: an analytical model of one training step, to size a cluster before renting it.

The model follows the data path of DESIGN.md (sync mode, streaming pushes,
one reply with the new weights per bucket). Every term is a number a user can
check by hand, so that the lead can hold it against the emulated cluster.

Inputs (see :class:`PlanSpec`): ``P`` parameters, ``W`` workers, ``N`` nodes
with capacities ``c_j``, link rates in Gbit/s, push/pull codec bytes per
element ``b_push``/``b_pull``, node optimizer rate ``R`` (params/s per thread)
with ``T`` threads, codec seconds per element (``e`` encode, ``d`` decode),
compute ``C`` = forward + backward seconds per step, streaming overlap ``f``,
protocol efficiency ``eta``.

Terms, per step::

    w_j    = c_j / sum(c)                       node j's share of the parameters
    P_j    = P * w_j                            its shard, elements
    B_w    = worker_gbps * 1e9 / 8 * eta        a worker link, bytes/s, each direction
    B_n,j  = node_gbps_j * 1e9 / 8 * eta        node j's link, bytes/s, each direction

    worker up    = P * b_push                bytes  / B_w     (its gradients, to all nodes)
    worker down  = P * b_pull                bytes  / B_w     (all new weights)
    node j down  = W * P_j * b_push          bytes  / B_n,j   (incast: every worker's shard)
    node j up    = W * P_j * b_pull          bytes  / B_n,j   (a reply to every worker)
    node j cpu   = P_j * (1/R + W * d_push + e_pull) / T      (sum + optimizer + reply)
    worker codec = P * (e_push + d_pull)                      (on the training thread, see below)

Where the worker's codec time goes (DESIGN.md's data path): a bucket is
encoded in the gradient hook that completes it, on the training thread, so
encoding lengthens backward; ``step()`` waits for every reply and then writes
the weights into the parameters, so decoding follows the last reply::

    C'    = C + P * e_push                      compute with the hooks' encoding
    write = P * d_pull                          after the last reply (delayed update: after the next backward)

A bucket crosses three stages in series; links are full duplex, and a transfer
through a worker link and a node link in series runs at the slower one::

    push  = max(worker up, max_j node j down)
    node  = max_j node j cpu
    pull  = max(max_j node j up, worker down)

Buckets (``K = ceil(4 P / bucket_bytes)``) pipeline through the stages::

    path = max(stages) + (sum(stages) - max(stages)) / K    # time for all of a step's buckets
    tail = sum(stages) / K                                  # the last bucket alone

Streaming: pushes start once the first bucket of backward is ready, so up to
``f * C'`` of the path hides behind backward (default ``f = 2/3 * (1 - 1/K)``:
backward is 2/3 of compute at fwd:bwd = 1:2, less its first bucket). The last
bucket cannot leave before backward ends, hence the ``tail`` floor::

    sync step    = C' + max(path - f * C', tail) + write

Delayed update (ZeRO-Offload's DPU, staleness 1): forward t+1 runs on weights
not yet updated by step t, which are written after backward t+1. Each resource
is busy once per step (throughput), and step t's path, which starts at
``(1 - f) * C'`` into step t, must end before backward t+1 does, one period
later, or the training thread waits::

    delayed step = max(C' + write, max(stages), ((1 - f) * C' + path + write) / 2)

which is never more than the sync step. ``samples/s = W * batch / step``.

Shared cores (``shared_cores = S``: every worker and node process runs on the
same S cores, as in the emulated cluster of benchmarks/cluster_study.py, or
processes packed on one host). The network stack costs CPU too: ``n`` seconds
per payload byte moved (sender and receiver together: kernel, ZeroMQ, the
worker's I/O thread; bench_links measures ~0.8 ns/B for bare sockets). Then::

    worker cpu   = C' + write                               (each worker's training thread)
    net cpu      = n * W * (P * b_push + P * b_pull)        (every byte crosses once)
    shared cpu   = (W * worker cpu + sum_j node j cpu + net cpu) / S
    C', write   -> C' * max(1, W / S), write * max(1, W / S)  (the W workers do them at once on S cores)

and both step formulas above take ``max(step, shared cpu)``: the cores must do
all the step's work once per step. Streaming needs a core the workers leave
free (the I/O threads, the kernel's network work and the nodes' decoding run
there while backward goes on): with ``W >= S`` the default overlap is ``f = 0``
(on the emulated cluster, 4 workers on 2 cores push after backward).
Without ``shared_cores`` every host has its own CPU and none of this applies.

The bottleneck is the resource busiest per step among compute, each worker link
direction, each node link direction, each node's CPU, the worker codec and (with
``shared_cores``) the shared cores.

Streaming mode (``stream_weights``): the nodes own the weights and a worker fetches every
unit for its forward, and again for its backward the share ``r`` (``stream_refetch``) it did not
keep (the last ``prefetch`` units of the forward, whose backward comes right after, and those whose
forward reply fits ``stream_hold_bytes``: :func:`stream_refetch_share`); every unit is written twice::

    worker down  = (1 + r) * P * b_pull    node j up = (1 + r) * W * P_j * b_pull    write = 2 * P * d_pull

The fetches run ahead of compute (``prefetch`` units) and the pushes leave unit by unit during
backward, so each resource is busy once per step, all at the same time; what cannot overlap is
the first unit's fetch and the last unit's push path: one unit through the stages (a unit is asked
for and waited for whole; ``U`` = ``stream_units``, default one unit per bucket)::

    stream step  = max(C' + write, push, node, pull, shared cpu) + (push + node + pull) / min(U, buckets)

Out-of-core nodes (``state_memory_bytes`` smaller than a node's state, which then lives on its
``disks``): the node's stage becomes ``max(cpu_j, disk time not hidden behind the gradients'
arrival)`` and every formula above takes ``max(step, D_j)``, the disk's seconds per step; the terms
and the overlap they assume are in :mod:`.disk`.

The switch tier (``group_size``: aggregators that sum a group's pushes before the nodes): a node
hears from the aggregators instead of the workers, and a bucket crosses six stages instead of
three; the terms are in :mod:`.tier`.

Not modelled: link latency and per-message overheads (frames are 1-4 MiB),
unfair incast sharing, CPU contention between compute, codecs and the I/O
thread on one host (except through ``shared_cores``), the bf16 warm-up
steps of the hybrid policy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from luwu.plan.checks import check_spec
from luwu.plan.disk import node_disk_terms
from luwu.plan.profiles import codec_profile
from luwu.plan.tier import TierTerms, members, tier_resources, tier_terms
from luwu.plan.tier import stages as tier_stages

ADAMW_PARAMS_PER_S_PER_THREAD = 1.3e9
"""torch fused AdamW on CPU, one thread (benchmarks/bench_node_step.py); a core with more memory
bandwidth does more: pass ``--opt-rate``."""

DEFAULT_BUCKET_BYTES = 4 << 20
BACKWARD_FRACTION = 2.0 / 3.0
"""Share of forward+backward spent in backward, for fwd:bwd = 1:2."""


@dataclass(kw_only=True, slots=True)
class PlanSpec:
    """One cluster and model to predict a step for."""

    num_params: int
    """Parameters of the model (all trained, fp32 on the nodes)."""
    workers: int
    """Training processes, one per worker host (each has its own link)."""
    compute_s: float
    """Forward + backward seconds per step on a worker, without any communication."""
    nodes: int = 1
    """Optimizer nodes, one per node host."""
    capacities: tuple[float, ...] | None = None
    """Relative capacity of each node (weights its shard); None = equal shards."""
    worker_gbps: float = 10.0
    """Line rate of each worker host's link, Gbit/s, each direction (full duplex)."""
    node_gbps: float | tuple[float, ...] = 10.0
    """Line rate of each node host's link, Gbit/s; one number for all or one per node."""
    push_bytes_per_elem: float = 4.0
    """Wire bytes per gradient element pushed (fp32 4, bf16 2, int8 ~1.03, top-k 1% 0.08)."""
    pull_bytes_per_elem: float = 4.0
    """Wire bytes per weight element sent back (fp32 4, bf16 2, int8 deltas ~1.03)."""
    opt_params_per_s: float = ADAMW_PARAMS_PER_S_PER_THREAD
    """Node optimizer rate per thread, params/s (fused AdamW)."""
    node_threads: int = 1
    """Threads a node gives its optimizer and codecs; divides their time."""
    push_encode_s_per_elem: float = 0.0
    """Worker seconds to encode one gradient element (one thread)."""
    push_decode_s_per_elem: float = 0.0
    """Node seconds to decode one pushed element into the accumulator (one thread), per worker."""
    pull_encode_s_per_elem: float = 0.0
    """Node seconds to encode one element of the reply (one thread), once for all workers."""
    pull_decode_s_per_elem: float = 0.0
    """Worker seconds to decode one element of the reply into its parameters."""
    delayed_update: bool = False
    """Whether the job runs with delayed update (staleness 1); picks :attr:`Plan.step_s`."""
    overlap_fraction: float | None = None
    """Fraction of compute that pushes can overlap; None = 2/3 * (1 - 1/buckets)."""
    protocol_efficiency: float = 0.9
    """Fraction of line rate that TCP + ZeroMQ achieve."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """fp32 bytes per bucket, the unit that pipelines through the stages."""
    batch_per_worker: int | None = None
    """Samples per worker per step, for samples/s; None = not reported."""
    stream_weights: bool = False
    """Streaming mode: weights fetched per unit for forward and, for the share ``stream_refetch``, again for
    backward (``pull_bytes_per_elem`` each time: the fetch codec, int8 with compression on); sync mode only."""
    stream_refetch: float = 1.0
    """Streaming mode: the share of the weights fetched again for backward (:func:`stream_refetch_share`)."""
    stream_units: int | None = None
    """Streaming mode: how many units the model streams in (None: one per bucket). A unit's weights are
    asked for and waited for whole, so what cannot overlap is one unit through the stages."""
    shared_cores: float | None = None
    """Cores that every worker and node process share (an emulated cluster on one machine, or processes
    packed on one host); None = every host has its own CPU."""
    net_cpu_s_per_byte: float = 0.0
    """CPU seconds the network stack spends per byte moved, sender and receiver together (kernel +
    ZeroMQ); counts only against ``shared_cores``."""
    state_bytes_per_param: float = 12.0
    """fp32 master + optimizer state a node keeps per parameter (AdamW 12; :func:`.disk.state_bytes_per_param`)."""
    state_memory_bytes: float | None = None
    """RAM a node gives its state (``node.state_memory_bytes``); None = every node's state stays in RAM."""
    disks: int = 0
    """Disks per node that hold the state when it is larger than ``state_memory_bytes``."""
    disk_read_gb_s: float = 3.0
    """Read rate of one disk, GB/s (``O_DIRECT``, the node's request size and queue depth)."""
    disk_write_gb_s: float = 2.0
    """Write rate of one disk, GB/s (sustained, synced)."""
    disk_mixed_gb_s: float | None = None
    """Rate of one disk under a 50/50 mix of reads and writes, GB/s; None = reads and writes take turns."""
    disk_bytes: float | None = None
    """Capacity of one disk, bytes; None = not checked (the state files hold two slots of the state)."""
    group_size: int | None = None
    """The switch tier: workers per aggregator (:mod:`.tier`); None = flat, workers talk to the nodes."""
    group_gbps: float | None = None
    """An aggregator's link to its group, Gbit/s each direction; None = ``worker_gbps``."""
    aggregator_gbps: float | None = None
    """An aggregator's uplink to the nodes, Gbit/s each direction; None = the slowest node link."""
    aggregator_threads: int = 1
    """Threads an aggregator decodes and sums with."""

    def __post_init__(self) -> None:
        check_spec(self)

    def node_gbps_list(self) -> tuple[float, ...]:
        if isinstance(self.node_gbps, tuple):
            return self.node_gbps
        return (float(self.node_gbps),) * self.nodes


def spec_with_codecs(
    spec: PlanSpec, push: str, pull: str, *, codec_costs: bool = True, worker_costs: bool = True
) -> PlanSpec:
    """``spec`` with the bytes (and, with ``codec_costs``, the encode/decode times) of two named codecs;
    ``worker_costs=False``: the workers' side costs nothing (they encode and decode on an accelerator)."""
    p, q = codec_profile(push), codec_profile(pull)
    node, worker = codec_costs, codec_costs and worker_costs
    return dataclasses.replace(
        spec,
        push_bytes_per_elem=p.bytes_per_elem,
        pull_bytes_per_elem=q.bytes_per_elem,
        push_encode_s_per_elem=p.encode_s_per_elem if worker else 0.0,
        push_decode_s_per_elem=p.decode_s_per_elem if node else 0.0,
        pull_encode_s_per_elem=q.encode_s_per_elem if node else 0.0,
        pull_decode_s_per_elem=q.decode_s_per_elem if worker else 0.0,
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """The predicted step; every field is a term of the module docstring."""

    spec: PlanSpec
    shard_params: tuple[float, ...]
    worker_up_bytes: float
    worker_down_bytes: float
    worker_up_s: float
    worker_down_s: float
    node_down_bytes: tuple[float, ...]
    node_up_bytes: tuple[float, ...]
    node_down_s: tuple[float, ...]
    node_up_s: tuple[float, ...]
    node_opt_s: tuple[float, ...]
    """Optimizer part of each node's CPU time."""
    node_cpu_s: tuple[float, ...]
    """Optimizer + decoding pushes + encoding the reply, per node."""
    node_state_bytes: tuple[float, ...]
    """Each node's state: its shard times ``state_bytes_per_param``."""
    node_out_of_core: tuple[bool, ...]
    """Whether a node's state is larger than ``state_memory_bytes`` (so it lives on its disks)."""
    node_fits: tuple[bool, ...]
    """Whether a node can hold its state: in RAM, or out of core with disks, a window of a bucket at
    least and (``disk_bytes`` given) room for two slots."""
    node_disk_s: tuple[float, ...]
    """Disk seconds per step of each node (0 in RAM)."""
    node_disk_ahead_s: tuple[float, ...]
    """The part of them read ahead into the window while forward runs."""
    worker_codec_s: float
    compute_eff_s: float
    """C': forward + backward with the hooks' encoding, slowed by sharing ``shared_cores``."""
    write_s: float
    """Writing the weights into the parameters after the last reply (slowed by sharing cores)."""
    net_cpu_s: float
    """CPU the network stack spends on one step's bytes (all hosts)."""
    shared_cpu_s: float
    """All the step's CPU work over ``shared_cores`` (0 without)."""
    num_buckets: int
    overlap_fraction: float
    push_s: float
    node_s: float
    pull_s: float
    path_s: float
    tail_s: float
    sync_step_s: float
    delayed_step_s: float
    bottleneck: str
    resources: dict[str, float] = field(default_factory=dict)
    """Busy seconds per step of each resource; the bottleneck is the largest."""
    tier: TierTerms | None = None
    """The aggregators' terms (:mod:`.tier`); None without the switch tier."""

    @property
    def step_s(self) -> float:
        return self.delayed_step_s if self.spec.delayed_update else self.sync_step_s

    @property
    def samples_per_s(self) -> float | None:
        if self.spec.batch_per_worker is None:
            return None
        return self.spec.workers * self.spec.batch_per_worker / self.step_s

    @property
    def fits(self) -> bool:
        """Whether every node can hold its state (see :attr:`node_fits`)."""
        return all(self.node_fits)

    @property
    def node_link_binds(self) -> bool:
        return self.bottleneck.startswith("node") and "link" in self.bottleneck

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec"}
        out["tier"] = dataclasses.asdict(self.tier) if self.tier is not None else None
        out["spec"] = dataclasses.asdict(self.spec)
        out["step_s"] = self.step_s
        out["samples_per_s"] = self.samples_per_s
        out["fits"] = self.fits
        return out


def stream_refetch_share(units: int, prefetch: int = 2, pull_bytes_per_elem: float = 4.0) -> float:
    """The share of a streamed model fetched again for backward, ``units`` equal units, on the defaults: the last
    ``max(1, prefetch)`` units of the forward stay for their backward, and the forward replies of the units
    before them are kept while they fit ``max(1, prefetch)`` units of fp32 (``optimizer.stream_hold_bytes = -1``)."""
    turn = min(units, max(1, prefetch))
    kept = min(units - turn, int(turn * 4.0 / max(pull_bytes_per_elem, 1e-9)))
    return (units - turn - kept) / units


def _wire_terms(spec: PlanSpec, shards: tuple[float, ...]) -> dict[str, Any]:
    """Bytes and seconds on every link (the docstring's worker up/down and node j down/up; with the
    switch tier a node hears from the aggregators, and :mod:`.tier` adds their links)."""
    P, W = spec.num_params, members(spec)
    bw_worker = spec.worker_gbps * 1e9 / 8 * spec.protocol_efficiency
    bw_nodes = [g * 1e9 / 8 * spec.protocol_efficiency for g in spec.node_gbps_list()]
    # streaming: fetched for forward, and the share not kept fetched again for backward
    fetches = 1 + spec.stream_refetch if spec.stream_weights else 1
    t: dict[str, Any] = {
        "worker_up_bytes": P * spec.push_bytes_per_elem,
        "worker_down_bytes": fetches * P * spec.pull_bytes_per_elem,
        "node_down_bytes": tuple(W * s * spec.push_bytes_per_elem for s in shards),
        "node_up_bytes": tuple(fetches * W * s * spec.pull_bytes_per_elem for s in shards),
    }
    t["worker_up_s"] = t["worker_up_bytes"] / bw_worker
    t["worker_down_s"] = t["worker_down_bytes"] / bw_worker
    t["node_down_s"] = tuple(b / bw for b, bw in zip(t["node_down_bytes"], bw_nodes))
    t["node_up_s"] = tuple(b / bw for b, bw in zip(t["node_up_bytes"], bw_nodes))
    t["tier"] = tier_terms(spec, fetches)
    return t


def _cpu_terms(spec: PlanSpec, shards: tuple[float, ...], wire: dict[str, Any]) -> dict[str, Any]:
    """Each node's CPU, the worker's codecs, compute with the hooks' encoding, and shared cores."""
    P, W, M = spec.num_params, spec.workers, members(spec)
    fetches = 1 + spec.stream_refetch if spec.stream_weights else 1
    node_opt_s = tuple(s / spec.opt_params_per_s / spec.node_threads for s in shards)
    # a reply is encoded once for every worker; a streaming fetch once per worker and fetch
    per_elem_codec = (
        M * spec.push_decode_s_per_elem
        + (fetches * M if spec.stream_weights else 1) * spec.pull_encode_s_per_elem
    )
    node_cpu_s = tuple(
        o + s * per_elem_codec / spec.node_threads for o, s in zip(node_opt_s, shards)
    )
    # after the last reply (streaming: as each unit arrives)
    write_s = (2 if spec.stream_weights else 1) * P * spec.pull_decode_s_per_elem
    worker_codec_s = P * spec.push_encode_s_per_elem + write_s
    C = spec.compute_s + P * spec.push_encode_s_per_elem  # the hooks encode on the training thread
    moved = W * (wire["worker_up_bytes"] + wire["worker_down_bytes"])
    tier, tier_cpu_s = wire["tier"], 0.0
    if tier is not None:  # every byte crosses twice; the aggregators decode and sum
        moved += M * (tier.uplink_up_bytes + tier.uplink_down_bytes)
        tier_cpu_s = M * tier.cpu_s
    net_cpu_s = spec.net_cpu_s_per_byte * moved
    shared_cpu_s = 0.0
    if spec.shared_cores is not None:
        shared_cpu_s = W * (C + write_s) + sum(node_cpu_s) + tier_cpu_s + net_cpu_s
        shared_cpu_s /= spec.shared_cores
        slow = max(1.0, W / spec.shared_cores)
        C, write_s = C * slow, write_s * slow
    return {
        "node_opt_s": node_opt_s,
        "node_cpu_s": node_cpu_s,
        "worker_codec_s": worker_codec_s,
        "compute_eff_s": C,
        "write_s": write_s,
        "net_cpu_s": net_cpu_s,
        "shared_cpu_s": shared_cpu_s,
    }


def _overlap(spec: PlanSpec, num_buckets: int) -> float:
    f = spec.overlap_fraction
    if f is None:
        f = BACKWARD_FRACTION * (1.0 - 1.0 / num_buckets)
        if spec.shared_cores is not None and spec.workers >= spec.shared_cores:
            f = 0.0  # no core left over while the workers compute: the pushes move after backward
    return f


def _step_terms(spec: PlanSpec, t: dict[str, Any]) -> dict[str, Any]:
    """The pipeline of stages, and the sync, delayed and streaming steps (floored by the disks)."""
    C, write_s, f, K = t["compute_eff_s"], t["write_s"], t["overlap_fraction"], t["num_buckets"]
    floor = max(t["shared_cpu_s"], *t["node_disk_s"])  # resources busy once per step, all the step
    push_s = max(t["worker_up_s"], *t["node_down_s"])
    # the node's stage: its CPU, or the disk time not read ahead during forward
    node_s = max(
        max(cpu, disk - ahead)
        for cpu, disk, ahead in zip(t["node_cpu_s"], t["node_disk_s"], t["node_disk_ahead_s"])
    )
    pull_s = max(t["worker_down_s"], *t["node_up_s"])
    stages = tier_stages(t | {"push_s": push_s, "node_s": node_s, "pull_s": pull_s})
    if t["tier"] is not None:  # (the push stages: two hops and the sum between; the pull: two hops)
        push_s, pull_s = max(stages[:3]), max(stages[4:])
    longest = max(stages)
    path_s = longest + (sum(stages) - longest) / K
    tail_s = sum(stages) / K
    sync_step_s = max(C + max(path_s - f * C, tail_s) + write_s, floor)
    delayed_step_s = max(C + write_s, longest, ((1.0 - f) * C + path_s + write_s) / 2.0, floor)
    if spec.stream_weights:  # every resource busy once per step, side by side; the first unit's fetch and last push exposed
        tail_s = sum(stages) / min(K, spec.stream_units or K)
        sync_step_s = delayed_step_s = max(C + write_s, longest, floor) + tail_s
    assert delayed_step_s <= sync_step_s * (1 + 1e-12), (delayed_step_s, sync_step_s)
    return {
        "push_s": push_s,
        "node_s": node_s,
        "pull_s": pull_s,
        "path_s": path_s,
        "tail_s": tail_s,
        "sync_step_s": sync_step_s,
        "delayed_step_s": delayed_step_s,
    }


def _resources(spec: PlanSpec, t: dict[str, Any]) -> dict[str, float]:
    """Busy seconds per step of every resource, in the order that breaks ties (compute first)."""
    resources = {
        "compute": t["compute_eff_s"],
        "worker uplink": t["worker_up_s"],
        "worker downlink": t["worker_down_s"],
    }
    for j in range(spec.nodes):
        resources[f"node {j} downlink"] = t["node_down_s"][j]
        resources[f"node {j} uplink"] = t["node_up_s"][j]
        resources[f"node {j} cpu"] = t["node_cpu_s"][j]
        if t["node_out_of_core"][j]:
            resources[f"node {j} disk"] = t["node_disk_s"][j]
    resources |= tier_resources(t["tier"])
    resources["worker codec"] = t["worker_codec_s"]
    if spec.shared_cores is not None:
        resources["shared cores"] = t["shared_cpu_s"]
    return resources


def plan(spec: PlanSpec) -> Plan:
    """Predict one step of ``spec`` (formulas in the module docstring and :mod:`.disk`)."""
    caps = spec.capacities or (1.0,) * spec.nodes
    shards = tuple(spec.num_params * c / sum(caps) for c in caps)
    t = _wire_terms(spec, shards)
    t |= _cpu_terms(spec, shards, t)
    t["num_buckets"] = max(1, math.ceil(4 * spec.num_params / spec.bucket_bytes))
    t["overlap_fraction"] = _overlap(spec, t["num_buckets"])
    disk = node_disk_terms(spec, shards, t["compute_eff_s"], t["overlap_fraction"])
    t |= {f"node_{k}": v for k, v in disk.items()}
    t["node_disk_ahead_s"] = t.pop("node_ahead_s")
    t |= _step_terms(spec, t)
    resources = _resources(spec, t)
    bottleneck = max(resources, key=resources.__getitem__)  # first of equals: compute wins ties
    return Plan(spec=spec, shard_params=shards, bottleneck=bottleneck, resources=resources, **t)

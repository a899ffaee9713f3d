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
(measured on the emulated cluster: 4 workers on 2 cores push after backward).
Without ``shared_cores`` every host has its own CPU and none of this applies.

The bottleneck is the resource busiest per step among compute, each worker link
direction, each node link direction, each node's CPU, the worker codec and (with
``shared_cores``) the shared cores.

Not modelled: link latency and per-message overheads (frames are 1-4 MiB),
unfair incast sharing, CPU contention between compute, codecs and the I/O
thread on one host (except through ``shared_cores``), the bf16 warm-up
steps of the hybrid policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from luwu.protocol.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "CodecProfile",
    "Option",
    "Plan",
    "PlanSpec",
    "Recommendation",
    "add_arguments",
    "codec_profile",
    "parse_count",
    "plan",
    "recommend",
    "run",
    "spec_with_codecs",
]

ADAMW_PARAMS_PER_S_PER_THREAD = 1.3e9
"""torch fused AdamW on CPU, one thread, 16M fp32 params: measured 1.29e9 params/s
on the 2-core dev machine (a server core with more memory bandwidth does more)."""

DEFAULT_BUCKET_BYTES = 4 << 20
BACKWARD_FRACTION = 2.0 / 3.0
"""Share of forward+backward spent in backward, for fwd:bwd = 1:2."""

_INT8_BLOCK = 128  # elements per fp32 scale in the blockwise codecs


@dataclass(frozen=True, slots=True)
class CodecProfile:
    """What the plan needs to know of one codec."""

    name: str
    bytes_per_elem: float
    encode_s_per_elem: float
    """One thread, one pass; for the push direction it includes nothing else."""
    decode_s_per_elem: float
    """One thread; for pushes this is decoding into (and so summing into) the fp32 accumulator."""
    lossiness: int
    """0 = exact; higher loses more. The recommendation prefers the least lossy codec that is fast enough."""


# Encode/decode costs, one thread, 16M elements, from benchmarks/results/bench_codecs.md
# (ns per element = 4 / GB/s of fp32 input): fp32 decode-add 0.33; bf16 encode 0.22 and
# decode-add 0.35; int8 blockwise encode with error feedback 1.0 and decode-add 0.32; int4
# encode with error feedback 1.8 and decode-add 0.9; top-k 1% encode with error feedback 4.2 and
# scatter-add 0.13. int8 deltas of the weights (the pull direction): encode against the shadow
# 1.33, decode-add 0.36 (luwu.protocol.policy.CODEC_GBPS). Pass measured numbers where it matters.
_NS = 1e-9
_CODECS: dict[str, CodecProfile] = {
    "none": CodecProfile("none", 4.0, 0.0, 0.33 * _NS, 0),
    "fp32": CodecProfile("fp32", 4.0, 0.0, 0.33 * _NS, 0),
    "bf16": CodecProfile("bf16", 2.0, 0.22 * _NS, 0.35 * _NS, 1),
    "fp16": CodecProfile("fp16", 2.0, 0.52 * _NS, 0.32 * _NS, 1),
    "int8": CodecProfile("int8", 1.0 + 4.0 / _INT8_BLOCK, 1.0 * _NS, 0.32 * _NS, 2),
    # the pull direction's int8: deltas against a shadow of the workers' weights
    "int8_delta": CodecProfile("int8_delta", 1.0 + 4.0 / _INT8_BLOCK, 1.33 * _NS, 0.36 * _NS, 2),
    # the hybrid policy: large matrices (nearly all bytes of a big model) go int8
    "hybrid": CodecProfile("hybrid", 1.0 + 4.0 / _INT8_BLOCK, 1.0 * _NS, 0.32 * _NS, 2),
    "int4": CodecProfile("int4", 0.5 + 4.0 / _INT8_BLOCK, 1.8 * _NS, 0.9 * _NS, 3),
}
_TOPK_DENSITY = 0.01
_TOPK_ENCODE_S = 4.2 * _NS
_TOPK_DECODE_S = 0.13 * _NS
_TOPK_RE = re.compile(r"^topk(?::(?P<density>[0-9.eE+-]+))?$")

PUSH_CODECS = ("none", "bf16", "int8", "int4", "topk")
PULL_CODECS = ("none", "bf16", "int8_delta")


def _codecs_module_bytes(name: str) -> float | None:
    """Bytes per element from luwu.protocol.codecs when it is there and answers sanely."""
    try:
        from luwu.protocol import codecs  # type: ignore[attr-defined]

        value = float(codecs.get_codec("int8" if name == "int8_delta" else name).bytes_per_element())
    except Exception as exc:  # absent, unfinished, or a name it does not know
        logger.debug("codec %r not taken from luwu.protocol.codecs: %s", name, exc)
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return value


def codec_profile(name: str) -> CodecProfile:
    """The profile of a codec by name (``none``, ``bf16``, ``fp16``, ``int8``, ``int8_delta``,
    ``hybrid``, ``int4``, ``topk`` or ``topk:<density>``). Bytes per element come from
    ``luwu.protocol.codecs`` when that module knows the codec, else from the table here."""
    key = name.strip().lower()
    match = _TOPK_RE.match(key)
    if match:
        density = float(match.group("density") or _TOPK_DENSITY)
        if not 0.0 < density <= 1.0:
            raise ConfigError(f"codec {name!r}: top-k density must be in (0, 1], got {density}")
        # fp32 value + int32 index per kept element
        profile = CodecProfile(key, density * 8.0, _TOPK_ENCODE_S, _TOPK_DECODE_S, 4)
        if match.group("density") is not None:
            return profile
    elif key in _CODECS:
        profile = _CODECS[key]
    else:
        known = ", ".join([*_CODECS, "topk", "topk:<density>"])
        raise ConfigError(f"unknown codec {name!r}; known: {known}")
    measured = _codecs_module_bytes(key)
    return profile if measured is None else dataclasses.replace(profile, bytes_per_elem=measured)


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


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
    shared_cores: float | None = None
    """Cores that every worker and node process share (an emulated cluster on one machine, or processes
    packed on one host); None = every host has its own CPU."""
    net_cpu_s_per_byte: float = 0.0
    """CPU seconds the network stack spends per byte moved, sender and receiver together (kernel +
    ZeroMQ); counts only against ``shared_cores``."""

    def __post_init__(self) -> None:
        _positive_int("num_params", self.num_params)
        _positive_int("workers", self.workers)
        _positive_int("nodes", self.nodes)
        _positive_int("node_threads", self.node_threads)
        _positive_int("bucket_bytes", self.bucket_bytes)
        if self.batch_per_worker is not None:
            _positive_int("batch_per_worker", self.batch_per_worker)
        for name in ("worker_gbps", "push_bytes_per_elem", "pull_bytes_per_elem", "opt_params_per_s"):
            _positive(name, getattr(self, name))
        for name in ("compute_s", "push_encode_s_per_elem", "push_decode_s_per_elem",
                     "pull_encode_s_per_elem", "pull_decode_s_per_elem", "net_cpu_s_per_byte"):
            _non_negative(name, getattr(self, name))
        if self.capacities is not None:
            self.capacities = tuple(self.capacities)
            if len(self.capacities) != self.nodes:
                raise ConfigError(f"capacities has {len(self.capacities)} entries for nodes={self.nodes}: "
                                  f"{self.capacities!r}")
            for i, c in enumerate(self.capacities):
                _positive(f"capacities[{i}]", c)
        if isinstance(self.node_gbps, (list, tuple)):
            self.node_gbps = tuple(self.node_gbps)
            if len(self.node_gbps) != self.nodes:
                raise ConfigError(f"node_gbps has {len(self.node_gbps)} entries for nodes={self.nodes}: "
                                  f"{self.node_gbps!r}")
            for i, g in enumerate(self.node_gbps):
                _positive(f"node_gbps[{i}]", g)
        else:
            _positive("node_gbps", self.node_gbps)
        if self.shared_cores is not None:
            _positive("shared_cores", self.shared_cores)
        if self.overlap_fraction is not None and not (
            isinstance(self.overlap_fraction, (int, float)) and 0.0 <= self.overlap_fraction <= 1.0
        ):
            raise ConfigError(f"overlap_fraction must be in [0, 1] or None, got {self.overlap_fraction!r}")
        if not (isinstance(self.protocol_efficiency, (int, float)) and 0.0 < self.protocol_efficiency <= 1.0):
            raise ConfigError(f"protocol_efficiency must be in (0, 1], got {self.protocol_efficiency!r}")

    def node_gbps_list(self) -> tuple[float, ...]:
        if isinstance(self.node_gbps, tuple):
            return self.node_gbps
        return (float(self.node_gbps),) * self.nodes


def spec_with_codecs(spec: PlanSpec, push: str, pull: str, *, codec_costs: bool = True) -> PlanSpec:
    """``spec`` with the bytes (and, with ``codec_costs``, the encode/decode times) of two named codecs."""
    p, q = codec_profile(push), codec_profile(pull)
    return dataclasses.replace(
        spec,
        push_bytes_per_elem=p.bytes_per_elem,
        pull_bytes_per_elem=q.bytes_per_elem,
        push_encode_s_per_elem=p.encode_s_per_elem if codec_costs else 0.0,
        push_decode_s_per_elem=p.decode_s_per_elem if codec_costs else 0.0,
        pull_encode_s_per_elem=q.encode_s_per_elem if codec_costs else 0.0,
        pull_decode_s_per_elem=q.decode_s_per_elem if codec_costs else 0.0,
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

    @property
    def step_s(self) -> float:
        return self.delayed_step_s if self.spec.delayed_update else self.sync_step_s

    @property
    def samples_per_s(self) -> float | None:
        if self.spec.batch_per_worker is None:
            return None
        return self.spec.workers * self.spec.batch_per_worker / self.step_s

    @property
    def node_link_binds(self) -> bool:
        return self.bottleneck.startswith("node") and "link" in self.bottleneck

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec"}
        out["spec"] = dataclasses.asdict(self.spec)
        out["step_s"] = self.step_s
        out["samples_per_s"] = self.samples_per_s
        return out


def plan(spec: PlanSpec) -> Plan:
    """Predict one step of ``spec`` (formulas in the module docstring)."""
    P, W, N = spec.num_params, spec.workers, spec.nodes
    caps = spec.capacities or (1.0,) * N
    total = sum(caps)
    shards = tuple(P * c / total for c in caps)
    bw_worker = spec.worker_gbps * 1e9 / 8 * spec.protocol_efficiency
    bw_nodes = [g * 1e9 / 8 * spec.protocol_efficiency for g in spec.node_gbps_list()]

    worker_up_bytes = P * spec.push_bytes_per_elem
    worker_down_bytes = P * spec.pull_bytes_per_elem
    worker_up_s = worker_up_bytes / bw_worker
    worker_down_s = worker_down_bytes / bw_worker
    node_down_bytes = tuple(W * s * spec.push_bytes_per_elem for s in shards)
    node_up_bytes = tuple(W * s * spec.pull_bytes_per_elem for s in shards)
    node_down_s = tuple(b / bw for b, bw in zip(node_down_bytes, bw_nodes))
    node_up_s = tuple(b / bw for b, bw in zip(node_up_bytes, bw_nodes))
    node_opt_s = tuple(s / spec.opt_params_per_s / spec.node_threads for s in shards)
    per_elem_codec = W * spec.push_decode_s_per_elem + spec.pull_encode_s_per_elem
    node_cpu_s = tuple(o + s * per_elem_codec / spec.node_threads for o, s in zip(node_opt_s, shards))
    worker_codec_s = P * (spec.push_encode_s_per_elem + spec.pull_decode_s_per_elem)

    C = spec.compute_s + P * spec.push_encode_s_per_elem  # the hooks encode on the training thread
    write_s = P * spec.pull_decode_s_per_elem  # after the last reply
    net_cpu_s = spec.net_cpu_s_per_byte * W * (worker_up_bytes + worker_down_bytes)
    shared_cpu_s = 0.0
    if spec.shared_cores is not None:
        shared_cpu_s = (W * (C + write_s) + sum(node_cpu_s) + net_cpu_s) / spec.shared_cores
        slow = max(1.0, W / spec.shared_cores)
        C, write_s = C * slow, write_s * slow

    num_buckets = max(1, math.ceil(4 * P / spec.bucket_bytes))
    f = spec.overlap_fraction
    if f is None:
        f = BACKWARD_FRACTION * (1.0 - 1.0 / num_buckets)
        if spec.shared_cores is not None and W >= spec.shared_cores:
            f = 0.0  # no core left over while the workers compute: the pushes move after backward
    push_s = max(worker_up_s, *node_down_s)
    node_s = max(node_cpu_s)
    pull_s = max(worker_down_s, *node_up_s)
    stages = (push_s, node_s, pull_s)
    longest = max(stages)
    path_s = longest + (sum(stages) - longest) / num_buckets
    tail_s = sum(stages) / num_buckets
    sync_step_s = max(C + max(path_s - f * C, tail_s) + write_s, shared_cpu_s)
    delayed_step_s = max(C + write_s, longest, ((1.0 - f) * C + path_s + write_s) / 2.0, shared_cpu_s)
    assert delayed_step_s <= sync_step_s * (1 + 1e-12), (delayed_step_s, sync_step_s)

    resources = {"compute": C, "worker uplink": worker_up_s, "worker downlink": worker_down_s}
    for j in range(N):
        resources[f"node {j} downlink"] = node_down_s[j]
        resources[f"node {j} uplink"] = node_up_s[j]
        resources[f"node {j} cpu"] = node_cpu_s[j]
    resources["worker codec"] = worker_codec_s
    if spec.shared_cores is not None:
        resources["shared cores"] = shared_cpu_s
    bottleneck = max(resources, key=resources.__getitem__)  # first of equals: compute wins ties

    return Plan(
        spec=spec, shard_params=shards,
        worker_up_bytes=worker_up_bytes, worker_down_bytes=worker_down_bytes,
        worker_up_s=worker_up_s, worker_down_s=worker_down_s,
        node_down_bytes=node_down_bytes, node_up_bytes=node_up_bytes,
        node_down_s=node_down_s, node_up_s=node_up_s,
        node_opt_s=node_opt_s, node_cpu_s=node_cpu_s, worker_codec_s=worker_codec_s,
        compute_eff_s=C, write_s=write_s, net_cpu_s=net_cpu_s, shared_cpu_s=shared_cpu_s,
        num_buckets=num_buckets, overlap_fraction=f,
        push_s=push_s, node_s=node_s, pull_s=pull_s, path_s=path_s, tail_s=tail_s,
        sync_step_s=sync_step_s, delayed_step_s=delayed_step_s,
        bottleneck=bottleneck, resources=resources,
    )


@dataclass(frozen=True, slots=True)
class Option:
    """One explored configuration."""

    nodes: int
    push_codec: str | None
    """None = the spec's own push bytes and costs."""
    pull_codec: str | None
    sync_step_s: float
    delayed_step_s: float
    bottleneck: str


@dataclass(frozen=True, slots=True)
class Recommendation:
    """What to change, with the options it was chosen from."""

    nodes: int
    """Fewest nodes whose step is within tolerance of the best over 1..max_nodes."""
    nodes_unbind_links: int | None
    """Fewest nodes at which no node link is the bottleneck; None if none up to max_nodes."""
    push_codec: str
    pull_codec: str
    """Least lossy codec pair within tolerance of the fastest, at ``nodes``."""
    delayed_update: bool
    """Whether delayed update beats sync by more than the tolerance at the recommended setting."""
    step_s: float
    """Predicted step with everything recommended."""
    current_step_s: float
    node_options: tuple[Option, ...]
    codec_options: tuple[Option, ...]

    @property
    def speedup(self) -> float:
        return self.current_step_s / self.step_s

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["speedup"] = self.speedup
        return out


def _with_nodes(spec: PlanSpec, n: int) -> PlanSpec:
    if n == spec.nodes:
        return spec
    gbps = spec.node_gbps
    if isinstance(gbps, tuple):
        gbps = min(gbps)  # other counts of unlike nodes: assume the slowest
    return dataclasses.replace(spec, nodes=n, capacities=None, node_gbps=gbps)


def _step(p: Plan, delayed: bool) -> float:
    return p.delayed_step_s if delayed else p.sync_step_s


def recommend(
    spec: PlanSpec,
    *,
    max_nodes: int = 8,
    push_codecs: tuple[str, ...] = PUSH_CODECS,
    pull_codecs: tuple[str, ...] = PULL_CODECS,
    tolerance: float = 0.05,
    codec_costs: bool = True,
) -> Recommendation:
    """Explore 1..max_nodes nodes with the spec's codecs, then codec pairs at the chosen count.

    Gains smaller than ``tolerance`` (relative) are not worth a node, a lossier
    codec or staleness, so the cheapest option within it of the best is chosen.
    """
    _positive_int("max_nodes", max_nodes)
    _non_negative("tolerance", tolerance)
    if not push_codecs or not pull_codecs:
        raise ConfigError("recommend needs at least one push and one pull codec")
    delayed = spec.delayed_update
    current = plan(spec)

    node_plans = [(n, plan(_with_nodes(spec, n))) for n in range(1, max_nodes + 1)]
    node_options = tuple(Option(n, None, None, p.sync_step_s, p.delayed_step_s, p.bottleneck) for n, p in node_plans)
    best = min(_step(p, delayed) for _, p in node_plans)
    nodes = next(n for n, p in node_plans if _step(p, delayed) <= best * (1 + tolerance))
    unbind = next((n for n, p in node_plans if not p.node_link_binds), None)

    base = _with_nodes(spec, nodes)
    pairs = []
    for push in push_codecs:
        for pull in pull_codecs:
            p = plan(spec_with_codecs(base, push, pull, codec_costs=codec_costs))
            rank = codec_profile(push).lossiness + codec_profile(pull).lossiness
            pairs.append((rank, push, pull, p))
    codec_options = tuple(Option(nodes, s, q, p.sync_step_s, p.delayed_step_s, p.bottleneck) for _, s, q, p in pairs)
    fastest = min(_step(p, delayed) for *_, p in pairs)
    _, push, pull, chosen = min(
        (x for x in pairs if _step(x[3], delayed) <= fastest * (1 + tolerance)),
        key=lambda x: (x[0], _step(x[3], delayed)),
    )
    use_delayed = chosen.sync_step_s > chosen.delayed_step_s * (1 + tolerance)
    return Recommendation(
        nodes=nodes, nodes_unbind_links=unbind, push_codec=push, pull_codec=pull,
        delayed_update=use_delayed, step_s=_step(chosen, use_delayed), current_step_s=current.step_s,
        node_options=node_options, codec_options=codec_options,
    )


# ---------------------------------------------------------------- CLI

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")


def parse_count(text: str) -> int:
    """``16.7M``, ``1.5B``, ``7e9``, ``350k``, ``16_700_000`` -> an integer count."""
    match = _COUNT_RE.match(str(text))
    if not match:
        raise ConfigError(f"not a count: {text!r} (use e.g. 16.7M, 1.5B, 7e9)")
    value = float(match.group(1).replace("_", "")) * _SUFFIX[match.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"count must be >= 1: {text!r}")
    return round(value)


def _floats(text: str) -> float | tuple[float, ...]:
    parts = [p for p in str(text).split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or comma-separated numbers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"empty: {text!r}")
    return values[0] if len(values) == 1 else values


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``luwu plan``."""
    parser.add_argument("--params", type=_count_arg, required=True, help="model parameters: 16.7M, 1.5B, 7e9")
    parser.add_argument("--workers", type=int, default=4, help="training workers, one per host (default 4)")
    parser.add_argument("--nodes", type=int, default=1, help="optimizer nodes, one per host (default 1)")
    parser.add_argument("--worker-gbps", type=float, default=10.0, help="worker link, Gbit/s (default 10)")
    parser.add_argument("--node-gbps", type=_floats, default=None,
                        help="node link, Gbit/s; one number or one per node, comma-separated (default: --worker-gbps)")
    parser.add_argument("--capacities", type=_floats, default=None, help="relative node capacities, comma-separated")
    parser.add_argument("--push-codec", default="hybrid", help="gradient codec: none, bf16, fp16, int8, hybrid, "
                        "int4, topk, topk:<density> (default hybrid, ~int8 for large models)")
    parser.add_argument("--pull-codec", default="bf16", help="weights codec: none, bf16, int8_delta (default bf16)")
    parser.add_argument("--no-codec-cost", action="store_true", help="ignore encode/decode time")
    parser.add_argument("--compute-ms", type=float, required=True, help="forward+backward ms per step on a worker")
    parser.add_argument("--batch", type=int, default=None, help="samples per worker per step, for samples/s")
    parser.add_argument("--delayed-update", action="store_true", help="the job uses delayed update")
    parser.add_argument("--opt-rate", type=float, default=ADAMW_PARAMS_PER_S_PER_THREAD,
                        help=f"node optimizer params/s per thread (default {ADAMW_PARAMS_PER_S_PER_THREAD:.2g}, "
                        "fused AdamW)")
    parser.add_argument("--node-threads", type=int, default=1, help="threads per node for optimizer and codecs")
    parser.add_argument("--overlap", type=float, default=None,
                        help="fraction of compute pushes overlap (default 2/3 * (1 - 1/buckets))")
    parser.add_argument("--efficiency", type=float, default=0.9, help="fraction of line rate achieved (default 0.9)")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help="bucket MiB (default 4)")
    parser.add_argument("--shared-cores", type=float, default=None,
                        help="cores every worker and node share (an emulated cluster on one machine)")
    parser.add_argument("--net-cpu-ns", type=float, default=0.0,
                        help="with --shared-cores: CPU ns the network stack spends per byte moved (default 0)")
    parser.add_argument("--max-nodes", type=int, default=8, help="largest node count explored (default 8)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    """The PlanSpec the CLI options describe (codec bytes and costs from the table)."""
    node_gbps = args.node_gbps if args.node_gbps is not None else args.worker_gbps
    capacities = args.capacities
    if isinstance(capacities, float):
        capacities = (capacities,)
    if args.bucket_mb is None or not args.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {args.bucket_mb!r}")
    spec = PlanSpec(
        num_params=args.params, workers=args.workers, nodes=args.nodes, capacities=capacities,
        worker_gbps=args.worker_gbps, node_gbps=node_gbps, opt_params_per_s=args.opt_rate,
        node_threads=args.node_threads, compute_s=args.compute_ms / 1e3, delayed_update=args.delayed_update,
        overlap_fraction=args.overlap, protocol_efficiency=args.efficiency,
        bucket_bytes=max(1, round(args.bucket_mb * 2**20)), batch_per_worker=args.batch,
        shared_cores=args.shared_cores, net_cpu_s_per_byte=args.net_cpu_ns * 1e-9,
    )
    return spec_with_codecs(spec, args.push_codec, args.pull_codec, codec_costs=not args.no_codec_cost)


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def _rows(p: Plan) -> list[tuple[str, str, str]]:
    label = "compute (fwd+bwd)"
    if abs(p.compute_eff_s - p.spec.compute_s) > 1e-12:
        label = f"compute (fwd+bwd {_ms(p.spec.compute_s)}, with encoding and sharing cores)"
    rows = [(label, "", _ms(p.compute_eff_s)),
            ("worker uplink (push)", _mb(p.worker_up_bytes), _ms(p.worker_up_s)),
            ("worker downlink (pull)", _mb(p.worker_down_bytes), _ms(p.worker_down_s))]
    for j in range(p.spec.nodes):
        rows += [(f"node {j} downlink (incast)", _mb(p.node_down_bytes[j]), _ms(p.node_down_s[j])),
                 (f"node {j} uplink (replies)", _mb(p.node_up_bytes[j]), _ms(p.node_up_s[j])),
                 (f"node {j} cpu (opt {_ms(p.node_opt_s[j])})", "", _ms(p.node_cpu_s[j]))]
    rows.append((f"worker codec (in backward {_ms(p.worker_codec_s - p.spec.num_params * p.spec.pull_decode_s_per_elem)})",
                 "", _ms(p.worker_codec_s)))
    if p.spec.shared_cores is not None:
        rows.append((f"shared cores (network {_ms(p.net_cpu_s)})", "", _ms(p.shared_cpu_s)))
    return rows


def _summary(p: Plan, args: argparse.Namespace, rec: Recommendation) -> list[str]:
    mode = "delayed update" if p.spec.delayed_update else "sync"
    sps = f", {p.samples_per_s:,.0f} samples/s" if p.samples_per_s is not None else ""
    lines = [
        f"step ({mode}): {_ms(p.step_s)}{sps}   [sync {_ms(p.sync_step_s)}, delayed update {_ms(p.delayed_step_s)}]",
        f"pipeline: {p.num_buckets} buckets, push {_ms(p.push_s)}, node {_ms(p.node_s)}, pull {_ms(p.pull_s)}, "
        f"path {_ms(p.path_s)}, overlap {p.overlap_fraction:.2f} of compute",
        f"bottleneck: {p.bottleneck}",
        f"recommended: {rec.nodes} node(s), push {rec.push_codec}, pull {rec.pull_codec}, "
        f"{'delayed update' if rec.delayed_update else 'sync'} -> {_ms(rec.step_s)} "
        f"({rec.speedup:.2f}x the current {_ms(rec.current_step_s)})",
    ]
    if rec.nodes_unbind_links is None:
        lines.append(f"node links still bind at {args.max_nodes} nodes: compress more or use faster node links")
    else:
        lines.append(f"node links stop binding at {rec.nodes_unbind_links} node(s)")
    return lines


def _print_table(p: Plan, args: argparse.Namespace, rec: Recommendation) -> None:
    title = (f"luwu plan: {p.spec.num_params / 1e6:,.1f}M params, {p.spec.workers} workers, {p.spec.nodes} node(s), "
             f"push {args.push_codec} / pull {args.pull_codec}")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for name, nbytes, secs in _rows(p):
            print(f"  {name:<32} {nbytes:>12} {secs:>12}")
        print("\n".join(_summary(p, args, rec)))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("resource")
    table.add_column("bytes/step", justify="right")
    table.add_column("time/step", justify="right")
    for name, nbytes, secs in _rows(p):
        style = "bold red" if name.split(" (")[0] == p.bottleneck else None
        table.add_row(name, nbytes, secs, style=style)
    console = Console(file=sys.stdout, soft_wrap=True)
    console.print(table)
    for line in _summary(p, args, rec):
        console.print(line, highlight=False, markup=False)


def run(args: argparse.Namespace) -> int:
    """Print the plan of the options in ``args``; 0 on success, 2 on a bad setting."""
    try:
        spec = spec_from_args(args)
        p = plan(spec)
        rec = recommend(spec, max_nodes=args.max_nodes, codec_costs=not args.no_codec_cost)
    except ConfigError as exc:
        print(f"luwu plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": p.to_dict(), "recommendation": rec.to_dict()}, indent=2))
    else:
        _print_table(p, args, rec)
    return 0

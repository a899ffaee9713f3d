"""The switch tier in ``luwu plan``: aggregators that sum a group's pushes before the nodes.

With ``group_size = g`` the ``W`` workers form ``A = ceil(W / g)`` groups. Each group's aggregator
receives its workers' pushes over its group link, decodes them and sums them in rank order, and
sends one push per bucket to the nodes over its uplink; it receives each reply once and fans it out
as it came (never re-encoded). A node sees ``A`` members where it saw ``W``: its incast, its replies
and its decoding shrink ``W / A``-fold. Terms per step (``F`` = 1, or ``1 + r`` fetches of each
weight in streaming mode; ``T_a`` the aggregator's threads)::

    B_g            = group_gbps * 1e9 / 8 * eta        the group link, bytes/s each direction
    B_a            = aggregator_gbps * 1e9 / 8 * eta   the uplink to the nodes

    group in       = g * P * b_push / B_g              its workers' pushes (incast)
    group out      = g * F * P * b_pull / B_g          each reply, fanned out
    uplink up      = P * b_push / B_a                  one sum (the workers' push codec)
    uplink down    = F * P * b_pull / B_a              each reply once
    aggregator cpu = P * (g * d_push + e_push) / T_a   decode and sum g pushes, encode the sum
    node j         as flat, with A members in place of W

A bucket crosses six stages in series, which pipeline over the buckets as the flat three do::

    push1 = max(worker up, group in)    agg  = aggregator cpu     push2 = max(uplink up, node j down)
    node  = max_j node j cpu            pull1 = max(node j up, uplink down)
    pull2 = max(group out, worker down)

With ``shared_cores`` the aggregators' CPU joins the shared sum, and the network stack moves every
byte twice (worker to aggregator, aggregator to node). The uplink sends with the workers' codec:
the policy at the aggregator's uplink speed may pick another, so pass ``--push-codec`` for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TierTerms:
    """The aggregators' terms (module docstring), each per aggregator: they are alike."""

    group_size: int
    aggregators: int
    group_in_bytes: float
    group_out_bytes: float
    uplink_up_bytes: float
    uplink_down_bytes: float
    group_in_s: float
    group_out_s: float
    uplink_up_s: float
    uplink_down_s: float
    cpu_s: float


def members(spec: Any) -> int:
    """Who a node hears from: the aggregators, or (flat) the workers."""
    if spec.group_size is None:
        return spec.workers
    return math.ceil(spec.workers / spec.group_size)


def tier_terms(spec: Any, fetches: float) -> TierTerms | None:
    """The aggregators' bytes, seconds and CPU per step (None: flat, no tier)."""
    g = spec.group_size
    if g is None:
        return None
    P, eta = spec.num_params, spec.protocol_efficiency
    b_group = (spec.group_gbps or spec.worker_gbps) * 1e9 / 8 * eta
    b_up = (spec.aggregator_gbps or min(spec.node_gbps_list())) * 1e9 / 8 * eta
    push, pull = P * spec.push_bytes_per_elem, fetches * P * spec.pull_bytes_per_elem
    decode_sum = g * spec.push_decode_s_per_elem + spec.push_encode_s_per_elem
    return TierTerms(
        group_size=g,
        aggregators=members(spec),
        group_in_bytes=g * push,
        group_out_bytes=g * pull,
        uplink_up_bytes=push,
        uplink_down_bytes=pull,
        group_in_s=g * push / b_group,
        group_out_s=g * pull / b_group,
        uplink_up_s=push / b_up,
        uplink_down_s=pull / b_up,
        cpu_s=P * decode_sum / spec.aggregator_threads,
    )


def stages(t: dict[str, Any]) -> tuple[float, ...]:
    """The stages one bucket crosses in series: flat (push, node, pull) or the six of the tier."""
    tier: TierTerms | None = t["tier"]
    node_s = t["node_s"]
    if tier is None:
        return (t["push_s"], node_s, t["pull_s"])
    push1 = max(t["worker_up_s"], tier.group_in_s)
    push2 = max(tier.uplink_up_s, *t["node_down_s"])
    pull1 = max(*t["node_up_s"], tier.uplink_down_s)
    pull2 = max(tier.group_out_s, t["worker_down_s"])
    return (push1, tier.cpu_s, push2, node_s, pull1, pull2)


def tier_resources(tier: TierTerms | None) -> dict[str, float]:
    """The aggregators' busy seconds per step, as the bottleneck search reads them."""
    if tier is None:
        return {}
    return {
        "aggregator group link in": tier.group_in_s,
        "aggregator group link out": tier.group_out_s,
        "aggregator uplink up": tier.uplink_up_s,
        "aggregator uplink down": tier.uplink_down_s,
        "aggregator cpu": tier.cpu_s,
    }


@dataclass(frozen=True, slots=True)
class GroupOption:
    """One explored group size (None: flat)."""

    group_size: int | None
    aggregators: int
    step_s: float
    bottleneck: str


def recommend_group(
    spec: Any, plan_fn, step_fn, tolerance: float
) -> tuple[int | None, tuple[GroupOption, ...]]:
    """The group size to use, and the options it was chosen from: flat, then ``g`` from 2 to ``W``
    (every size up to 64, then powers of two, and ``W``). Each aggregator is a host to run, so flat wins within ``tolerance`` of the best, and then
    the fewest aggregators (the largest ``g``) within it."""
    import dataclasses

    W = spec.workers
    sizes = sorted({*range(2, min(W, 64) + 1), *(2**k for k in range(7, W.bit_length())), W} - {1})
    options = []
    for g in [None, *sizes]:
        p = plan_fn(dataclasses.replace(spec, group_size=g))
        n = members(p.spec) if g is not None else 0
        options.append(GroupOption(g, n, step_fn(p), p.bottleneck))
    best = min(o.step_s for o in options)
    good = [o for o in options if o.step_s <= best * (1 + tolerance)]
    flat = next((o for o in good if o.group_size is None), None)
    chosen = flat or min(good, key=lambda o: (o.aggregators, o.step_s))
    return chosen.group_size, tuple(options)

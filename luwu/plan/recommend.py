"""``luwu plan``'s recommendation: how many nodes, which codecs, and whether delayed update pays."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from luwu.plan.checks import _non_negative, _positive_int
from luwu.plan.model import Plan, PlanSpec, plan, spec_with_codecs
from luwu.plan.profiles import PULL_CODECS, PUSH_CODECS, codec_profile
from luwu.plan.tier import GroupOption, recommend_group
from luwu.protocol.errors import ConfigError


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
    """Fewest nodes whose step is within tolerance of the best over 1..max_nodes (among the counts whose
    nodes hold their state, where any do)."""
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
    group_size: int | None = None
    """The switch tier's group size for the spec's nodes, codecs and links (None: flat), chosen by
    :func:`.tier.recommend_group`."""
    group_options: tuple[GroupOption, ...] = ()

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
    worker_codec_costs: bool = True,
) -> Recommendation:
    """Explore 1..max_nodes nodes with the spec's codecs, then codec pairs at the chosen count, and
    the switch tier's group sizes on the spec as given.

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
    node_options = tuple(
        Option(n, None, None, p.sync_step_s, p.delayed_step_s, p.bottleneck) for n, p in node_plans
    )
    # counts whose nodes cannot hold their state (out of core without disks) are not candidates
    held = [(n, p) for n, p in node_plans if p.fits] or node_plans
    best = min(_step(p, delayed) for _, p in held)
    nodes = next(n for n, p in held if _step(p, delayed) <= best * (1 + tolerance))
    unbind = next((n for n, p in node_plans if not p.node_link_binds), None)

    base = _with_nodes(spec, nodes)
    pairs = []
    for push in push_codecs:
        for pull in pull_codecs:
            codecs = {"codec_costs": codec_costs, "worker_costs": worker_codec_costs}
            p = plan(spec_with_codecs(base, push, pull, **codecs))
            rank = codec_profile(push).lossiness + codec_profile(pull).lossiness
            pairs.append((rank, push, pull, p))
    codec_options = tuple(
        Option(nodes, s, q, p.sync_step_s, p.delayed_step_s, p.bottleneck) for _, s, q, p in pairs
    )
    fastest = min(_step(p, delayed) for *_, p in pairs)
    _, push, pull, chosen = min(
        (x for x in pairs if _step(x[3], delayed) <= fastest * (1 + tolerance)),
        key=lambda x: (x[0], _step(x[3], delayed)),
    )
    use_delayed = chosen.sync_step_s > chosen.delayed_step_s * (1 + tolerance)
    group, group_options = recommend_group(spec, plan, lambda p: _step(p, delayed), tolerance)
    return Recommendation(
        nodes=nodes,
        nodes_unbind_links=unbind,
        push_codec=push,
        pull_codec=pull,
        delayed_update=use_delayed,
        step_s=_step(chosen, use_delayed),
        current_step_s=current.step_s,
        node_options=node_options,
        codec_options=codec_options,
        group_size=group,
        group_options=group_options,
    )

"""How many nodes and disks a model needs: ``luwu plan``'s search over both, for out-of-core nodes.

Every node count 1..``max_nodes`` with 0..``max_disks`` disks per node is planned (:func:`.model.plan`;
a node whose state fits ``state_memory_bytes`` needs no disk). The choice prefers the fewest nodes,
then the fewest disks per node:

* with a step-time target, the first (nodes, disks) that holds the state and meets it;
* without one, the fewest nodes that can hold the state at all, with the fewest disks whose step is
  within ``tolerance`` of the best that node count reaches (more disks would not pay).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from luwu.plan.checks import _non_negative, _positive_int
from luwu.plan.model import PlanSpec, plan
from luwu.plan.recommend import _with_nodes
from luwu.protocol.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SizeOption:
    """One planned (nodes, disks per node)."""

    nodes: int
    disks: int
    state_bytes: float
    """The largest node's state."""
    out_of_core: bool
    fits: bool
    step_s: float
    bottleneck: str


@dataclass(frozen=True, slots=True)
class NodeCountRow:
    """What one node count needs: the fewest disks that hold the state, and the fewest that meet the target
    (or, without one, that reach within tolerance of its best step); where the target is out of reach, the
    fewest disks within tolerance of its best step, with ``meets`` False."""

    nodes: int
    state_bytes: float
    out_of_core: bool
    disks_to_fit: int | None
    """None: no disk count up to ``max_disks`` holds the state."""
    disks: int | None
    """Disks per node chosen at this count; None: none holds the state."""
    step_s: float | None
    bottleneck: str | None
    meets: bool
    """Whether ``step_s`` meets the target (without a target: whether the state fits at all)."""


@dataclass(frozen=True, slots=True)
class Sizing:
    """The chosen node and disk counts, and what each node count would need."""

    nodes: int | None
    """Fewest nodes that meet the target (or hold the state); None: none up to ``max_nodes``."""
    disks: int | None
    """Disks per node at ``nodes``."""
    step_s: float | None
    target_step_s: float | None
    rows: tuple[NodeCountRow, ...]
    options: tuple[SizeOption, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _row(n: int, opts: list[SizeOption], target: float | None, tolerance: float) -> NodeCountRow:
    fitting = [o for o in opts if o.fits]
    good: list[SizeOption] = []
    if fitting:
        best = min(o.step_s for o in fitting)
        near = [o for o in fitting if o.step_s <= best * (1 + tolerance)]
        good = near if target is None else [o for o in fitting if o.step_s <= target] or near
    pick = min(good, key=lambda o: o.disks) if good else None
    return NodeCountRow(
        nodes=n,
        state_bytes=opts[0].state_bytes,
        out_of_core=opts[0].out_of_core,
        disks_to_fit=min((o.disks for o in fitting), default=None),
        disks=pick.disks if pick else None,
        step_s=pick.step_s if pick else None,
        bottleneck=pick.bottleneck if pick else None,
        meets=pick is not None and (target is None or pick.step_s <= target),
    )


def size_cluster(
    spec: PlanSpec,
    *,
    target_step_s: float | None = None,
    max_nodes: int = 8,
    max_disks: int = 16,
    tolerance: float = 0.05,
) -> Sizing:
    """Plan 1..max_nodes nodes with 0..max_disks disks each and choose (module docstring)."""
    _positive_int("max_nodes", max_nodes)
    if isinstance(max_disks, bool) or not isinstance(max_disks, int) or max_disks < 0:
        raise ConfigError(f"max_disks must be an integer >= 0, got {max_disks!r}")
    _non_negative("tolerance", tolerance)
    if target_step_s is not None and not target_step_s > 0:
        raise ConfigError(f"target_step_s must be > 0 seconds, got {target_step_s!r}")
    options: list[SizeOption] = []
    rows: list[NodeCountRow] = []
    for n in range(1, max_nodes + 1):
        base = _with_nodes(spec, n)
        opts = []
        for k in range(max_disks + 1):
            p = plan(dataclasses.replace(base, disks=k))
            opts.append(
                SizeOption(
                    n,
                    k,
                    max(p.node_state_bytes),
                    any(p.node_out_of_core),
                    p.fits,
                    p.step_s,
                    p.bottleneck,
                )
            )
            if not opts[-1].out_of_core:
                break  # the state is in RAM: disks change nothing
        options += opts
        rows.append(_row(n, opts, target_step_s, tolerance))
    chosen = next((r for r in rows if r.meets), None)
    return Sizing(
        nodes=chosen.nodes if chosen else None,
        disks=chosen.disks if chosen else None,
        step_s=chosen.step_s if chosen else None,
        target_step_s=target_step_s,
        rows=tuple(rows),
        options=tuple(options),
    )

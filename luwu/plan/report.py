"""What ``luwu plan`` prints: the step's table, its summary, the node and disk sizing, a preset's
assumptions."""

from __future__ import annotations

import argparse
import sys

from luwu.plan.model import Plan
from luwu.plan.presets import Preset
from luwu.plan.recommend import Recommendation
from luwu.plan.sizing import Sizing
from luwu.units import human_bytes


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def _time(x: float) -> str:
    """Milliseconds below 10 s, seconds above (a 175B step takes minutes)."""
    return _ms(x) if x < 10 else f"{x:,.1f} s"


def _node_rows(p: Plan, j: int) -> list[tuple[str, str, str]]:
    rows = [
        (f"node {j} downlink (incast)", _mb(p.node_down_bytes[j]), _time(p.node_down_s[j])),
        (f"node {j} uplink (replies)", _mb(p.node_up_bytes[j]), _time(p.node_up_s[j])),
        (f"node {j} cpu (opt {_time(p.node_opt_s[j])})", "", _time(p.node_cpu_s[j])),
    ]
    if p.node_out_of_core[j]:
        rows.append(
            (
                f"node {j} disk ({p.spec.disks} disks, {_time(p.node_disk_ahead_s[j])} read ahead)",
                _mb(2 * p.node_state_bytes[j]),
                _time(p.node_disk_s[j]),
            )
        )
    return rows


def _rows(p: Plan) -> list[tuple[str, str, str]]:
    label = "compute (fwd+bwd)"
    if abs(p.compute_eff_s - p.spec.compute_s) > 1e-12:
        label = f"compute (fwd+bwd {_time(p.spec.compute_s)}, with encoding and sharing cores)"
    rows = [
        (label, "", _time(p.compute_eff_s)),
        ("worker uplink (push)", _mb(p.worker_up_bytes), _time(p.worker_up_s)),
        ("worker downlink (pull)", _mb(p.worker_down_bytes), _time(p.worker_down_s)),
    ]
    if p.tier is not None:
        t = p.tier
        rows += [
            (
                f"aggregator group link in ({t.aggregators} of {t.group_size} workers)",
                _mb(t.group_in_bytes),
                _time(t.group_in_s),
            ),
            ("aggregator group link out (replies)", _mb(t.group_out_bytes), _time(t.group_out_s)),
            ("aggregator uplink (one sum)", _mb(t.uplink_up_bytes), _time(t.uplink_up_s)),
            (
                "aggregator uplink down (replies once)",
                _mb(t.uplink_down_bytes),
                _time(t.uplink_down_s),
            ),
            ("aggregator cpu (decode and sum)", "", _time(t.cpu_s)),
        ]
    for j in range(p.spec.nodes):
        rows += _node_rows(p, j)
    in_backward = p.worker_codec_s - p.spec.num_params * p.spec.pull_decode_s_per_elem
    rows.append((f"worker codec (in backward {_time(in_backward)})", "", _time(p.worker_codec_s)))
    if p.spec.shared_cores is not None:
        rows.append((f"shared cores (network {_time(p.net_cpu_s)})", "", _time(p.shared_cpu_s)))
    return rows


def _state_lines(p: Plan) -> list[str]:
    """Where each node's state lives, and a warning for a node that cannot hold it."""
    spec, lines = p.spec, []
    budget = spec.state_memory_bytes
    for j, (state, ooc, fits) in enumerate(
        zip(p.node_state_bytes, p.node_out_of_core, p.node_fits)
    ):
        where = f"{human_bytes(state)} ({spec.state_bytes_per_param:g} B/param)"
        if not ooc:
            lines.append(f"node {j} state: {where} in RAM")
        elif fits:
            lines.append(
                f"node {j} state: {where} on {spec.disks} disk(s), {human_bytes(budget)} window; "
                f"disk {_time(p.node_disk_s[j])}/step, {_time(p.node_disk_ahead_s[j])} of it read ahead "
                "during forward"
            )
        else:
            lines.append(
                f"node {j} state: {where} does not fit: {human_bytes(budget)} of RAM, {spec.disks} "
                "disk(s); add --disks (room for 2 slots of the state), RAM or nodes"
            )
    return lines


def _tier_line(p: Plan, rec: Recommendation) -> str:
    """The switch tier: the group size to use for these links, against flat."""
    by = {o.group_size: o for o in rec.group_options}
    flat = by[None]
    if rec.group_size is None:
        best = min(rec.group_options, key=lambda o: o.step_s)
        gain = (
            f"; the best, groups of {best.group_size}, {_time(best.step_s)}"
            if best.group_size
            else ""
        )
        return f"switch tier: flat is within 5% of the best ({_time(flat.step_s)}{gain})"
    o = by[rec.group_size]
    return (
        f"switch tier: groups of {o.group_size} workers ({o.aggregators} aggregator(s)) -> "
        f"{_time(o.step_s)}, {flat.step_s / o.step_s:.2f}x flat's {_time(flat.step_s)} "
        f"(bottleneck {o.bottleneck})"
    )


def summary_lines(p: Plan, args: argparse.Namespace, rec: Recommendation) -> list[str]:
    mode = "delayed update" if p.spec.delayed_update else "sync"
    if p.spec.stream_weights:
        mode = "streaming"
    sps = f", {p.samples_per_s:,.0f} samples/s" if p.samples_per_s is not None else ""
    lines = [
        f"step ({mode}): {_time(p.step_s)}{sps}   [sync {_time(p.sync_step_s)}, delayed update {_time(p.delayed_step_s)}]",
        f"pipeline: {p.num_buckets} buckets, push {_time(p.push_s)}, node {_time(p.node_s)}, pull {_time(p.pull_s)}, "
        f"path {_time(p.path_s)}, overlap {p.overlap_fraction:.2f} of compute",
        f"bottleneck: {p.bottleneck}",
    ]
    if p.spec.state_memory_bytes is not None:
        lines += _state_lines(p)
    lines.append(
        f"recommended: {rec.nodes} node(s), push {rec.push_codec}, pull {rec.pull_codec}, "
        f"{'delayed update' if rec.delayed_update else 'sync'} -> {_time(rec.step_s)} "
        f"({rec.speedup:.2f}x the current {_time(rec.current_step_s)})"
    )
    lines.append(_tier_line(p, rec))
    if rec.nodes_unbind_links is None:
        lines.append(
            f"node links still bind at {args.max_nodes} nodes: compress more or use faster node links"
        )
    else:
        lines.append(f"node links stop binding at {rec.nodes_unbind_links} node(s)")
    return lines


def sizing_lines(s: Sizing) -> list[str]:
    """The nodes x disks table: per node count, its state, the disks that hold it and those chosen."""
    goal = (
        f"meet {_time(s.target_step_s)}"
        if s.target_step_s is not None
        else "within 5% of that count's best"
    )
    lines = [
        f"nodes and disks (disks per node to {goal}):",
        f"  {'nodes':>5} {'state/node':>12} {'where':>8} {'disks to fit':>12} {'disks':>6} {'step':>20}  bottleneck",
    ]
    for r in s.rows:
        fit = "-" if r.disks_to_fit is None else str(r.disks_to_fit)
        chosen = "-" if r.disks is None else str(r.disks)
        step = "-" if r.step_s is None else _time(r.step_s) + ("" if r.meets else " (misses)")
        where = "on disk" if r.out_of_core else "in RAM"
        lines.append(
            f"  {r.nodes:>5} {human_bytes(r.state_bytes):>12} {where:>8} {fit:>12} {chosen:>6} {step:>20}  {r.bottleneck or '-'}"
        )
    if s.nodes is None:
        lines.append(
            f"sized: no count up to {len(s.rows)} node(s) does: raise --max-nodes or --max-disks"
        )
    else:
        lines.append(f"sized: {s.nodes} node(s) x {s.disks} disk(s) -> {_time(s.step_s)} a step")
    return lines


def assumption_lines(preset: Preset, given: set[str]) -> list[str]:
    """Every input of ``preset`` with its source; ``given``: the options the command line set itself."""
    lines = [f"preset {preset.name}: {preset.description}", "assumptions:"]
    for a in preset.assumptions:
        note = " [overridden on the command line]" if a.option in given else ""
        lines.append(f"  - {a.what}: {a.value} ({a.source}: {a.why}){note}")
    return lines


def print_table(p: Plan, title: str, lines: list[str]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for name, nbytes, secs in _rows(p):
            print(f"  {name:<32} {nbytes:>12} {secs:>12}")
        print("\n".join(lines))
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
    for line in lines:
        console.print(line, highlight=False, markup=False)

"""``luwu top``: the ``status`` table, refreshed like htop."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from luwu.cli.common import add_command
from luwu.cli.status import (
    DEFAULT_TIMEOUT_S,
    Target,
    add_cluster_arguments,
    console,
    resolve_cluster,
    restarts_of,
)
from luwu.protocol.errors import ConfigError


def reread(args, target: Target) -> tuple[Target, str]:
    """The cluster to poll now, read again from its cluster file at every refresh: ``luwu down`` and
    ``luwu up`` bind new ports and rewrite the run dir's cluster.toml, and top follows them. While the
    file cannot be read (``up`` removes it until its nodes are ready), the nodes read before are kept
    and the title says why: (target, '' or that note)."""
    from rich.markup import escape

    try:
        return resolve_cluster(args), ""
    except ConfigError as exc:
        return (
            target,
            f"\n[yellow]cannot read the cluster again ({escape(str(exc))}): polling the nodes read before[/]",
        )


STATE_KEYS = (
    "state_bytes_read",
    "state_bytes_written",
    "state_io_wait_s",
    "state_buffer_bytes",
    "state_memory_bytes",
)
"""The STATS fields of a node's out-of-core state (node.state_dir): its luwu_node_state_* metrics."""


def state_line(number: str, cur, prev=None) -> str:
    """One line on a node whose state is out of core ('' for an in-RAM node, or one that has not read or
    written state yet): state bytes read and written per second and the I/O wait per step, between the
    two samples (since the node started where there is no earlier sample of this node life), and how
    full the state window's buffers are."""
    from luwu.units import human_bytes

    d = cur.detail
    if not cur.up or not any(d.get(k) for k in STATE_KEYS[:3]):
        return ""
    p = prev.detail if prev is not None and prev.up and cur.at > prev.at else None
    if p is not None and any(d.get(k, 0.0) < p.get(k, 0.0) for k in (*STATE_KEYS[:3], "uptime_s")):
        p = None  # the node restarted between the samples
    base = p or {}
    span = cur.at - prev.at if p is not None else max(float(d.get("uptime_s", 0.0)), 1e-9)
    read, written = (
        (float(d.get(k, 0.0)) - float(base.get(k, 0.0))) / span for k in STATE_KEYS[:2]
    )
    steps = int(d.get("step") or 0) - int(base.get("step") or 0)
    wait = float(d.get("state_io_wait_s", 0.0)) - float(base.get("state_io_wait_s", 0.0))
    per_step = f"{wait / steps:.2f} s/step" if steps > 0 else f"{wait:.2f} s (no step finished)"
    held, budget = float(d.get("state_buffer_bytes", 0.0)), float(d.get("state_memory_bytes", 0.0))
    full = f" ({100 * held / budget:.0f}%)" if budget > 0 else ""
    return (
        f"node {number}: state out of core: read {human_bytes(read)}/s, written "
        f"{human_bytes(written)}/s, I/O wait {per_step}, buffers {human_bytes(held)} of "
        f"{human_bytes(budget)}{full}"
    )


def with_state_lines(table, statuses, prev: dict):
    """The table, and under it a line per node whose state is out of core (none for in-RAM nodes)."""
    from rich.console import Group
    from rich.text import Text

    lines = []
    for i, st in enumerate(statuses):
        node = st.detail.get("node") if st.up else None
        number = str(node if isinstance(node, int) and node >= 0 else i)
        line = state_line(number, st, prev.get(st.address))
        if line:
            lines.append(line)
    return Group(table, Text("\n".join(lines))) if lines else table


def with_tier(table, rows: list[dict], width: int):
    """The nodes' table, and under it the switch tier's (none without ``[[groups]]``): one row per
    aggregator with its rates between refreshes, read from its /metrics."""
    if not rows:
        return table
    from rich.console import Group

    from luwu.ops.tier_status import render_tier

    return Group(table, render_tier(rows, width=width))


def cmd_top(args) -> int:
    from rich.live import Live

    from luwu.ops.monitor import NodeStatus, query_many, render_table
    from luwu.ops.tier_status import probe_aggregators

    target = resolve_cluster(args)
    if not args.interval > 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {args.interval}")
    if args.iterations < 0:
        raise ConfigError(f"--iterations must be >= 0 (0 = until Ctrl-C), got {args.iterations}")
    timeout_s = (
        args.timeout
        if args.timeout is not None
        else max(0.2, min(DEFAULT_TIMEOUT_S, args.interval))
    )
    out = console()
    prev: dict[str, NodeStatus] = {}
    tier_prev: dict = {}
    n = 0

    def frame():
        nonlocal prev, tier_prev, target
        target, stale = reread(args, target)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="luwu-top") as pool:
            tier = pool.submit(
                probe_aggregators, target.groups, target.run_dir, timeout_s, tier_prev
            )
            statuses = query_many(
                target.addresses,
                target.job,
                timeout_s,
                curve=target.curve,
                join_secret=target.join_secret,
            )
            tier_rows, tier_prev = tier.result()
        title = f"luwu top - job [bold]{target.job}[/] ({target.source}) - {time.strftime('%H:%M:%S')} - every {args.interval:g} s, Ctrl-C quits{stale}"
        table = render_table(
            statuses, prev, title=title, restarts=restarts_of(target), width=out.width
        )
        table = with_state_lines(table, statuses, prev)
        prev = {st.address: st for st in statuses if st.up}
        return with_tier(table, tier_rows, out.width)

    try:
        if out.is_terminal:
            with Live(frame(), console=out, auto_refresh=False, screen=False) as live:
                n = 1
                while not args.iterations or n < args.iterations:
                    time.sleep(args.interval)
                    live.update(frame(), refresh=True)
                    n += 1
        else:  # batch mode, like `top -b`: one table per refresh, for logs and pipes
            while not args.iterations or n < args.iterations:
                if n:
                    time.sleep(args.interval)
                out.print(frame())
                sys.stdout.flush()
                n += 1
    except KeyboardInterrupt:
        pass
    return 0


def register(subparsers) -> None:
    t = add_command(
        subparsers,
        "top",
        func=cmd_top,
        settings=True,
        help="live view of the cluster that refreshes, like htop",
        description=(
            "A table of every node that refreshes every --interval seconds, with bytes/s and updates/s computed between "
            "refreshes; with the switch tier ([[groups]]), a table of its aggregators under it, their bytes/s from the "
            "workers and to the nodes, pushes summed/s and the wait for a block's last push, from each one's /metrics "
            "(the group's metrics key, or luwu up's state). Ctrl-C quits. When stdout is not a terminal it prints one table per refresh (like `top -b`). "
            "Extra --section.field=value flags override the cluster file."
        ),
    )
    add_cluster_arguments(t)
    t.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    t.add_argument(
        "--iterations",
        type=int,
        default=0,
        metavar="N",
        help="stop after N refreshes (default 0: until Ctrl-C)",
    )
    t.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for answers per refresh (default: min(interval, 2))",
    )

"""``luwu top``: the ``status`` table, refreshed like htop."""

from __future__ import annotations

import sys
import time

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


def cmd_top(args) -> int:
    from rich.live import Live

    from luwu.ops.monitor import NodeStatus, query_many, render_table

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
    n = 0

    def frame():
        nonlocal prev, target
        target, stale = reread(args, target)
        statuses = query_many(
            target.addresses,
            target.job,
            timeout_s,
            curve=target.curve,
            join_secret=target.join_secret,
        )
        title = f"luwu top - job [bold]{target.job}[/] ({target.source}) - {time.strftime('%H:%M:%S')} - every {args.interval:g} s, Ctrl-C quits{stale}"
        table = render_table(
            statuses, prev, title=title, restarts=restarts_of(target), width=out.width
        )
        prev = {st.address: st for st in statuses if st.up}
        return table

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
            "refreshes. Ctrl-C quits. When stdout is not a terminal it prints one table per refresh (like `top -b`). "
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

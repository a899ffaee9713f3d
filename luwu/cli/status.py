"""``luwu status``: ask every node of a cluster how it is doing, once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from luwu.cli.common import add_command
from luwu.monitor import DEFAULT_TIMEOUT_S
from luwu.protocol.errors import ConfigError


def resolve_cluster(args) -> tuple[list[str], str, str]:
    """(node addresses, job, where they came from) from --config / --run-dir / env / flags.

    Without a cluster file, ``luwu up``'s default run dir is looked at, so that
    ``luwu up --nodes 2`` followed by a bare ``luwu status`` just works.
    """
    from luwu.config import load_config
    from luwu.rundir import CLUSTER_FILE, default_run_dir

    path = args.config
    if path is None and args.run_dir:
        path = os.path.join(args.run_dir, CLUSTER_FILE)
        if not os.path.exists(path):
            raise ConfigError(f"run dir {args.run_dir!r} has no {CLUSTER_FILE}: is the cluster up (luwu up --run-dir {args.run_dir})?")
    cfg = load_config(path, argv=args.overrides)
    if not cfg.cluster.nodes and path is None:
        guess = os.path.join(default_run_dir(cfg.cluster.job), CLUSTER_FILE)
        if os.path.exists(guess):
            path = guess
            cfg = load_config(path, argv=args.overrides)
    if not cfg.cluster.nodes:
        raise ConfigError("no nodes to ask: pass --config CLUSTER_FILE (luwu up writes <run dir>/cluster.toml), --run-dir DIR, or --cluster.nodes=tcp://host:port,...")
    return list(cfg.cluster.nodes), cfg.cluster.job, path or "environment/flags"


def restarts_of(source: str) -> dict[str, int]:
    """How often the supervisor restarted each node, when the cluster file is a run dir's."""
    from luwu.monitor import restart_counts

    return restart_counts(Path(source).parent) if source.endswith(".toml") else {}


def console():
    """stdout; wide enough for the table when it is a pipe or a file (rich assumes 80 columns there)."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def cmd_status(args) -> int:
    from luwu.monitor import query_many, render_table, row

    addresses, job, source = resolve_cluster(args)
    if args.sample < 0:
        raise ConfigError(f"--sample must be >= 0 seconds, got {args.sample}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    statuses = query_many(addresses, job, args.timeout)
    prev = None
    if args.sample > 0:
        prev = {st.address: st for st in statuses}
        time.sleep(args.sample)
        statuses = query_many(addresses, job, args.timeout)
    restarts = restarts_of(source)
    if args.json:
        print(json.dumps([row(st, (prev or {}).get(st.address), restarts=restarts.get(st.address)) for st in statuses], indent=2))
    else:
        how = f"rates over the last {args.sample:g} s" if args.sample > 0 else "rates averaged since each node started (--sample S for a window)"
        out = console()
        out.print(render_table(statuses, prev, title=f"LuWu job [bold]{job}[/] ({source}); {how}", restarts=restarts, width=out.width))
    return 0 if all(st.up for st in statuses) else 1


def add_cluster_arguments(p) -> None:
    """--run-dir, next to the --config of every settings command: which cluster to ask."""
    p.add_argument("--run-dir", metavar="DIR", help="read DIR/cluster.toml (what `luwu up --run-dir DIR` wrote)")


def register(subparsers) -> None:
    s = add_command(
        subparsers, "status", func=cmd_status, settings=True,
        help="ask every node of a cluster file: up or not, step, workers, bytes/s, restarts, last checkpoint",
        description=(
            "Ask every node of a cluster (STATS over its ZeroMQ address, all at once with one deadline) and print one row "
            "per node: address, UP/DOWN, step, connected workers, bytes/s in and out, uptime, restarts, last checkpoint. "
            "A node that does not answer within --timeout is DOWN; a note under the table says why a node that answers holds no bucket yet. "
            "Exit code 0 when every node answers, 1 otherwise. "
            "Without --config, the cluster file that `luwu up` wrote for the job is used. "
            "Extra --section.field=value flags override the file (e.g. --cluster.job=myjob)."
        ),
    )
    add_cluster_arguments(s)
    s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help=f"seconds to wait for the nodes' answers (default {DEFAULT_TIMEOUT_S:g})")
    s.add_argument("--sample", type=float, default=0.0, metavar="S", help="ask twice, S seconds apart, and show rates over that window (default: averages since each node started)")
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")

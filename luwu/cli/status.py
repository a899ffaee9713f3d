"""``luwu status``: ask every node of a cluster how it is doing, once."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from luwu.cli.common import add_command
from luwu.ops.monitor import DEFAULT_TIMEOUT_S
from luwu.protocol.errors import ConfigError


@dataclass(slots=True)
class Target:
    """The cluster ``status`` and ``top`` ask."""

    addresses: list[str]
    job: str
    source: str
    """The cluster file read, or 'environment/flags'."""
    curve: tuple[str, str, str] | None
    """(nodes' public key, client public key, client secret key) when the nodes run CURVE."""
    join_secret: str
    """transport.join_secret, for nodes that ask for one."""
    run_dir: Path | None
    """The ``luwu up`` run dir the cluster file belongs to, if any."""
    groups: list = field(default_factory=list)
    """The switch tier's groups (cluster.groups): their aggregators are listed too."""


def _run_dir_file(run_dir: str) -> str:
    """What to read in a run dir: keys/monitor.toml (the cluster file plus the keys the nodes accept
    from the operator's tools) when ``up`` made keys, else cluster.toml."""
    from luwu.ops.rundir import CLUSTER_FILE, KEYS_DIR

    monitor = os.path.join(run_dir, KEYS_DIR, "monitor.toml")
    return monitor if os.path.exists(monitor) else os.path.join(run_dir, CLUSTER_FILE)


def resolve_cluster(args) -> Target:
    """The nodes, job and client keys from --config / --run-dir / env / flags.

    Without a cluster file, ``luwu up``'s default run dir is looked at, so that
    ``luwu up --nodes 2`` followed by a bare ``luwu status`` just works.
    """
    from luwu.config import load_config
    from luwu.ops.rundir import CLUSTER_FILE, default_run_dir

    path = (
        args.config[-1] if args.config and len(args.config) == 1 else args.config
    )  # one file, or the layered list
    if path is None and args.run_dir:
        path = _run_dir_file(args.run_dir)
        if not os.path.exists(path):
            raise ConfigError(
                f"run dir {args.run_dir!r} has no {CLUSTER_FILE}: is the cluster up (luwu up --run-dir {args.run_dir})?"
            )
    cfg = load_config(path, argv=args.overrides)
    if not cfg.cluster.nodes and path is None:
        guess = _run_dir_file(default_run_dir(cfg.cluster.job))
        if os.path.exists(guess):
            path = guess
            cfg = load_config(path, argv=args.overrides)
    if not cfg.cluster.nodes:
        raise ConfigError(
            "no nodes to ask: pass --config CLUSTER_FILE (luwu up writes <run dir>/cluster.toml), --run-dir DIR, or --cluster.nodes=tcp://host:port,..."
        )
    t = cfg.transport
    curve = (
        (t.curve_server_key, t.curve_public_key, t.curve_secret_key) if t.curve_server_key else None
    )
    files = [path] if isinstance(path, str) else list(path or ())
    return Target(
        list(cfg.cluster.nodes),
        cfg.cluster.job,
        " + ".join(files) or "environment/flags",
        curve,
        t.join_secret,
        _run_dir_of(files[0] if files else None),
        list(cfg.cluster.groups),
    )


def _run_dir_of(path: str | None) -> Path | None:
    from luwu.ops.rundir import KEYS_DIR, PLAN_FILE

    if not path or not path.endswith(".toml"):
        return None
    folder = Path(path).parent
    if folder.name == KEYS_DIR and not (folder / PLAN_FILE).exists():
        folder = folder.parent
    return folder if (folder / PLAN_FILE).exists() else None


def restarts_of(target: Target) -> dict[str, int]:
    """How often the supervisor restarted each node, when the cluster file is a run dir's."""
    from luwu.ops.monitor import restart_counts

    return restart_counts(target.run_dir) if target.run_dir is not None else {}


def warnings_of(target: Target) -> list[str]:
    """What ``luwu up`` warned about when it started the run (checkpoints off, no encryption)."""
    from luwu.ops.rundir import PLAN_FILE

    if target.run_dir is None:
        return []
    try:
        return list(json.loads((target.run_dir / PLAN_FILE).read_text()).get("warnings", []))
    except (OSError, ValueError, AttributeError):
        return []


def console():
    """stdout; wide enough for the table when it is a pipe or a file (rich assumes 80 columns there)."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def cmd_status(args) -> int:
    from luwu.ops.monitor import query_many, render_table, row
    from luwu.ops.tier_status import probe_aggregators, render_tier

    target = resolve_cluster(args)
    job, source = target.job, target.source
    if args.sample < 0:
        raise ConfigError(f"--sample must be >= 0 seconds, got {args.sample}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")

    def ask(tier_prev=None):
        statuses = query_many(
            target.addresses, job, args.timeout, curve=target.curve, join_secret=target.join_secret
        )
        return statuses, *probe_aggregators(target.groups, target.run_dir, args.timeout, tier_prev)

    statuses, tier, samples = ask()
    prev = None
    if args.sample > 0:
        prev = {st.address: st for st in statuses}
        time.sleep(args.sample)
        statuses, tier, _ = ask(samples)
    restarts = restarts_of(target)
    if args.json:  # the nodes' rows, then one per aggregator ("role": "aggregator")
        rows = [
            row(st, (prev or {}).get(st.address), restarts=restarts.get(st.address))
            for st in statuses
        ]
        print(json.dumps(rows + tier, indent=2))
    else:
        how = (
            f"rates over the last {args.sample:g} s"
            if args.sample > 0
            else "rates averaged since each node started (--sample S for a window)"
        )
        out = console()
        out.print(
            render_table(
                statuses,
                prev,
                title=f"LuWu job [bold]{job}[/] ({source}); {how}",
                restarts=restarts,
                width=out.width,
            )
        )
        if tier:
            out.print(render_tier(tier, width=out.width))
        for line in warnings_of(target):
            out.print(
                f"warning: {line}", style="yellow", markup=False, highlight=False, soft_wrap=True
            )
    return 0 if all(st.up for st in statuses) and all(r["up"] for r in tier) else 1


def add_cluster_arguments(p) -> None:
    """--run-dir, next to the --config of every settings command: which cluster to ask."""
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="read DIR/cluster.toml (what `luwu up --run-dir DIR` wrote)",
    )


def register(subparsers) -> None:
    s = add_command(
        subparsers,
        "status",
        func=cmd_status,
        settings=True,
        help="ask every node of a cluster file: up or not, step, workers, bytes/s, restarts, last checkpoint",
        description=(
            "Ask every node of a cluster (STATS over its ZeroMQ address, all at once with one deadline) and print one row "
            "per node: address, UP/DOWN, step, connected workers, bytes/s in and out, uptime, restarts, last checkpoint. "
            "A node that does not answer within --timeout is DOWN; a note under the table says why a node that answers holds no bucket yet. "
            "With the switch tier (the cluster file's [[groups]]), one row per aggregator too: UP when its address takes "
            "a TCP connection within --timeout (and its pid and restarts under luwu up), with its workers, bytes/s "
            "from the workers and to the nodes, pushes summed/s and the wait for a block's last push, read from "
            "its /metrics (the group's metrics key, or luwu up's state) in the same --timeout. "
            "Exit code 0 when every node answers and every aggregator is up, 1 otherwise. "
            "Without --config, the cluster file that `luwu up` wrote for the job is used. "
            "Extra --section.field=value flags override the file (e.g. --cluster.job=myjob)."
        ),
    )
    add_cluster_arguments(s)
    s.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for the nodes' answers (default {DEFAULT_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--sample",
        type=float,
        default=0.0,
        metavar="S",
        help="ask twice, S seconds apart, and show rates over that window (default: averages since each node started)",
    )
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")

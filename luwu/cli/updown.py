"""``luwu up`` / ``luwu down``: a local cluster of node daemons in the background."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from luwu.cli.common import add_command, positive_int
from luwu.ops.rundir import CLUSTER_FILE, KEYS_DIR, RUN_ROOT, default_run_dir
from luwu.protocol.errors import ConfigError


def _positive(args, *names: str) -> None:
    for name in names:
        if not getattr(args, name) > 0:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}"
            )


def _example_script() -> str:
    """The shipped worker example, as a path to type: relative when it is under the current directory."""
    from importlib.util import find_spec

    spec = find_spec("luwu.deploy.train_example")
    path = (
        Path(spec.origin) if spec is not None and spec.origin else Path("deploy/train_example.py")
    )
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def cmd_up(args) -> int:
    from rich.console import Console

    from luwu.config import load_config
    from luwu.ops import daemons
    from luwu.ops.keyset import aggregator_envs, argv_secret_warning
    from luwu.ops.supervisor import Plan

    console, err = Console(), Console(stderr=True)
    _positive(args, "timeout", "stop_timeout")
    cfg = load_config(args.config, argv=args.overrides)
    job = cfg.cluster.job
    run_dir = Path(args.run_dir or default_run_dir(job)).resolve()
    nodes = daemons.plan_nodes(args, cfg, args.overrides)
    aggregators, cfg = daemons.plan_aggregators(args, cfg, args.overrides)
    secrets, keys, warnings = daemons.node_secrets(args, cfg, args.overrides, nodes)
    daemons.check_tier(cfg, aggregators, keys)
    if argv_secret_warning(cfg):
        warnings.append(argv_secret_warning(cfg))
    for line in warnings:
        err.print(
            f"luwu up: warning: {line}",
            style="yellow",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    plan = Plan(
        job=job,
        cwd=os.getcwd(),
        nodes=nodes,
        aggregators=aggregators,
        stop_timeout_s=args.stop_timeout,
        warnings=warnings,
    )
    agg_env = aggregator_envs(cfg, keys, len(aggregators))  # with CURVE: each one's own keys
    daemons.launch(run_dir, plan, secrets, agg_env)
    try:
        state, problem = daemons.wait_ready(
            run_dir, len(plan.nodes), args.timeout, err, aggregators=len(aggregators)
        )
    except KeyboardInterrupt:
        err.print("luwu up: interrupted: stopping what was started", highlight=False)
        daemons.stop_run_dir(run_dir, timeout_s=args.stop_timeout, console=err)
        raise
    if problem:
        head, _, body = problem.partition("\n")
        err.print(
            f"luwu up: {head}", style="bold red", markup=False, highlight=False, soft_wrap=True
        )
        if body:
            err.print(body, markup=False, highlight=False, soft_wrap=True)
        err.print("luwu up: stopping what was started", highlight=False)
        daemons.stop_run_dir(run_dir, timeout_s=args.stop_timeout, console=err)
        return 1
    nodes, tier = state["nodes"], state.get("aggregators", [])
    join_secret = secrets.get("LUWU_NODE__JOIN_SECRET", "")
    daemons.write_outputs(run_dir, cfg, nodes, keys, join_secret, aggregators=tier)
    console.print(_up_table(job, nodes, tier))
    made = keys is not None and bool(keys.workers)
    if made:
        console.print(
            f"CURVE on: keys made for {len(keys.workers)} worker ranks in {run_dir / KEYS_DIR} (mode 600; --workers N for more)",
            highlight=False,
            soft_wrap=True,
        )
    if join_secret:
        console.print(
            f"join secret on: workers use {run_dir / KEYS_DIR}/join.toml (mode 600)",
            highlight=False,
            soft_wrap=True,
        )
    for line in next_steps(run_dir, made, join=bool(join_secret)):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    return 0


def _up_table(job: str, nodes: list[dict], tier: list[dict]):
    """What ``up`` started: one row per node, then one per aggregator (a<i>); with aggregators, a
    ranks column holds the worker ranks each one serves (``-`` for a node)."""
    from rich.table import Table

    also = f", {len(tier)} aggregators" if tier else ""
    table = Table(
        title=f"LuWu job [bold]{job}[/]: {len(nodes)} nodes{also} up",
        title_justify="left",
        header_style="bold",
    )
    ranks = ["ranks"] if tier else []  # the worker ranks an aggregator serves ("-": a node)
    for col in ("#", "address", *ranks, "metrics", "pid"):
        table.add_column(col, no_wrap=True)
    no_group = ["-"] * len(ranks)
    for n in nodes:
        table.add_row(
            str(n["index"]), n["address"], *no_group, n["metrics_url"] or "-", str(n["pid"])
        )
    for a in tier:  # the switch tier: workers of these ranks talk to the nodes through it
        metrics = a.get("metrics_url") or "-"
        table.add_row(f"a{a['index']}", a["address"], a["ranks"], metrics, str(a["pid"]))
    return table


def next_steps(run_dir: Path, curve: bool = False, *, join: bool = False) -> list[str]:
    """What ``up`` prints after its table: where things are and the commands to go on with,
    the training one with the shipped example, which reads the cluster file given by --config
    (with CURVE keys made by ``up``: each rank its own file, keys/worker<RANK>.toml)."""
    cluster_file = run_dir / CLUSTER_FILE
    if curve:
        train = f"torchrun --nproc-per-node 2 --no-python sh -c 'exec {sys.executable} {_example_script()} --config {run_dir / KEYS_DIR}/worker$RANK.toml'"
    elif join:
        train = f"torchrun --nproc-per-node 2 {_example_script()} --config {run_dir / KEYS_DIR}/join.toml"
    else:
        train = f"torchrun --nproc-per-node 2 {_example_script()} --config {cluster_file}"
    return [
        f"logs:         {run_dir}/node-<i>.log, supervisor.log (restarts)",
        f"cluster file: {cluster_file}",
        f"  train:    {train}",
        f"  watch:    luwu top --run-dir {run_dir}",
        f"  stop:     luwu down --run-dir {run_dir}",
    ]


def cmd_down(args) -> int:
    from rich.console import Console

    from luwu.config import load_config
    from luwu.ops import daemons

    console = Console(stderr=True)
    _positive(args, "timeout")
    cfg = load_config(
        args.config, argv=args.overrides
    )  # also checks the flags when --run-dir is given
    run_dir = Path(args.run_dir or default_run_dir(cfg.cluster.job))
    if not run_dir.is_dir():
        console.print(f"luwu down: nothing to stop: no run dir {run_dir}", highlight=False)
        return 0
    before = sum(1 for _ in run_dir.glob("node-*.pid"))
    tier = sum(1 for _ in run_dir.glob("aggregator-*.pid"))
    stopped, left = daemons.stop_run_dir(run_dir.resolve(), timeout_s=args.timeout, console=console)
    if left:
        console.print(
            f"[bold red]luwu down: still running after SIGKILL: {', '.join(left)}[/]",
            highlight=False,
        )
        return 1
    if not stopped:
        console.print(f"luwu down: nothing was running in {run_dir}", highlight=False)
    else:
        console.print(
            f"luwu down: stopped the supervisor and {before} node(s)"
            + (f" and {tier} aggregator(s)" if tier else "")
            + f" of {run_dir}",
            highlight=False,
        )
    return 0


def register(subparsers) -> None:
    _register_up(subparsers)
    _register_down(subparsers)


def _register_up(subparsers) -> None:
    s = add_command(
        subparsers,
        "up",
        func=cmd_up,
        settings=True,
        help="start a local cluster of node daemons in the background (pid files, logs, restarts)",
        description=(
            "Start N node daemons in the background, detached from the terminal, each with its own log and pid file in the "
            "run dir, plus one supervisor that restarts a daemon that dies (exponential backoff; restarts are counted in "
            "supervisor.log). Waits until every node is ready, then writes <run dir>/cluster.toml with the node addresses "
            "(`luwu status` reads it) and <run dir>/targets.json (Prometheus file_sd targets). "
            "Addresses: --nodes N gives tcp://HOST:BASE_PORT+i (port 0: any free port, the bound one is reused on restart); "
            "otherwise [cluster] nodes of --config. Extra --section.field=value flags are passed to every node "
            "(e.g. --node.checkpoint_dir=ckpt --node.checkpoint_every=100); secret ones (*secret*) reach the nodes through "
            "a mode 600 environment file, never their command line. Nodes bound to an address other hosts reach (--host "
            "0.0.0.0, a cluster file's host names) run CURVE: without keys configured, up makes them (node, one per worker "
            "rank, one for status) and writes <run dir>/keys/worker<r>.toml for rank r; node.insecure_public_bind = true "
            "opts out, with a warning. Other nodes (loopback) ask for a join secret that up makes: workers use "
            "<run dir>/keys/join.toml (the cluster file plus the secret); node.insecure_open = true serves anyone instead. "
            "The switch tier: the cluster file's [[groups]] (or --aggregators K --world-size W) start once the nodes "
            "are up, supervised alike (aggregator-<i>.log/.pid; with CURVE, keys of its own: aggregator-<i>.env), "
            "and the run dir's cluster files list them. The run dir is mode 700, its plan, state, logs and keys mode 600."
        ),
    )
    s.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="number of nodes (default: the cluster file's node list, else 2)",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface the nodes bind with --nodes (default 127.0.0.1)",
    )
    s.add_argument(
        "--base-port",
        type=int,
        default=0,
        metavar="P",
        help="node i binds port P+i (default 0: any free port)",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="node i serves /metrics on P+i; 0 = any free port, -1 = off (default: metrics.port of the config if set there, else 0)",
    )
    s.add_argument(
        "--run-dir",
        metavar="DIR",
        help=f"where pid files, logs and cluster.toml go (default ./{RUN_ROOT}/<job>)",
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds for every node to be ready (default 60)",
    )
    from luwu.ops.keyset import DEFAULT_WORKER_KEYS

    s.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"worker key files to make when up makes CURVE keys (default cluster.world_size, else {DEFAULT_WORKER_KEYS})",
    )
    _tier_arguments(s)
    s.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="SIGTERM to SIGKILL when stopping a node, leaving time for its checkpoint (default 30)",
    )


def _tier_arguments(s) -> None:
    s.add_argument(
        "--aggregators",
        type=positive_int,
        default=None,
        metavar="K",
        help="the switch tier: K aggregators on loopback, one per even contiguous group of the "
        "--world-size ranks, written into the run dir's cluster files as [[groups]] (default: "
        "the cluster file's [[groups]])",
    )
    s.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        metavar="W",
        help="the job's worker ranks, with --aggregators (written as cluster.world_size)",
    )


def _register_down(subparsers) -> None:
    d = add_command(
        subparsers,
        "down",
        func=cmd_down,
        settings=True,
        help="stop the cluster that `luwu up` started (supervisor first, then the nodes)",
        description=(
            "Stop the supervisor (so that nothing is restarted), which stops its nodes and aggregators with SIGTERM and, after --timeout, "
            "SIGKILL; then stop any node whose pid file outlived its supervisor, and remove the pid files. Logs and "
            "cluster.toml stay in the run dir. --config and --cluster.job name the default run dir."
        ),
    )
    d.add_argument(
        "--run-dir",
        metavar="DIR",
        help=f"the run dir given to `luwu up` (default ./{RUN_ROOT}/<job>)",
    )
    d.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds from SIGTERM to SIGKILL (default 30)",
    )

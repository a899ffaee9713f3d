"""Starting and stopping the node daemons of a run directory (``luwu up`` / ``luwu down``).

``up`` writes a :class:`~luwu.ops.supervisor.Plan` and starts one supervisor,
detached from the shell, which starts the daemons; it then waits until every
node printed its READY line and writes ``cluster.toml`` (the resolved cluster
file that training scripts and ``luwu status`` point at) and ``targets.json``
(Prometheus file_sd targets of the nodes' /metrics). Secrets given to ``up``
reach the nodes through a 0600 environment file, never their argv; when a node
binds an address other hosts can reach and no keys are configured, ``up`` makes
the job's CURVE keys itself (:mod:`luwu.ops.keyset`). ``down`` stops the
supervisor first (so nothing it stops is restarted), then makes sure of every
pid file itself, in case the supervisor was killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from secrets import token_hex

from luwu.groups import even_groups
from luwu.ops.cluster_file import cluster_file_text, cluster_sections, group_table, reachable
from luwu.ops.keyset import (
    DEFAULT_WORKER_KEYS,
    KeySet,
    env_file_text,
    is_loopback,
    split_secrets,
    with_aggregator_keys,
    write_join_files,
    write_keyset,
)
from luwu.ops.rundir import (
    CLUSTER_FILE,
    KEYS_DIR,
    NODE_ENV_FILE,
    SUPERVISOR_LOG,
    SUPERVISOR_PID,
    daemon_log,
    is_luwu,
    make_run_dir,
    open_log,
    pid_alive,
    read_pid,
    read_state,
    supervisor_running,
    tail,
    write_atomic,
    write_state,
)
from luwu.ops.supervisor import NodeSpec, Plan
from luwu.protocol.errors import ConfigError, LuwuError
from luwu.switch_nodes.lines import READY_LINE

ENV_SETTINGS = ("node.curve_authorized_keys", "node.curve_monitor_keys")
"""Settings that reach the nodes through node.env even when given as flags: ``up`` adds the
monitor's key to the monitor keys, and the environment ranks below the command line."""


def plan_nodes(options, cfg, overrides: list[str]) -> list[NodeSpec]:
    """One NodeSpec per node: ``options.nodes`` fresh addresses on ``options.host`` from
    ``options.base_port``, else the cluster file's ``[cluster] nodes``. Secret flags among
    ``overrides`` are left out of the command lines (:func:`node_secrets` has them)."""
    overrides, _ = split_secrets(overrides, to_env=ENV_SETTINGS)
    if options.nodes is not None or not cfg.cluster.nodes:
        num = 2 if options.nodes is None else options.nodes
        if num < 1:
            raise ConfigError(f"--nodes must be >= 1, got {num}")
        if options.base_port < 0 or options.base_port + num - 1 > 65535:
            raise ConfigError(
                f"--base-port must be 0 (any free port) or leave room for {num} ports, got {options.base_port}"
            )
        binds = [
            f"tcp://{options.host}:{options.base_port + i if options.base_port else 0}"
            for i in range(num)
        ]
    else:
        binds = list(cfg.cluster.nodes)
    mbase = options.metrics_port
    if mbase is None:
        mbase = cfg.metrics.port if cfg.sources.get("metrics.port", "default") != "default" else 0
    if mbase < -1 or mbase + len(binds) - 1 > 65535:
        raise ConfigError(
            f"--metrics-port must be -1 (off), 0 (any free port) or a base port leaving room for {len(binds)} nodes, got {mbase}"
        )
    base = [sys.executable, "-m", "luwu", "-v", "node"]
    for path in options.config or ():
        base += ["--config", os.path.abspath(path)]
    return [
        NodeSpec(
            index=i,
            args=[*base, *overrides, "--node.index", str(i), "--cluster.job", cfg.cluster.job],
            bind=b,
            metrics_port=mbase if mbase <= 0 else mbase + i,
        )
        for i, b in enumerate(binds)
    ]


def plan_aggregators(options, cfg, overrides: list[str]) -> tuple[list[NodeSpec], object]:
    """The switch tier's daemons, one per group, and ``cfg`` with those groups: ``options.aggregators``
    K even contiguous groups of ``options.world_size`` ranks on loopback (any free port; cfg then
    says that world size), else the cluster file's ``[[groups]]`` (each binds its aggregator's
    address). None: ``[]`` and ``cfg``."""
    count, world = getattr(options, "aggregators", None), getattr(options, "world_size", None)
    if count is not None or world is not None:
        if count is None or world is None:
            raise ConfigError(
                "--aggregators K and --world-size W go together (K groups of W ranks)"
            )
        groups = [
            {"ranks": f"{a}-{b}", "aggregator": "tcp://127.0.0.1:0"}
            for a, b in even_groups(world, count)
        ]
        cfg = cfg.replace(
            {"cluster.world_size": world, "cluster.groups": groups}, "--aggregators/--world-size"
        )
    overrides, _ = split_secrets(overrides, to_env=ENV_SETTINGS)
    base = [sys.executable, "-m", "luwu", "-v", "aggregator"]
    for path in options.config or ():
        base += ["--config", os.path.abspath(path)]
    specs = [
        NodeSpec(
            index=i,
            args=[*base, *overrides, "--ranks", g["ranks"], "--cluster.job", cfg.cluster.job],
            bind=g["aggregator"],
            metrics_port=-1 if _metrics_off(options, cfg) else 0,  # /metrics: any free port
            kind="aggregator",
            ranks=g["ranks"],
        )
        for i, g in enumerate(cfg.cluster.groups)
    ]
    return specs, cfg


def _metrics_off(options, cfg) -> bool:
    """The nodes serve no /metrics (``--metrics-port -1``, or metrics.port = -1 set in the config):
    nor do the aggregators."""
    port = getattr(options, "metrics_port", None)
    if port is None and cfg.sources.get("metrics.port", "default") != "default":
        port = cfg.metrics.port
    return port == -1


def check_tier(cfg, aggregators: list[NodeSpec], keys: KeySet | None) -> None:
    """Refuse an aggregator other hosts reach serving without encryption: with CURVE nodes it has keys
    of its own (:func:`~luwu.ops.keyset.aggregator_envs`); else node.insecure_public_bind opts in."""
    if not aggregators or keys is not None:
        return
    public = [a.bind for a in aggregators if not is_loopback(a.bind)]
    if public and not (cfg.node.insecure_public_bind or cfg.node.insecure_open):
        raise ConfigError(
            f"aggregators at {', '.join(public)} would serve other hosts without encryption (the "
            "nodes run without CURVE keys): bind them to loopback, let the nodes run CURVE (a "
            "network address without node.insecure_public_bind), or set "
            "node.insecure_public_bind = true (a trusted network only)"
        )


def node_secrets(
    options, cfg, overrides: list[str], nodes: list[NodeSpec]
) -> tuple[dict[str, str], KeySet | None, list[str]]:
    """What the nodes get through their environment, and what ``up`` warns about.

    Returns (LUWU_* variables: the secret flags of ``overrides`` and, when made here, the node's
    CURVE keys; the job's key set or None; warning lines). With node keys configured, the key
    set is those plus a new pair for ``luwu status``, added to the authorized keys. Without, keys
    are made when a node binds an address other hosts can reach and node.insecure_public_bind is
    not set: one pair for the nodes, one per worker rank (--workers, else cluster.world_size, else
    DEFAULT_WORKER_KEYS) and one for ``luwu status``. Otherwise (loopback, or
    node.insecure_public_bind) the nodes get a join secret (node.join_secret, made unless given): only
    who holds it may talk to them; node.insecure_open alone leaves them open, with a warning.
    """
    _, env = split_secrets(overrides, to_env=ENV_SETTINGS)
    warnings: list[str] = []
    keys = None
    public = [n.bind for n in nodes if not is_loopback(n.bind)]
    groups = [g["ranks"] for g in cfg.cluster.groups]  # an aggregator's pair each
    if cfg.node.curve_secret_key:
        node = (cfg.node.curve_public_key, cfg.node.curve_secret_key)
        keys = KeySet.generate(0, node=node, groups=groups)
        env["LUWU_NODE__CURVE_AUTHORIZED_KEYS"] = ",".join(cfg.node.curve_authorized_keys)
        env["LUWU_NODE__CURVE_MONITOR_KEYS"] = ",".join(
            [*cfg.node.curve_monitor_keys, keys.monitor[0]]
        )
        if groups:
            env["LUWU_NODE__CURVE_AGGREGATOR_KEYS"] = ",".join(keys.aggregator_entries())
    elif public and not cfg.node.insecure_public_bind:
        keys = KeySet.generate(
            getattr(options, "workers", None) or cfg.cluster.world_size or DEFAULT_WORKER_KEYS,
            groups=groups,
        )
        env.update(keys.node_env())
    elif cfg.node.insecure_open:
        warnings.append(
            f"nodes serve anyone who reaches {', '.join(n.bind for n in nodes)} (node.insecure_open): any local user can join the job and make the nodes allocate"
        )
    elif cfg.node.uses_zmtp:
        if public:
            warnings.append(
                f"nodes bind {', '.join(public)} WITHOUT encryption (node.insecure_public_bind): anyone who reaches these ports can read the job's traffic (and its join secret)"
            )
        env["LUWU_NODE__JOIN_SECRET"] = cfg.node.join_secret or token_hex(16)
    if not cfg.node.checkpoint_dir:
        warnings.append(
            "checkpoints are off (no node.checkpoint_dir): a node the supervisor restarts comes back empty and the job cannot go on; set --node.checkpoint_dir=DIR"
        )
    return env, keys, warnings


def launch(
    run_dir: Path,
    plan: Plan,
    secrets: dict[str, str] | None = None,
    aggregator_env: list[dict] | None = None,
) -> None:
    """Clear what a previous run left, write the plan (and ``secrets``, the nodes' LUWU_* variables,
    into a 0600 environment file; each of ``aggregator_env`` into aggregator i's own) and start its
    supervisor, detached."""
    make_run_dir(run_dir)
    pid = supervisor_running(run_dir)
    if pid is not None:
        raise LuwuError(
            f"job {plan.job!r} is already up in {run_dir} (supervisor pid {pid}): `luwu down --run-dir {run_dir}` first"
        )
    for stale in (
        "state.json",
        CLUSTER_FILE,
        "targets.json",
        NODE_ENV_FILE,
        *(p.name for p in run_dir.glob("node-*.pid")),
        *(p.name for p in run_dir.glob("aggregator-*.pid")),
        *(p.name for p in run_dir.glob("aggregator-*.env")),
    ):
        (run_dir / stale).unlink(missing_ok=True)
    for stale in (run_dir / KEYS_DIR).glob("*"):  # the keys of an earlier run of this dir
        stale.unlink()
    if secrets:
        write_atomic(run_dir / NODE_ENV_FILE, env_file_text(secrets), 0o600)
        plan.env_file = NODE_ENV_FILE
    for spec, env in zip(plan.aggregators, aggregator_env or ()):
        if env:  # its own keys, not the nodes'
            spec.env_file = f"aggregator-{spec.index}.env"
            write_atomic(run_dir / spec.env_file, env_file_text(env), 0o600)
    for spec in [*plan.nodes, *plan.aggregators]:  # keep the previous run's log for a post-mortem
        logf = daemon_log(run_dir, spec.index, spec.kind)
        if logf.exists():
            os.replace(logf, logf.with_suffix(".log.prev"))
    plan.save(run_dir / "plan.json")
    with open_log(run_dir / SUPERVISOR_LOG) as fh:
        starter = subprocess.Popen(
            [sys.executable, "-m", "luwu.ops.supervisor", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=plan.cwd,
            start_new_session=True,
        )
    starter.wait(30)  # the intermediate exits at once; the supervisor lives on, detached


def _daemons(state: dict | None) -> list[dict]:
    """The nodes and aggregators of a supervisor's state, each row with its ``kind``."""
    rows = [dict(n, kind="node") for n in (state or {}).get("nodes", [])]
    return rows + [dict(a, kind="aggregator") for a in (state or {}).get("aggregators", [])]


def wait_ready(
    run_dir: Path, num: int, timeout_s: float, console, aggregators: int = 0
) -> tuple[dict | None, str]:
    """Until every node (and each of the ``aggregators``) is up: (state, '') or (last state, why
    not)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    deadline = time.monotonic() + timeout_s
    state = None
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("starting nodes", total=num + aggregators)
        while True:
            state = read_state(run_dir) or state
            nodes = _daemons(state)
            progress.update(task, completed=sum(n["state"] == "up" for n in nodes))
            failed = [n for n in nodes if n["state"] in ("failed", "exited")]
            if failed:
                n = failed[0]
                log = daemon_log(run_dir, n["index"], n["kind"])
                why = _up_port_hint(_node_error(tail(log)))
                return (
                    state,
                    f"{n['kind']} {n['index']} {n['last_exit'] or 'exited'} before printing {READY_LINE}{why}; its log {log} ends with:\n{tail(log)}",
                )
            if len(nodes) == num + aggregators and all(n["state"] == "up" for n in nodes):
                return state, ""
            pid = read_pid(run_dir / SUPERVISOR_PID)
            if state is not None and (pid is None or not pid_alive(pid)):
                return (
                    state,
                    f"the supervisor died; {run_dir / SUPERVISOR_LOG} ends with:\n{tail(run_dir / SUPERVISOR_LOG)}",
                )
            if time.monotonic() > deadline:
                waiting = [n for n in nodes if n["state"] != "up"] or [
                    {"index": i, "kind": "node"} for i in range(num)
                ]
                logs = "\n".join(
                    f"--- {n['kind']} {n['index']} ({daemon_log(run_dir, n['index'], n['kind'])}):\n"
                    f"{tail(daemon_log(run_dir, n['index'], n['kind']), 10)}"
                    for n in waiting
                )
                names = ", ".join(f"{n['kind']} {n['index']}" for n in waiting)
                return state, f"{names} not ready within {timeout_s:g} s (--timeout):\n{logs}"
            time.sleep(0.1)


def _node_error(log_tail: str) -> str:
    """': <reason>' from the one-line error a node prints when it cannot start (a busy port), else ''."""
    prefix = "luwu node: error: "
    lines = [line for line in log_tail.splitlines() if line.startswith(prefix)]
    return f": {lines[-1][len(prefix) :]}" if lines else ""


UP_PORT_FLAGS = {
    "the node address": "--base-port P (node i binds P+i; 0: any free ports; with a cluster file's nodes, add --nodes N)",
    "the metrics endpoint": "--metrics-port P (node i serves /metrics on P+i; 0: any free ports; -1: off)",
}
"""What a node that cannot bind says it could not bind -> the ``luwu up`` flag that moves it."""


def _up_port_hint(why: str) -> str:
    """A busy-port reason from a node's log, its advice given as ``luwu up``'s flag for that port
    (the node names its own ``--section.field`` setting, which ``up`` hands on per node)."""
    if "Address already in use" not in why:
        return why
    for what, flag in UP_PORT_FLAGS.items():
        if f"cannot bind {what} " in why:
            return f"{why.partition(', or choose another port')[0]}, or with luwu up: {flag}"
    return why


def write_outputs(
    run_dir: Path,
    cfg,
    nodes: list[dict],
    keys: KeySet | None = None,
    join_secret: str = "",
    aggregators: list[dict] | None = None,
) -> None:
    """``cluster.toml`` with the bound addresses (no secret: mode 0644) and ``targets.json`` for
    Prometheus; with ``keys``, ``keys/worker<r>.toml`` for each rank ``up`` made keys for and
    ``keys/monitor.toml``: the cluster file's settings plus that client's keys, mode 0600. With a
    ``join_secret``, ``keys/join.toml`` (every rank's) and ``keys/monitor.toml``: the cluster file's
    settings plus transport.join_secret, mode 0600."""
    job = cfg.cluster.job
    addresses = [
        reachable(n["address"]) for n in nodes
    ]  # a node bound to 0.0.0.0 is listed by this host's name
    server_key = keys.node[0] if keys else ""
    groups = None
    if aggregators:
        groups = with_aggregator_keys([group_table(a) for a in aggregators], keys)
    if join_secret:
        point = f"Nodes ask for the job's join secret: workers use --config {run_dir / KEYS_DIR}/join.toml (this file plus the secret)"
    elif server_key:
        point = (
            f"CURVE is on: worker rank r uses --config {run_dir / KEYS_DIR}/worker<r>.toml (this file plus its keys)"
            if keys.workers
            else "CURVE is on: each worker adds its own key pair (worker<r>.toml of luwu keys, or LUWU_TRANSPORT__* variables)"
        )
    else:
        point = "Point workers at it (--config, RemoteOptimizer(nodes=...) or LUWU_NODES)"
    header = f"Written by `luwu up` at {time.strftime('%Y-%m-%d %H:%M:%S')} for job {job!r}; run dir {run_dir}.\n{point} and `luwu status --run-dir` the run dir."
    write_atomic(
        run_dir / CLUSTER_FILE,
        cluster_file_text(cfg, addresses, header=header, server_key=server_key, groups=groups),
        0o644,
    )
    if keys is not None:
        write_keyset(
            run_dir / KEYS_DIR,
            keys,
            shared=cluster_sections(cfg, addresses, server_key=server_key, groups=groups),
            node_files=False,
        )
    if join_secret:
        shared = cluster_sections(cfg, addresses, groups=groups)
        write_join_files(run_dir / KEYS_DIR, join_secret, shared)
    targets = [
        {
            "targets": [reachable(n["metrics_url"]).split("://", 1)[1]],
            "labels": {"luwu_job": job, "luwu_node": str(n["index"]), "luwu_role": "node"},
        }
        for n in nodes
        if n["metrics_url"]
    ]
    targets += [
        {
            "targets": [reachable(a["metrics_url"]).split("://", 1)[1]],
            "labels": {"luwu_job": job, "luwu_aggregator": a["ranks"], "luwu_role": "aggregator"},
        }
        for a in aggregators or []
        if a.get("metrics_url")
    ]
    write_atomic(run_dir / "targets.json", json.dumps(targets, indent=2), 0o644)


def _terminate(pids: dict[str, int], timeout_s: float, console) -> list[str]:
    """SIGTERM, wait up to timeout_s, SIGKILL; returns the names still alive after all that."""
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    for name, pid in pids.items():
        if pid_alive(pid):
            console.print(
                f"{name} (pid {pid}) still running {timeout_s:g} s after SIGTERM: SIGKILL",
                highlight=False,
            )
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    return [name for name, pid in pids.items() if pid_alive(pid)]


def stop_run_dir(
    run_dir: Path, *, timeout_s: float = 30.0, console=None
) -> tuple[list[str], list[str]]:
    """Stop the supervisor and the daemons of ``run_dir``; returns (stopped, still alive)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    stopped: list[str] = []
    left: list[str] = []
    pid = supervisor_running(run_dir)
    if pid is not None:
        with console.status(
            f"stopping supervisor {pid} and its nodes (SIGTERM, up to {timeout_s:g} s each)"
        ):
            # The supervisor's own SIGTERM -> SIGKILL of the nodes takes up to timeout_s; give it that and a margin.
            left += _terminate({"supervisor": pid}, timeout_s + 10.0, console)
        stopped.append(f"supervisor (pid {pid})")
    (run_dir / SUPERVISOR_PID).unlink(missing_ok=True)
    nodes = {}
    for pid_file in sorted([*run_dir.glob("node-*.pid"), *run_dir.glob("aggregator-*.pid")]):
        npid = read_pid(pid_file)
        if npid is not None and pid_alive(npid) and is_luwu(npid):
            nodes[pid_file.stem] = npid
        else:
            pid_file.unlink(missing_ok=True)
    if nodes:  # left over by a supervisor that was killed
        with console.status(f"stopping {len(nodes)} nodes (SIGTERM, up to {timeout_s:g} s)"):
            still = _terminate(nodes, timeout_s, console)
        left += still
        stopped += [f"{name} (pid {p})" for name, p in nodes.items() if name not in still]
        for name in nodes:
            if name not in still:
                (run_dir / f"{name}.pid").unlink(missing_ok=True)
    state = read_state(run_dir)
    if state is not None and not left:
        for n in [*state.get("nodes", []), *state.get("aggregators", [])]:
            if n["state"] not in ("failed", "exited"):
                n["state"], n["pid"] = "stopped", None
        write_state(run_dir, state)
    return stopped, left

"""``luwu node``: one node daemon in the foreground."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import socket
import sys

from luwu.cli.common import add_command
from luwu.protocol.errors import ConfigError


def _bindable(address: str) -> str:
    """A ``[cluster] nodes`` entry as an address ZeroMQ can bind: a host name becomes its IP
    (ZeroMQ binds interfaces and IP addresses, not names)."""
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or host in ("*", "") or host.startswith("["):
        return address
    try:
        ipaddress.ip_address(host)
        return address
    except ValueError:
        pass
    try:
        ip = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise ConfigError(
            f"cannot resolve {host!r} of this node's entry {address!r} in [cluster] nodes: {exc}"
        ) from None
    return f"tcp://{ip}:{port}"


def own_node_config(cfg):
    """The node's settings, binding its own entry of ``[cluster] nodes`` (by ``node.index``)
    unless ``node.bind`` was given: workers reading the same file then reach it."""
    index = cfg.node.index
    if cfg.sources.get("node.bind", "default") != "default" or not 0 <= index < len(
        cfg.cluster.nodes
    ):
        return cfg.node
    return dataclasses.replace(cfg.node, bind=_bindable(cfg.cluster.nodes[index]))


def _busy(what: str, address: str, hint: str) -> int:
    print(
        f"luwu node: error: cannot bind {what} {address}: Address already in use; another program (an old node?) holds it: "
        f"stop it (`ss -ltnp` shows which), or {hint}",
        file=sys.stderr,
    )
    return 1


def warnings_for(cfg, node) -> list[str]:
    """What a node started this way should be told: no encryption on a network address, a secret on
    the command line (every local user reads it in ``ps``)."""
    from luwu.ops.keyset import argv_secret_warning, is_loopback

    out = []
    if not is_loopback(node.bind) and not node.curve_secret_key and node.insecure_public_bind:
        out.append(
            f"node.insecure_public_bind: {node.bind} is served WITHOUT encryption; anyone who reaches it can join the job (luwu keys makes CURVE keys)"
        )
    return [*out, argv_secret_warning(cfg)] if argv_secret_warning(cfg) else out


def with_gate(node, job: str, run_dir: str | None) -> tuple:
    """The node's settings with a gate, and the line that tells how workers join: unchanged when it has
    one (join secret, CURVE keys) or is told to be open (node.insecure_open); else with the job's join
    secret, made or read in the run dir's keys/join.toml."""
    from pathlib import Path

    from luwu.ops.keyset import job_join_secret
    from luwu.ops.rundir import KEYS_DIR, default_run_dir, make_run_dir

    if node.gate == "CURVE keys":
        return (
            node,
            "CURVE keys on: a worker joins with its own key file (worker<rank>.toml of luwu keys or luwu up)",
        )
    if node.gate == "join secret":
        return (
            node,
            "join secret on: workers and luwu status join with the same transport.join_secret (a mode-600 --config file or LUWU_TRANSPORT__JOIN_SECRET)",
        )
    if node.insecure_open or not node.uses_zmtp:
        return node, ""
    folder = Path(run_dir or default_run_dir(job))
    make_run_dir(folder)
    secret, path, made = job_join_secret(folder / KEYS_DIR, job)
    line = (
        f"join secret on ({'made in' if made else 'read from'} {path}, mode 600): workers and luwu status join with "
        f"--config {path} (after the cluster file) or LUWU_TRANSPORT__JOIN_SECRET set from it; node.insecure_open = true serves anyone"
    )
    return dataclasses.replace(node, join_secret=secret), line


def cmd_node(args) -> int:
    from luwu.config import load_config

    cfg = load_config(args.config, argv=args.overrides)  # a bad setting is told before torch loads
    from luwu.switch_nodes.daemon import run_node
    from luwu.switch_nodes.listener import AddressInUse

    node = own_node_config(cfg)
    for line in warnings_for(cfg, node):
        print(f"luwu node: warning: {line}", file=sys.stderr)
    node, joining = with_gate(node, cfg.cluster.job, args.run_dir)

    def bound(
        server,
    ) -> None:  # said once the port is ours: a node that cannot bind says one line only
        if joining:
            print(f"luwu node: {joining}", file=sys.stderr, flush=True)

    try:
        return run_node(node, job=cfg.cluster.job, metrics=cfg.metrics, on_start=bound)
    except AddressInUse:
        return _busy(
            "the node address",
            node.bind,
            "choose another port: --node.bind=tcp://HOST:PORT (port 0: any free port)",
        )
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return _busy(
            "the metrics endpoint",
            f"http://{cfg.metrics.host}:{cfg.metrics.port}",
            "choose another port: --metrics.port=PORT (0: any free port, -1: off)",
        )


def register(subparsers) -> None:
    s = add_command(
        subparsers,
        "node",
        func=cmd_node,
        settings=True,
        help="run one node daemon in the foreground",
        description=(
            "Run one node daemon in the foreground. It prints 'LUWU_NODE_READY <address>' once bound. It binds node.bind if "
            "given, else its own entry (node.index) of [cluster] nodes, else tcp://127.0.0.1:0 (any free port). Without a join secret or CURVE keys "
            "it makes the job's join secret in <run dir>/keys/join.toml (mode 600; nodes of the job started in the same run dir share it; "
            "on several hosts give every node one secret, LUWU_NODE__JOIN_SECRET, or CURVE keys) and asks every "
            "peer for it; node.insecure_open = true serves anyone instead."
        ),
    )
    from luwu.ops.rundir import RUN_ROOT

    s.add_argument(
        "--run-dir",
        metavar="DIR",
        help=f"where the join secret is made or found: DIR/keys/join.toml (default ./{RUN_ROOT}/<job>)",
    )

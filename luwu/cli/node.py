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
        raise ConfigError(f"cannot resolve {host!r} of this node's entry {address!r} in [cluster] nodes: {exc}") from None
    return f"tcp://{ip}:{port}"


def own_node_config(cfg):
    """The node's settings, binding its own entry of ``[cluster] nodes`` (by ``node.index``)
    unless ``node.bind`` was given: workers reading the same file then reach it."""
    index = cfg.node.index
    if cfg.sources.get("node.bind", "default") != "default" or not 0 <= index < len(cfg.cluster.nodes):
        return cfg.node
    return dataclasses.replace(cfg.node, bind=_bindable(cfg.cluster.nodes[index]))


def _busy(what: str, address: str, hint: str) -> int:
    print(f"luwu node: error: cannot bind {what} {address}: Address already in use; another program (an old node?) holds it: "
          f"stop it (`ss -ltnp` shows which), or {hint}", file=sys.stderr)
    return 1


def warnings_for(cfg, node) -> list[str]:
    """What a node started this way should be told: no encryption on a network address, a secret on
    the command line (every local user reads it in ``ps``)."""
    from luwu.keyset import argv_secret_warning, is_loopback

    out = []
    if not is_loopback(node.bind) and not node.curve_secret_key and node.insecure_public_bind:
        out.append(f"node.insecure_public_bind: {node.bind} is served WITHOUT encryption; anyone who reaches it can join the job (luwu keys makes CURVE keys)")
    return [*out, argv_secret_warning(cfg)] if argv_secret_warning(cfg) else out


def cmd_node(args) -> int:
    from luwu.config import load_config

    cfg = load_config(args.config, argv=args.overrides)  # a bad setting is told before torch loads
    from luwu.switch_nodes.daemon import run_node
    from luwu.switch_nodes.listener import AddressInUse

    node = own_node_config(cfg)
    for line in warnings_for(cfg, node):
        print(f"luwu node: warning: {line}", file=sys.stderr)
    try:
        return run_node(node, job=cfg.cluster.job, metrics=cfg.metrics)
    except AddressInUse:
        return _busy("the node address", node.bind, "choose another port: --node.bind=tcp://HOST:PORT (port 0: any free port)")
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return _busy("the metrics endpoint", f"http://{cfg.metrics.host}:{cfg.metrics.port}", "choose another port: --metrics.port=PORT (0: any free port, -1: off)")


def register(subparsers) -> None:
    add_command(
        subparsers, "node", func=cmd_node, settings=True,
        help="run one node daemon in the foreground",
        description=(
            "Run one node daemon in the foreground. It prints 'LUWU_NODE_READY <address>' once bound. It binds node.bind if "
            "given, else its own entry (node.index) of [cluster] nodes, else tcp://127.0.0.1:0 (any free port)."
        ),
    )

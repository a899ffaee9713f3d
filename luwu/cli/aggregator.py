"""``luwu aggregator``: one aggregator of the switch tier in the foreground."""

from __future__ import annotations

import sys

from luwu.cli.common import add_command
from luwu.groups import rank_run
from luwu.protocol.errors import ConfigError


def cmd_aggregator(args) -> int:
    from luwu.config import load_config

    cfg = load_config(args.config, argv=args.overrides)  # a bad setting is told before torch loads
    first, last = rank_run(args.ranks, "--ranks")
    group = tuple(range(first, last + 1))
    if not cfg.cluster.nodes:
        raise ConfigError(
            "an aggregator needs the job's nodes: [cluster] nodes in --config, or "
            "--cluster.nodes=tcp://HOST:PORT,..."
        )
    from luwu.switch_nodes.tier import run_aggregator

    node, tc = cfg.node, cfg.transport
    if not node.join_secret and not node.curve_secret_key and tc.join_secret:
        import dataclasses  # the workers show the job's secret

        node = dataclasses.replace(node, join_secret=tc.join_secret)
    upstream_curve = None
    if tc.curve_server_key:  # its own key to the nodes (their node.curve_aggregator_keys)
        upstream_curve = (tc.curve_server_key, tc.curve_public_key, tc.curve_secret_key)
    print(
        f"luwu aggregator: ranks {group[0]}-{group[-1]} in front of {len(cfg.cluster.nodes)} nodes",
        file=sys.stderr,
        flush=True,
    )
    return run_aggregator(
        node,
        job=cfg.cluster.job,
        nodes=list(cfg.cluster.nodes),
        group=group,
        upstream_secret="" if upstream_curve else tc.join_secret,
        upstream_curve=upstream_curve,
        metrics=cfg.metrics,
        compression=cfg.compression,
    )


def register(subparsers) -> None:
    s = add_command(
        subparsers,
        "aggregator",
        func=cmd_aggregator,
        settings=True,
        help="run one aggregator of the switch tier in the foreground",
        description=(
            "Run one aggregator in front of the nodes of [cluster] nodes, for the workers of --ranks. It prints "
            "'LUWU_NODE_READY <address>' once bound (node.bind, default tcp://127.0.0.1:0: any free port); the "
            "group's workers connect to it (RemoteOptimizer(..., aggregator=ADDRESS), cluster.aggregator) instead "
            "of to the nodes. It asks its workers for the job's join secret (node.join_secret, else "
            "transport.join_secret) and shows the nodes transport.join_secret; with CURVE (luwu keys: "
            "--config keys/aggregator<i>.toml) it serves its workers with its own key pair "
            "(node.curve_*: the group's worker keys let in, bound by rank) and shows the nodes its "
            "aggregator key (transport.curve_*: the nodes list it in node.curve_aggregator_keys)."
        ),
    )
    s.add_argument(
        "--ranks",
        required=True,
        metavar="FIRST-LAST",
        help="the worker ranks it serves, a contiguous run (e.g. 0-3)",
    )

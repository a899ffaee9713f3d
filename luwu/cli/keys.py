"""``luwu keys``: CURVE key pairs for the nodes, the workers and the operator's tools."""

from __future__ import annotations

from luwu.cli.common import add_command, positive_int


def cmd_keys(args) -> int:
    """One key pair for the nodes, one per worker rank, one for ``luwu status`` and one per aggregator of
    the cluster file's ``[[groups]]``; files 0600 in a 0700 folder."""
    from luwu.ops.keyset import KeySet, with_aggregator_keys, write_keyset

    shared, groups = None, []
    if args.cluster:
        from luwu.config import load_config
        from luwu.ops.cluster_file import cluster_sections

        cfg = load_config(args.cluster)
        groups = cfg.cluster.groups
    keys = KeySet.generate(args.workers, groups=[g["ranks"] for g in groups])
    if args.cluster:
        shared = cluster_sections(
            cfg, list(cfg.cluster.nodes), groups=with_aggregator_keys(groups, keys)
        )
    write_keyset(args.out, keys, shared=shared)
    tier = (
        f", aggregator<i>.toml and .env for each of the {len(groups)} groups (its aggregator's keys "
        "to its workers and to the nodes; the worker files' [[groups]] carry its public key)"
        if groups
        else ""
    )
    print(
        f"wrote {args.out}/node.toml and node.env (node keys + authorized worker keys), worker0..{args.workers - 1}.toml "
        f"(rank r's keys{', with the settings of ' + args.cluster if args.cluster else ''}) and monitor.toml (for luwu status){tier}; mode 600"
    )
    return 0


def register(subparsers) -> None:
    s = add_command(
        subparsers,
        "keys",
        func=cmd_keys,
        settings=False,
        help="generate CURVE keys for nodes and workers",
        description=(
            "Generate a CURVE key pair for the nodes, one per worker rank and one for `luwu status`/`top`; nodes then accept "
            "only the listed keys, and all traffic is encrypted. Files are written mode 600 into a mode 700 folder. Give the "
            "nodes node.toml (--config) or node.env (environment: systemd EnvironmentFile, `set -a; . node.env`), and worker "
            "rank r its own worker<r>.toml. With a --cluster file that has [[groups]] (the switch tier), one pair per "
            "aggregator too: the nodes let it relay its group's ranks only (node.curve_aggregator_keys), and it runs "
            "with --config aggregator<i>.toml."
        ),
    )
    s.add_argument(
        "--out",
        default="luwu-keys",
        help="directory to write the key files into (default ./luwu-keys)",
    )
    s.add_argument(
        "--workers", type=positive_int, default=1, help="number of worker key pairs (default 1)"
    )
    s.add_argument(
        "--cluster",
        metavar="FILE",
        help="a cluster file (no secrets) whose settings are copied into each worker<r>.toml and monitor.toml, so a worker needs one --config",
    )

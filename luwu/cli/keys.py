"""``luwu keys``: CURVE key pairs for the nodes, the workers and the operator's tools."""

from __future__ import annotations

from luwu.cli.common import add_command, positive_int


def cmd_keys(args) -> int:
    """One key pair for the nodes, one per worker rank, one for ``luwu status``; files 0600 in a 0700 folder."""
    from luwu.ops.keyset import KeySet, write_keyset

    shared = None
    if args.cluster:
        from luwu.config import load_config
        from luwu.ops.cluster_file import cluster_sections

        cfg = load_config(args.cluster)
        shared = cluster_sections(cfg, list(cfg.cluster.nodes))
    write_keyset(args.out, KeySet.generate(args.workers), shared=shared)
    print(
        f"wrote {args.out}/node.toml and node.env (node keys + authorized worker keys), worker0..{args.workers - 1}.toml "
        f"(rank r's keys{', with the settings of ' + args.cluster if args.cluster else ''}) and monitor.toml (for luwu status); mode 600"
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
            "rank r its own worker<r>.toml."
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

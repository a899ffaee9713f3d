"""``luwu config show``: the resolved configuration as TOML, each value with its source."""

from __future__ import annotations

from luwu.cli.common import add_command


def cmd_config_show(args) -> int:
    from luwu.config import load_config
    from luwu.ops.cluster_file import config_text

    cfg = load_config(args.config, argv=args.overrides)
    header = "Resolved by `luwu config show`: loads back with --config (unset values and secrets are comments)."
    print(config_text(cfg, header=header), end="")
    return 0


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "config",
        help="show the resolved configuration",
        allow_abbrev=False,
        description="Print the resolved configuration and where each value came from (default, the cluster file, env LUWU_SECTION__FIELD, or --section.field=value).",
    )
    actions = s.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    add_command(
        actions,
        "show",
        func=cmd_config_show,
        settings=True,
        help="print every setting as TOML, with its source in a comment",
        description="Print every setting as TOML that loads back with --config; a comment on each line names where its value came from.",
    )

"""What every ``luwu`` command shares: registering a subcommand, settings flags, the version.

A command that reads the configuration takes ``--config FILE`` and
``--section.field=value`` flags; any other argument it does not know is an
error (exit code 2), never silently ignored.
"""

from __future__ import annotations

import argparse


def add_command(
    subparsers, name: str, *, help: str, description: str, func, settings: bool
) -> argparse.ArgumentParser:
    """A subcommand that runs ``func(args)``; with ``settings``, it takes ``--config`` and
    ``--section.field=value`` flags (handed to ``func`` as ``args.overrides``)."""
    p = subparsers.add_parser(name, help=help, description=description, allow_abbrev=False)
    p.set_defaults(func=func, parser=p, settings=settings, overrides=[])
    if settings:
        p.add_argument(
            "--config",
            metavar="FILE",
            action="append",
            help="TOML cluster file; repeat it to layer files, a later one's settings over an earlier one's (e.g. the cluster file, then a worker's key file); --section.field=value flags override them",
        )
    return p


def split_overrides(parser: argparse.ArgumentParser, extra: list[str]) -> list[str]:
    """The ``--section.field=value`` / ``--section.field value`` flags among the arguments argparse
    did not know; anything else ends the command with a usage error naming it."""
    out: list[str] = []
    i = 0
    while i < len(extra):
        token = extra[i]
        key = token[2:].partition("=")[0]
        if not token.startswith("--") or "." not in key or key.startswith(".") or key.endswith("."):
            parser.error(f"unrecognized argument: {token} (settings are --section.field=value)")
        if "=" in token:
            out.append(token)
        elif i + 1 < len(extra):
            out += [token, extra[i + 1]]
            i += 1
        else:
            parser.error(f"{token} needs a value")
        i += 1
    return out


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class VersionAction(argparse.Action):
    """``--version``: reads the package metadata only when asked (it costs an import)."""

    def __init__(
        self,
        option_strings,
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        help="print the version and exit",
    ):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import luwu

        print(f"luwu {luwu.__version__}")
        parser.exit()

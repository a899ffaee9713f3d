"""The ``luwu`` command line: one module per command, each with a ``register(subparsers)``.

Settings come from a TOML cluster file (--config), LUWU_SECTION__FIELD environment
variables and --section.field=value flags. Building the parser imports nothing
heavy: torch and ZeroMQ load inside the command that needs them, so ``luwu --help``
answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from luwu.cli import aggregator, config, demo, keys, node, plan, status, top, updown
from luwu.cli.common import VersionAction, split_overrides
from luwu.protocol.errors import LuwuError

DESCRIPTION = """LuWu: an in-network optimizer runtime.

Settings come from a TOML cluster file (--config), LUWU_SECTION__FIELD environment
variables and --section.field=value flags, in that order of precedence (lowest first).
"""

COMMANDS = (node, aggregator, updown, status, top, config, keys, plan, demo)
"""Modules that register the subcommands, in the order of ``luwu --help``."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="luwu",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)"
    )
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return p


def _setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _quiet_broken_pipe() -> int:
    """stdout's reader left (``luwu config show | head``): no traceback, no error at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the command; returns the exit code:
    0 done, 1 the command failed (a node down, a daemon that did not start), 2 a usage or setting error."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not args.settings:
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = split_overrides(args.parser, extra)
        _setup_logging(args.verbose)
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as an ignored exception at exit
        return rc
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except LuwuError as exc:
        print(f"luwu {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        return 130

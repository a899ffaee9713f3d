"""The ``luwu`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from luwu.protocol.errors import LuwuError

DESCRIPTION = """LuWu: an in-network optimizer runtime.

Settings come from a TOML cluster file (--config), LUWU_SECTION__FIELD environment
variables and --section.field=value flags, in that order of precedence (lowest first).
"""


def _setup_logging(verbose: int) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_node(args, rest) -> int:
    from luwu.config import load_config
    from luwu.switch_nodes.daemon import run_node

    cfg = load_config(args.config, argv=rest)
    return run_node(cfg.node, job=cfg.cluster.job, metrics=cfg.metrics)


def cmd_demo(args, rest) -> int:
    from luwu.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, nodes=args.nodes, argv=rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="luwu", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("node", help="run one node daemon in the foreground", description="Run one node daemon in the foreground. It prints 'LUWU_NODE_READY <address>' once bound (use --node.bind=tcp://127.0.0.1:0 for any free port).")
    s.add_argument("--config", help="TOML cluster file")
    s.set_defaults(func=cmd_node)

    s = sub.add_parser("demo", help="train a small real model on an embedded local cluster and compare with local AdamW", description="Train an MLP on scikit-learn's digits with 2 worker processes and 2 node daemons on loopback, then the same training with torch.optim.AdamW in one process, and print both.")
    s.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    s.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    s.add_argument("--nodes", type=int, default=2, help="node daemons (default 2)")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args, rest)
    except LuwuError as exc:
        print(f"luwu {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

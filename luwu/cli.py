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


def cmd_config_show(args, rest) -> int:
    from luwu.config import load_config

    cfg = load_config(args.config, argv=rest)
    plain = cfg.as_dict()
    for section, values in plain.items():
        print(f"[{section}]")
        for key, value in values.items():
            src = cfg.sources.get(f"{section}.{key}", "default")
            shown = repr(value) if not isinstance(value, str) else f'"{value}"'
            if "secret" in key and value:
                shown = '"<hidden>"'
            print(f"{key} = {shown}  # from {src}")
        print()
    return 0


def cmd_keys(args, rest) -> int:
    """Generate CURVE key pairs: one for the nodes, one per worker, and the authorized list."""
    import os

    import zmq

    os.makedirs(args.out, exist_ok=True)
    pub, sec = zmq.curve_keypair()
    workers = [zmq.curve_keypair() for _ in range(args.workers)]
    with open(os.path.join(args.out, "node.toml"), "w") as fh:
        fh.write(f'[node]\ncurve_public_key = "{pub.decode()}"\ncurve_secret_key = "{sec.decode()}"\n')
        fh.write("curve_authorized_keys = [" + ", ".join(f'"{w[0].decode()}"' for w in workers) + "]\n")
    for i, (wp, ws) in enumerate(workers):
        with open(os.path.join(args.out, f"worker{i}.toml"), "w") as fh:
            fh.write(f'[transport]\ncurve_server_key = "{pub.decode()}"\ncurve_public_key = "{wp.decode()}"\ncurve_secret_key = "{ws.decode()}"\n')
    for name in os.listdir(args.out):
        os.chmod(os.path.join(args.out, name), 0o600)
    print(f"wrote {args.out}/node.toml (node keys + authorized worker keys) and worker0..{args.workers - 1}.toml (mode 600)")
    return 0


def cmd_plan(args, rest) -> int:
    from luwu import plan

    return plan.run(args)


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

    from luwu import launcher, status

    launcher.add_arguments(sub)
    status.add_arguments(sub)

    s = sub.add_parser("config", help="show the resolved configuration", description="Print the resolved configuration and where each value came from (default, the cluster file, env LUWU_SECTION__FIELD, or --section.field=value).")
    cs = s.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = cs.add_parser("show", help="print every setting with its source")
    show.add_argument("--config", help="TOML cluster file")
    show.set_defaults(func=cmd_config_show)

    s = sub.add_parser("keys", help="generate CURVE keys for nodes and workers", description="Generate a CURVE key pair for the nodes and one per worker; nodes then accept only the listed worker keys, and all traffic is encrypted.")
    s.add_argument("--out", default="luwu-keys", help="directory to write the key files into (default ./luwu-keys)")
    s.add_argument("--workers", type=int, default=1, help="number of worker key pairs (default 1)")
    s.set_defaults(func=cmd_keys)

    from luwu import plan

    s = sub.add_parser("plan", help="predict step time, bottleneck and the best setup before renting machines", description="An analytical model of one LuWu step: bytes and time on each worker and node link, optimizer time, overlap with and without delayed update; prints the bottleneck and a recommendation.")
    plan.add_arguments(s)
    s.set_defaults(func=cmd_plan)
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

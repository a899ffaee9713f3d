"""``luwu demo``: a small real training on an embedded local cluster, next to local AdamW."""

from __future__ import annotations

from luwu.cli.common import add_command, positive_int


def cmd_demo(args) -> int:
    from luwu.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, nodes=args.nodes)


def register(subparsers) -> None:
    s = add_command(
        subparsers,
        "demo",
        func=cmd_demo,
        settings=False,
        help="train a small real model on an embedded local cluster and compare with local AdamW",
        description="Train an MLP on scikit-learn's digits with 2 worker processes and 2 node daemons on loopback, then the same training with torch.optim.AdamW in one process, and print both.",
    )
    s.add_argument("--steps", type=positive_int, default=150, help="training steps (default 150)")
    s.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")
    s.add_argument("--nodes", type=positive_int, default=2, help="node daemons (default 2)")

"""``luwu plan``: predict a step's time and bottleneck before renting machines."""

from __future__ import annotations

from luwu.cli.common import add_command


def cmd_plan(args) -> int:
    from luwu import plan

    return plan.run(args)


def register(subparsers) -> None:
    from luwu import plan

    s = add_command(
        subparsers,
        "plan",
        func=cmd_plan,
        settings=False,
        help="predict step time, bottleneck and the best setup before renting machines",
        description="An analytical model of one LuWu step: bytes and time on each worker and node link, optimizer time, overlap with and without delayed update; prints the bottleneck and a recommendation.",
    )
    plan.add_arguments(s)

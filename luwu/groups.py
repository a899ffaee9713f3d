"""The switch tier's groups in a cluster file: which worker ranks talk through which aggregator.

A cluster file lists them as ``[[groups]]`` tables, one per aggregator::

    [[groups]]
    ranks = "0-3"                      # a contiguous run of worker ranks (or one rank, "4")
    aggregator = "tcp://10.0.0.5:7100" # the address the aggregator binds and its workers connect to

(``--cluster.groups=0-3=tcp://10.0.0.5:7100,4-7=tcp://10.0.0.6:7100`` or ``LUWU_CLUSTER__GROUPS``
say the same). They are ``cluster.groups`` of the configuration tree, checked when the section is
built (:func:`checked_groups`): runs of ranks that do not overlap, within ``cluster.world_size``
when it is set, each with an address of its own. A worker finds its aggregator with
:func:`aggregator_for`; a rank in no group talks to the nodes directly. Nothing here imports torch
or ZeroMQ.
"""

from __future__ import annotations

import json

from luwu.protocol.errors import ConfigError

GROUP_KEYS = ("ranks", "aggregator")
"""The keys of one ``[[groups]]`` table."""
EXAMPLE = '[[groups]] ranks = "0-3", aggregator = "tcp://HOST:PORT"'


def rank_run(value, where: str = "cluster.groups") -> tuple[int, int]:
    """``"4-7"``, ``"4"``, ``4`` or ``[4, 5, 6, 7]`` as (first, last) rank: a contiguous run."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: ranks must be FIRST-LAST (e.g. 0-3), got {value!r}")
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str):
        a, dash, b = value.strip().partition("-")
        try:
            first, last = int(a), int(b if dash else a)
        except ValueError:
            raise ConfigError(
                f"{where}: ranks must be FIRST-LAST (e.g. 0-3), got {value!r}"
            ) from None
    elif isinstance(value, (list, tuple)) and value and all(type(r) is int for r in value):
        first, last = value[0], value[-1]
        if list(value) != list(range(first, last + 1)):
            raise ConfigError(f"{where}: ranks must be a contiguous run, got {list(value)}")
    else:
        raise ConfigError(f"{where}: ranks must be FIRST-LAST (e.g. 0-3), got {value!r}")
    if not 0 <= first <= last:
        raise ConfigError(
            f"{where}: ranks must be FIRST-LAST with 0 <= FIRST <= LAST, got {value!r}"
        )
    return first, last


def is_address(text) -> bool:
    """``tcp://HOST:PORT`` (PORT 0..65535; HOST a name, an IPv4 address or ``[IPv6]``)."""
    if not isinstance(text, str) or not text.startswith("tcp://"):
        return False
    host, colon, port = text[len("tcp://") :].rpartition(":")
    return bool(colon and host and port.isdigit() and int(port) <= 65535 and " " not in host)


def group_entries(value, source: str) -> list[dict]:
    """A setting's value as a list of tables: TOML's ``[[groups]]`` (a list of tables) as it is; a
    string (environment, flag) or list of strings as ``RANKS=ADDRESS`` items, comma-separated."""
    items = value
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(items, (list, tuple)):
        raise ConfigError(
            f"cluster.groups = {value!r} (from {source}) is not a list of groups: {EXAMPLE}, "
            "or RANKS=ADDRESS,... (e.g. 0-3=tcp://10.0.0.5:7100)"
        )
    out = []
    for item in items:
        if isinstance(item, str):
            ranks, eq, address = item.partition("=")
            if not eq:
                raise ConfigError(
                    f"cluster.groups entry {item!r} (from {source}) is not RANKS=ADDRESS "
                    "(e.g. 0-3=tcp://10.0.0.5:7100)"
                )
            item = {"ranks": ranks.strip(), "aggregator": address.strip()}
        if not isinstance(item, dict):
            raise ConfigError(
                f"cluster.groups entry {item!r} (from {source}) is not a table: {EXAMPLE}"
            )
        out.append(dict(item))
    return out


def checked_groups(groups: list, world_size: int = 0) -> list[dict]:
    """``groups`` checked and normalized (``ranks`` as ``"FIRST-LAST"``), in their order; a
    ConfigError naming the value otherwise."""
    out: list[dict] = []
    for g in groups:
        if not isinstance(g, dict):
            raise ConfigError(f"cluster.groups entry {g!r} is not a table: {EXAMPLE}")
        unknown = sorted(set(g) - set(GROUP_KEYS))
        missing = [k for k in GROUP_KEYS if k not in g]
        if unknown or missing:
            raise ConfigError(
                f"cluster.groups entry {g!r}: "
                + (f"unknown key(s) {unknown}" if unknown else f"no {' or '.join(missing)}")
                + f"; a group has {list(GROUP_KEYS)}"
            )
        first, last = rank_run(g["ranks"], f"cluster.groups entry {g!r}")
        if not is_address(g["aggregator"]):
            raise ConfigError(
                f"cluster.groups entry {g!r}: aggregator must be an address like tcp://host:port, "
                f"got {g['aggregator']!r}"
            )
        if world_size and last >= world_size:
            raise ConfigError(
                f"cluster.groups entry {g!r}: ranks {first}-{last} are past cluster.world_size = "
                f"{world_size} (ranks 0-{world_size - 1})"
            )
        out.append({"ranks": f"{first}-{last}", "aggregator": g["aggregator"]})
    _check_disjoint(out)
    return out


def _check_disjoint(groups: list[dict]) -> None:
    seen: dict[str, str] = {}
    runs = sorted((rank_run(g["ranks"]), g["aggregator"]) for g in groups)
    for (prev, prev_addr), (run, addr) in zip(runs, runs[1:]):
        if run[0] <= prev[1]:
            raise ConfigError(
                f"cluster.groups: ranks {run[0]}-{run[1]} (aggregator {addr}) overlap ranks "
                f"{prev[0]}-{prev[1]} (aggregator {prev_addr}): a rank has one aggregator"
            )
    for run, addr in runs:
        if addr in seen and not addr.endswith(":0"):
            raise ConfigError(
                f"cluster.groups: ranks {seen[addr]} and {run[0]}-{run[1]} name the same aggregator "
                f"{addr}: an aggregator serves one group"
            )
        seen[addr] = f"{run[0]}-{run[1]}"


def group_ranks(group: dict) -> tuple[int, ...]:
    """The ranks of one (checked) group."""
    first, last = rank_run(group["ranks"])
    return tuple(range(first, last + 1))


def aggregator_for(cfg, rank: int) -> str:
    """The aggregator worker ``rank`` talks to the nodes through: ``cluster.aggregator`` when it is
    set (it always wins), else the address of the group of ``cluster.groups`` holding ``rank``, else
    ``""`` (no switch tier for this rank: it talks to the nodes directly). ``cfg`` is a
    :class:`~luwu.config.LuwuConfig` or its ``cluster`` section."""
    cluster = getattr(cfg, "cluster", cfg)
    if cluster.aggregator:
        return cluster.aggregator
    for g in cluster.groups:
        first, last = rank_run(g["ranks"])
        if first <= rank <= last:
            return g["aggregator"]
    return ""


def even_groups(world_size: int, count: int) -> list[tuple[int, int]]:
    """``world_size`` ranks in ``count`` contiguous runs as even as can be, larger first (as
    ``luwu.local_cluster(aggregators=count)`` cuts them): (first, last) of each."""
    if not 0 < count <= world_size:
        raise ConfigError(
            f"--aggregators {count} needs 1 <= aggregators <= --world-size, got world size {world_size}"
        )
    size, extra = divmod(world_size, count)
    out, first = [], 0
    for i in range(count):
        n = size + (i < extra)
        out.append((first, first + n - 1))
        first += n
    return out


def groups_toml(groups: list[dict]) -> str:
    """``groups`` as the inline value of ``groups = [...]`` under ``[cluster]`` (for
    ``luwu config show``, which writes one line per setting)."""
    items = [
        f"{{ ranks = {json.dumps(g['ranks'])}, aggregator = {json.dumps(g['aggregator'])} }}"
        for g in groups
    ]
    return f"[{', '.join(items)}]"


def group_on_host(cfg, host: str) -> dict | None:
    """The group of ``cfg`` whose aggregator address is on ``host`` (its host part), else None."""
    for g in getattr(cfg, "cluster", cfg).groups:
        if g["aggregator"][len("tcp://") :].rpartition(":")[0].strip("[]") == host:
            return g
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m luwu.groups CLUSTER_FILE... HOST``: print ``RANKS PORT`` of the group whose
    aggregator is on HOST (a recipe starting one aggregator per host uses it: ``luwu aggregator
    --ranks RANKS --node.bind tcp://0.0.0.0:PORT``); exit code 3 when HOST has none."""
    import sys

    from luwu.config import load_config

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m luwu.groups CLUSTER_FILE... HOST", file=sys.stderr)
        return 2
    group = group_on_host(load_config(args[:-1]), args[-1])
    if group is None:
        print(f"no group of the switch tier has its aggregator on {args[-1]}", file=sys.stderr)
        return 3
    print(group["ranks"], group["aggregator"].rpartition(":")[2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

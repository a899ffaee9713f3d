"""The switch tier's groups in a cluster file: which worker ranks talk through which aggregator.

A cluster file lists them as ``[[groups]]`` tables, one per aggregator::

    [[groups]]
    ranks = "0-3"                      # a contiguous run of worker ranks (or one rank, "4")
    aggregator = "tcp://10.0.0.5:7100" # the address the aggregator binds and its workers connect to
    metrics = "http://10.0.0.5:9500"   # optional: its /metrics (luwu top and luwu status read it)

(``--cluster.groups=0-3=tcp://10.0.0.5:7100,4-7=tcp://10.0.0.6:7100`` or ``LUWU_CLUSTER__GROUPS``
say the same; ``0-3=tcp://10.0.0.5:7100=http://10.0.0.5:9500`` adds the metrics address). They
are ``cluster.groups`` of the configuration tree, checked when the section is built
(:func:`checked_groups`): runs of ranks that do not overlap, within ``cluster.world_size`` when it
is set, each with an address of its own. A worker finds its aggregator with
:func:`aggregator_for`; a rank in no group talks to the nodes directly. Nothing here imports torch
or ZeroMQ.
"""

from __future__ import annotations

import json

from luwu.protocol.errors import ConfigError

GROUP_KEYS = ("ranks", "aggregator")
"""The keys every ``[[groups]]`` table has."""
OPTIONAL_KEYS = ("metrics", "aggregator_key")
"""The keys a ``[[groups]]`` table may have: ``metrics``, the ``http://HOST:PORT`` of the
aggregator's ``/metrics`` (``luwu aggregator --metrics.port``), where ``luwu top`` reads its rates."""
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


def is_metrics_url(text) -> bool:
    """``http://HOST:PORT`` (a ``/metrics`` endpoint's root; ``/metrics`` itself is allowed too)."""
    if not isinstance(text, str) or not text.startswith("http://"):
        return False
    rest = text[len("http://") :].removesuffix("/metrics").rstrip("/")
    return is_address(f"tcp://{rest}")


def group_entries(value, source: str) -> list[dict]:
    """A setting's value as a list of tables: TOML's ``[[groups]]`` (a list of tables) as it is; a
    string (environment, flag) or list of strings as ``RANKS=ADDRESS[=METRICS]`` items,
    comma-separated."""
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
            address, eq, metrics = address.partition("=")
            item = {"ranks": ranks.strip(), "aggregator": address.strip()}
            if eq:
                item["metrics"] = metrics.strip()
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
        unknown = sorted(set(g) - set(GROUP_KEYS) - set(OPTIONAL_KEYS))
        missing = [k for k in GROUP_KEYS if k not in g]
        if unknown or missing:
            raise ConfigError(
                f"cluster.groups entry {g!r}: "
                + (f"unknown key(s) {unknown}" if unknown else f"no {' or '.join(missing)}")
                + f"; a group has {list(GROUP_KEYS)} (and may have {list(OPTIONAL_KEYS)})"
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
        if "metrics" in g and not is_metrics_url(g["metrics"]):
            raise ConfigError(
                f"cluster.groups entry {g!r}: metrics must be the aggregator's /metrics address like "
                f"http://host:port, got {g['metrics']!r}"
            )
        out.append({"ranks": f"{first}-{last}", "aggregator": g["aggregator"]})
        if "metrics" in g:
            out[-1]["metrics"] = g["metrics"]
        if "aggregator_key" in g:
            out[-1]["aggregator_key"] = _checked_key(g)
    _check_disjoint(out)
    return out


def _checked_key(group: dict) -> str:
    """A group's ``aggregator_key``: the aggregator's Z85 CURVE public key (40 characters)."""
    key = group["aggregator_key"]
    if not isinstance(key, str) or len(key) != 40:
        raise ConfigError(
            f"cluster.groups entry {group!r}: aggregator_key must be the aggregator's 40-character "
            "Z85 CURVE public key (luwu keys, luwu up write it)"
        )
    return key


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


def aggregator_key_for(cfg, rank: int) -> str:
    """The CURVE public key of the aggregator worker ``rank`` talks through, its server key there:
    ``cluster.aggregator_key`` with ``cluster.aggregator``, else its group's ``aggregator_key``, else
    ``""`` (none: the worker shows that aggregator transport.curve_server_key)."""
    cluster = getattr(cfg, "cluster", cfg)
    if cluster.aggregator:
        return cluster.aggregator_key
    for g in cluster.groups:
        first, last = rank_run(g["ranks"])
        if first <= rank <= last:
            return g.get("aggregator_key", "")
    return ""


def worker_route(cfg, rank: int) -> tuple[str, str]:
    """(the aggregator worker ``rank`` talks through, '' for none; the CURVE server key it shows that
    aggregator, '' for transport.curve_server_key): with CURVE and that aggregator's key known
    (:func:`aggregator_key_for`), an aggregator serves its workers with a key pair of its own, and a
    worker falling back to the nodes shows them theirs. ``cfg`` a LuwuConfig."""
    via = aggregator_for(cfg, rank)
    key = aggregator_key_for(cfg, rank) if via else ""
    return via, key if key and cfg.transport.curve_server_key else ""


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
        "{ "
        + ", ".join(f"{k} = {json.dumps(g[k])}" for k in (*GROUP_KEYS, *OPTIONAL_KEYS) if k in g)
        + " }"
        for g in groups
    ]
    return f"[{', '.join(items)}]"


def group_on_host(cfg, host: str) -> dict | None:
    """The group of ``cfg`` whose aggregator address is on ``host`` (its host part), else None."""
    for g in getattr(cfg, "cluster", cfg).groups:
        if g["aggregator"][len("tcp://") :].rpartition(":")[0].strip("[]") == host:
            return g
    return None


def group_with_ranks(cfg, ranks: str) -> dict | None:
    """The group of ``cfg`` whose ranks are ``ranks`` (``"0-3"``), else None."""
    want = rank_run(ranks, "--ranks")
    for g in getattr(cfg, "cluster", cfg).groups:
        if rank_run(g["ranks"]) == want:
            return g
    return None


def bind_line(group: dict) -> str:
    """``ADDRESS METRICS_HOST METRICS_PORT`` of a group, what ``luwu aggregator`` binds:
    ``--node.bind ADDRESS --metrics.host METRICS_HOST --metrics.port METRICS_PORT`` (``127.0.0.1
    -1``, no /metrics, for a group without a ``metrics`` address)."""
    url = group.get("metrics", "")
    rest = url[len("http://") :].removesuffix("/metrics").rstrip("/") if url else ""
    host, _, port = rest.rpartition(":")
    return f"{group['aggregator']} {host.strip('[]') or '127.0.0.1'} {port or -1}"


USAGE = "usage: python -m luwu.groups CLUSTER_FILE... HOST | --ranks FIRST-LAST CLUSTER_FILE..."


def main(argv: list[str] | None = None) -> int:
    """``python -m luwu.groups CLUSTER_FILE... HOST``: print ``RANKS PORT`` of the group whose
    aggregator is on HOST (a recipe starting one aggregator per host uses it: ``luwu aggregator
    --ranks RANKS --node.bind tcp://0.0.0.0:PORT``); exit code 3 when HOST has none.
    ``python -m luwu.groups --ranks FIRST-LAST CLUSTER_FILE...``: print :func:`bind_line` of the
    group of those ranks (the systemd unit ``luwu-aggregator@FIRST-LAST`` uses it); 3 when none."""
    import sys

    from luwu.config import load_config

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--ranks"] and len(args) >= 3:
        group = group_with_ranks(load_config(args[2:]), args[1])
        if group is None:
            print(f"no group of the switch tier has ranks {args[1]}", file=sys.stderr)
            return 3
        print(bind_line(group))
        return 0
    if len(args) < 2 or args[0] == "--ranks":
        print(USAGE, file=sys.stderr)
        return 2
    group = group_on_host(load_config(args[:-1]), args[-1])
    if group is None:
        print(f"no group of the switch tier has its aggregator on {args[-1]}", file=sys.stderr)
        return 3
    print(group["ranks"], group["aggregator"].rpartition(":")[2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

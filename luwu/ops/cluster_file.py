"""Writing a configuration back as a TOML cluster file.

Two writers share one TOML encoder (``tomli_w``): :func:`cluster_file_text`, the
file ``luwu up`` and the Slurm/SSH launchers hand to workers, and
:func:`config_text`, what ``luwu config show`` prints. Both load back with
``--config``. Neither ever writes a secret: a cluster file handed to workers
carries the nodes' public key (``transport.curve_server_key``) and no key of
the nodes' own; each worker gets its own key pair in a file of its own
(:mod:`luwu.ops.keyset`).
"""

from __future__ import annotations

import socket

import tomli_w

from luwu.groups import groups_toml
from luwu.ops.keyset import is_secret
from luwu.protocol.errors import ConfigError

PER_NODE_KEYS = ("node.bind", "node.index", "metrics.port")
"""Settings that differ per node: never copied into a shared cluster file."""
NODE_KEYS = (
    "node.curve_public_key",
    "node.curve_secret_key",
    "node.curve_authorized_keys",
    "node.curve_monitor_keys",
)
"""The nodes' own CURVE identity: a cluster file gets the public key as transport.curve_server_key."""
CLIENT_KEYS = (
    "transport.curve_public_key",
    "transport.curve_secret_key",
    "transport.curve_server_key",
)
"""One client's CURVE identity: each worker has its own (luwu.ops.keyset), never the shared file."""


WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
"""Bind addresses meaning "every interface": a peer cannot connect to them."""


def reachable(address: str, host: str | None = None) -> str:
    """``address`` (``tcp://HOST:PORT`` or ``http://HOST:PORT``) as other hosts reach it: a wildcard
    bind host (0.0.0.0, ``*``, ``::``) becomes ``host``, else this machine's fully qualified name (its
    host name where that resolves only to ``localhost``)."""
    scheme, sep, rest = address.rpartition("://")
    bind_host, colon, port = rest.rpartition(":")
    if not colon or bind_host not in WILDCARD_HOSTS:
        return address
    if not host:
        host = socket.getfqdn()
        host = socket.gethostname() if host.startswith("localhost") else host
    return f"{scheme}{sep}{host}:{port}"


def group_table(aggregator: dict) -> dict:
    """An aggregator of a supervisor's state (``ranks``, ``address``, ``metrics_url``) as its
    ``[[groups]]`` table, as other hosts reach it: the address it bound and, when it serves one, its
    /metrics (where ``luwu top`` and ``luwu status`` read its numbers)."""
    group = {"ranks": aggregator["ranks"], "aggregator": reachable(aggregator["address"])}
    if aggregator.get("metrics_url"):
        group["metrics"] = reachable(aggregator["metrics_url"])
    return group


def _dumps(table: dict) -> str:
    try:
        return tomli_w.dumps(table)
    except TypeError as exc:
        raise ConfigError(f"cannot write {table!r} into a TOML cluster file: {exc}") from None


def _comment(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in text.splitlines()]


def cluster_sections(
    cfg, nodes: list[str], *, server_key: str = "", groups: list[dict] | None = None
) -> dict:
    """[cluster] with ``nodes``, plus every setting given that nodes and workers share (file, env,
    flags: not the defaults, not the per-node ones, no secret, not the nodes' keys). The nodes'
    public key (``server_key``, else node.curve_public_key of ``cfg``) goes in as
    transport.curve_server_key; the switch tier's ``groups`` (default: cluster.groups of ``cfg``)
    as ``[[groups]]`` tables."""
    sections: dict = {"cluster": {"job": cfg.cluster.job, "nodes": list(nodes)}}
    if cfg.cluster.capacities:
        sections["cluster"]["capacities"] = list(cfg.cluster.capacities)
    if cfg.cluster.world_size:
        sections["cluster"]["world_size"] = cfg.cluster.world_size
    for key, source in sorted(cfg.sources.items()):
        section, _, name = key.partition(".")
        if (
            source == "default"
            or key in (*PER_NODE_KEYS, *NODE_KEYS, *CLIENT_KEYS)
            or section == "cluster"
            or is_secret(name)
        ):
            continue
        value = getattr(getattr(cfg, section), name)
        if value is not None:
            sections.setdefault(section, {})[name] = value
    server_key = server_key or cfg.node.curve_public_key or cfg.transport.curve_server_key
    if server_key:
        sections.setdefault("transport", {})["curve_server_key"] = server_key
    groups = cfg.cluster.groups if groups is None else groups
    if groups:
        sections["groups"] = [dict(g) for g in groups]
    return sections


def cluster_file_text(
    cfg,
    nodes: list[str],
    *,
    header: str = "",
    server_key: str = "",
    groups: list[dict] | None = None,
) -> str:
    """:func:`cluster_sections` as TOML, under a comment ``header``."""
    sections = cluster_sections(cfg, nodes, server_key=server_key, groups=groups)
    return "\n".join([*_comment(header), dumps_sections(sections)]).lstrip("\n")


def dumps_sections(sections: dict) -> str:
    """A cluster file's sections as TOML, the switch tier's groups as ``[[groups]]`` tables at the
    end (tomli_w would write them as one inline array above [cluster])."""
    groups = sections.get("groups", [])
    text = _dumps({k: v for k, v in sections.items() if k != "groups"})
    tables = [f"[[groups]]\n{_dumps(dict(g))}" for g in groups]
    return "\n".join([text, *tables]) if tables else text


def config_text(cfg, *, header: str = "") -> str:
    """Every setting of ``cfg`` as TOML, each with a comment naming where its value came from.

    Unset values (None) and secrets are written as comments, so the text loads back
    with ``--config`` to the same settings (less the secrets, which stay where they are).
    """
    out = _comment(header)
    for section, values in cfg.as_dict().items():
        out += ["", f"[{section}]"]
        for name, value in values.items():
            source = cfg.sources.get(f"{section}.{name}", "default")
            if value is None:
                out.append(f"# {name} is unset (from {source})")
            elif is_secret(name) and value:
                out.append(f"# {name} = <hidden> (set, from {source})")
            elif (
                f"{section}.{name}" == "cluster.groups"
            ):  # one line: [[groups]] would end [cluster]
                out.append(f"{name} = {groups_toml(value)}  # from {source}")
            else:
                text = _dumps({name: value}).rstrip("\n")
                out.append(f"{text}  # from {source}")
    return "\n".join(out).lstrip("\n") + "\n"

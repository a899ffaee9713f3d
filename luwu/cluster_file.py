"""Writing a configuration back as a TOML cluster file.

Two writers share one TOML encoder (``tomli_w``): :func:`cluster_file_text`, the
file ``luwu up`` and the Slurm/SSH launchers hand to workers, and
:func:`config_text`, what ``luwu config show`` prints. Both load back with
``--config``.
"""

from __future__ import annotations

import tomli_w

from luwu.protocol.errors import ConfigError

PER_NODE_KEYS = ("node.bind", "node.index", "metrics.port")
"""Settings that differ per node: never copied into a shared cluster file."""


def _dumps(table: dict) -> str:
    try:
        return tomli_w.dumps(table)
    except TypeError as exc:
        raise ConfigError(f"cannot write {table!r} into a TOML cluster file: {exc}") from None


def _comment(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in text.splitlines()]


def cluster_file_text(cfg, nodes: list[str], *, header: str = "") -> str:
    """[cluster] with the bound node addresses, plus every setting given to ``up`` that is shared
    by nodes and workers (file, env, flags: not the defaults, not the per-node ones)."""
    sections: dict[str, dict] = {"cluster": {"job": cfg.cluster.job, "nodes": list(nodes)}}
    if cfg.cluster.capacities:
        sections["cluster"]["capacities"] = list(cfg.cluster.capacities)
    if cfg.cluster.world_size:
        sections["cluster"]["world_size"] = cfg.cluster.world_size
    for key, source in sorted(cfg.sources.items()):
        section, _, name = key.partition(".")
        if source == "default" or key in PER_NODE_KEYS or section == "cluster":
            continue
        value = getattr(getattr(cfg, section), name)
        if value is not None:
            sections.setdefault(section, {})[name] = value
    return "\n".join([*_comment(header), _dumps(sections)]).lstrip("\n")


def _is_secret(name: str) -> bool:
    return "secret" in name


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
            elif _is_secret(name) and value:
                out.append(f"# {name} = <hidden> (set, from {source})")
            else:
                text = _dumps({name: value}).rstrip("\n")
                out.append(f"{text}  # from {source}")
    return "\n".join(out).lstrip("\n") + "\n"

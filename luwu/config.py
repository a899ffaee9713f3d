"""The configuration tree and where each value came from.

Sections: ``cluster``, ``optimizer``, ``transport``, ``compression``,
``prefetch``, ``metrics``, ``node``; each is the ``Config`` dataclass of the
part that owns it. Sources, lowest first: defaults, a TOML cluster file,
environment ``LUWU_SECTION__FIELD``, command-line ``--section.field=value``.
Unknown keys and bad values are :class:`ConfigError` naming key and value.

The Python API takes the same path: ``RemoteOptimizer(...)`` resolves defaults
and the environment like a daemon without a cluster file, and its keyword
arguments are settings of this tree placed over them (:func:`resolve_config`);
``RemoteOptimizer.from_config`` starts from a tree already resolved.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from luwu.gpu_workers.config import PrefetchConfig, TransportConfig
from luwu.groups import checked_groups, group_entries
from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.optimizers.kinds import OPTIMIZER_NAMES, UNSUPPORTED

HOLD_REPLIES = ("auto", "always", "never")
"""optimizer.hold_replies's values."""

if TYPE_CHECKING:
    from luwu.protocol.policy import CompressionConfig


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The ``[cluster]`` section: which nodes serve which job, as workers and nodes both see it."""

    job: str = "luwu"
    """Job id: every message carries it; a node refuses messages of another job."""
    nodes: list[str] = field(default_factory=list)
    """Node addresses (tcp://host:port), in node-index order."""
    capacities: list[float] = field(default_factory=list)
    """Relative capacity of each node (bandwidth x memory); weights the layout. Empty = all equal."""
    world_size: int = 0
    """Number of workers; 0 = from the WORLD_SIZE variable that torchrun sets."""
    aggregator: str = ""
    """This worker's aggregator (``luwu aggregator``, the switch tier), tcp://host:port: the worker talks
    to the nodes through it. Empty = the one of its rank's group (``groups``), else the nodes directly."""
    aggregator_key: str = ""
    """The Z85 CURVE public key of ``aggregator`` (its ``luwu keys`` pair), shown it as the server key
    instead of transport.curve_server_key (the nodes'); a group's is its ``aggregator_key``."""
    groups: list[dict] = field(default_factory=list)
    """The switch tier's groups, ``[[groups]]`` tables of the cluster file: ``ranks = "0-3"`` (a contiguous
    run) and ``aggregator = "tcp://host:port"``; a worker of those ranks talks through that aggregator
    (luwu.groups.aggregator_for) and ``luwu up`` starts it. Flags and env: ``0-3=tcp://h:p,...``."""

    def __post_init__(self) -> None:
        if not self.job or len(self.job) > 128:
            raise ConfigError(
                f"cluster.job must be a non-empty string of at most 128 chars, got {self.job!r}"
            )
        for a in self.nodes:
            if not isinstance(a, str) or "://" not in a:
                raise ConfigError(
                    f"cluster.nodes entries must be addresses like tcp://host:port, got {a!r}"
                )
        if self.capacities and len(self.capacities) != len(self.nodes):
            raise ConfigError(
                f"cluster.capacities has {len(self.capacities)} entries for {len(self.nodes)} nodes"
            )
        if any(not c > 0 for c in self.capacities):
            raise ConfigError(f"cluster.capacities must be positive, got {self.capacities}")
        if self.world_size < 0:
            raise ConfigError(f"cluster.world_size must be >= 0, got {self.world_size}")
        if self.aggregator and "://" not in self.aggregator:
            raise ConfigError(
                f"cluster.aggregator must be an address like tcp://host:port, got {self.aggregator!r}"
            )
        self.groups = checked_groups(self.groups, self.world_size)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The ``[optimizer]`` section: the algorithm the nodes run and when its updates reach the workers.

    Hyperparameters (``lr``, ``betas``...) are not settings of the tree: they are RemoteOptimizer's
    keywords and travel with every push from ``param_groups``, so schedulers keep working."""

    name: str = "adamw"
    """Optimizer the nodes run (luwu.switch_nodes.optimizers.kinds.OPTIMIZER_NAMES)."""
    delayed_update: bool = False
    """ZeRO-Offload's delayed parameter update: step t's forward runs on the weights of t-1."""
    delayed_update_warmup: int = 0
    """With delayed_update: steps (from 0) run in sync before the delay starts."""
    delayed_params: list[str] = field(default_factory=list)
    """With delayed_update: delay only the parameters whose names match one of these fnmatch patterns
    (empty: all). The first layers' round trip is the tail of a sync step: delaying only them (e.g.
    ``["embed*", "layers.0.*"]``) takes it off the critical path for a fraction of full delay's loss."""
    max_grad_norm: float = 0.0
    """Clip by the global norm of the averaged gradient across all shards (0 = off)."""
    layer_waits: bool = True
    """Resident mode: step() returns once the pushes are out, and each parameter waits for its new weights
    when it is next read, in the next forward when its layer runs (luwu.gpu_workers.layer_waits). False:
    step() waits for every bucket's new weights."""
    hold_replies: str = "auto"
    """Resident mode: ``always``: the nodes hold a step's new weights until this worker's ``step()`` (one small
    message to each node at its start, which travels behind the pushes already handed to ZeroMQ), so the
    worker never keeps a reply it may not write yet. ``never``: replies come as soon as the nodes have them
    and wait in the worker. ``auto``: always where replies come before ``step()``, on fast links
    (the slowest node link measured at connect, or the ``compression.link_gbps`` told, >= 10 Gbit/s:
    loopback, datacenter NICs); never on slower ones, where
    they come after it anyway and holding would only delay the first (luwu.switch_nodes.held_replies)."""
    grads_in_buckets: bool = True
    """Resident mode: a parameter's ``.grad`` is a view of its bucket's buffer once backward produced it, so the
    gradients exist once (DDP's gradient_as_bucket_view; luwu.gpu_workers.grad_views). False: ``.grad`` keeps
    autograd's tensor and the buckets hold a second copy."""
    stream_weights: bool = False
    """Streaming mode: the worker holds no weights of the streamed units between uses; it fetches each
    unit's weights from the nodes just before its forward and its backward (luwu.gpu_workers.streaming)."""
    stream_units: list[str] = field(default_factory=list)
    """With stream_weights: fnmatch patterns on module names or class names choosing the units (empty: the
    blocks of the largest nn.ModuleList / nn.Sequential). Parameters outside every unit stay resident."""
    stream_prefetch: int = 2
    """With stream_weights: how many units ahead the worker asks for weights."""
    stream_keep_for_backward: bool = False
    """With stream_weights: keep each unit's weights from its forward to its backward (FSDP2's
    reshard_after_forward=False): one fetch a step instead of two, for up to the whole model's fp32 weights
    held at the end of forward."""
    stream_hold_bytes: int = -1
    """With stream_weights: bytes of fetched weights, as they travelled (int8 with compression on), that a worker keeps
    from a unit's forward to its backward, so that backward writes them again instead of fetching them; units are
    kept in forward order while they fit. -1: max(1, stream_prefetch) x the largest unit's fp32 weights (as much as
    that many more units in flight); 0: every unit is fetched again for its backward."""
    stream_budget_bytes: int = 0
    """With stream_weights: the most one unit may take on a worker, its fp32 weights and gradient
    (8 B per parameter); a larger unit is refused at start, named with its size (0 = no limit)."""
    init_weights: str = ""
    """With stream_weights and a model built on the meta device: seed the nodes from these weights instead of
    reset_parameters(), one unit at a time: a torch state-dict file (read with mmap) or a
    torch.distributed.checkpoint folder (e.g. luwu.export_dcp's). Nodes that hold weights already keep them."""
    resume: bool = False
    """Continue the job from the step the nodes hold (restored from their checkpoints, or left by an earlier run):
    their weights and optimizer state go on. Without it, a worker meeting nodes that hold the job past step 0,
    with no other worker training it, is refused (JobExistsError): resuming is never silent. Nodes at step 0:
    a fresh start either way."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            why = UNSUPPORTED.get(self.name.lower())
            raise ConfigError(
                f"optimizer.name must be one of {', '.join(OPTIMIZER_NAMES)}, got {self.name!r}"
                + (f": {why}" if why else "")
            )
        if self.max_grad_norm < 0:
            raise ConfigError(f"optimizer.max_grad_norm must be >= 0, got {self.max_grad_norm}")
        if self.hold_replies not in HOLD_REPLIES:
            raise ConfigError(
                f"optimizer.hold_replies must be one of {HOLD_REPLIES}, got {self.hold_replies!r}"
            )
        if self.delayed_update_warmup < 0:  # the loader already made it an int, as every other key
            raise ConfigError(
                f"optimizer.delayed_update_warmup must be >= 0, got {self.delayed_update_warmup}"
            )
        if any(not isinstance(p, str) or not p for p in self.delayed_params):
            raise ConfigError(
                f"optimizer.delayed_params must be fnmatch patterns on parameter names, got {self.delayed_params!r}"
            )
        if self.delayed_params and not self.delayed_update:
            raise ConfigError(
                f"optimizer.delayed_params = {self.delayed_params} needs optimizer.delayed_update = true"
            )
        if self.stream_budget_bytes < 0:
            raise ConfigError(
                f"optimizer.stream_budget_bytes must be >= 0 (0 = no limit), got {self.stream_budget_bytes}"
            )
        if self.stream_hold_bytes < -1:
            raise ConfigError(
                f"optimizer.stream_hold_bytes must be >= 0, or -1 for the default, got {self.stream_hold_bytes}"
            )
        if self.stream_prefetch < 0:
            raise ConfigError(f"optimizer.stream_prefetch must be >= 0, got {self.stream_prefetch}")
        if any(not isinstance(p, str) or not p for p in self.stream_units):
            raise ConfigError(
                f"optimizer.stream_units must be fnmatch patterns on module names, got {self.stream_units!r}"
            )
        if self.stream_weights and self.delayed_update:
            raise ConfigError(
                "optimizer.stream_weights and optimizer.delayed_update cannot be combined: a streaming worker holds no weights to update late"
            )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """The ``[metrics]`` section: where a node serves ``/metrics`` and ``/healthz`` (and a worker its
    ``/metrics``, when ``RemoteOptimizer(metrics_port=...)`` asks for it)."""

    host: str = "127.0.0.1"
    """Address the /metrics (and, on nodes, /healthz) HTTP endpoint binds."""
    port: int = -1
    """Port of the endpoint: -1 = off, 0 = any free port (printed at start)."""

    def __post_init__(self) -> None:
        if not -1 <= self.port <= 65535:
            raise ConfigError(f"metrics.port must be -1 (off) or 0..65535, got {self.port}")


def _sections() -> dict[str, type]:
    from luwu.protocol.policy import CompressionConfig  # here: the policy module loads the codecs

    return {
        "cluster": ClusterConfig,
        "optimizer": OptimizerConfig,
        "transport": TransportConfig,
        "compression": CompressionConfig,
        "prefetch": PrefetchConfig,
        "metrics": MetricsConfig,
        "node": NodeConfig,
    }


@dataclass(kw_only=True)
class LuwuConfig:
    """The whole tree, one section per part, and where each value came from."""

    cluster: ClusterConfig
    optimizer: OptimizerConfig
    transport: TransportConfig
    compression: CompressionConfig
    prefetch: PrefetchConfig
    metrics: MetricsConfig
    node: NodeConfig
    sources: dict[str, str] = field(default_factory=dict)
    """'section.field' -> where its value came from (default, file path, env VAR, --flag, argument)."""

    def as_dict(self) -> dict:
        return {name: _to_plain(getattr(self, name)) for name in _sections()}

    def replace(self, settings: dict, source: str = "argument") -> LuwuConfig:
        """A copy with ``settings`` over this tree: ``{"section.field": value}`` sets one field (a string
        is parsed as from the environment), ``{"section": SectionConfig(...)}`` replaces a whole section.
        Whole sections apply first, so a field named too wins over its section. Each section touched is
        checked again; ``sources`` records ``source`` for what changed."""
        sections = _sections()
        built = {name: getattr(self, name) for name in sections}
        sources = dict(self.sources)
        fields: dict[str, dict] = {}
        for key, value in settings.items():
            section, dot, name = key.partition(".")
            if dot:
                fields.setdefault(section, {})[name] = _checked(section, name, value, source)
                sources[key] = source
                continue
            cls = sections.get(section)
            if cls is None:
                raise ConfigError(
                    f"unknown config section {section!r} (from {source}); sections are {sorted(sections)}"
                )
            if not isinstance(value, cls):
                raise ConfigError(
                    f"{section} must be a {cls.__name__}, got {type(value).__name__} (from {source})"
                )
            built[section] = value
            sources.update({f"{section}.{f.name}": source for f in dataclasses.fields(cls)})
        for section, values in fields.items():
            built[section] = _build(section, dataclasses.replace, built[section], **values)
        return LuwuConfig(**built, sources=sources)


def _to_plain(obj):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _checked(section: str, name: str, value, source: str):
    """``value`` for ``section.name`` in the field's type; unknown sections and keys are errors."""
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"unknown config section {section!r} (from {source}); sections are {sorted(sections)}"
        )
    fields = {f.name: f for f in dataclasses.fields(sections[section])}
    if name not in fields:
        raise ConfigError(
            f"unknown config key {section}.{name} (from {source}); {section} has {sorted(fields)}"
        )
    return _coerce(section, name, fields[name].type, value, source)


def _build(section: str, make, *args, **values):
    """``make(*args, **values)`` (a section's class, or ``dataclasses.replace``), its errors as ConfigError."""
    try:
        return make(*args, **values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{section}]: {exc}") from None


def _coerce(section: str, name: str, typ, value, source: str):
    """Turn a TOML / env / CLI value into the field's type; strings are parsed."""
    key = f"{section}.{name}"
    if key == "cluster.groups":
        return group_entries(value, source)
    typ = typing.get_type_hints(_sections()[section]).get(name, typ)
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ in (int, float):
            if isinstance(value, bool):
                raise ValueError
            if typ is int and isinstance(value, float):
                raise ValueError
            return typ(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if origin in (list, tuple):
            (inner,) = typing.get_args(typ)[:1] or (str,)
            items = value
            if isinstance(value, str):
                items = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(items, (list, tuple)):
                raise ValueError
            conv = []
            for v in items:
                if typing.get_origin(inner) in (list, tuple):
                    conv.append(list(v))
                else:
                    conv.append(inner(v) if not isinstance(v, inner) else v)
            return conv
        return value
    except (ValueError, TypeError):
        raise ConfigError(
            f"{key} = {value!r} (from {source}) is not a valid {getattr(typ, '__name__', typ)}"
        ) from None


#: Keyword arguments of RemoteOptimizer that are settings of the configuration tree.
KEYWORD_SETTINGS = {
    "optimizer": "optimizer.name",
    "nodes": "cluster.nodes",
    "capacities": "cluster.capacities",
    "world_size": "cluster.world_size",
    "job": "cluster.job",
    "aggregator": "cluster.aggregator",
    "mode": "node.mode",
    "delayed_update": "optimizer.delayed_update",
    "delayed_update_warmup": "optimizer.delayed_update_warmup",
    "delayed_params": "optimizer.delayed_params",
    "max_grad_norm": "optimizer.max_grad_norm",
    "layer_waits": "optimizer.layer_waits",
    "stream_weights": "optimizer.stream_weights",
    "stream_units": "optimizer.stream_units",
    "prefetch": "optimizer.stream_prefetch",
    "init_weights": "optimizer.init_weights",
    "resume": "optimizer.resume",
    "bucket_bytes": "transport.bucket_bytes",
    "timeout_s": "transport.timeout_s",
    "metrics_host": "metrics.host",
}


def keyword_settings(**kw) -> dict:
    """The ``LuwuConfig.replace`` settings that RemoteOptimizer's keyword arguments stand for (None:
    not given). ``transport`` and a ``CompressionConfig`` replace their section; ``compression=False``
    / ``True`` switch the section's policy off / on."""
    out: dict = {}
    transport, compression = kw.pop("transport", None), kw.pop("compression", None)
    if transport is not None:
        out["transport"] = transport
    if isinstance(compression, bool):
        out["compression.enabled"] = compression
    elif compression is not None:
        out["compression"] = compression
    for name, value in kw.items():
        if value is None:
            continue
        if name == "max_grad_norm" and not (isinstance(value, (int, float)) and value > 0):
            raise ConfigError(f"max_grad_norm must be > 0, got {value}")
        if name == "optimizer" and isinstance(value, str):
            value = value.lower()
        out[KEYWORD_SETTINGS[name]] = value
    return out


def resolve_config(
    config: LuwuConfig | None = None, *, env: dict | None = None, **keywords
) -> LuwuConfig:
    """The tree RemoteOptimizer runs on: ``config`` (default: defaults < ``LUWU_SECTION__FIELD`` of ``env``,
    default ``os.environ``) with the keyword arguments given over it; with no node configured, the
    comma-separated ``LUWU_NODES``."""
    env = os.environ if env is None else env
    base = config if config is not None else load_config(None, env=env)
    patterns = keywords.get("delayed_params")
    if isinstance(patterns, str):
        patterns = keywords["delayed_params"] = [
            v.strip() for v in patterns.split(",") if v.strip()
        ]
    delayed = keywords.get("delayed_update")
    if patterns and not (delayed if delayed is not None else base.optimizer.delayed_update):
        raise ConfigError(
            f"delayed_params={patterns} needs delayed_update=True"
        )  # in the caller's words
    cfg = base.replace(keyword_settings(**keywords))
    if not cfg.cluster.nodes:
        cfg = cfg.replace({"cluster.nodes": env.get("LUWU_NODES", "")}, "env LUWU_NODES")
    if not cfg.cluster.nodes:
        raise ConfigError(
            "no nodes: pass nodes=[...] (see luwu.local_cluster), set cluster.nodes or LUWU_NODES"
        )
    return cfg


def _file_settings(path: str):
    """(section, name, value) of every setting in the TOML cluster file ``path``."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"cluster file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"cluster file {path!r} is a folder, not a TOML file") from None
    except OSError as exc:  # permission denied, an I/O error: one line, never a traceback
        raise ConfigError(f"cluster file {path!r} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"cluster file {path!r} is not valid TOML: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file {path!r} is not valid TOML: {exc}") from None
    for section, table in data.items():
        if section == "groups" and isinstance(table, list):  # [[groups]]: cluster.groups
            yield "cluster", "groups", table
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
        for name, value in table.items():
            yield section, name, value


def load_config(
    path: str | list[str] | tuple[str, ...] | None = None,
    *,
    env: dict | None = None,
    argv: list[str] | None = None,
    overrides: dict | None = None,
) -> LuwuConfig:
    """Resolve the configuration: defaults < TOML files < LUWU_SECTION__FIELD env < --section.field=value.

    ``path`` is one cluster file or several, read in order, a later file's setting over an earlier
    one's: e.g. the shared cluster file, then a worker's own key file."""
    sections = _sections()
    values: dict[str, dict] = {s: {} for s in sections}
    sources: dict[str, str] = {}

    def put(section: str, name: str, value, source: str) -> None:
        values[section][name] = _checked(section, name, value, source)
        sources[f"{section}.{name}"] = source

    for one in [path] if isinstance(path, str) else list(path or ()):
        for section, name, value in _file_settings(one):
            put(section, name, value, one)
    for var, value in sorted((env if env is not None else os.environ).items()):
        if var.startswith("LUWU_") and "__" in var:
            section, _, name = var[5:].partition("__")
            put(section.lower(), name.lower(), value, f"env {var}")
    for name, value in (overrides or {}).items():
        section, _, fld = name.partition(".")
        put(section, fld, value, "argument")
    args = list(argv or [])
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a:
            raise ConfigError(f"unexpected argument {a!r}: settings are --section.field=value")
        key, eq, value = a[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"{a} needs a value")
            value = args[i + 1]
            i += 1
        section, _, fld = key.partition(".")
        put(section, fld, value, f"--{key}")
        i += 1
    built = {section: _build(section, cls, **values[section]) for section, cls in sections.items()}
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            sources.setdefault(f"{section}.{f.name}", "default")
    return LuwuConfig(**built, sources=sources)

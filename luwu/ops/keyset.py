"""CURVE key sets for a job, and keeping secrets out of files, logs and command lines.

A key set is one key pair for the nodes, one per worker rank, one for the
operator's tools (``luwu status``/``top``) and one per aggregator of the switch
tier; the nodes authorize the worker keys in rank order
(``node.curve_authorized_keys``: the i-th may only be rank i, on one connection
at a time), the operator key as a monitor's (``node.curve_monitor_keys``: it
asks STATS, holds little, never trains) and each aggregator's key for its
group's ranks (``node.curve_aggregator_keys``: it only relays them). An
aggregator serves its workers with its own pair and shows it to the nodes; the
workers of its group find its public key in their ``[[groups]]`` entry
(``aggregator_key``). ``luwu keys``, ``luwu up`` and the deploy recipes write it
as files that only their owner can read:

    node.toml           [node] keys: the node's pair, the workers', the monitor's and the aggregators' public keys
    node.env            the same as LUWU_NODE__* variables (for scripts, systemd, k8s)
    worker<r>.toml      [transport] keys of rank r (plus the cluster's settings when given)
    monitor.toml        [transport] keys of the operator's tools
    aggregator<i>.toml  [node] (to its workers) and [transport] (to the nodes) keys of aggregator i
    aggregator<i>.env   the same as LUWU_NODE__* / LUWU_TRANSPORT__* variables

A secret is any setting whose name contains ``secret``. Secrets reach a node
daemon through its environment, never its argv (which every local user can
read in ``ps``), and are replaced by ``<hidden>`` wherever a command line is
logged or saved.

Nothing here imports ZeroMQ at module level: the supervisor stays light.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from luwu.ops.rundir import write_atomic

HIDDEN = "<hidden>"
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
DEFAULT_WORKER_KEYS = 8
"""Worker key pairs ``luwu up`` makes when neither --workers nor cluster.world_size says how many."""


def is_secret(key: str) -> bool:
    """True for a setting ('node.curve_secret_key', 'LUWU_NODE__CURVE_SECRET_KEY') that holds a secret."""
    return "secret" in key.lower()


def is_loopback(address: str) -> bool:
    """True when a ZeroMQ bind address is reachable from this host only (loopback TCP, ipc, inproc)."""
    if not address.startswith("tcp://"):
        return True
    host = address.split("://", 1)[1].rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def argv_secret_warning(cfg) -> str:
    """A warning naming the secrets of ``cfg`` that came from --flags ('' when none did): while the
    program runs, every local user reads its command line (``ps``)."""
    flags = sorted(
        key for key, source in cfg.sources.items() if is_secret(key) and source.startswith("--")
    )
    if not flags:
        return ""
    return f"{', '.join(flags)} given on the command line, where every local user can read it: use --config FILE (mode 600) or LUWU_SECTION__FIELD variables"


def split_secrets(
    overrides: list[str], *, to_env: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """``--section.field=value`` flags as (the flags without secrets, the secrets as
    LUWU_SECTION__FIELD environment variables); the settings named in ``to_env`` go to the
    environment too."""
    public: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(overrides):
        token = overrides[i]
        key, eq, value = token[2:].partition("=")
        step = 1
        if not eq and i + 1 < len(overrides):
            value, step = overrides[i + 1], 2
        if is_secret(key) or key in to_env:
            section, _, name = key.partition(".")
            env[f"LUWU_{section.upper()}__{name.upper()}"] = value
        else:
            public += overrides[i : i + step]
        i += step
    return public, env


def redact_args(args: list[str]) -> list[str]:
    """A command line with the value of every secret flag replaced by ``<hidden>``."""
    out = list(args)
    for i, token in enumerate(out):
        if not token.startswith("--"):
            continue
        key, eq, _ = token[2:].partition("=")
        if not is_secret(key):
            continue
        if eq:
            out[i] = f"--{key}={HIDDEN}"
        elif i + 1 < len(out):
            out[i + 1] = HIDDEN
    return out


def env_file_text(values: dict[str, str]) -> str:
    """KEY='value' lines that a shell (``set -a; . FILE``), systemd's EnvironmentFile and
    :func:`read_env_file` all read the same (Z85 keys hold no quote)."""
    for key, value in values.items():
        if "'" in value or "\n" in value:
            raise ValueError(
                f"{key}: a value in an environment file cannot hold a quote or a newline"
            )
    return "".join(f"{key}='{value}'\n" for key, value in values.items())


def read_env_file(path: Path | str) -> dict[str, str]:
    """The variables of an environment file written by :func:`env_file_text`."""
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


@dataclass(frozen=True, slots=True)
class KeySet:
    """Z85 key pairs (public, secret) of one job."""

    node: tuple[str, str]
    workers: list[tuple[str, str]]
    """One pair per worker rank, in rank order."""
    monitor: tuple[str, str]
    """The operator's tools (``luwu status``, ``luwu top``)."""
    aggregators: list[tuple[str, tuple[str, str]]] = field(default_factory=list)
    """The switch tier: (the group's ranks ``FIRST-LAST``, its aggregator's pair), in group order."""

    @classmethod
    def generate(
        cls, num_workers: int, *, node: tuple[str, str] | None = None, groups: list[str] = ()
    ) -> KeySet:
        """New pairs for ``num_workers`` ranks, the monitor and the aggregator of each of ``groups``
        (their ranks, ``FIRST-LAST``); new node pair unless ``node`` is given."""
        return cls(
            node=node or _pair(),
            workers=[_pair() for _ in range(num_workers)],
            monitor=_pair(),
            aggregators=[(ranks, _pair()) for ranks in groups],
        )

    def node_settings(self) -> dict:
        """The [node] keys: the node's pair, the workers' public keys (in rank order), the monitor's,
        and each aggregator's for its group's ranks."""
        out = {
            "curve_public_key": self.node[0],
            "curve_secret_key": self.node[1],
            "curve_authorized_keys": [w[0] for w in self.workers],
            "curve_monitor_keys": [self.monitor[0]],
        }
        if self.aggregators:
            out["curve_aggregator_keys"] = self.aggregator_entries()
        return out

    def aggregator_entries(self) -> list[str]:
        """node.curve_aggregator_keys: ``FIRST-LAST=KEY`` per aggregator."""
        return [f"{ranks}={pair[0]}" for ranks, pair in self.aggregators]

    def aggregator_key(self, ranks: str) -> str:
        """The public key of the aggregator of ``ranks`` ('' when there is none)."""
        return next((pair[0] for r, pair in self.aggregators if r == ranks), "")

    def aggregator_settings(self, i: int, workers: list[str] | None = None) -> dict:
        """Aggregator ``i``'s sections: [node] its pair as its workers' server and the worker keys it
        lets in (``workers``, default this set's, in rank order), [transport] its pair to the nodes."""
        _, (public, secret) = self.aggregators[i]
        authorized = [w[0] for w in self.workers] if workers is None else list(workers)
        return {
            "node": {
                "curve_public_key": public,
                "curve_secret_key": secret,
                "curve_authorized_keys": authorized,
            },
            "transport": {"curve_server_key": self.node[0], **_client(public, secret)},
        }

    def aggregator_env(self, i: int, workers: list[str] | None = None) -> dict[str, str]:
        """Aggregator ``i``'s settings as LUWU_NODE__* and LUWU_TRANSPORT__* variables."""
        return {
            f"LUWU_{section.upper()}__{k.upper()}": ",".join(v) if isinstance(v, list) else v
            for section, table in self.aggregator_settings(i, workers).items()
            for k, v in table.items()
        }

    def node_env(self) -> dict[str, str]:
        """The node's settings as LUWU_NODE__* variables (lists comma-separated)."""
        return {
            f"LUWU_NODE__{k.upper()}": ",".join(v) if isinstance(v, list) else v
            for k, v in self.node_settings().items()
        }

    def client_settings(self, pair: tuple[str, str]) -> dict:
        """The [transport] keys of one client (a worker rank or the monitor)."""
        return {"curve_server_key": self.node[0], **_client(*pair)}


def aggregator_envs(cfg, keys: KeySet | None, count: int) -> list[dict[str, str]]:
    """The LUWU_* variables of each of ``count`` aggregators ``luwu up`` starts: with CURVE (``keys``),
    its own pair to its workers (the workers' keys let in: the key set's, else
    node.curve_authorized_keys) and to the nodes. Without, none (it reads the nodes' environment file:
    the join secret)."""
    if keys is None or not keys.aggregators:
        return [{} for _ in range(count)]
    workers = None if keys.workers else list(cfg.node.curve_authorized_keys)
    return [keys.aggregator_env(i, workers) for i in range(count)]


def _pair() -> tuple[str, str]:
    import zmq

    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def _client(public: str, secret: str) -> dict:
    return {"curve_public_key": public, "curve_secret_key": secret}


def with_aggregator_keys(groups: list[dict], keys: KeySet | None) -> list[dict]:
    """``[[groups]]`` tables with each group's ``aggregator_key`` from ``keys`` (where it has one)."""
    out = [dict(g) for g in groups]
    for g in out:
        key = keys.aggregator_key(g["ranks"]) if keys is not None else ""
        if key:
            g["aggregator_key"] = key
    return out


def _toml(sections: dict) -> str:
    from luwu.ops.cluster_file import dumps_sections  # here: cluster_file imports this module

    return dumps_sections(sections)


def _copied(shared: dict) -> dict:
    """A copy of a cluster file's sections: each [section] a dict of its own; an array of tables
    (``[[groups]]``) a list of them."""
    return {
        name: [dict(t) for t in table] if isinstance(table, list) else dict(table)
        for name, table in shared.items()
    }


def client_file_sections(keys: KeySet, pair: tuple[str, str], shared: dict | None) -> dict:
    """A client's whole file: the cluster's shared sections (if any) plus its own [transport] keys."""
    sections = _copied(shared or {})
    sections["transport"] = {**sections.get("transport", {}), **keys.client_settings(pair)}
    return sections


def write_keyset(
    out: Path | str, keys: KeySet, *, shared: dict | None = None, node_files: bool = True
) -> list[Path]:
    """Write the files of a key set into ``out`` (created 0700), each 0600; returns their paths.

    With ``shared`` (the sections of a cluster file), every worker file and the monitor file
    hold those settings too, so a worker needs a single ``--config`` (give ``shared`` the groups'
    ``aggregator_key``: :func:`with_aggregator_keys`). Without ``node_files``, node.toml, node.env and
    the aggregators' files are left out (``luwu up`` hands those keys over by itself).
    """
    import tomli_w

    out = _private_dir(out)
    files = (
        {
            "node.toml": tomli_w.dumps({"node": keys.node_settings()}),
            "node.env": env_file_text(keys.node_env()),
        }
        if node_files
        else {}
    )
    for rank, pair in enumerate(keys.workers):
        files[f"worker{rank}.toml"] = _toml(client_file_sections(keys, pair, shared))
    files["monitor.toml"] = _toml(client_file_sections(keys, keys.monitor, shared))
    for i in range(len(keys.aggregators) if node_files else 0):
        own = keys.aggregator_settings(i)
        sections = _copied(shared or {})
        for name, table in own.items():
            sections[name] = {**sections.get(name, {}), **table}
        files[f"aggregator{i}.toml"] = _toml(sections)
        files[f"aggregator{i}.env"] = env_file_text(keys.aggregator_env(i))
    return _write_private(out, files)


def write_join_files(out: Path | str, secret: str, shared: dict) -> list[Path]:
    """``join.toml`` (every worker rank's) and ``monitor.toml`` (``luwu status``/``top``): the cluster
    file's ``shared`` sections plus transport.join_secret, each 0600 in ``out`` (0700)."""

    sections = _copied(shared)
    sections["transport"] = {**sections.get("transport", {}), "join_secret": secret}
    text = _toml(sections)
    return _write_private(_private_dir(out), {"join.toml": text, "monitor.toml": text})


JOIN_FILE = "join.toml"
"""The file in a run dir's keys/ that holds the job's join secret for workers and tools."""


def job_join_secret(keys_dir: Path | str, job: str) -> tuple[str, Path, bool]:
    """The join secret of ``job`` kept in ``keys_dir``/join.toml: read when the file is there (it must be
    this user's and mode 600), else made (128 bits) and written there, mode 600 in a 0700 folder.
    Returns (secret, the file, whether it was made now). Nodes of one job started in the same run dir
    share it: the file is made at most once (an atomic link), whichever node comes first."""
    import secrets
    import tomllib

    import tomli_w

    from luwu.protocol.errors import ConfigError

    path = _private_dir(keys_dir) / JOIN_FILE
    made = False
    if not path.exists():
        tmp = path.with_name(f".{JOIN_FILE}.{os.getpid()}.tmp")
        write_atomic(
            tmp,
            tomli_w.dumps(
                {"cluster": {"job": job}, "transport": {"join_secret": secrets.token_hex(16)}}
            ),
            0o600,
        )
        try:
            os.link(tmp, path)
            made = True
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"{path} holds the job's join secret but is {'not yours' if st.st_uid != os.geteuid() else f'mode {st.st_mode & 0o777:o}'}: "
            "another user may have read or planted it; remove it (a new secret is made) or chmod 600 it if it is yours"
        )
    try:
        secret = tomllib.loads(path.read_text())["transport"]["join_secret"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} should hold [transport] join_secret, and cannot be read ({exc}): remove it and a new secret is made"
        ) from None
    return secret, path, made


def _private_dir(out: Path | str) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(out, 0o700)
    return out


def _write_private(out: Path, files: dict[str, str]) -> list[Path]:
    paths = []
    for name, text in files.items():
        write_atomic(out / name, text, 0o600)
        paths.append(out / name)
    return paths

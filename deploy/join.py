"""One join secret for a job whose nodes run without CURVE keys, made by the deploy launchers.

    python -m luwu.deploy.join KEYS_DIR CLUSTER_FILE

A node without CURVE keys asks every connection for the job's join secret. ``luwu node`` alone
makes one in its own run dir: nodes on several hosts would each make a different one, and no
worker could join them all. A launcher (``ssh/launch.sh``, ``slurm/luwu.sbatch`` with
LUWU_INSECURE_PUBLIC_BIND=1) runs this once for the job instead and hands the same secret to every
node. It writes, each mode 600 in KEYS_DIR (mode 700):

    node.env      LUWU_NODE__JOIN_SECRET, read by every node's shell (never on its command line)
    join.toml     the cluster file plus transport.join_secret: every worker rank's --config
    monitor.toml  the same, for ``luwu status`` / ``luwu top``

The secret is node.join_secret when the environment sets it (LUWU_NODE__JOIN_SECRET), else the
one in KEYS_DIR/join.toml from an earlier start (a restart keeps the workers' files valid), else a
new one (128 bits). A KEYS_DIR that holds CURVE keys (``luwu keys``: node.toml, worker<r>.toml) is
refused rather than mixed with a secret: nodes with keys need none.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from luwu.config import load_config
from luwu.ops.keyset import env_file_text, job_join_secret, write_join_files
from luwu.ops.rundir import NODE_ENV_FILE, write_atomic
from luwu.protocol.errors import ConfigError

__all__ = ["write_job_join_files"]


def write_job_join_files(keys_dir: Path | str, cluster_file: Path | str) -> tuple[str, list[Path]]:
    """Make or reuse the job's join secret and write node.env, join.toml and monitor.toml into
    ``keys_dir``; returns (the secret, the files written)."""
    keys_dir = Path(keys_dir)
    # validates the file, and a LUWU_NODE__JOIN_SECRET of the environment
    cfg = load_config(str(cluster_file))
    shared = tomllib.loads(Path(cluster_file).read_text())
    if not shared.get("cluster", {}).get("nodes"):
        raise ConfigError(
            f"{cluster_file} lists no [cluster] nodes: give the job's cluster file, which workers read"
        )
    curve = sorted(
        f.name for f in (keys_dir / "node.toml", *keys_dir.glob("worker*.toml")) if f.exists()
    )
    if curve:
        raise ConfigError(
            f"{keys_dir} holds CURVE keys ({', '.join(curve)}): nodes with keys need no join secret; "
            "write the join secret into another folder, or remove those files if the keys are no longer used"
        )
    secret = cfg.node.join_secret or job_join_secret(keys_dir, cfg.cluster.job)[0]
    files = write_join_files(keys_dir, secret, shared)
    write_atomic(keys_dir / NODE_ENV_FILE, env_file_text({"LUWU_NODE__JOIN_SECRET": secret}), 0o600)
    return secret, [*files, keys_dir / NODE_ENV_FILE]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m luwu.deploy.join KEYS_DIR CLUSTER_FILE", file=sys.stderr)
        return 2
    try:
        _, files = write_job_join_files(args[0], args[1])
    except ConfigError as exc:
        print(f"luwu.deploy.join: error: {exc}", file=sys.stderr)
        return 1
    names = ", ".join(f.name for f in files)
    print(
        f"join secret of the job in {args[0]} ({names}, mode 600): nodes read node.env, workers use --config {files[0]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

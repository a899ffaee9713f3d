"""The run directory of a local cluster, and the pid files in it.

``luwu up`` writes the plan, the supervisor writes what it sees, ``luwu down``,
``luwu status`` and ``luwu top`` read it. Layout (default ``./.luwu-run/<job>/``)::

    plan.json         what the supervisor runs (written by up; secrets as <hidden>)
    node.env          secrets for the nodes, as LUWU_SECTION__FIELD variables (only when there are any)
    state.json        what the supervisor sees: pid, address, restarts of each node
    supervisor.pid    supervisor.log
    node-<i>.pid      node-<i>.log   (the daemon's stdout and stderr; kept across restarts)
    aggregator-<i>.pid  aggregator-<i>.log   (the switch tier: one per group of cluster.groups)
    cluster.toml      [cluster] job, nodes = [...] and the settings given to up; no secret
    keys/             the job's CURVE keys when up made them: worker<r>.toml (one per rank), monitor.toml
    targets.json      Prometheus file_sd_configs targets of the nodes' /metrics

The folder is mode 0700 and every file but the pid files, cluster.toml and
targets.json 0600: a run's keys, logs and plan are its owner's alone.

Nothing here imports torch or ZeroMQ: the supervisor and ``luwu down`` stay light.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

RUN_ROOT = ".luwu-run"
CLUSTER_FILE = "cluster.toml"
STATE_FILE = "state.json"
PLAN_FILE = "plan.json"
NODE_ENV_FILE = "node.env"
KEYS_DIR = "keys"
SUPERVISOR_PID = "supervisor.pid"
SUPERVISOR_LOG = "supervisor.log"


def default_run_dir(job: str) -> str:
    """Where ``luwu up`` keeps the files of ``job`` unless told otherwise."""
    return os.path.join(RUN_ROOT, job)


def node_log(run_dir: Path, index: int) -> Path:
    return run_dir / f"node-{index}.log"


def node_pid_file(run_dir: Path, index: int) -> Path:
    return run_dir / f"node-{index}.pid"


def daemon_log(run_dir: Path, index: int, kind: str = "node") -> Path:
    """``node-<i>.log``, or ``aggregator-<i>.log`` for the switch tier's aggregator i."""
    return run_dir / f"{kind}-{index}.log"


def daemon_pid_file(run_dir: Path, index: int, kind: str = "node") -> Path:
    return run_dir / f"{kind}-{index}.pid"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (dead, not yet reaped: e.g. an orphan under a PID 1 that
    does not reap) counts as dead; if it is our own child it is reaped here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    if state in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


def is_luwu(pid: int) -> bool:
    """Guards against a stale pid file whose pid now belongs to another program."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"luwu" in fh.read()
    except OSError:
        return pid_alive(pid)  # no /proc: trust the pid file


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def supervisor_running(run_dir: Path) -> int | None:
    """The pid of the run dir's supervisor while it runs, else None."""
    pid = read_pid(run_dir / SUPERVISOR_PID)
    return pid if pid is not None and pid_alive(pid) and is_luwu(pid) else None


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Readers see the old file or the new one, never half of one; the file has ``mode``
    (0600 unless said otherwise: only the owner reads a run's files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as fh:
            fd = -1
            fh.write(text)
    finally:
        if fd >= 0:
            os.close(fd)
    os.replace(tmp, path)


def open_log(path: Path):
    """A log file for appending, created 0600 (a node's log may name its peers and settings)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and its parents) with mode 0700; an existing run dir is made 0700 too."""
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(run_dir, 0o700)


def read_state(run_dir: Path) -> dict | None:
    """The supervisor's ``state.json``, or None when there is none (yet) or it is unreadable."""
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_state(run_dir: Path, state: dict) -> None:
    write_atomic(run_dir / STATE_FILE, json.dumps(state, indent=2))


def tail(path: Path, num_lines: int = 20) -> str:
    """The last lines of a log, for error messages."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(lines[-num_lines:]) or "(empty)"


def exit_text(rc: int) -> str:
    """A process's return code in words: 'exit code 1', 'signal SIGKILL'."""
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"

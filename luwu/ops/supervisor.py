"""The supervisor: parent of the node daemons of one run directory.

``luwu up`` writes a :class:`Plan` into the run directory and starts one
supervisor, detached from the shell. The supervisor starts every node daemon and
is their parent, so it sees a death at once, without polling pids that may be
reused; it writes their pid files and ``state.json`` and restarts a daemon that
dies, with an exponential backoff. On SIGTERM it stops its daemons (SIGTERM,
wait, SIGKILL) and leaves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from luwu.ops.keyset import read_env_file, redact_args
from luwu.ops.rundir import (
    PLAN_FILE,
    SUPERVISOR_PID,
    daemon_log,
    daemon_pid_file,
    exit_text,
    open_log,
    write_atomic,
    write_state,
)
from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.lines import METRICS_LINE, READY_LINE

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class NodeSpec:
    index: int
    """Position in the cluster's node list."""
    args: list[str]
    """The daemon's command line, less --node.bind and --metrics.port (the supervisor adds them).
    Never a secret: those reach the daemon through its environment (:attr:`Plan.env_file`)."""
    bind: str
    """Address to bind; port 0 on the first start only: restarts reuse the bound address."""
    metrics_port: int
    """Port of /metrics: -1 off, 0 any (restarts reuse the bound port)."""
    kind: str = "node"
    """``node``, or ``aggregator`` (the switch tier: started once every node is up, with
    --cluster.nodes their addresses)."""
    ranks: str = ""
    """An aggregator's worker ranks, FIRST-LAST."""
    env_file: str = ""
    """This daemon's own environment file (mode 0600, relative to the run dir), read instead of
    :attr:`Plan.env_file`: an aggregator's CURVE keys, which must not be the nodes'."""

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index}"


@dataclass(kw_only=True, slots=True)
class Plan:
    job: str
    cwd: str
    """Working directory of the daemons (relative paths in the config resolve against it)."""
    nodes: list[NodeSpec]
    backoff_s: float = 0.5
    """First restart delay; doubles with each quick death, up to max_backoff_s."""
    max_backoff_s: float = 30.0
    stable_s: float = 30.0
    """A daemon that ran this long before dying restarts after backoff_s again."""
    stop_timeout_s: float = 30.0
    """SIGTERM to SIGKILL: long enough for the checkpoint a node writes on SIGTERM."""
    env_file: str = ""
    """An environment file (mode 0600, relative to the run dir) whose LUWU_SECTION__FIELD variables
    every daemon gets: the secrets (CURVE keys), kept out of argv, this plan and the logs."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    aggregators: list[NodeSpec] = dataclasses.field(default_factory=list)
    """The switch tier's aggregators, one per group of cluster.groups (``luwu aggregator``)."""
    """What ``up`` warned about when it started the run (checkpoints off, no encryption): ``luwu status`` repeats it."""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("a cluster needs at least one node")
        for name in ("backoff_s", "max_backoff_s", "stable_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    def save(self, path: Path) -> None:
        """Write the plan (0600), any secret flag of a command line as <hidden>."""
        data = dataclasses.asdict(self)
        for node in [*data["nodes"], *data["aggregators"]]:
            node["args"] = redact_args(node["args"])
        write_atomic(path, json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        data["nodes"] = [NodeSpec(**n) for n in data["nodes"]]
        data["aggregators"] = [NodeSpec(**n) for n in data.get("aggregators", [])]
        return cls(**data)


@dataclass(slots=True)
class _Daemon:
    spec: NodeSpec
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting | up | backoff | failed | exited | stopped
    pid: int | None = None
    address: str = ""
    metrics_url: str = ""
    restarts: int = 0
    quick_deaths: int = 0
    ever_ready: bool = False
    started_at: float = 0.0
    next_start_at: float = 0.0
    log_offset: int = 0
    partial: bytes = b""
    last_exit: str = ""


class Supervisor:
    """Parent of the node daemons of one run dir; restarts the ones that die."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.plan = Plan.load(run_dir / PLAN_FILE)
        self.daemons = [_Daemon(spec) for spec in [*self.plan.nodes, *self.plan.aggregators]]
        for d in self.daemons:
            if d.spec.kind == "aggregator":
                d.state = "waiting"  # for the nodes' addresses
        self.stopping = False

    def log_path(self, d: _Daemon) -> Path:
        return daemon_log(self.run_dir, d.spec.index, d.spec.kind)

    def pid_path(self, d: _Daemon) -> Path:
        return daemon_pid_file(self.run_dir, d.spec.index, d.spec.kind)

    def _start(self, d: _Daemon) -> None:
        bind = d.address or d.spec.bind
        mport = d.spec.metrics_port
        if d.metrics_url:
            mport = int(d.metrics_url.rsplit(":", 1)[1])
        cmd = [*d.spec.args, "--node.bind", bind, "--metrics.port", str(mport)]
        path = self.log_path(d)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env_file = d.spec.env_file or self.plan.env_file
        if env_file:  # read at every start: the file may have been rotated since
            env.update(read_env_file(self.run_dir / env_file))
        if d.spec.kind == "aggregator":
            nodes = ",".join(n.address for n in self.daemons if n.spec.kind == "node")
            cmd = [*d.spec.args, "--cluster.nodes", nodes, "--node.bind", bind]
            cmd += ["--metrics.port", str(mport)]
            if env.get("LUWU_NODE__JOIN_SECRET"):  # it asks its workers for it, shows it the nodes
                env.setdefault("LUWU_TRANSPORT__JOIN_SECRET", env["LUWU_NODE__JOIN_SECRET"])
        with open_log(path) as fh:
            what = f"restart #{d.restarts}" if d.restarts else "start"
            fh.write(
                f"---- luwu supervisor: {what} of {d.spec.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(redact_args(cmd))}\n".encode()
            )
            fh.flush()
            d.log_offset = fh.tell()
            d.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=self.plan.cwd,
                env=env,
                start_new_session=True,
            )
        d.partial = b""
        d.pid = d.proc.pid
        d.state = "starting"
        d.started_at = time.monotonic()
        write_atomic(self.pid_path(d), f"{d.pid}\n", 0o644)
        log.info("%s: started pid %d (%s)", d.spec.name, d.pid, what)

    def _scan_log(self, d: _Daemon) -> None:
        """Read what the daemon printed since its start, looking for the READY lines."""
        try:
            with open(self.log_path(d), "rb") as fh:
                fh.seek(d.log_offset)
                data = fh.read(1 << 20)
        except OSError:
            return
        d.log_offset += len(data)
        *lines, d.partial = (d.partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line.startswith(METRICS_LINE):
                d.metrics_url = line.split()[1]
            elif line.startswith(READY_LINE):
                d.address = line.split()[1]
                d.state = "up"
                d.ever_ready = True
                log.info(
                    "%s: up at %s (pid %d)%s",
                    d.spec.name,
                    d.address,
                    d.pid,
                    f", metrics {d.metrics_url}" if d.metrics_url else "",
                )

    def _on_exit(self, d: _Daemon, rc: int) -> None:
        ran_s = time.monotonic() - d.started_at
        d.proc = None
        d.last_exit = f"{exit_text(rc)} after {ran_s:.1f} s"
        self.pid_path(d).unlink(missing_ok=True)
        if not d.ever_ready:
            d.state = "failed"
            log.error(
                "%s (pid %d): %s before it was ready; not restarting (see %s)",
                d.spec.name,
                d.pid,
                d.last_exit,
                self.log_path(d),
            )
            return
        if rc == 0:
            d.state = "exited"
            log.warning(
                "%s (pid %d) exited cleanly after %.1f s (stopped by someone); not restarting",
                d.spec.name,
                d.pid,
                ran_s,
            )
            return
        d.quick_deaths = d.quick_deaths + 1 if ran_s < self.plan.stable_s else 1
        delay = min(self.plan.max_backoff_s, self.plan.backoff_s * 2 ** (d.quick_deaths - 1))
        d.restarts += 1
        d.state = "backoff"
        d.next_start_at = time.monotonic() + delay
        log.warning(
            "%s (pid %d) died: %s; restart #%d in %.1f s",
            d.spec.name,
            d.pid,
            d.last_exit,
            d.restarts,
            delay,
        )

    def state(self) -> dict:
        rows = {"node": [], "aggregator": []}
        for d in self.daemons:
            row = {
                "index": d.spec.index,
                "state": d.state,
                "pid": d.pid if d.proc is not None else None,
                "address": d.address,
                "metrics_url": d.metrics_url,
                "restarts": d.restarts,
                "last_exit": d.last_exit,
            }
            if d.spec.kind == "aggregator":
                row["ranks"] = d.spec.ranks
            rows[d.spec.kind].append(row)
        return {
            "job": self.plan.job,
            "supervisor_pid": os.getpid(),
            "stopping": self.stopping,
            "nodes": rows["node"],
            "aggregators": rows["aggregator"],
        }

    def _save_state(self) -> None:
        write_state(self.run_dir, self.state())

    def _stop_all(self) -> None:
        live = [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]
        for d in live:
            log.info("%s: SIGTERM to pid %d", d.spec.name, d.pid)
            d.proc.terminate()
        deadline = time.monotonic() + self.plan.stop_timeout_s
        for d in live:
            try:
                d.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s: no exit %.0f s after SIGTERM; SIGKILL to pid %d",
                    d.spec.name,
                    self.plan.stop_timeout_s,
                    d.pid,
                )
                d.proc.kill()
                d.proc.wait()
        for d in self.daemons:
            if d.proc is not None:
                d.last_exit = exit_text(d.proc.returncode)
                d.proc = None
            if d.state not in ("failed", "exited", "waiting"):
                d.state = "stopped"
            self.pid_path(d).unlink(missing_ok=True)

    def _nodes_bound(self) -> bool:
        """Every node has printed its address once (an aggregator is told them all at its start;
        a restarted node binds the same one)."""
        return all(d.address for d in self.daemons if d.spec.kind == "node")

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        write_atomic(self.run_dir / SUPERVISOR_PID, f"{os.getpid()}\n", 0o644)
        log.info(
            "supervisor of job %r (pid %d): %d nodes, %d aggregators",
            self.plan.job,
            os.getpid(),
            len(self.plan.nodes),
            len(self.plan.aggregators),
        )
        try:
            for d in self.daemons:
                if d.state != "waiting":
                    self._start(d)
            self._save_state()
            while not self.stopping:
                before = json.dumps(self.state())
                for d in self.daemons:
                    if self.stopping:
                        break
                    if d.proc is None:
                        if d.state == "backoff" and time.monotonic() >= d.next_start_at:
                            self._start(d)
                        elif d.state == "waiting" and self._nodes_bound():
                            self._start(d)
                        continue
                    if d.state == "starting":
                        self._scan_log(d)
                    rc = d.proc.poll()
                    if rc is not None:
                        self._scan_log(d)
                        self._on_exit(d, rc)
                if json.dumps(self.state()) != before:
                    self._save_state()
                time.sleep(0.1)
        finally:
            log.info("supervisor stopping: %d nodes", sum(d.proc is not None for d in self.daemons))
            self.stopping = True
            self._stop_all()
            self._save_state()
            (self.run_dir / SUPERVISOR_PID).unlink(missing_ok=True)
            log.info("supervisor stopped")
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m luwu.ops.supervisor RUN_DIR``: detach once more, then supervise RUN_DIR."""
    (run_dir,) = sys.argv[1:] if argv is None else argv
    if os.fork():  # the parent (started by `up`, which waits for it) leaves at once:
        os._exit(0)  # the supervisor is reparented and never becomes a zombie of `up`
    logging.basicConfig(
        stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        return Supervisor(Path(run_dir)).run()
    except Exception:
        log.exception("supervisor failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())

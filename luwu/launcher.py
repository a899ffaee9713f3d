"""``luwu up`` / ``luwu down``: a local cluster of node daemons in the background.

``up`` writes a plan into a run directory and starts ONE supervisor process
(detached: its own session, reparented away from the shell). The supervisor
starts every node daemon, is their parent (so it sees a death at once, without
polling pids that may be reused), writes their pid files and a ``state.json``,
and restarts a daemon that dies with an exponential backoff. ``up`` waits until
every node printed its READY line, then writes ``cluster.toml`` (the resolved
cluster file that training scripts and ``luwu status`` point at) and
``targets.json`` (Prometheus file_sd targets of the nodes' /metrics).

``down`` stops the supervisor first (so nothing it stops is restarted), which
stops its daemons (SIGTERM, wait, SIGKILL); then it makes sure of every pid
file itself, in case the supervisor was killed.

Run directory layout (default ``./.luwu-run/<job>/``)::

    plan.json         what the supervisor runs (written by up)
    state.json        what the supervisor sees: pid, address, restarts of each node
    supervisor.pid    supervisor.log
    node-<i>.pid      node-<i>.log   (the daemon's stdout and stderr; kept across restarts)
    cluster.toml      [cluster] job, nodes = [...] and the settings given to up
    targets.json      Prometheus file_sd_configs targets of the nodes' /metrics
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

from luwu.protocol.errors import ConfigError, LuwuError

log = logging.getLogger(__name__)

READY_LINE = "LUWU_NODE_READY"  # switch_nodes.server.READY_LINE; not imported so the supervisor stays light
METRICS_LINE = "LUWU_METRICS_READY"  # switch_nodes.daemon.METRICS_LINE
RUN_ROOT = ".luwu-run"
# Settings that differ per node: never copied into the shared cluster.toml.
PER_NODE_KEYS = ("node.bind", "node.index", "metrics.port")


def default_run_dir(job: str) -> str:
    return os.path.join(RUN_ROOT, job)


# ----------------------------------------------------------------- processes and pid files


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


def _is_luwu(pid: int) -> bool:
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tail(path: Path, num_lines: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(lines[-num_lines:]) or "(empty)"


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


# ----------------------------------------------------------------- the plan (up -> supervisor)


@dataclass(kw_only=True, slots=True)
class NodeSpec:
    index: int
    """Position in the cluster's node list."""
    args: list[str]
    """The daemon's command line, less --node.bind and --metrics.port (the supervisor adds them)."""
    bind: str
    """Address to bind; port 0 on the first start only: restarts reuse the bound address."""
    metrics_port: int
    """Port of /metrics: -1 off, 0 any (restarts reuse the bound port)."""


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

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("a cluster needs at least one node")
        for name in ("backoff_s", "max_backoff_s", "stable_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    def save(self, path: Path) -> None:
        _write_atomic(path, json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        data["nodes"] = [NodeSpec(**n) for n in data["nodes"]]
        return cls(**data)


# ----------------------------------------------------------------- the supervisor


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
        self.plan = Plan.load(run_dir / "plan.json")
        self.daemons = [_Daemon(spec) for spec in self.plan.nodes]
        self.stopping = False

    def log_path(self, d: _Daemon) -> Path:
        return self.run_dir / f"node-{d.spec.index}.log"

    def pid_path(self, d: _Daemon) -> Path:
        return self.run_dir / f"node-{d.spec.index}.pid"

    def _start(self, d: _Daemon) -> None:
        bind = d.address or d.spec.bind
        mport = d.spec.metrics_port
        if d.metrics_url:
            mport = int(d.metrics_url.rsplit(":", 1)[1])
        cmd = [*d.spec.args, "--node.bind", bind, "--metrics.port", str(mport)]
        path = self.log_path(d)
        with open(path, "ab") as fh:
            what = f"restart #{d.restarts}" if d.restarts else "start"
            fh.write(f"---- luwu supervisor: {what} of node {d.spec.index} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n".encode())
            fh.flush()
            d.log_offset = fh.tell()
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            d.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, cwd=self.plan.cwd, env=env, start_new_session=True)
        d.partial = b""
        d.pid = d.proc.pid
        d.state = "starting"
        d.started_at = time.monotonic()
        _write_atomic(self.pid_path(d), f"{d.pid}\n")
        log.info("node %d: started pid %d (%s)", d.spec.index, d.pid, what)

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
                log.info("node %d: up at %s (pid %d)%s", d.spec.index, d.address, d.pid, f", metrics {d.metrics_url}" if d.metrics_url else "")

    def _on_exit(self, d: _Daemon, rc: int) -> None:
        ran_s = time.monotonic() - d.started_at
        d.proc = None
        d.last_exit = f"{_exit_text(rc)} after {ran_s:.1f} s"
        self.pid_path(d).unlink(missing_ok=True)
        if not d.ever_ready:
            d.state = "failed"
            log.error("node %d (pid %d): %s before it was ready; not restarting (see %s)", d.spec.index, d.pid, d.last_exit, self.log_path(d))
            return
        if rc == 0:
            d.state = "exited"
            log.warning("node %d (pid %d) exited cleanly after %.1f s (stopped by someone); not restarting", d.spec.index, d.pid, ran_s)
            return
        d.quick_deaths = d.quick_deaths + 1 if ran_s < self.plan.stable_s else 1
        delay = min(self.plan.max_backoff_s, self.plan.backoff_s * 2 ** (d.quick_deaths - 1))
        d.restarts += 1
        d.state = "backoff"
        d.next_start_at = time.monotonic() + delay
        log.warning("node %d (pid %d) died: %s; restart #%d in %.1f s", d.spec.index, d.pid, d.last_exit, d.restarts, delay)

    def state(self) -> dict:
        return {
            "job": self.plan.job,
            "supervisor_pid": os.getpid(),
            "stopping": self.stopping,
            "nodes": [
                {"index": d.spec.index, "state": d.state, "pid": d.pid if d.proc is not None else None, "address": d.address, "metrics_url": d.metrics_url, "restarts": d.restarts, "last_exit": d.last_exit}
                for d in self.daemons
            ],
        }

    def _save_state(self) -> None:
        _write_atomic(self.run_dir / "state.json", json.dumps(self.state(), indent=2))

    def _stop_all(self) -> None:
        live = [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]
        for d in live:
            log.info("node %d: SIGTERM to pid %d", d.spec.index, d.pid)
            d.proc.terminate()
        deadline = time.monotonic() + self.plan.stop_timeout_s
        for d in live:
            try:
                d.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("node %d: no exit %.0f s after SIGTERM; SIGKILL to pid %d", d.spec.index, self.plan.stop_timeout_s, d.pid)
                d.proc.kill()
                d.proc.wait()
        for d in self.daemons:
            if d.proc is not None:
                d.last_exit = _exit_text(d.proc.returncode)
                d.proc = None
            if d.state not in ("failed", "exited"):
                d.state = "stopped"
            self.pid_path(d).unlink(missing_ok=True)

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        _write_atomic(self.run_dir / "supervisor.pid", f"{os.getpid()}\n")
        log.info("supervisor of job %r (pid %d): %d nodes", self.plan.job, os.getpid(), len(self.daemons))
        try:
            for d in self.daemons:
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
            (self.run_dir / "supervisor.pid").unlink(missing_ok=True)
            log.info("supervisor stopped")
        return 0


def _supervise_main(run_dir: str) -> int:
    """Entry of the supervisor process: detach once more, then supervise."""
    if os.fork():  # the parent (started by `up`, which waits for it) leaves at once:
        os._exit(0)  # the supervisor is reparented and never becomes a zombie of `up`
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return Supervisor(Path(run_dir)).run()
    except Exception:
        log.exception("supervisor failed")
        return 1


# ----------------------------------------------------------------- up


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} ({type(v).__name__}) into a TOML cluster file")


def cluster_file_text(cfg, nodes: list[str], *, header: str = "") -> str:
    """[cluster] with the bound node addresses, plus every setting given to ``up`` that is shared
    by nodes and workers (file, env, flags: not the defaults, not the per-node ones)."""
    sections: dict[str, dict] = {"cluster": {"job": cfg.cluster.job, "nodes": nodes}}
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
    out = [f"# {line}" for line in header.splitlines()]
    for section, table in sections.items():
        out += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(out).lstrip("\n") + "\n"


def _plan_nodes(args, cfg, rest: list[str]) -> list[NodeSpec]:
    if args.nodes is not None or not cfg.cluster.nodes:
        num = 2 if args.nodes is None else args.nodes
        if num < 1:
            raise ConfigError(f"--nodes must be >= 1, got {num}")
        if args.base_port < 0 or args.base_port + num - 1 > 65535:
            raise ConfigError(f"--base-port must be 0 (any free port) or leave room for {num} ports, got {args.base_port}")
        binds = [f"tcp://{args.host}:{args.base_port + i if args.base_port else 0}" for i in range(num)]
    else:
        binds = list(cfg.cluster.nodes)
    mbase = args.metrics_port
    if mbase is None:
        mbase = cfg.metrics.port if cfg.sources.get("metrics.port", "default") != "default" else 0
    if mbase < -1 or mbase + len(binds) - 1 > 65535:
        raise ConfigError(f"--metrics-port must be -1 (off), 0 (any free port) or a base port leaving room for {len(binds)} nodes, got {mbase}")
    base = [sys.executable, "-m", "luwu", "-v", "node"]
    if args.config:
        base += ["--config", os.path.abspath(args.config)]
    return [
        NodeSpec(index=i, args=[*base, *rest, "--node.index", str(i), "--cluster.job", cfg.cluster.job], bind=b, metrics_port=mbase if mbase <= 0 else mbase + i)
        for i, b in enumerate(binds)
    ]


def _log_of(run_dir: Path, index: int) -> Path:
    return run_dir / f"node-{index}.log"


def _read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _wait_ready(run_dir: Path, num: int, timeout_s: float, console) -> tuple[dict | None, str]:
    """Until every node is up: (state, '') or (last state, why not)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + timeout_s
    state = None
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("starting nodes", total=num)
        while True:
            state = _read_state(run_dir) or state
            nodes = (state or {}).get("nodes", [])
            progress.update(task, completed=sum(n["state"] == "up" for n in nodes))
            failed = [n for n in nodes if n["state"] in ("failed", "exited")]
            if failed:
                n = failed[0]
                return state, f"node {n['index']} {n['last_exit'] or 'exited'} before printing {READY_LINE}; its log {_log_of(run_dir, n['index'])} ends with:\n{tail(_log_of(run_dir, n['index']))}"
            if len(nodes) == num and all(n["state"] == "up" for n in nodes):
                return state, ""
            pid = read_pid(run_dir / "supervisor.pid")
            if state is not None and (pid is None or not pid_alive(pid)):
                return state, f"the supervisor died; {run_dir / 'supervisor.log'} ends with:\n{tail(run_dir / 'supervisor.log')}"
            if time.monotonic() > deadline:
                waiting = [n for n in nodes if n["state"] != "up"] or [{"index": i} for i in range(num)]
                logs = "\n".join(f"--- node {n['index']} ({_log_of(run_dir, n['index'])}):\n{tail(_log_of(run_dir, n['index']), 10)}" for n in waiting)
                return state, f"nodes {[n['index'] for n in waiting]} not ready within {timeout_s:g} s (--timeout):\n{logs}"
            time.sleep(0.1)


def _supervisor_running(run_dir: Path) -> int | None:
    pid = read_pid(run_dir / "supervisor.pid")
    return pid if pid is not None and pid_alive(pid) and _is_luwu(pid) else None


def cmd_up(args, rest: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from luwu.config import load_config

    console, err = Console(), Console(stderr=True)
    for name in ("timeout", "stop_timeout"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    cfg = load_config(args.config, argv=rest)
    job = cfg.cluster.job
    run_dir = Path(args.run_dir or default_run_dir(job)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = _supervisor_running(run_dir)
    if pid is not None:
        raise LuwuError(f"job {job!r} is already up in {run_dir} (supervisor pid {pid}): `luwu down --run-dir {run_dir}` first")
    plan = Plan(job=job, cwd=os.getcwd(), nodes=_plan_nodes(args, cfg, rest), stop_timeout_s=args.stop_timeout)
    for stale in ("state.json", "cluster.toml", "targets.json", *(p.name for p in run_dir.glob("node-*.pid"))):
        (run_dir / stale).unlink(missing_ok=True)
    for i in range(len(plan.nodes)):  # keep the previous run's log for a post-mortem
        logf = run_dir / f"node-{i}.log"
        if logf.exists():
            os.replace(logf, logf.with_suffix(".log.prev"))
    plan.save(run_dir / "plan.json")
    with open(run_dir / "supervisor.log", "ab") as fh:
        launcher = subprocess.Popen([sys.executable, "-m", "luwu.launcher", "_supervise", str(run_dir)], stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, cwd=plan.cwd, start_new_session=True)
    launcher.wait(30)  # the intermediate exits at once; the supervisor lives on, detached
    try:
        state, problem = _wait_ready(run_dir, len(plan.nodes), args.timeout, err)
    except KeyboardInterrupt:
        err.print("luwu up: interrupted: stopping what was started", highlight=False)
        stop_run_dir(run_dir, timeout_s=args.stop_timeout, console=err)
        raise
    if problem:
        head, _, body = problem.partition("\n")
        err.print(f"luwu up: {head}", style="bold red", markup=False, highlight=False, soft_wrap=True)
        if body:
            err.print(body, markup=False, highlight=False, soft_wrap=True)
        err.print("luwu up: stopping what was started", highlight=False)
        stop_run_dir(run_dir, timeout_s=args.stop_timeout, console=err)
        return 1
    nodes = state["nodes"]
    addresses = [n["address"] for n in nodes]
    header = f"Written by `luwu up` at {time.strftime('%Y-%m-%d %H:%M:%S')} for job {job!r}; run dir {run_dir}.\nPoint workers at it (RemoteOptimizer(nodes=...) / LUWU_NODES) and `luwu status --config` this file."
    _write_atomic(run_dir / "cluster.toml", cluster_file_text(cfg, addresses, header=header))
    targets = [{"targets": [n["metrics_url"].split("://", 1)[1]], "labels": {"luwu_job": job, "luwu_node": str(n["index"]), "luwu_role": "node"}} for n in nodes if n["metrics_url"]]
    _write_atomic(run_dir / "targets.json", json.dumps(targets, indent=2))
    table = Table(title=f"LuWu job [bold]{job}[/]: {len(nodes)} nodes up", title_justify="left", header_style="bold")
    for col in ("#", "address", "metrics", "pid"):
        table.add_column(col, no_wrap=True)
    for n in nodes:
        table.add_row(str(n["index"]), n["address"], n["metrics_url"] or "-", str(n["pid"]))
    console.print(table)
    console.print(f"logs:         {run_dir}/node-<i>.log, supervisor.log (restarts)", highlight=False, soft_wrap=True)
    console.print(f"cluster file: {run_dir / 'cluster.toml'}", highlight=False, soft_wrap=True)
    console.print(f"  workers:  LUWU_NODES={','.join(addresses)} torchrun --nproc-per-node N train.py", highlight=False, soft_wrap=True)
    console.print(f"  watch:    luwu top --run-dir {run_dir}", highlight=False, soft_wrap=True)
    console.print(f"  stop:     luwu down --run-dir {run_dir}", highlight=False, soft_wrap=True)
    return 0


# ----------------------------------------------------------------- down


def _terminate(pids: dict[str, int], timeout_s: float, console) -> list[str]:
    """SIGTERM, wait up to timeout_s, SIGKILL; returns the names still alive after all that."""
    for name, pid in pids.items():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    for name, pid in pids.items():
        if pid_alive(pid):
            console.print(f"{name} (pid {pid}) still running {timeout_s:g} s after SIGTERM: SIGKILL", highlight=False)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    return [name for name, pid in pids.items() if pid_alive(pid)]


def stop_run_dir(run_dir: Path, *, timeout_s: float = 30.0, console=None) -> tuple[list[str], list[str]]:
    """Stop the supervisor and the daemons of ``run_dir``; returns (stopped, still alive)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    stopped: list[str] = []
    left: list[str] = []
    pid = _supervisor_running(run_dir)
    if pid is not None:
        with console.status(f"stopping supervisor {pid} and its nodes (SIGTERM, up to {timeout_s:g} s each)"):
            # The supervisor's own SIGTERM -> SIGKILL of the nodes takes up to timeout_s; give it that and a margin.
            left += _terminate({"supervisor": pid}, timeout_s + 10.0, console)
        stopped.append(f"supervisor (pid {pid})")
    (run_dir / "supervisor.pid").unlink(missing_ok=True)
    nodes = {}
    for pid_file in sorted(run_dir.glob("node-*.pid")):
        npid = read_pid(pid_file)
        if npid is not None and pid_alive(npid) and _is_luwu(npid):
            nodes[pid_file.stem] = npid
        else:
            pid_file.unlink(missing_ok=True)
    if nodes:  # left over by a supervisor that was killed
        with console.status(f"stopping {len(nodes)} nodes (SIGTERM, up to {timeout_s:g} s)"):
            still = _terminate(nodes, timeout_s, console)
        left += still
        stopped += [f"{name} (pid {p})" for name, p in nodes.items() if name not in still]
        for name in nodes:
            if name not in still:
                (run_dir / f"{name}.pid").unlink(missing_ok=True)
    state = _read_state(run_dir)
    if state is not None and not left:
        for n in state.get("nodes", []):
            if n["state"] not in ("failed", "exited"):
                n["state"], n["pid"] = "stopped", None
        _write_atomic(run_dir / "state.json", json.dumps(state, indent=2))
    return stopped, left


def cmd_down(args, rest: list[str]) -> int:
    from rich.console import Console

    from luwu.config import load_config

    console = Console(stderr=True)
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        run_dir = Path(default_run_dir(load_config(args.config, argv=rest).cluster.job))
    if not run_dir.is_dir():
        console.print(f"luwu down: nothing to stop: no run dir {run_dir}", highlight=False)
        return 0
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    before = sum(1 for _ in run_dir.glob("node-*.pid"))
    stopped, left = stop_run_dir(run_dir.resolve(), timeout_s=args.timeout, console=console)
    if left:
        console.print(f"[bold red]luwu down: still running after SIGKILL: {', '.join(left)}[/]", highlight=False)
        return 1
    if not stopped:
        console.print(f"luwu down: nothing was running in {run_dir}", highlight=False)
    else:
        console.print(f"luwu down: stopped the supervisor and {before} node(s) of {run_dir}", highlight=False)
    return 0


# ----------------------------------------------------------------- argparse


def add_arguments(subparsers) -> None:
    """Register ``up`` and ``down`` on the ``luwu`` command's subparsers."""
    s = subparsers.add_parser(
        "up",
        help="start a local cluster of node daemons in the background (pid files, logs, restarts)",
        description=(
            "Start N node daemons in the background, detached from the terminal, each with its own log and pid file in the "
            "run dir, plus one supervisor that restarts a daemon that dies (exponential backoff; restarts are counted in "
            "supervisor.log). Waits until every node is ready, then writes <run dir>/cluster.toml with the node addresses "
            "(point workers and `luwu status` at it) and <run dir>/targets.json (Prometheus file_sd targets). "
            "Addresses: --nodes N gives tcp://HOST:BASE_PORT+i (port 0: any free port, the bound one is reused on restart); "
            "otherwise [cluster] nodes of --config. Extra --section.field=value flags are passed to every node "
            "(e.g. --node.checkpoint_dir=ckpt --node.checkpoint_every=100)."
        ),
        allow_abbrev=False,
    )
    s.add_argument("--config", metavar="FILE", help="TOML cluster file; its [cluster] nodes are the addresses to bind unless --nodes is given")
    s.add_argument("--nodes", type=int, default=None, metavar="N", help="number of nodes (default: the cluster file's node list, else 2)")
    s.add_argument("--host", default="127.0.0.1", help="interface the nodes bind with --nodes (default 127.0.0.1)")
    s.add_argument("--base-port", type=int, default=0, metavar="P", help="node i binds port P+i (default 0: any free port)")
    s.add_argument("--metrics-port", type=int, default=None, metavar="P", help="node i serves /metrics on P+i; 0 = any free port, -1 = off (default: metrics.port of the config if set there, else 0)")
    s.add_argument("--run-dir", metavar="DIR", help=f"where pid files, logs and cluster.toml go (default ./{RUN_ROOT}/<job>)")
    s.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds for every node to be ready (default 60)")
    s.add_argument("--stop-timeout", type=float, default=30.0, metavar="S", help="SIGTERM to SIGKILL when stopping a node, leaving time for its checkpoint (default 30)")
    s.set_defaults(func=cmd_up)

    d = subparsers.add_parser(
        "down",
        help="stop the cluster that `luwu up` started (supervisor first, then the nodes)",
        description=(
            "Stop the supervisor (so that nothing is restarted), which stops its nodes with SIGTERM and, after --timeout, "
            "SIGKILL; then stop any node whose pid file outlived its supervisor, and remove the pid files. Logs and "
            "cluster.toml stay in the run dir."
        ),
        allow_abbrev=False,
    )
    d.add_argument("--config", metavar="FILE", help="TOML cluster file (for its job id, which names the default run dir)")
    d.add_argument("--run-dir", metavar="DIR", help=f"the run dir given to `luwu up` (default ./{RUN_ROOT}/<job>)")
    d.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds from SIGTERM to SIGKILL (default 30)")
    d.set_defaults(func=cmd_down)


def main(argv: list[str] | None = None) -> int:
    """``python -m luwu.launcher up|down ...`` (the same as ``luwu up|down``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_supervise"]:
        return _supervise_main(argv[1])
    from luwu.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())

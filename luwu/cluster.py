"""``local_cluster``: real node daemons as subprocesses on loopback.

The embedded default for the demo, notebooks and tests: each node is started
with port 0, prints the address it bound, and is stopped (SIGTERM, then
SIGKILL) when the context exits. The nodes ask every peer for a join secret
made here (every local user can reach a loopback port); workers get it through
the environment, never argv.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from luwu.groups import even_groups
from luwu.protocol.errors import NodeTimeoutError
from luwu.switch_nodes.lines import METRICS_LINE, READY_LINE


@dataclass
class LocalCluster:
    """The node daemons a :func:`local_cluster` started: their addresses, processes and how to restart them."""

    addresses: list[str]
    """The bound address of each node (``tcp://127.0.0.1:port``), in node-index order: pass them as
    ``RemoteOptimizer(..., nodes=cluster.addresses)``."""
    procs: list[subprocess.Popen] = field(repr=False)
    """The node processes, in node-index order."""
    job: str = "luwu"
    """The job id the nodes serve (``cluster.job``)."""
    args: list[list[str]] = field(default_factory=list, repr=False)
    """The command-line arguments each node was started with (``restart`` reuses them)."""
    metrics_urls: list[str] = field(default_factory=list)
    """http://host:port of each node's /metrics endpoint (when started with --metrics.port)."""
    aggregators: list[str] = field(default_factory=list)
    """The bound address of each aggregator (``local_cluster(aggregators=k)``), in group order."""
    groups: list[tuple[int, ...]] = field(default_factory=list)
    """The worker ranks each aggregator serves: a worker of rank r passes
    ``RemoteOptimizer(..., aggregator=cluster.aggregator_for(r))``."""
    aggregator_procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    aggregator_metrics_urls: list[str] = field(default_factory=list)
    """http://host:port of each aggregator's /metrics (when started with --metrics.port)."""
    join_secret: str = field(default="", repr=False)
    """The join secret the nodes ask for, unless node_args give them CURVE keys, a secret of their own, or
    node.insecure_open. While the cluster is open it is LUWU_TRANSPORT__JOIN_SECRET in this process's
    environment, so workers started here or in child processes show it without being told; hand it to a
    worker started elsewhere the same way, never in argv."""

    def aggregator_for(self, rank: int) -> str | None:
        """The address of the aggregator of worker ``rank`` (None: the cluster has no switch tier)."""
        for addr, group in zip(self.aggregators, self.groups):
            if rank in group:
                return addr
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every aggregator and node: SIGTERM (a node then writes its checkpoint), SIGKILL after
        ``timeout_s``."""
        for p in self.aggregator_procs:
            if p.poll() is None:
                p.terminate()
        for p in self.aggregator_procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def kill(self, index: int) -> None:
        """SIGKILL one node (fault injection)."""
        self.procs[index].kill()
        self.procs[index].wait(5)

    def restart(self, index: int, timeout_s: float = 30.0) -> str:
        """Start node ``index`` again on the same address (same identity)."""
        if self.procs[index].poll() is None:
            self.kill(index)
        args = list(self.args[index])
        i = args.index("--node.bind")
        args[i + 1] = self.addresses[index]
        proc, addr = _start(args, timeout_s)
        self.procs[index] = proc
        return addr


def _start(
    args: list[str], timeout_s: float, metrics: list | None = None
) -> tuple[subprocess.Popen, str]:
    return _await_ready(*_spawn(args), args, timeout_s, metrics)


WORKER_SECRET_VAR = "LUWU_TRANSPORT__JOIN_SECRET"
_gate_lock = threading.Lock()
_gate_users = 0
_gate_saved: str | None = None


@contextlib.contextmanager
def _job_secret():
    """The join secret of this process's local clusters, as LUWU_TRANSPORT__JOIN_SECRET in its
    environment while any is open: workers started in this process or its children show it without
    being told. One the environment already holds is used (it must have 32+ characters)."""
    global _gate_users, _gate_saved
    with _gate_lock:
        if _gate_users == 0:
            _gate_saved = os.environ.get(WORKER_SECRET_VAR)
            if not _gate_saved:
                os.environ[WORKER_SECRET_VAR] = secrets.token_hex(16)
        _gate_users += 1
        secret = os.environ[WORKER_SECRET_VAR]
    try:
        yield secret
    finally:
        with _gate_lock:
            _gate_users -= 1
            if _gate_users == 0 and not _gate_saved:
                os.environ.pop(WORKER_SECRET_VAR, None)


def _gate_env(args: list[str]) -> dict[str, str]:
    """LUWU_NODE__JOIN_SECRET for a node that ``args`` (and the environment) leave without a gate and
    not told to be open: the process's job secret (:func:`_job_secret`); {} otherwise."""
    from luwu.config import load_config

    files, rest, i = [], [], 0
    while i < len(args):
        if args[i] == "--config":
            files.append(args[i + 1])
            i += 2
            continue
        rest.append(args[i])
        i += 1
    node = load_config(files, argv=rest).node
    if node.gate or node.insecure_open or not node.uses_zmtp or WORKER_SECRET_VAR not in os.environ:
        return {}
    return {"LUWU_NODE__JOIN_SECRET": os.environ[WORKER_SECRET_VAR]}


def _spawn(args: list[str], command: str = "node") -> tuple[subprocess.Popen, queue.Queue]:
    gate = _gate_env(args) if command == "node" else {}  # (an aggregator: the env's secret)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **gate)
    proc = subprocess.Popen(
        [sys.executable, "-m", "luwu", command, *args],
        stdout=subprocess.PIPE,
        stderr=None,
        env=env,
        text=True,
    )
    lines: queue.Queue = queue.Queue()

    def pump() -> (
        None
    ):  # reads the node's stdout for its whole life, so the node never blocks on a full pipe
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="luwu-node-stdout", daemon=True).start()
    return proc, lines


def _await_ready(
    proc: subprocess.Popen,
    lines: queue.Queue,
    args: list[str],
    timeout_s: float,
    metrics: list | None,
) -> tuple[subprocess.Popen, str]:
    deadline = time.monotonic() + timeout_s
    seen = []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            break
        seen.append(line)
        if line.startswith(METRICS_LINE) and metrics is not None:
            metrics.append(line.split()[1])
        if line.startswith(READY_LINE):
            return proc, line.split()[1]
    proc.kill()
    proc.wait(5)
    raise NodeTimeoutError(
        f"node did not report its address within {timeout_s:.0f} s (args {args}); output: {''.join(seen)[-2000:]}"
    )


@contextlib.contextmanager
def local_cluster(
    num_nodes: int = 2,
    *,
    job: str = "luwu",
    node_args: list[str] | None = None,
    per_node_args: Callable[[int], list[str]] | None = None,
    start_timeout_s: float = 60.0,
    aggregators: int = 0,
    world_size: int = 0,
    aggregator_args: list[str] | None = None,
):
    """Start ``num_nodes`` real node daemons on 127.0.0.1 and yield a :class:`LocalCluster`.

    Each node runs ``luwu node`` in a subprocess of its own, binds a free port and prints the address it
    bound; the nodes are started together and waited for together. Leaving the ``with`` block stops
    them all (:meth:`LocalCluster.stop`), also on an exception.

    Args:
        num_nodes: how many nodes (node indices 0..num_nodes-1).
        job: the job id the nodes serve; workers must use the same (``RemoteOptimizer(job=...)``).
        node_args: extra ``--section.field value`` arguments for every node, e.g.
            ``["--node.checkpoint_dir", "ckpt", "--node.checkpoint_every", "5"]``.
        per_node_args: ``index -> list of arguments`` for settings that differ between nodes.
        start_timeout_s: how long each node may take to report its address; past it,
            ``NodeTimeoutError`` with the node's output.
        aggregators: the switch tier: this many ``luwu aggregator`` daemons in front of the nodes,
            each for a contiguous group of the ``world_size`` ranks (:attr:`LocalCluster.groups`;
            a worker connects to :meth:`LocalCluster.aggregator_for` its rank).
        world_size: the job's workers, with ``aggregators``.
        aggregator_args: extra arguments for every aggregator (``["--metrics.port", "0"]``).
    """
    if aggregators and not 0 < aggregators <= world_size:
        raise ValueError(
            f"aggregators={aggregators} needs 1 <= aggregators <= world_size, got world_size={world_size}"
        )
    procs, addrs, all_args, murls = [], [], [], []
    agg_procs: list[subprocess.Popen] = []
    with _job_secret() as secret:
        try:
            spawned = []
            for i in range(num_nodes):  # start them all, then wait: imports run in parallel
                args = [
                    "--node.bind",
                    "tcp://127.0.0.1:0",
                    "--node.index",
                    str(i),
                    "--cluster.job",
                    job,
                    *(node_args or []),
                ]
                if per_node_args is not None:
                    args += per_node_args(i)
                proc, lines = _spawn(args)
                procs.append(proc)
                spawned.append((proc, lines, args))
            for proc, lines, args in spawned:
                _, addr = _await_ready(proc, lines, args, start_timeout_s, murls)
                addrs.append(addr)
                all_args.append(args)
            runs = even_groups(world_size, aggregators) if aggregators else []
            groups = [tuple(range(a, b + 1)) for a, b in runs]
            agg_addrs, agg_murls = _start_aggregators(
                groups, addrs, job, aggregator_args, agg_procs, start_timeout_s
            )
            yield LocalCluster(
                addrs,
                procs,
                job,
                all_args,
                murls,
                aggregators=agg_addrs,
                groups=groups,
                aggregator_procs=agg_procs,
                aggregator_metrics_urls=agg_murls,
                join_secret=secret,
            )
        finally:
            LocalCluster(addrs, procs, aggregator_procs=agg_procs).stop()


def _start_aggregators(
    groups: list[tuple[int, ...]],
    nodes: list[str],
    job: str,
    extra: list[str] | None,
    procs: list[subprocess.Popen],
    timeout_s: float,
) -> tuple[list[str], list[str]]:
    """One ``luwu aggregator`` for each group in front of ``nodes``, started together, then waited
    for (each appended to ``procs`` at once, so the caller stops it whatever happens): their
    addresses and /metrics URLs."""
    spawned = []
    for g in groups:
        args = ["--ranks", f"{g[0]}-{g[-1]}", "--cluster.nodes", ",".join(nodes)]
        args += ["--cluster.job", job, "--node.bind", "tcp://127.0.0.1:0", *(extra or [])]
        proc, lines = _spawn(args, "aggregator")
        procs.append(proc)
        spawned.append((proc, lines, args))
    murls: list[str] = []
    return [_await_ready(*sp, timeout_s, murls)[1] for sp in spawned], murls

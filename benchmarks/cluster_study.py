"""LuWu against DDP on an emulated cluster: network-namespace hosts, tbf links, one task (issue 9).

On loopback the network is almost free; here every worker and every node is
its own host (a network namespace from ``netns_cluster.py``) behind a bridge,
each link limited to 1 or 10 Gbit/s both ways by tbf. The task is
teacher-student classification (``cluster_task.py``): a student MLP 1024 ->
2048 x4 -> 1000 (16.7M parameters), batch 64 per worker, 1 torch thread per
process, the same global batches, initial weights and steps for everyone.

Competitors, per link rate and worker count:

- ``ddp_fp32``, ``ddp_bf16`` (the bf16 compression hook), ``ddp_powersgd``
  (rank 4, error feedback, after 10 uncompressed steps, as many as the warm-up
  of LuWu's hybrid policy): DDP over gloo with fused AdamW, workers only;
- ``luwu_sync``, ``luwu_partial`` and ``luwu_delayed``: ``RemoteOptimizer``
  on the default compression policy told the link speed (``link_gbps`` = the
  link; at 1 Gbit/s ``pull_codec = "auto"`` picks int8-delta weights by the
  cost rule, at 10 Gbit/s bf16), on 1, 2 and 4 node hosts separate
  from the worker hosts; partial delays only the first layer's weights
  (``optimizer.delayed_params``: its gradient comes last in backward and its
  weights first in forward), delayed every weight. Every setting comes from a
  cluster file, as a real job's would.
- ``luwu_stream``: streaming mode (``optimizer.stream_weights``: the nodes own
  the weights, a worker holds one layer at a time; ``luwu_streamkeep``: with
  ``stream_keep_for_backward``, one fetch a step) against ``fsdp_fp32``: torch
  FSDP2 (``fully_shard`` on every layer and on the model, over gloo, AdamW on
  the shards) with the same model, batch and links. Both report the worker's
  peak RSS above the runtime floor (``worker_peak_mb``, rank 0 excluded: it
  keeps the loss curve's weight copies) and streaming its weight-fetch wait
  share of the step (``fetch_share``).

Measured (see ``cluster_task.py``): samples/s from the median step time after
warm-up (slowest rank), eval loss at the final step, wall time (the training
clock) to reach a target eval loss (DDP fp32's loss at ``target_frac`` of its
run, interpolated), wire bytes per host per step from the kernel counters of
each host (headers included), CPU per process and busy cores of the machine.
Everything shares the machine's cores, so each row says what bound it: the
links (a host's link busy most of the step) or the cores.

The plan validation feeds each LuWu configuration (compute time per step and
node optimizer rate measured here at the start, link rates, codec bytes per
element measured on the wire, link efficiency and network CPU per byte from
``results/bench_links.json``) to ``luwu.plan`` and sets the predicted step
next to the measured one. ``--hetero`` runs the heterogeneous-node study: one
node host at half the bandwidth of the other, capacity-weighted layout (from
the cluster file) against the uniform one.

Root is needed (skips with the reason otherwise). Traffic only goes to the
addresses of the namespaces built here.

    python3 benchmarks/cluster_study.py              # head-to-head + plan validation (30-40 min)
    python3 benchmarks/cluster_study.py --hetero     # heterogeneous nodes, 30 steps, 2 repetitions (~10 min)
    python3 benchmarks/cluster_study.py --quick      # smoke: 1 Gbit/s, 4 workers, 2 nodes, 16 steps (~3 min)
    python3 benchmarks/cluster_study.py --replot     # tables and plan validation again from the JSON

Writes benchmarks/results/cluster.{json,md} and plan_validation.{json,md}
(``--hetero``: hetero.*; ``--quick``: *.quick.*).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(
    0, str(HERE.parent / "tests")
)  # `support`: the emulated cluster is test infrastructure
from support.netns_cluster import (  # noqa: E402
    Cluster,
    ClusterConfig,
    list_namespaces,  # noqa: E402,F401  (for the system test: what teardown left)
    netns_available,
    parse_rate,
)

from luwu.switch_nodes.lines import READY_LINE  # noqa: E402  (torch-free)

log = logging.getLogger(__name__)

RESULTS = HERE / "results"
TASK = HERE / "cluster_task.py"
NODE_PORT = 5555
DDP_PORT = 29500
DDP_VARIANTS = ("fp32", "bf16", "powersgd")
LUWU_VARIANTS = ("sync", "partial", "delayed", "stream", "streamkeep")
FSDP_VARIANTS = ("fp32",)


# ----------------------------------------------------------------------------- settings


@dataclass(kw_only=True, slots=True)
class Settings:
    """What every run of a study shares: model, task, steps, optimizer."""

    dims: tuple[int, ...] = (1024, 2048, 2048, 2048, 2048, 1000)
    """Student MLP layer widths."""
    batch: int = 64
    """Samples per worker per step."""
    steps: int = 60
    """Steps of every run."""
    warmup: int = 12
    """Steps before the timed window (past the hybrid policy's 10 bf16 warm-up steps and the first resync)."""
    eval_every: int = 5
    """Rank 0 keeps the weights every this many steps for the loss curve."""
    eval_samples: int = 1024
    subspace: int = 16
    """Dimension of the input subspace of the teacher-student task."""
    task_seed: int = 1234
    lr: float = 1e-3
    weight_decay: float = 0.01
    powersgd_rank: int = 4
    powersgd_start: int = 10
    """PowerSGD's uncompressed steps, as many as LuWu's hybrid warm-up."""
    compression_warmup: int = 10
    """LuWu's hybrid policy: bf16 warm-up steps before int8 (``compression.warmup_steps``)."""
    dpu_warmup: int = 10
    """LuWu's delayed update: steps run in sync first (``optimizer.delayed_update_warmup``; ZeRO-Offload
    turns DPU on after a warm-up). Within ``warmup``, so the timed steps all run delayed."""
    partial_params: tuple[str, ...] = ("0.*",)
    """``luwu_partial``: the parameters whose weights land a step late (``optimizer.delayed_params``):
    the student's first layer."""
    bucket_bytes: int = 4 << 20
    settings: dict = dataclasses.field(default_factory=dict)
    """LuWu settings over the defaults, ``section.field`` -> TOML value (``--set``)."""
    target_frac: float = 0.75
    """Time-to-loss target: DDP fp32's eval loss at this fraction of its steps."""
    timeout_s: float = 120.0
    """Deadline of every wait inside a run (gloo, LuWu transport)."""
    congestion_control: str | None = "reno"
    """TCP congestion control inside every host, for every competitor (None: the kernel's default, bbr
    on these machines). Loss-based like cubic, Linux's default, which namespaces here may not select;
    at LAN round-trip times cubic runs in its Reno-friendly region. BBR (v1) in the 4 ms tbf queue
    retransmitted 700-1600 packets per step under a node link's 4-to-1 incast (LuWu, 1 Gbit/s, 4
    workers; DDP's ring: 0-3); reno 25-70."""

    def __post_init__(self) -> None:
        if len(self.dims) < 2 or any(d < 1 for d in self.dims):
            raise ValueError(f"dims must be >= 2 positive widths, got {self.dims!r}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(
                f"warmup must be in [0, steps), got warmup={self.warmup}, steps={self.steps}"
            )
        if not 1 <= self.eval_every <= self.steps:
            raise ValueError(f"eval_every must be in [1, steps], got {self.eval_every}")
        if not 0 < self.target_frac <= 1:
            raise ValueError(f"target_frac must be in (0, 1], got {self.target_frac}")

    @property
    def num_params(self) -> int:
        return sum(a * b + b for a, b in zip(self.dims, self.dims[1:]))


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One competitor on one cluster shape."""

    kind: str
    """``ddp`` or ``luwu``."""
    variant: str
    """ddp: fp32 / bf16 / powersgd; luwu: sync / partial / delayed."""
    workers: int
    nodes: int = 0
    rate: str = "1gbit"
    compression: bool = True
    capacities: tuple[float, ...] | None = None
    """LuWu node capacities written to the cluster file (None = equal)."""
    label: str = ""
    told_link: bool = True
    """LuWu: the cluster file tells the compression policy the link's rate; False: the defaults
    (``link_gbps = "auto"``: each worker measures its link to each node), named ``..._auto``."""
    out_of_core: bool = False
    """LuWu: every node keeps its shard's state in files (``node.state_dir``, in the run's folder on
    this machine's disk) with ``node.state_memory_bytes`` a quarter of its share of the state (the
    state 4x its budget), named ``..._ooc``."""

    @property
    def name(self) -> str:
        base = f"{self.kind}_{self.variant}" + (f"_n{self.nodes}" if self.kind == "luwu" else "")
        base += "" if self.compression or self.kind != "luwu" else "_fp32"
        base += "" if self.told_link else "_auto"
        base += "_ooc" if self.out_of_core else ""
        return base + (f"_{self.label}" if self.label else "")


@dataclass(slots=True)
class Hosts:
    """Which cluster host plays which role: workers h0.., nodes after the largest worker count."""

    cluster: Cluster
    max_workers: int

    def worker(self, rank: int) -> str:
        return f"h{rank}"

    def node(self, j: int) -> str:
        return f"h{self.max_workers + j}"


# ----------------------------------------------------------------------------- running one configuration


def _cluster_file(path: Path, rc: RunConfig, hosts: Hosts, s: Settings, job: str) -> list[str]:
    nodes = [f"tcp://{hosts.cluster.addr(hosts.node(j))}:{NODE_PORT}" for j in range(rc.nodes)]
    rate_gbps = (parse_rate(rc.rate) or 10**11) / 1e9
    lines = [
        "[cluster]",
        f'job = "{job}"',
        "nodes = [" + ", ".join(f'"{n}"' for n in nodes) + "]",
        f"world_size = {rc.workers}",
    ]
    if rc.capacities:
        lines.append("capacities = [" + ", ".join(f"{c:g}" for c in rc.capacities) + "]")
    lines += [
        "",
        "[optimizer]",
        'name = "adamw"',
        f"delayed_update = {str(rc.variant in ('delayed', 'partial')).lower()}",
        f"stream_weights = {str(rc.variant.startswith('stream')).lower()}",
        f"stream_keep_for_backward = {str(rc.variant == 'streamkeep').lower()}",
        f"delayed_update_warmup = {s.dpu_warmup}",
        "delayed_params = ["
        + (", ".join(f'"{p}"' for p in s.partial_params) if rc.variant == "partial" else "")
        + "]",
        "",
        "[compression]",
        f"enabled = {str(rc.compression).lower()}",
        f"warmup_steps = {s.compression_warmup}",
        f"link_gbps = {rate_gbps:g}" if rc.told_link else "# link_gbps: not told (auto)",
        "",
        "[transport]",
        f"timeout_s = {s.timeout_s:g}",
        f"bucket_bytes = {s.bucket_bytes}",
        "",
        "[node]",
        "insecure_public_bind = true  # the bridge of the emulated cluster",
        *(_ooc_lines(path.parent / "state", s, rc) if rc.out_of_core else []),
        "",
    ]
    for key, value in s.settings.items():  # --set section.field=value: after its section's header
        section, _, name = key.partition(".")
        at = lines.index(f"[{section}]") + 1 if f"[{section}]" in lines else len(lines)
        lines[at:at] = [f"[{section}]"] * (at == len(lines)) + [f"{name} = {value}"]
    path.write_text("\n".join(lines))
    return nodes


def _ooc_lines(state_dir: Path, s: Settings, rc: RunConfig) -> list[str]:
    """A node's state in files, its budget a quarter of its share (AdamW: 12 B/param), but at least
    what one bucket needs: its pushes in flight (2 + workers fp32 copies) and two slots of its state
    in the window (12 B/param each)."""
    share = 12 * s.num_params // rc.nodes
    budget = max(share // 4, s.bucket_bytes * (2 + rc.workers + 6))
    return [f'state_dir = "{state_dir}"', f"state_memory_bytes = {budget}"]


JOIN_SECRET = secrets.token_hex(16)
"""The study's nodes ask for it (node.join_secret); its workers show it: through the environment."""


def _env() -> dict:
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="eth0",
        LUWU_NODE__JOIN_SECRET=JOIN_SECRET,
        LUWU_TRANSPORT__JOIN_SECRET=JOIN_SECRET,
    )


def _start_nodes(
    hosts: Hosts, rc: RunConfig, cluster_file: Path, run_dir: Path, timeout_s: float = 90.0
) -> list:
    """Start the node daemons on their hosts; return their Popen objects once every one printed READY."""
    daemons = []
    for j in range(rc.nodes):
        addr = hosts.cluster.addr(hosts.node(j))
        argv = [
            sys.executable,
            "-m",
            "luwu",
            "node",
            "--config",
            str(cluster_file),
            f"--node.bind=tcp://{addr}:{NODE_PORT}",
            f"--node.index={j}",
        ]
        daemons.append((hosts.node(j), argv, f"node{j}"))
    return start_daemons(hosts.cluster, daemons, run_dir, timeout_s)


def start_daemons(
    cluster: Cluster, daemons: list[tuple[str, list[str], str]], run_dir: Path, timeout_s: float
) -> list:
    """Start each ``(host, argv, name)`` on its host (stderr into ``run_dir/<name>.err``); return their
    Popen objects once every one printed READY (the node's line: nodes and aggregators alike)."""
    procs, lines = [], queue.Queue()
    names = [name for _, _, name in daemons]
    for j, (host, argv, name) in enumerate(daemons):
        err = open(run_dir / f"{name}.err", "w")
        p = cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=err, text=True, env=_env())
        err.close()
        procs.append(p)

        def pump(p=p, j=j) -> None:  # drain stdout for the daemon's whole life
            for line in p.stdout:
                lines.put((j, line))
            lines.put((j, None))

        threading.Thread(target=pump, daemon=True).start()
    ready: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(daemons):
        try:
            j, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            missing = [names[k] for k in range(len(daemons)) if k not in ready]
            _stop(procs)
            raise RuntimeError(f"{missing} not ready in {timeout_s:.0f} s") from None
        if line is None:
            tail = (run_dir / f"{names[j]}.err").read_text()[-2000:]
            _stop(procs)
            raise RuntimeError(f"{names[j]} exited before it was ready: {tail}")
        if line.startswith(READY_LINE):
            ready.add(j)
    return procs


def _stop(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def run_config(hosts: Hosts, rc: RunConfig, s: Settings, tmp: Path, setup=None) -> dict:
    """Run one configuration to the end; return the summary row (raises with the processes' errors).
    ``setup(run_dir, spec)`` (nodes up, no worker yet) starts more daemons (returns them) and adds to
    the workers' spec (e.g. ``watch``: more processes rank 0 reads, ``cluster_task._snapshot``)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{rc.name}-", dir=tmp))
    job = f"study-{rc.name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    node_procs, workers, extra = [], [], []  # extra: setup's daemons
    base = {
        "kind": rc.kind,
        "variant": rc.variant,
        "world": rc.workers,
        "steps": s.steps,
        "warmup": s.warmup,
        "batch": s.batch,
        "dims": list(s.dims),
        "subspace": s.subspace,
        "task_seed": s.task_seed,
        "eval_every": s.eval_every,
        "eval_samples": s.eval_samples,
        "lr": s.lr,
        "weight_decay": s.weight_decay,
        "powersgd_rank": s.powersgd_rank,
        "powersgd_start": s.powersgd_start,
        "timeout_s": s.timeout_s,
        "run_dir": str(run_dir),
        "study_pid": os.getpid(),
        "master_addr": hosts.cluster.addr(hosts.worker(0)),
        "master_port": DDP_PORT,
    }
    deadline_s = 90 + s.steps * 8.0
    t0 = time.monotonic()
    try:
        if rc.kind == "luwu":
            cluster_file = run_dir / "cluster.toml"
            _cluster_file(cluster_file, rc, hosts, s, job)
            node_procs = _start_nodes(hosts, rc, cluster_file, run_dir)
            base["cluster_file"] = str(cluster_file)
            base["node_pids"] = [p.pid for p in node_procs]
        extra = setup(run_dir, base) if setup is not None else []
        for r in range(rc.workers):
            spec = dict(base, rank=r, result_path=str(run_dir / f"result{r}.json"))
            path = run_dir / f"spec{r}.json"
            path.write_text(json.dumps(spec))
            with open(run_dir / f"worker{r}.log", "w") as logf:
                workers.append(
                    hosts.cluster.popen(
                        hosts.worker(r),
                        [sys.executable, str(TASK), str(path)],
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        env=_env(),
                    )
                )
        while any(p.poll() is None for p in workers):
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"{rc.name}: workers still running after {deadline_s:.0f} s")
            if any(p.poll() not in (None, 0) for p in workers):
                break
            time.sleep(0.2)
        results = []
        for r, p in enumerate(workers):
            path = run_dir / f"result{r}.json"
            res = json.loads(path.read_text()) if path.exists() else None
            if p.poll() != 0 or res is None or "error" in res:
                logs = "\n".join(
                    f"--- worker {k} (exit {q.poll()}):\n"
                    + (run_dir / f"worker{k}.log").read_text()[-2000:]
                    for k, q in enumerate(workers)
                )
                raise RuntimeError(f"{rc.name}: worker {r} failed (exit {p.poll()})\n{logs}")
            results.append(res)
    finally:
        _stop(workers)
        _stop(extra)
        _stop(node_procs)
    row = summarize(rc, s, results, hosts)
    row["run_wall_s"] = time.monotonic() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


# ----------------------------------------------------------------------------- summaries


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(statistics.median(xs)) if xs else float("nan")


def time_to_loss(curve: list[dict], target: float) -> float:
    """Training-clock seconds at which the eval loss first reaches ``target`` (linear between points); inf if never."""
    prev = None
    for pt in curve:
        if pt["eval_loss"] <= target:
            if prev is None or prev["eval_loss"] == pt["eval_loss"]:
                return pt["clock_s"]
            frac = (prev["eval_loss"] - target) / (prev["eval_loss"] - pt["eval_loss"])
            return prev["clock_s"] + frac * (pt["clock_s"] - prev["clock_s"])
        prev = pt
    return math.inf


def loss_at(curve: list[dict], step: float) -> float:
    """Eval loss at ``step``, linear between the curve's points."""
    for a, b in zip(curve, curve[1:]):
        if a["step"] <= step <= b["step"]:
            w = (step - a["step"]) / max(1e-9, b["step"] - a["step"])
            return a["eval_loss"] + w * (b["eval_loss"] - a["eval_loss"])
    return curve[-1]["eval_loss"]


def summarize(rc: RunConfig, s: Settings, results: list[dict], hosts: Hosts) -> dict:
    timed = [r["recs"][s.warmup :] for r in results]
    meds = [median([x["step_s"] for x in recs]) for recs in timed]
    slow = max(range(len(meds)), key=meds.__getitem__)
    step_s = meds[slow]
    rate_bps = hosts.cluster.rate_bps(hosts.worker(0))
    win = [r["window"] for r in results]
    row: dict = {
        "config": rc.name,
        "kind": rc.kind,
        "variant": rc.variant,
        "workers": rc.workers,
        "nodes": rc.nodes,
        "rate": rc.rate,
        "compression": rc.compression,
        "capacities": list(rc.capacities) if rc.capacities else None,
        "step_ms": step_s * 1e3,
        "samples_per_s": rc.workers * s.batch / step_s,
        "fb_ms": median([x["fb_s"] for x in timed[slow]]) * 1e3,
        "opt_ms": median([x["opt_s"] for x in timed[slow]]) * 1e3,
        # training thread CPU per step, mean over ranks and timed steps: forward+backward with the gradient
        # hooks, and step() (waiting uses none; writing the weights does)
        "fb_cpu_ms": statistics.fmean(x["fb_cpu_s"] for recs in timed for x in recs) * 1e3,
        "opt_cpu_ms": statistics.fmean(x["opt_cpu_s"] for recs in timed for x in recs) * 1e3,
        "step_ms_per_rank": [m * 1e3 for m in meds],
        # worker peak RSS above the runtime floor (a process that imported torch and luwu), the largest rank's
        # but rank 0's, which also keeps the weight snapshots of the loss curve
        "worker_peak_mb": max(r.get("peak_mb", float("nan")) for r in (results[1:] or results)),
        # streaming: the share of the step forward and backward waited for weights (slowest rank, median)
        "fetch_share": median([x.get("fetch_s", 0.0) / x["step_s"] for x in timed[slow]]),
        "curve": results[0]["curve"],
        "eval_loss": results[0]["curve"][-1]["eval_loss"],
        "train_clock_s": results[0]["train_clock_s"],
        "worker_tx_bytes": [w["tx_bytes_per_step"] for w in win],
        "worker_rx_bytes": [w["rx_bytes_per_step"] for w in win],
        "worker_cpu_share": [w["cpu_share"] for w in win],
        "node_rx_bytes": [n["rx_bytes_per_step"] for n in win[0]["nodes"]],
        "node_tx_bytes": [n["tx_bytes_per_step"] for n in win[0]["nodes"]],
        "node_cpu_share": [n["cpu_share"] for n in win[0]["nodes"]],
        "watched": win[0].get("watched", {}),  # run_config's setup: spec["watch"]
        # the state files' traffic (out-of-core nodes), all nodes together: one disk here
        "node_disk_mb": sum(n.get("disk_bytes_per_step", 0) for n in win[0]["nodes"]) / 1e6,
        # the longest any node waited for its state a step (STATS state_io_wait_s)
        "node_io_wait_ms": max(
            (n.get("io_wait_s_per_step", 0.0) * 1e3 for n in win[0]["nodes"]), default=0.0
        ),
        "node_cpu_ms_by_role": [
            {k: v * 1e3 for k, v in n["cpu_s_per_step_by_role"].items()} for n in win[0]["nodes"]
        ],
        "busy_cores": win[0]["machine_busy_cores"],
        "cores": os.cpu_count(),
        # TCP retransmitted segments and retransmission timeouts per step, all hosts of the run
        "tcp_retrans_per_step": sum(w["tcp_retrans_per_step"] for w in win)
        + sum(n["tcp_retrans_per_step"] for n in win[0]["nodes"]),
        "tcp_timeouts_per_step": sum(w["tcp_timeouts_per_step"] for w in win)
        + sum(n["tcp_timeouts_per_step"] for n in win[0]["nodes"]),
        "worker_rate_bps": rate_bps,
        "node_rate_bps": [hosts.cluster.rate_bps(hosts.node(j)) for j in range(rc.nodes)],
    }
    for key in ("worker_tx", "worker_rx", "node_rx", "node_tx"):
        vals = row[f"{key}_bytes"]
        row[f"{key}_mb"] = statistics.fmean(vals) / 1e6 if vals else float("nan")
    if rc.kind == "luwu":
        row["layout"] = results[0]["layout"]
        row["timeline"] = results[0].get("timeline")
        row["payload_push_bytes"] = statistics.fmean(
            r["window"]["payload_tx_per_step"] for r in results
        )
        row["payload_pull_bytes"] = statistics.fmean(
            r["window"]["payload_rx_per_step"] for r in results
        )
    # which resource was busy: the busiest link direction of any host, and the machine's cores
    util = {}
    if rate_bps:
        for r, w in enumerate(win):
            util[f"worker {r} up"] = (
                w["tx_bytes_per_step"] * 8 / hosts.cluster.rate_bps(hosts.worker(r)) / step_s
            )
            util[f"worker {r} down"] = (
                w["rx_bytes_per_step"] * 8 / hosts.cluster.rate_bps(hosts.worker(r)) / step_s
            )
        for j, n in enumerate(win[0]["nodes"]):
            bps = hosts.cluster.rate_bps(hosts.node(j))
            util[f"node {j} down"] = n["rx_bytes_per_step"] * 8 / bps / step_s
            util[f"node {j} up"] = n["tx_bytes_per_step"] * 8 / bps / step_s
    busiest = max(util, key=util.get) if util else None
    row["link_util"] = util[busiest] if busiest else float("nan")
    row["busiest_link"] = busiest
    row["own_cores"] = sum(row["worker_cpu_share"]) + sum(row["node_cpu_share"])
    row["other_cores"] = win[0]["other_user_cores"]
    row["kernel_thread_cores"] = win[0]["kernel_thread_cores"]
    row["worker_cpu_ms"] = statistics.fmean(row["worker_cpu_share"]) * step_s * 1e3
    row["node_cpu_ms"] = (
        statistics.fmean(row["node_cpu_share"]) * step_s * 1e3 if rc.nodes else float("nan")
    )
    row["cpu_util"] = row["busy_cores"] / row["cores"]
    row["bound"] = bound_of(row["link_util"], row["cpu_util"], busiest)
    return row


def bound_of(link_util: float, cpu_util: float, busiest: str | None) -> str:
    """Links bind when one is busy >= 80% of the step; the cores when >= 90% of them are busy."""
    link = link_util >= 0.8
    cores = cpu_util >= 0.9
    if link and cores:
        return f"link ({busiest}) + cores"
    if link:
        return f"link ({busiest})"
    if cores:
        return "cores"
    return "neither (waits)"


# ----------------------------------------------------------------------------- the head-to-head


def h2h_configs(
    rates: list[str],
    workers: list[int],
    nodes: list[int],
    only: list[str] | None,
    auto_link: bool = False,
    out_of_core: bool = False,
) -> list[RunConfig]:
    """The head-to-head's runs; ``auto_link``: every LuWu run also on pure defaults (the link's
    rate not told: ``..._auto``), side by side with the told one; ``out_of_core``: every LuWu run
    also with its nodes' state in files (``..._ooc``), side by side with in-RAM nodes."""
    out = []
    told = (True, False) if auto_link else (True,)
    ooc = (False, True) if out_of_core else (False,)
    for rate in rates:
        for w in workers:
            out += [RunConfig("ddp", v, w, rate=rate) for v in DDP_VARIANTS]
            out += [RunConfig("fsdp", v, w, rate=rate) for v in FSDP_VARIANTS]
            out += [
                RunConfig("luwu", v, w, n, rate=rate, told_link=t, out_of_core=o)
                for n in nodes
                for v in LUWU_VARIANTS
                for t in told
                for o in ooc
            ]
    if only:
        out = [rc for rc in out if any(o in rc.name for o in only)]
    return out


def disk_floor(reps: int = 3, mib: int = 256) -> dict:
    """The disk's mixed O_DIRECT bandwidth where the runs keep their state (``bench_ooc.DiskFloor``:
    the state engine's request size and depth), median of ``reps`` passes."""
    from bench_ooc import DiskFloor

    from luwu.switch_nodes.ooc.io import DEFAULT_NUM_THREADS, DEFAULT_REQUEST_BYTES

    with tempfile.TemporaryDirectory(prefix="luwu-study-disk-") as tmp:
        floor = DiskFloor(
            Path(tmp) / "floor.bin", mib << 20, DEFAULT_REQUEST_BYTES, DEFAULT_NUM_THREADS
        )
        try:
            floor.run("mixed")
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                floor.run("mixed")
                times.append(time.perf_counter() - t0)
        finally:
            floor.close()
    return {"mixed_mb_s": floor.nbytes / median(times) / 1e6, "file_mib": mib, "reps": reps}


def _remove_stale_run_dirs() -> None:
    """Run folders of studies that died (SIGKILL skips their cleanup; their namespaces go by the watchdog)."""
    for path in Path(tempfile.gettempdir()).glob("luwu-study-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def run_many(
    configs: list[RunConfig],
    s: Settings,
    *,
    reps: int = 1,
    host_rates: dict | None = None,
    before: list[RunConfig] = (),
) -> list[dict]:
    """Run ``configs`` (``reps`` times each, order rotated per repetition), one cluster per link rate;
    ``before``: configurations run once, first, on the cluster of their rate (calibration)."""
    rows = []
    by_rate: dict[str, list[RunConfig]] = {}
    for rc in configs:
        by_rate.setdefault(rc.rate, []).append(rc)
    for rc in before:
        by_rate.setdefault(rc.rate, [])
    _remove_stale_run_dirs()
    with tempfile.TemporaryDirectory(prefix=f"luwu-study-{os.getpid()}-") as tmp:
        for rate, rcs in by_rate.items():
            first = [rc for rc in before if rc.rate == rate]
            max_w = max(rc.workers for rc in rcs + first)
            max_n = max(rc.nodes for rc in rcs + first)
            cfg = ClusterConfig(
                num_hosts=max_w + max(max_n, 0),
                rate=rate,
                host_rates={max_w + j: r for j, r in (host_rates or {}).items()},
                congestion_control=s.congestion_control,
            )
            with Cluster(cfg) as cluster:
                hosts = Hosts(cluster, max_w)
                for rep in range(reps):
                    order = rcs[rep % len(rcs) :] + rcs[: rep % len(rcs)] if rcs else []
                    for rc in (first if rep == 0 else []) + order:
                        t0 = time.monotonic()
                        row = run_config(hosts, rc, s, Path(tmp))
                        row["rep"] = rep
                        rows.append(row)
                        log.info(
                            "%-8s W=%d %-22s %6.0f samples/s  step %5.0f ms  eval %.3f  bound: %s  (%.0f s)",
                            rate,
                            rc.workers,
                            rc.name,
                            row["samples_per_s"],
                            row["step_ms"],
                            row["eval_loss"],
                            row["bound"],
                            time.monotonic() - t0,
                        )
    return rows


def merge_reps(rows: list[dict]) -> list[dict]:
    """One row per (rate, workers, config): medians of the numbers over repetitions, the first run's curve."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["rate"], r["workers"], r["config"]), []).append(r)
    out = []
    for rs in groups.values():
        row = dict(rs[0])
        for k, v in rs[0].items():
            if (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and k not in ("workers", "nodes", "rep", "cores")
            ):
                row[k] = median([r[k] for r in rs])
        row["reps"] = len(rs)
        row["samples_per_s_each"] = [r["samples_per_s"] for r in rs]
        out.append(row)
    return out


def add_comparisons(rows: list[dict], s: Settings, disk_mb_s: float = 0.0) -> None:
    """Ratios vs DDP fp32 / bf16 of the same rate and worker count, the time-to-loss target and times;
    out-of-core runs against the same run with in-RAM nodes (``disk_mb_s``: the disk's mixed
    bandwidth, to say how much of the state traffic's time the step hid)."""
    for rate, w in sorted({(r["rate"], r["workers"]) for r in rows}):
        group = [r for r in rows if r["rate"] == rate and r["workers"] == w]
        ref = {r["config"]: r for r in group}
        fp32, bf16 = ref.get("ddp_fp32"), ref.get("ddp_bf16")
        target = (
            loss_at(fp32["curve"], s.target_frac * s.steps)
            if fp32
            else min(r["eval_loss"] for r in group)
        )
        for r in group:
            r["target_loss"] = target
            r["time_to_loss_s"] = time_to_loss(r["curve"], target)
            r["vs_ddp_fp32"] = r["samples_per_s"] / fp32["samples_per_s"] if fp32 else float("nan")
            r["vs_ddp_bf16"] = r["samples_per_s"] / bf16["samples_per_s"] if bf16 else float("nan")
            r["loss_vs_fp32"] = r["eval_loss"] / fp32["eval_loss"] - 1 if fp32 else float("nan")
            fsdp = ref.get("fsdp_fp32")
            resident = (
                ref.get(f"luwu_sync_n{r['nodes']}" + ("" if r["compression"] else "_fp32"))
                if r["variant"].startswith("stream")
                else None
            )
            r["vs_fsdp"] = r["samples_per_s"] / fsdp["samples_per_s"] if fsdp else float("nan")
            r["memory_vs_fsdp"] = (
                r["worker_peak_mb"] / fsdp["worker_peak_mb"] if fsdp else float("nan")
            )
            r["vs_resident"] = (
                r["samples_per_s"] / resident["samples_per_s"] if resident else float("nan")
            )
            in_ram = ref.get(r["config"].replace("_ooc", "")) if "_ooc" in r["config"] else None
            r["vs_in_ram"] = (
                r["samples_per_s"] / in_ram["samples_per_s"] if in_ram else float("nan")
            )
            if in_ram and disk_mb_s:
                # the disk's time for the step's state traffic, and how much of it the step hid
                disk_s = r["node_disk_mb"] / disk_mb_s
                r["disk_ms"] = disk_s * 1e3
                r["disk_hidden"] = 1 - r["node_io_wait_ms"] / r["disk_ms"]


def verdicts(
    rows: list[dict], *, rate: str = "1gbit", workers: int = 4, nodes: int = 2
) -> list[dict]:
    """The targets of issue 9 for each LuWu variant at (rate, workers, nodes)."""
    group = {r["config"]: r for r in rows if r["rate"] == rate and r["workers"] == workers}
    ddp = {k: v for k, v in group.items() if k.startswith("ddp_")}
    out = []
    for v in LUWU_VARIANTS:
        r = group.get(f"luwu_{v}_n{nodes}")
        if r is None:
            continue
        if v.startswith(
            "stream"
        ):  # the model in the network: against FSDP2 and LuWu's own resident mode
            out += _stream_verdicts(
                r, f"luwu_{v}, {nodes} nodes, {workers} workers, {rate}", "fsdp_fp32" in group
            )
            continue
        where = f"luwu_{v}, {nodes} nodes, {workers} workers, {rate}"
        if "ddp_fp32" in ddp:
            out.append(
                _verdict(
                    f"{where}: samples/s vs DDP fp32",
                    r["vs_ddp_fp32"],
                    ">= 2.0x",
                    r["vs_ddp_fp32"] >= 2.0,
                )
            )
            out.append(
                _verdict(
                    f"{where}: eval loss vs DDP fp32",
                    r["loss_vs_fp32"],
                    "<= +2%",
                    r["loss_vs_fp32"] <= 0.02,
                    pct=True,
                )
            )
        if "ddp_bf16" in ddp:
            out.append(
                _verdict(
                    f"{where}: samples/s vs DDP bf16",
                    r["vs_ddp_bf16"],
                    ">= 1.2x",
                    r["vs_ddp_bf16"] >= 1.2,
                )
            )
        if ddp:
            best = min(ddp.values(), key=lambda d: d["time_to_loss_s"])
            ok = all(r["time_to_loss_s"] < d["time_to_loss_s"] for d in ddp.values())
            out.append(
                _verdict(
                    f"{where}: time to eval loss {r['target_loss']:.3f} vs the fastest DDP ({best['config']}, "
                    f"{_secs(best['time_to_loss_s'])})",
                    r["time_to_loss_s"],
                    "less than every DDP",
                    ok,
                    secs=True,
                )
            )
    return out


def _stream_verdicts(r: dict, where: str, fsdp: bool) -> list[dict]:
    out = []
    if fsdp:
        out.append(
            _verdict(f"{where}: samples/s vs FSDP2", r["vs_fsdp"], ">= 3x", r["vs_fsdp"] >= 3)
        )
        out.append(
            _verdict(
                f"{where}: worker peak memory vs FSDP2",
                r["memory_vs_fsdp"],
                "<= 0.5x",
                r["memory_vs_fsdp"] <= 0.5,
            )
        )
    if r["vs_resident"] == r["vs_resident"]:
        out.append(
            _verdict(
                f"{where}: samples/s vs resident mode (luwu_sync)",
                r["vs_resident"],
                ">= 0.8x",
                r["vs_resident"] >= 0.8,
            )
        )
    out.append(
        _verdict(
            f"{where}: weight-fetch wait share of the step",
            r["fetch_share"],
            "<= 10%",
            r["fetch_share"] <= 0.10,
            pct=True,
        )
    )
    out.append(
        _verdict(
            f"{where}: eval loss vs DDP fp32",
            r["loss_vs_fp32"],
            "<= +2%",
            r["loss_vs_fp32"] <= 0.02,
            pct=True,
        )
    )
    return out


def _secs(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.1f} s"


def _verdict(
    what: str, value: float, target: str, ok: bool, *, pct: bool = False, secs: bool = False
) -> dict:
    shown = f"{value:+.2%}" if pct else _secs(value) if secs else f"{value:.2f}x"
    return {"target": what, "value": shown, "wanted": target, "verdict": "met" if ok else "MISSED"}


# ----------------------------------------------------------------------------- tables


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "never"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def md_table(rows: list[dict], cols: list[str], headers: list[str] | None = None) -> str:
    out = ["| " + " | ".join(headers or cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)


H2H_COLS = [
    "config",
    "samples_per_s",
    "vs_ddp_fp32",
    "vs_ddp_bf16",
    "vs_fsdp",
    "worker_peak_mb",
    "fetch_share",
    "step_ms",
    "fb_ms",
    "eval_loss",
    "loss_vs_fp32",
    "time_to_loss_s",
    "worker_tx_mb",
    "worker_rx_mb",
    "node_rx_mb",
    "node_tx_mb",
    "link_util",
    "tcp_retrans_per_step",
    "worker_cpu_ms",
    "node_cpu_ms",
    "busy_cores",
    "other_cores",
    "bound",
]
H2H_HEADERS = [
    "config",
    "samples/s",
    "x DDP fp32",
    "x DDP bf16",
    "x FSDP2",
    "worker peak MB",
    "fetch wait share",
    "step ms",
    "fwd+bwd ms",
    "eval loss",
    "loss vs fp32",
    "time to loss (s)",
    "worker tx MB",
    "worker rx MB",
    "node rx MB",
    "node tx MB",
    "busiest link",
    "TCP retransmits/step",
    "CPU ms/step per worker",
    "CPU ms/step per node",
    "busy cores",
    "of them others'",
    "bound by",
]


def ooc_markdown(result: dict) -> list[str]:
    """Out-of-core nodes against in-RAM ones, and how much of the disk's time the step hid."""
    rows = [r for r in result["rows"] if r["config"].endswith("_ooc")]
    if not rows:
        return []
    disk = result.get("disk", {}).get("mixed_mb_s", float("nan"))
    cols = ["config", "rate", "workers", "samples_per_s", "vs_in_ram", "step_ms", "node_disk_mb"]
    cols += ["disk_ms", "node_io_wait_ms", "disk_hidden", "node_cpu_ms"]
    heads = ["config", "rate", "workers", "samples/s", "x in-RAM nodes", "step ms"]
    heads += [
        "state MB/step (all nodes)",
        "disk ms/step",
        "I/O wait ms/step",
        "disk time hidden",
        "CPU ms/step per node",
    ]
    return [
        "## Out-of-core nodes (each node's state 4x its node.state_memory_bytes)",
        "",
        md_table(rows, cols, heads),
        "",
        f"State MB/step: what the nodes read and wrote (`/proc/<pid>/io`, O_DIRECT), all nodes on this "
        f"machine's one disk; disk ms/step: that at the disk's mixed O_DIRECT bandwidth measured before "
        f"the runs ({disk:.0f} MB/s, `bench_ooc`'s floor); I/O wait: the longest a node's loop and "
        "optimizer thread waited for its state a step (`luwu_node_state_io_wait_seconds_total`); disk "
        "time hidden: 1 - I/O wait / disk ms, the share of the disk's time no node waited for (1: all "
        "of it behind the gradients' arrival). x in-RAM nodes also counts the out-of-core nodes' CPU "
        "(CPU ms/step per node against the in-RAM run's), which on this machine's 2 shared cores is "
        "step time too.",
        "",
    ]


def timeline_markdown(rows: list[dict]) -> list[str]:
    """Rank 0's step timeline of each LuWu run: when each bucket was pushed, answered and written."""
    out = []
    for r in rows:
        tl = r.get("timeline")
        if not tl:
            continue
        m = tl["marks"]
        marks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(m.items(), key=lambda kv: kv[1]))
        out += [
            f"## Step timeline: {r['config']} ({r['rate']}, {r['workers']} workers), rank 0, step {tl['step']}",
            "",
            f"ms from the step's start (`zero_grad`); marks: {marks}. pushed: handed to the I/O thread; "
            "answered: the reply filed by the I/O thread; written: the new weights in the parameters (the wait "
            "for them over: in `step()`, or in the next forward with per-layer waits). Buckets in forward order.",
            "",
            md_table(
                [
                    {
                        "bucket": b["bucket"],
                        "node": b["node"],
                        "numel": b["numel"],
                        **{k: round(b[k]) for k in ("pushed", "answered", "written") if k in b},
                    }
                    for b in tl["buckets"]
                ],
                ["bucket", "node", "numel", "pushed", "answered", "written"],
            ),
            "",
        ]
    return out


def h2h_markdown(result: dict) -> str:
    s, rows = result["settings"], result["rows"]
    lines = [
        f"# Emulated cluster: LuWu vs DDP over gloo{' (quick)' if result['quick'] else ''}",
        "",
        f"Teacher-student task, student MLP {' -> '.join(map(str, s['dims']))} ({result['num_params'] / 1e6:.1f}M "
        f"params), batch {s['batch']}/worker, {s['steps']} steps (timed: steps {s['warmup']}..{s['steps'] - 1}), "
        f"1 torch thread per process, every worker and node its own network namespace, tbf links both ways, "
        f"TCP congestion control {s.get('congestion_control') or 'bbr (the kernel default)'}. "
        f"Machine: {result['machine']['cpus']} cores shared by all hosts (and by other users: see the busy cores "
        f"and how many of them others took). "
        f"{result['elapsed_s'] / 60:.0f} min.",
        "",
        *(
            [
                f"LuWu settings over the defaults (`--set`): {', '.join(f'`{k} = {v}`' for k, v in s['settings'].items())}.",
                "",
            ]
            if s.get("settings")
            else []
        ),
        "## Targets (1 Gbit/s, 4 workers, 2 nodes)",
        "",
        md_table(result["verdicts"], ["target", "value", "wanted", "verdict"])
        if result["verdicts"]
        else "(not in this run)",
        "",
    ]
    for rate, w in sorted(
        {(r["rate"], r["workers"]) for r in rows}, key=lambda k: (parse_rate(k[0]) or 0, -k[1])
    ):
        group = [r for r in rows if r["rate"] == rate and r["workers"] == w]
        lines += [
            f"## {rate}, {w} workers (time-to-loss target: eval loss {group[0]['target_loss']:.3f})",
            "",
            md_table(group, H2H_COLS, H2H_HEADERS),
            "",
        ]
    lines += ooc_markdown(result)
    lines += timeline_markdown(rows)
    by_bound: dict[str, list[str]] = {}
    for r in rows:
        key = "links and cores" if "+ cores" in r["bound"] else r["bound"].split(" (")[0]
        by_bound.setdefault(key, []).append(f"{r['config']} ({r['rate']}, {r['workers']}w)")
    lines += ["## What bound each run", ""]
    lines += [f"- **{k}**: {', '.join(v)}" for k, v in sorted(by_bound.items())]
    lines += [
        "",
        "Every host of the emulated cluster shares the machine's cores, so the cores rather than the links can "
        "set the pace: each worker's forward+backward, the nodes' optimizer and codecs and the kernel's work for "
        "the emulated links all run on them. A real cluster gives every "
        "host its own cores; `luwu plan` without `--shared-cores` predicts that case.",
        "",
        f"Delayed update runs the first {s.get('dpu_warmup', 0)} steps in sync, then applies every gradient one step "
        "late (ZeRO-Offload's DPU warm-up, `optimizer.delayed_update_warmup`): compare its `loss vs fp32`. "
        f"Partial delay (`luwu_partial`) does the same for the parameters {', '.join(f'`{p}`' for p in s.get('partial_params', ()))} "
        "only (`optimizer.delayed_params`: the first layer, whose gradient comes last in backward and whose weights "
        "come first in forward, so its round trip is the tail of a sync step); the rest stays sync. The plan "
        "validation leaves partial rows out: `luwu plan` models sync and full delay.",
        "",
    ]
    lines += [
        "samples/s: workers x batch / median step time over the timed steps (slowest rank). eval loss: rank 0's "
        "weights after the last step (delayed update: after `synchronize()`). loss vs fp32: relative to DDP fp32. "
        "time to loss: training clock (wall seconds of steps since step 0) when the eval loss first reaches the "
        f"target, DDP fp32's eval loss at {s['target_frac']:.0%} of its steps (linear between the points every "
        f"{s['eval_every']} steps). Bytes: kernel counters of each host's link per step, headers included, mean "
        "over the hosts of a role. busiest link: bytes / (rate x step time) of the busiest host direction. TCP "
        "retransmits: segments resent per step, all hosts (packets the tbf queues dropped). busy "
        "cores: the whole machine during the timed steps; others': CPU of user processes outside this run (other "
        "users of the machine) over the same window. CPU ms/step: CPU seconds (all threads) per step of one "
        "process of that role. bound by: links when one is busy >= 80% of the step, cores when >= 90% of them are "
        "busy, neither when the step waits on something else (in sync mode: the pushes after backward, the "
        "replies, TCP recovering from drops).",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plan validation


def calibrate(s: Settings, reps: int = 10) -> dict:
    """What ``luwu plan`` takes as measured inputs: compute per step and the optimizer rate (1 thread, CPU
    time, with every other core running a worker-like process), link efficiency and network CPU per byte (results/bench_links.json)."""
    import torch
    from common import make_student

    torch.set_num_threads(1)
    model = make_student(list(s.dims))
    x, y = torch.randn(s.batch, s.dims[0]), torch.randint(0, s.dims[-1], (s.batch,))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, fused=True)

    def fwd_bwd() -> None:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def cpu_time(fn) -> float:
        # CPU seconds of this thread, not wall time: other users of the shared machine inflate the
        # latter (a descheduled thread uses no CPU), and the plan accounts for sharing itself
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            c0 = time.thread_time()
            fn()
            times.append(time.thread_time() - c0)
        return median(times)

    load = os.getloadavg()[0]
    alone = cpu_time(fwd_bwd)
    # as the study runs it: every core busy with a worker-like process (caches and memory shared)
    burners = [
        subprocess.Popen(
            [sys.executable, str(TASK), "--burn", ",".join(map(str, s.dims)), str(s.batch)],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for _ in range((os.cpu_count() or 1) - 1)
    ]
    try:
        for b in burners:
            b.stdout.readline()
        busy = cpu_time(fwd_bwd)
        opt_rate = s.num_params / cpu_time(opt.step)
    finally:
        _stop(burners)
    out = {
        "compute_s": busy,
        "compute_alone_s": alone,
        "opt_params_per_s": opt_rate,
        "cores": os.cpu_count(),
        "loadavg_1min": round(load, 2),
        "links": link_calibration(),
    }
    log.info(
        "calibration: fwd+bwd %.1f ms alone, %.1f ms with every core busy; AdamW %.2g params/s (CPU time; "
        "loadavg %.2f)",
        alone * 1e3,
        busy * 1e3,
        opt_rate,
        load,
    )
    return out


def link_calibration(path: Path = RESULTS / "bench_links.json") -> dict:
    """Per link rate: payload fraction of the line rate and CPU seconds per byte moved (sender + receiver),
    from the ZeroMQ rows of bench_links (4 MiB messages, like LuWu's buckets); defaults if absent."""
    out = {
        "1gbit": {"efficiency": 0.956, "cpu_s_per_byte": 0.8e-9, "source": "default"},
        "10gbit": {"efficiency": 0.93, "cpu_s_per_byte": 0.8e-9, "source": "default"},
    }
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return out
    for r in rows:
        if r.get("transport") == "zmq" and r.get("rate_bps") and r.get("msg_bytes") == 4 << 20:
            bps = r["gbit_s_median"] * 1e9 / 8
            out[r["link"]] = {
                "efficiency": r["of_nominal"],
                "cpu_s_per_byte": (r["rx_cpu_share"] + r["tx_cpu_share"]) / bps,
                "source": path.name,
            }
    return out


CALIBRATION_RUN = "calib"


def calibration_config(rate: str, compression: bool = True) -> RunConfig:
    """A LuWu run of 1 worker and 1 node (sync): what LuWu's own data path costs in CPU, by role."""
    return RunConfig(
        "luwu", "sync", 1, 1, rate=rate, compression=compression, label=CALIBRATION_RUN
    )


def datapath_calibration(row: dict, calib: dict) -> dict:
    """Per-element CPU costs of LuWu's data path, from the 1-worker, 1-node calibration run, in the plan's
    own terms. Worker: its training thread's CPU in forward+backward beyond compute (the gradient hooks:
    copying into buckets, encoding) per parameter, and in ``step()`` (writing the weights back) per
    parameter. Node: its optimizer thread (optimizer + encoding the reply: once per shard element) and its
    event loop and ZeroMQ threads (receiving and decoding each worker's push, sending each reply: once per
    shard element and worker). Transport: the worker's I/O and ZeroMQ threads and the kernel threads (the
    emulated links' softirq work charged to no process of ours) per payload byte moved."""
    P = sum(n for n, _ in row["layout"]["buckets"])
    roles = row["node_cpu_ms_by_role"][0]
    step_s = row["step_ms"] / 1e3
    moved = row["payload_push_bytes"] + row["payload_pull_bytes"]
    worker_io_ms = max(0.0, row["worker_cpu_ms"] - row["fb_cpu_ms"] - row["opt_cpu_ms"])
    out = {
        "worker_cpu_ms": row["worker_cpu_ms"],
        "fb_cpu_ms": row["fb_cpu_ms"],
        "opt_cpu_ms": row["opt_cpu_ms"],
        "worker_io_cpu_ms": worker_io_ms,
        "node_cpu_ms": row["node_cpu_ms"],
        "node_cpu_ms_by_role": roles,
        "step_ms": row["step_ms"],
        "payload_bytes_per_step": moved,
        "other_cores": row["other_cores"],
        "kernel_thread_cores": row["kernel_thread_cores"],
        "push_encode_s_per_elem": max(0.0, row["fb_cpu_ms"] / 1e3 - calib["compute_s"]) / P,
        "pull_decode_s_per_elem": row["opt_cpu_ms"] / 1e3 / P,
        "node_fixed_s_per_elem": roles["optimizer_thread"] / 1e3 / P,
        "node_per_worker_s_per_elem": (roles["loop"] + roles["zmq_io"] + roles["other"]) / 1e3 / P,
        "net_cpu_s_per_byte": (worker_io_ms / 1e3 + row["kernel_thread_cores"] * step_s) / moved,
    }
    log.info(
        "calibration run (1 worker, 1 node, %s): worker hooks %.2f ns/param, writing weights %.2f ns/param, "
        "node optimizer thread %.0f ms, loop + ZeroMQ %.0f ms, transport %.2f ns/B",
        "hybrid" if row["compression"] else "fp32",
        out["push_encode_s_per_elem"] * 1e9,
        out["pull_decode_s_per_elem"] * 1e9,
        roles["optimizer_thread"],
        roles["loop"] + roles["zmq_io"] + roles["other"],
        out["net_cpu_s_per_byte"] * 1e9,
    )
    return out


def split_calibration(runs: list[dict], calib: dict) -> list[dict]:
    """Take the calibration runs out of ``runs`` into ``calib['datapath'][hybrid|fp32]``."""
    rest = [r for r in runs if not r["config"].endswith("_" + CALIBRATION_RUN)]
    for r in runs:
        if r["config"].endswith("_" + CALIBRATION_RUN):
            key = "hybrid" if r["compression"] else "fp32"
            calib.setdefault("datapath", {})[key] = datapath_calibration(r, calib)
            calib.setdefault("datapath_runs", {})[key] = r
    return rest


def plan_spec(row: dict, settings: dict, calib: dict):
    """The ``luwu.plan`` input of one measured LuWu configuration."""
    from luwu.plan import PlanSpec, stream_refetch_share
    from luwu.protocol.codec_facts import bytes_per_element

    P = sum(a * b + b for a, b in zip(settings["dims"], settings["dims"][1:]))
    link = calib["links"].get(row["rate"], {"efficiency": 0.95, "cpu_s_per_byte": 0.8e-9})
    # the cores this run had: the machine's, less what other users' processes took meanwhile
    cores = max(0.5, row["cores"] - row.get("other_cores", 0.0))
    dp = calib["datapath"]["hybrid" if row["compression"] else "fp32"]
    refetch = 1.0  # (resident: one pull a step)
    if (
        row["variant"] == "stream"
    ):  # the share fetched again for backward, by the nominal size of the fetch codec
        refetch = stream_refetch_share(
            len(settings["dims"]) - 1, 2, bytes_per_element("int8") if row["compression"] else 4.0
        )
    return PlanSpec(
        num_params=P,
        workers=row["workers"],
        nodes=row["nodes"],
        capacities=tuple(row["capacities"]) if row.get("capacities") else None,
        worker_gbps=row["worker_rate_bps"] / 1e9,
        node_gbps=tuple(b / 1e9 for b in row["node_rate_bps"]),
        compute_s=calib["compute_s"],
        delayed_update=row["variant"] == "delayed",
        stream_weights=row["variant"] == "stream",
        stream_units=len(settings["dims"]) - 1,  # the student's Linear layers: the default units
        protocol_efficiency=link["efficiency"],
        bucket_bytes=settings["bucket_bytes"],
        batch_per_worker=settings["batch"],
        shared_cores=cores,
        # the bytes per element the codecs really put on the wire in this run (payload, per worker and step)
        # (streaming: the measured weight bytes are a fetch and the refetched share a step, the plan counts the share itself)
        push_bytes_per_elem=row["payload_push_bytes"] / P,
        pull_bytes_per_elem=row["payload_pull_bytes"] / P / (1 + refetch),
        stream_refetch=refetch,
        # the data path's CPU from the calibration run (1 worker, 1 node), in the plan's per-element terms
        push_encode_s_per_elem=dp["push_encode_s_per_elem"],
        pull_decode_s_per_elem=dp["pull_decode_s_per_elem"],
        opt_params_per_s=1.0 / max(dp["node_fixed_s_per_elem"], 1e-15),
        pull_encode_s_per_elem=0.0,
        push_decode_s_per_elem=dp["node_per_worker_s_per_elem"],
        net_cpu_s_per_byte=dp["net_cpu_s_per_byte"],
    )


def plan_validation(result: dict, tolerance: float = 0.25) -> dict:
    """Predicted (``luwu.plan``) against measured step time of every LuWu configuration of a head-to-head."""
    from luwu.plan import plan

    rows = []
    for r in result["rows"]:
        if r["kind"] != "luwu" or r["variant"] in (
            "partial",
            "streamkeep",
        ):  # the plan models sync, full delay and streaming
            continue
        spec = plan_spec(r, result["settings"], result["calibration"])
        p = plan(spec)
        err = p.step_s * 1e3 / r["step_ms"] - 1
        rows.append(
            {
                "config": r["config"],
                "rate": r["rate"],
                "workers": r["workers"],
                "nodes": r["nodes"],
                "measured_ms": r["step_ms"],
                "predicted_ms": p.step_s * 1e3,
                "error": err,
                "within": abs(err) <= tolerance,
                "bottleneck": p.bottleneck,
                "measured_bound": r["bound"],
                "push_bytes_per_elem": spec.push_bytes_per_elem,
                "pull_bytes_per_elem": spec.pull_bytes_per_elem,
                "plan": p.to_dict(),
            }
        )
    n_ok = sum(r["within"] for r in rows)
    return {
        "quick": result["quick"],
        "tolerance": tolerance,
        "calibration": result["calibration"],
        "rows": rows,
        "within": n_ok,
        "configs": len(rows),
        "verdict": ("met" if n_ok >= 4 else "MISSED")
        + f": {n_ok} of {len(rows)} configurations within "
        f"{tolerance:.0%} (target: at least 4)",
    }


def plan_markdown(v: dict) -> str:
    c = v["calibration"]
    table = [dict(r, error_pct=f"{r['error']:+.0%}") for r in v["rows"]]
    return "\n".join(
        [
            f"# luwu plan against the emulated cluster{' (quick)' if v['quick'] else ''}",
            "",
            f"**{v['verdict']}**",
            "",
            "Inputs, all measured in the same study before or apart from the configurations below: compute "
            f"(forward + backward, batch 64, 1 thread, CPU time with the other cores busy) {c['compute_s'] * 1e3:.1f} ms; "
            "link rates as configured, with the payload fraction of the line rate from bench_links ("
            + ", ".join(f"{k}: {x['efficiency']:.1%}" for k, x in c["links"].items())
            + "); codec bytes per element: "
            "the payload each worker pushed and received per step in that run; the data path's CPU from a calibration "
            "run of 1 worker and 1 node, by role, in the plan's per-element terms:",
            "",
            md_table(
                [dict(mode=k, **v) for k, v in c.get("datapath", {}).items()],
                [
                    "mode",
                    "push_encode_s_per_elem",
                    "pull_decode_s_per_elem",
                    "node_fixed_s_per_elem",
                    "node_per_worker_s_per_elem",
                    "net_cpu_s_per_byte",
                    "worker_cpu_ms",
                    "node_cpu_ms",
                    "step_ms",
                ],
                [
                    "calibration run",
                    "worker hooks beyond compute, s/param (plan: push encode)",
                    "worker writing weights, s/param (plan: pull decode)",
                    "node optimizer thread, s/param (plan: 1 / optimizer rate)",
                    "node loop + ZeroMQ, s/param per worker (plan: push decode)",
                    "worker I/O threads + kernel threads, s/payload byte (plan: network CPU)",
                    "worker CPU ms/step",
                    "node CPU ms/step",
                    "step ms",
                ],
            ),
            "",
            "Shared cores: the machine's cores less what other users' processes took during each run. "
            f"For reference, torch's fused AdamW alone runs at {c['opt_params_per_s']:.3g} params/s on one core here.",
            "",
            md_table(
                table,
                [
                    "config",
                    "rate",
                    "workers",
                    "nodes",
                    "measured_ms",
                    "predicted_ms",
                    "error_pct",
                    "within",
                    "bottleneck",
                    "measured_bound",
                    "push_bytes_per_elem",
                    "pull_bytes_per_elem",
                ],
                [
                    "config",
                    "rate",
                    "workers",
                    "nodes",
                    "measured step ms",
                    "predicted step ms",
                    "error",
                    "within",
                    "plan's bottleneck",
                    "measured bound",
                    "push B/elem",
                    "pull B/elem",
                ],
            ),
            "",
        ]
    )


def replot(args: argparse.Namespace) -> int:
    """Tables (and the plan validation, with the current model) again from the saved JSON."""
    stem = "cluster.quick" if args.quick else "cluster"
    path = args.out / f"{stem}.json"
    result = json.loads(path.read_text())
    s = Settings(
        **{
            k: tuple(v) if k in ("dims", "partial_params") else v
            for k, v in result["settings"].items()
        }
    )
    add_comparisons(result["rows"], s)
    result["verdicts"] = verdicts(result["rows"])
    write("cluster", result, h2h_markdown(result), quick=result["quick"], out=args.out)
    validation = plan_validation(result)
    write(
        "plan_validation",
        validation,
        plan_markdown(validation),
        quick=result["quick"],
        out=args.out,
    )
    return 0


# ----------------------------------------------------------------------------- heterogeneous nodes


def hetero_configs(modes: list[tuple[str, bool]], rate: str, slow_rate: str) -> list[RunConfig]:
    """4 workers, 2 nodes, node 1 at ``slow_rate``: the uniform layout and the one weighted by link rate,
    for each (variant, compression) mode."""
    weights = (1.0, (parse_rate(slow_rate) or 1) / (parse_rate(rate) or 1))
    out = []
    for v, comp in modes:
        out.append(RunConfig("luwu", v, 4, 2, rate=rate, compression=comp, label="uniform"))
        out.append(
            RunConfig(
                "luwu", v, 4, 2, rate=rate, compression=comp, capacities=weights, label="weighted"
            )
        )
    return out


def hetero(args: argparse.Namespace, s: Settings) -> int:
    """Heterogeneous nodes: one node host at half the bandwidth; weighted layout against the uniform one."""
    from luwu.plan import plan

    rate, slow = "1gbit", "500mbit"
    # fp32 makes the node links the bottleneck (what the layout decides); hybrid is the default job
    modes = [("sync", False)] if args.quick else [("sync", False), ("sync", True)]
    reps = args.reps if args.reps > 1 or args.quick else 2
    t0 = time.monotonic()
    info = machine()
    calib = calibrate(s)
    runs = run_many(
        hetero_configs(modes, rate, slow),
        s,
        reps=reps,
        host_rates={1: slow},
        before=[calibration_config(rate, comp) for comp in sorted({c for _, c in modes})],
    )
    runs = split_calibration(runs, calib)
    rows = merge_reps(runs)
    settings = dataclasses.asdict(s)
    for r in rows:
        r["layout_name"] = r["config"].rsplit("_", 1)[1]
        r["node_bytes_share"] = [b / sum(r["node_rx_bytes"]) for b in r["node_rx_bytes"]]
        r["planned_ms"] = plan(plan_spec(r, settings, calib)).step_s * 1e3
    summary = []
    for v, comp in modes:
        uni = next(
            r
            for r in rows
            if (r["variant"], r["compression"], r["layout_name"]) == (v, comp, "uniform")
        )
        wei = next(
            r
            for r in rows
            if (r["variant"], r["compression"], r["layout_name"]) == (v, comp, "weighted")
        )
        per_rep = [
            b["samples_per_s"] / a["samples_per_s"]
            for a, b in zip(
                [x for x in runs if x["config"] == uni["config"]],
                [x for x in runs if x["config"] == wei["config"]],
            )
        ]
        ratio = median(per_rep)
        summary.append(
            {
                "variant": f"{v}, {'hybrid + int8_delta' if comp else 'fp32'}",
                "uniform_samples_per_s": uni["samples_per_s"],
                "weighted_samples_per_s": wei["samples_per_s"],
                "ratio": ratio,
                "ratio_per_rep": per_rep,
                "planned_ratio": uni["planned_ms"] / wei["planned_ms"],
                "verdict": "weighted wins" if ratio > 1.0 else "weighted does NOT win",
            }
        )
    result = {
        "quick": args.quick,
        "settings": settings,
        "num_params": s.num_params,
        "machine": info,
        "calibration": calib,
        "link_rate": rate,
        "slow_node_rate": slow,
        "rows": rows,
        "runs": runs,
        "summary": summary,
        "elapsed_s": time.monotonic() - t0,
    }
    table = [
        dict(
            r,
            share=" / ".join(f"{x:.0%}" for x in r["node_bytes_share"]),
            node_mb=" / ".join(f"{b / 1e6:.1f}" for b in r["node_rx_bytes"]),
            caps=" / ".join(f"{c:g}" for c in r["capacities"]) if r["capacities"] else "1 / 1",
        )
        for r in rows
    ]
    md = "\n".join(
        [
            f"# Heterogeneous nodes: capacity-weighted layout against the uniform one{' (quick)' if args.quick else ''}",
            "",
            f"4 workers and 2 nodes, every host its own network namespace; links {rate} except node 1's, {slow}. "
            "LuWu in sync mode, fp32 both ways (the node links bind) and with the hybrid compression policy and "
            "int8-delta weights (the default job); `capacities` in the cluster file weight "
            f"the layout by link rate (weighted) or are left equal (uniform). Same task and settings as cluster.md; "
            f"{reps} repetition(s), alternating; {(time.monotonic() - t0) / 60:.0f} min.",
            "",
            md_table(
                summary,
                [
                    "variant",
                    "uniform_samples_per_s",
                    "weighted_samples_per_s",
                    "ratio",
                    "planned_ratio",
                    "verdict",
                ],
                [
                    "mode",
                    "uniform samples/s",
                    "weighted samples/s",
                    "weighted / uniform (median of paired reps)",
                    "luwu plan's ratio",
                    "verdict",
                ],
            ),
            "",
            md_table(
                table,
                [
                    "config",
                    "caps",
                    "samples_per_s",
                    "step_ms",
                    "planned_ms",
                    "node_mb",
                    "share",
                    "link_util",
                    "busiest_link",
                    "worker_cpu_ms",
                    "node_cpu_ms",
                    "busy_cores",
                    "other_cores",
                    "bound",
                ],
                [
                    "config",
                    "capacities",
                    "samples/s",
                    "step ms",
                    "plan's step ms",
                    "node rx MB/step (0 / 1)",
                    "byte share",
                    "busiest link",
                    "which",
                    "CPU ms/step per worker",
                    "CPU ms/step per node",
                    "busy cores",
                    "of them others'",
                    "bound by",
                ],
            ),
            "",
            "node rx MB/step: kernel counters of each node host's link (the gradients of every worker for its shard). "
            "With equal capacities the slow node gets half the bytes and its link sets the pace; weighted by link rate "
            "it gets a third, and both node links finish together.",
            "",
        ]
    )
    write("hetero", result, md, quick=args.quick, out=args.out)
    return 0


# ----------------------------------------------------------------------------- entry point


def machine() -> dict:
    import platform

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def write(name: str, result: dict, md: str, *, quick: bool, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}.quick" if quick else name
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(md if md.endswith("\n") else md + "\n")
    print(md)


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1gbit, 4 workers, 2 nodes, 16 steps"
    )
    ap.add_argument(
        "--hetero",
        action="store_true",
        help="the heterogeneous-node study instead of the head-to-head",
    )
    ap.add_argument(
        "--replot", action="store_true", help="tables and plan validation again from the saved JSON"
    )
    ap.add_argument(
        "--rates", type=_csv(str), default=None, help="link rates (default 1gbit,10gbit)"
    )
    ap.add_argument("--workers", type=_csv(int), default=None, help="worker counts (default 4,2)")
    ap.add_argument(
        "--nodes", type=_csv(int), default=None, help="LuWu node counts (default 1,2,4)"
    )
    ap.add_argument(
        "--only", type=_csv(str), default=None, help="configs whose name contains one of these"
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument(
        "--reps", type=int, default=1, help="repetitions of every configuration (order rotated)"
    )
    ap.add_argument(
        "--dims",
        type=_csv(int),
        default=None,
        help="student widths (default 1024,2048,2048,2048,2048,1000)",
    )
    ap.add_argument(
        "--bucket-mib",
        type=float,
        default=None,
        help="LuWu bucket size in MiB of fp32 gradient (default 4)",
    )
    ap.add_argument(
        "--cc",
        default=None,
        help="TCP congestion control in the hosts (default reno; 'default': the kernel's)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a LuWu setting over the defaults, as in a cluster file (TOML value), e.g. optimizer.layer_waits=false",
    )
    ap.add_argument(
        "--auto-link",
        action="store_true",
        help="each LuWu run also on pure defaults, the link's rate not told (named ..._auto)",
    )
    ap.add_argument(
        "--out-of-core",
        action="store_true",
        help="each LuWu run also with its nodes' state in files, 4x their budget (named ..._ooc); "
        "with 4 MiB buckets a node's budget must hold a bucket's pushes and state: use --bucket-mib 1",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.replot:
        return replot(args)
    ok, reason = netns_available()
    if not ok:
        print(f"skipped: {reason}")
        return 0
    s = Settings()
    if args.quick:
        s = dataclasses.replace(s, steps=16, warmup=12)
    s = dataclasses.replace(
        s,
        **{
            k: v
            for k, v in (
                ("steps", args.steps),
                ("warmup", args.warmup),
                ("dims", tuple(args.dims) if args.dims else None),
                ("bucket_bytes", int(args.bucket_mib * 2**20) if args.bucket_mib else None),
            )
            if v is not None
        },
    )
    if args.set:
        s = dataclasses.replace(s, settings=dict(kv.split("=", 1) for kv in args.set))
    if args.cc is not None:
        s = dataclasses.replace(s, congestion_control=None if args.cc == "default" else args.cc)
    if args.hetero:
        if args.steps is None and not args.quick:
            s = dataclasses.replace(s, steps=30)  # throughput only: no time-to-loss here
        return hetero(args, s)
    quick = args.quick
    rates = args.rates or (["1gbit"] if quick else ["1gbit", "10gbit"])
    workers = args.workers or ([4] if quick else [4, 2])
    nodes = args.nodes or ([2] if quick else [1, 2, 4])
    configs = h2h_configs(rates, workers, nodes, args.only, args.auto_link, args.out_of_core)
    t0 = time.monotonic()
    info = machine()
    calib = calibrate(s)
    before = [calibration_config(rates[0])] if any(rc.kind == "luwu" for rc in configs) else []
    disk = disk_floor() if args.out_of_core else {}
    runs = split_calibration(run_many(configs, s, reps=args.reps, before=before), calib)
    rows = merge_reps(runs)
    add_comparisons(rows, s, disk.get("mixed_mb_s", 0.0))
    result = {
        "quick": quick,
        "settings": dataclasses.asdict(s),
        "num_params": s.num_params,
        "machine": info,
        "calibration": calib,
        "disk": disk,
        "rows": rows,
        "runs": runs,
        "verdicts": verdicts(rows),
        "elapsed_s": time.monotonic() - t0,
    }
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write("cluster", result, h2h_markdown(result), quick=quick, out=args.out)
    if "datapath" in calib:
        validation = plan_validation(result)
        write("plan_validation", validation, plan_markdown(validation), quick=quick, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The switch tier on an emulated cluster of racks (issue 35): LuWu through aggregators against LuWu
flat and DDP, on the same links, in one run.

The topology (``tests/support/netns_racks.py``; every host its own network namespace, every link
tbf-limited both ways): ``--groups`` racks; rack g holds the workers of group g and its aggregator,
each on a fast link (``--fast``, 10 Gbit/s) to the rack's bridge; each rack reaches the core bridge
through one uplink at ``--slow`` (1 Gbit/s: a rack behind an oversubscribed core); the ``--nodes``
nodes sit on the core on slow links. So:

- **tier**: a worker pushes to its aggregator over the rack (fast); the aggregator sums the group's
  pushes and sends one push per bucket up the uplink (slow), and fans each reply out;
- **flat**: the same racks and uplinks, no aggregators: every worker's pushes and replies cross its
  rack's uplink;
- **DDP** (gloo, fused AdamW, workers only): its collectives between racks cross the same uplinks.

Competitors: ``luwu_sync`` tier and flat, compression off (fp32 both ways: the tier's bits are the
flat run's) and on the default compression policy *told the link each sender sees*: a worker of the
tier its fast link to the aggregator (``compression.link_gbps`` = fast), the aggregator its uplink
(``--compression.link_gbps`` = slow), a flat worker the slow link its pushes cross; the tier also
with its workers told the slow link their path to the nodes crosses (``..._tierpath``: a worker
picks the codec of its replies, which the aggregator passes on as they came); and DDP fp32 and bf16
(the bf16 compression hook). The task, the model and the measurements are those of
``cluster_study.py`` (``cluster_task.py``); here also the bytes on each rack's uplink (the kernel
counters of its veth), the aggregators' CPU, and which link or the cores bound each run.

Each configuration runs ``--reps`` times (order rotated); a run's step time is the median of its
timed steps (slowest rank), a configuration's the median of its runs. Everything shares the
machine's cores (2 here, with other users): the busy cores and how many of them were ours say how
CPU-bound each run was. Root is needed (skips with the reason otherwise).

    python3 benchmarks/bench_tier_cluster.py            # 4 workers, 2 racks, 2 nodes, 3 reps
    python3 benchmarks/bench_tier_cluster.py --quick    # smoke: 1 rep, 10 steps (*.quick.*)

Writes benchmarks/results/bench_tier_cluster.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]  # `benchmarks`; `support` (netns)
from support.netns_base import ClusterConfig, parse_rate  # noqa: E402
from support.netns_racks import RackCluster, uplink_if  # noqa: E402

from benchmarks import cluster_study as cs  # noqa: E402

log = logging.getLogger(__name__)

AGG_PORT = 7100
SETTINGS = cs.Settings(
    dims=(1024, 2048, 2048, 1000),
    batch=64,
    steps=24,
    warmup=8,
    eval_every=4,
    compression_warmup=5,
)
"""An 8.4M-parameter student (33.6 MB of fp32 gradient a step), 16 timed steps after the policy's
5 bf16 warm-up steps."""


@dataclass(frozen=True, slots=True)
class Shape:
    """The emulated cluster: workers in ``groups`` racks of equal size, nodes on the core."""

    workers: int = 4
    groups: int = 2
    nodes: int = 2
    fast: str = "10gbit"
    """Host links in a rack (workers, aggregators)."""
    slow: str = "1gbit"
    """Each rack's uplink to the core, and each node's link."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.workers % self.groups or self.nodes < 1:
            raise ValueError(
                f"workers must split into groups of equal size and nodes >= 1, got "
                f"workers={self.workers}, groups={self.groups}, nodes={self.nodes}"
            )

    @property
    def size(self) -> int:
        return self.workers // self.groups

    def ranks(self, g: int) -> range:
        return range(g * self.size, (g + 1) * self.size)

    @property
    def slow_gbps(self) -> float:
        return parse_rate(self.slow) / 1e9


@dataclass(slots=True)
class TierHosts(cs.Hosts):
    """Workers h0.., then the nodes, then one aggregator per group."""

    num_nodes: int = 0

    def aggregator(self, g: int) -> str:
        return f"h{self.max_workers + self.num_nodes + g}"


@dataclass(frozen=True, slots=True)
class TierRun:
    """One competitor: a study configuration, through the tier or not."""

    rc: cs.RunConfig
    tier: bool = False

    @property
    def layout(self) -> str:
        return "tier" if self.tier else ("flat" if self.rc.kind == "luwu" else "ring")


def competitors(shape: Shape, only: list[str] | None = None) -> list[TierRun]:
    """DDP fp32 and bf16; LuWu tier and flat, compression off and on (told the link each sender
    sees), and the tier with its workers told the slow link their path to the nodes crosses
    (``..._tierpath``: the pull codec follows the workers' link)."""
    w, n = shape.workers, shape.nodes
    runs = [TierRun(cs.RunConfig("ddp", v, w, rate=shape.slow)) for v in ("fp32", "bf16")]
    told = [(False, "tier", shape.fast), (False, "flat", shape.slow)]
    told += [(True, "tier", shape.fast), (True, "flat", shape.slow), (True, "tierpath", shape.slow)]
    for compression, label, rate in told:  # rate: what the workers' policy is told
        rc = cs.RunConfig("luwu", "sync", w, n, rate=rate, compression=compression, label=label)
        runs.append(TierRun(rc, tier=label != "flat"))
    return [r for r in runs if not only or any(o in r.rc.name for o in only)]


def build_cluster(shape: Shape, s: cs.Settings) -> tuple[RackCluster, TierHosts]:
    """The racks (each group's workers and aggregator), the nodes on the core."""
    w, n, g = shape.workers, shape.nodes, shape.groups
    cfg = ClusterConfig(
        num_hosts=w + n + g,
        rate=shape.fast,
        host_rates={w + j: shape.slow for j in range(n)},
        congestion_control=s.congestion_control,
    )
    racks = [[*shape.ranks(k), w + n + k] for k in range(g)]
    cluster = RackCluster(cfg, racks=racks, uplink_rate=shape.slow)
    return cluster, TierHosts(cluster, w, num_nodes=n)


def _setup(hosts: TierHosts, shape: Shape, run: TierRun):
    """``run_config``'s hook: the rack uplinks watched; for the tier, ``[[groups]]`` in the cluster
    file and one aggregator per group started in its rack."""
    cluster: RackCluster = hosts.cluster

    def setup(run_dir: Path, spec: dict) -> list:
        pid = cluster.counter_pid()
        watch = [
            {"name": f"rack{k}", "pid": pid, "iface": uplink_if(k)} for k in range(shape.groups)
        ]
        procs = []
        if run.tier:
            path = Path(spec["cluster_file"])
            addrs = [
                f"tcp://{cluster.addr(hosts.aggregator(g))}:{AGG_PORT}" for g in range(shape.groups)
            ]
            groups = [
                f'[[groups]]\nranks = "{r[0]}-{r[-1]}"\naggregator = "{a}"\n'
                for r, a in zip(map(shape.ranks, range(shape.groups)), addrs)
            ]
            path.write_text(path.read_text() + "\n" + "\n".join(groups))
            daemons = [
                (hosts.aggregator(g), _aggregator_argv(path, shape, g, addrs[g]), f"agg{g}")
                for g in range(shape.groups)
            ]
            procs = cs.start_daemons(cluster, daemons, run_dir, timeout_s=90.0)
            watch += [
                {"name": f"agg{g}", "pid": p.pid, "iface": "eth0"} for g, p in enumerate(procs)
            ]
        spec["watch"] = watch
        return procs

    return setup


def _aggregator_argv(cluster_file: Path, shape: Shape, g: int, addr: str) -> list[str]:
    r = shape.ranks(g)
    return [
        sys.executable,
        "-m",
        "luwu",
        "aggregator",
        "--config",
        str(cluster_file),
        "--ranks",
        f"{r[0]}-{r[-1]}",
        f"--node.bind={addr}",
        f"--compression.link_gbps={shape.slow_gbps:g}",  # its uplink's rate
    ]


def tier_row(row: dict, run: TierRun, shape: Shape) -> dict:
    """The study's row, with the rack uplinks' bytes and use, the aggregators' CPU, and the links
    and cores that bound the run judged over every link (the uplinks too)."""
    watched = row.pop("watched")
    step_s = row["step_ms"] / 1e3
    slow_bps = parse_rate(shape.slow)
    row["layout"] = run.layout
    row["told_gbps"] = (parse_rate(run.rc.rate) / 1e9) if run.rc.kind == "luwu" else None
    util = {}
    for k in range(shape.groups):
        up, down = (
            watched[f"rack{k}"]["tx_bytes_per_step"],
            watched[f"rack{k}"]["rx_bytes_per_step"],
        )
        row[f"rack{k}_up_mb"], row[f"rack{k}_down_mb"] = up / 1e6, down / 1e6
        util[f"rack {k} uplink up"] = up * 8 / slow_bps / step_s
        util[f"rack {k} uplink down"] = down * 8 / slow_bps / step_s
    racks = range(shape.groups)
    row["uplink_up_mb"] = statistics.fmean(row[f"rack{k}_up_mb"] for k in racks)
    row["uplink_down_mb"] = statistics.fmean(row[f"rack{k}_down_mb"] for k in racks)
    aggs = [watched[f"agg{g}"] for g in range(shape.groups) if f"agg{g}" in watched]
    row["agg_cpu_share"] = [a["cpu_share"] for a in aggs]
    row["agg_cpu_ms"] = statistics.fmean(row["agg_cpu_share"]) * step_s * 1e3 if aggs else None
    row["agg_rx_mb"] = (
        statistics.fmean(a["rx_bytes_per_step"] for a in aggs) / 1e6 if aggs else None
    )
    row["own_cores"] += sum(row["agg_cpu_share"])
    if row["busiest_link"]:
        util[row["busiest_link"]] = row["link_util"]
    busiest = max(util, key=util.get)
    row["link_util"], row["busiest_link"] = util[busiest], busiest
    row["bound"] = cs.bound_of(row["link_util"], row["cpu_util"], busiest)
    return row


def run_all(
    runs: list[TierRun], shape: Shape, s: cs.Settings, reps: int, budget_s: float = math.inf
) -> tuple[list[dict], list, list[dict]]:
    """Every competitor ``reps`` times on one cluster, the order rotated per repetition; no new
    repetition once the ones so far say it would end past ``budget_s``. Returns the rows, the
    hosts, and the runs that failed (with their error: the processes' logs), which the rest go on
    without."""
    rows, failures, t_start = [], [], time.monotonic()
    cs._remove_stale_run_dirs()
    with tempfile.TemporaryDirectory(prefix=f"luwu-study-{os.getpid()}-") as tmp:
        cluster, hosts = build_cluster(shape, s)
        with cluster:
            topology = cluster.describe()
            for rep in range(reps):
                spent = time.monotonic() - t_start
                if rep and spent + spent / rep > budget_s:
                    log.info(
                        "stopping after %d repetitions: the next would end past the budget", rep
                    )
                    break
                for run in runs[rep % len(runs) :] + runs[: rep % len(runs)]:
                    t0 = time.monotonic()
                    try:
                        row = cs.run_config(hosts, run.rc, s, Path(tmp), _setup(hosts, shape, run))
                    except RuntimeError as exc:
                        log.error("%s failed: %s", run.rc.name, exc)
                        failures.append({"config": run.rc.name, "rep": rep, "error": str(exc)})
                        continue
                    row = tier_row(row, run, shape)
                    row["rep"] = rep
                    rows.append(row)
                    log.info(
                        "%-26s step %5.0f ms  uplink up %6.1f MB  busy cores %.2f  bound: %s  (%.0f s)",
                        run.rc.name,
                        row["step_ms"],
                        row["uplink_up_mb"],
                        row["busy_cores"],
                        row["bound"],
                        time.monotonic() - t0,
                    )
    return rows, topology, failures


def ratios(rows: list[dict]) -> dict:
    """Per tier run, side by side in this run (medians of the runs): LuWu flat's step time and
    uplink bytes (up) with the same compression over the tier's, and each DDP's step time over it."""
    by = {r["config"]: r for r in rows}
    out = {}
    for tier in (r for r in rows if r["layout"] == "tier"):
        flat = next(
            (r for r in rows if r["layout"] == "flat" and r["compression"] == tier["compression"]),
            None,
        )
        got = {}
        if flat is not None:
            got["flat_step"] = flat["step_ms"] / tier["step_ms"]
            got["flat_uplink_up_bytes"] = flat["uplink_up_mb"] / tier["uplink_up_mb"]
        for v in ("fp32", "bf16"):
            if f"ddp_{v}" in by:
                got[f"ddp_{v}_step"] = by[f"ddp_{v}"]["step_ms"] / tier["step_ms"]
        out[tier["config"]] = got
    return out


RATIO_COLS = [
    ("flat_step", "flat / tier step"),
    ("flat_uplink_up_bytes", "flat / tier uplink bytes up"),
    ("ddp_fp32_step", "DDP fp32 / tier step"),
    ("ddp_bf16_step", "DDP bf16 / tier step"),
]


def same_curves(rows: list[dict]) -> bool | None:
    """Whether the tier's fp32 run trained the flat fp32 run's model: equal eval losses, bit for bit
    (None: one of them was not run)."""
    by = {r["layout"]: r for r in rows if r["kind"] == "luwu" and not r["compression"]}
    if "tier" not in by or "flat" not in by:
        return None
    return [p["eval_loss"] for p in by["tier"]["curve"]] == [
        p["eval_loss"] for p in by["flat"]["curve"]
    ]


COLS = [
    ("config", "config"),
    ("layout", "layout"),
    ("step_ms", "step ms"),
    ("step_ms_each", "step ms per rep"),
    ("samples_per_s", "samples/s"),
    ("x_tier", "step / tier's"),
    ("uplink_up_mb", "uplink up MB/step"),
    ("uplink_down_mb", "uplink down MB/step"),
    ("node_rx_mb", "node rx MB/step"),
    ("worker_tx_mb", "worker tx MB/step"),
    ("busiest_link", "busiest link"),
    ("link_util", "its use"),
    ("worker_cpu_ms", "CPU ms/step per worker"),
    ("agg_cpu_ms", "per aggregator"),
    ("node_cpu_ms", "per node"),
    ("busy_cores", "busy cores"),
    ("own_cores", "of them ours"),
    ("other_cores", "others'"),
    ("kernel_thread_cores", "kernel threads"),
    ("bound", "bound by"),
    ("eval_loss", "eval loss"),
]


def markdown(result: dict) -> str:
    s, shape = result["settings"], result["shape"]
    rows = result["rows"]
    for r in rows:
        tier = next(
            (t for t in rows if t["layout"] == "tier" and t["compression"] == r["compression"]),
            None,
        )
        if r["kind"] == "ddp":
            tier = next((t for t in rows if t["config"].endswith("_fp32_tier")), tier)
        r["x_tier"] = r["step_ms"] / tier["step_ms"] if tier else None
        r["step_ms_each"] = " / ".join(f"{x:.0f}" for x in r["step_ms_runs"])
        r["bound"] = cs.bound_of(r["link_util"], r["cpu_util"], r["busiest_link"])  # the medians
    lines = [
        "# The switch tier on an emulated cluster of racks (bench_tier_cluster)",
        "",
        f"`{result['command']}`: {shape['workers']} workers in {shape['groups']} racks of "
        f"{shape['workers'] // shape['groups']}, each rack's workers and its aggregator on "
        f"{shape['fast']} links to the rack's bridge, each rack behind one {shape['slow']} uplink to "
        f"the core, {shape['nodes']} nodes on the core on {shape['slow']} links (every host its own "
        "network namespace, tbf both ways, TCP reno). Student MLP "
        f"{' -> '.join(map(str, s['dims']))} ({result['num_params'] / 1e6:.1f}M params), batch "
        f"{s['batch']}/worker, {s['steps']} steps (timed: {s['warmup']}..{s['steps'] - 1}), "
        f"AdamW; medians of {result['reps']} runs (each the median timed step of the slowest rank). "
        f"{result['elapsed_s'] / 60:.0f} min; 1-min load before {result['loadavg_before'][0]}.",
        "",
        "Compression on: the default policy told the link each sender sees (tier workers "
        f"{shape['fast']} to their aggregator, aggregators {shape['slow']} up, flat workers "
        f"{shape['slow']}; `tierpath`: tier workers told {shape['slow']}, the path to the nodes). "
        "DDP's 'step / tier's' is over the fp32 tier run. Uplink bytes: the kernel "
        "counters of each rack's uplink veth, mean of the racks, per step. CPU: process CPU per step "
        f"(all threads); busy cores of the machine's {result['machine']['cpus']} (all users), of them "
        "ours (workers, nodes, aggregators) and other users'; kernel work of the links is in neither. "
        "Bound (on the medians): a link busy >= 80% of the step, or >= 90% of the cores busy.",
        "",
        cs.md_table(rows, [c for c, _ in COLS], [h for _, h in COLS]),
        "",
        "Ratios over each tier run (> 1: the tier is faster, or sends fewer bytes):",
        "",
        cs.md_table(
            [{"config": k, **v} for k, v in result["ratios"].items()],
            ["config", *(c for c, _ in RATIO_COLS)],
            ["tier run", *(h for _, h in RATIO_COLS)],
        ),
        "",
    ]
    for f in result.get("failures", []):  # the whole error with its logs is in the JSON
        lines += [
            f"Failed: {f['config']} (repetition {f['rep']}): {f['error'].splitlines()[0]}",
            "",
        ]
    return "\n".join(lines)


def source_state() -> dict:
    """The commit and the uncommitted runtime files this run measured (others edit the tree too)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True)
        return out.stdout.strip()

    dirs = ("luwu/", "switch_nodes/", "gpu_workers/", "protocol/")
    changed = [
        ln[3:] for ln in git("status", "--porcelain").splitlines() if ln[3:].startswith(dirs)
    ]
    return {"head": git("rev-parse", "HEAD"), "uncommitted_runtime_files": changed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 rep, 10 steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--budget-min", type=float, default=None, help="start no repetition that would end past it"
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--fast", default="10gbit")
    ap.add_argument("--slow", default="1gbit")
    ap.add_argument("--only", type=cs._csv(str), default=None, help="configs naming one of these")
    ap.add_argument("--skip", type=cs._csv(str), default=[], help="configs named exactly these")
    ap.add_argument("--out", type=Path, default=cs.RESULTS)
    ap.add_argument("--replot", action="store_true", help="the table again from the saved JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.replot:
        stem = "bench_tier_cluster" + (".quick" if args.quick else "")
        result = json.loads((args.out / f"{stem}.json").read_text())
        cs.write("bench_tier_cluster", result, markdown(result), quick=args.quick, out=args.out)
        return 0
    ok, reason = cs.netns_available()
    if not ok:
        print(f"skipped: {reason}")
        return 0
    s = SETTINGS
    if args.quick:
        s = dataclasses.replace(s, steps=10, warmup=6, compression_warmup=3, eval_every=5)
    over = {"steps": args.steps, "warmup": args.warmup}
    s = dataclasses.replace(s, **{k: v for k, v in over.items() if v is not None})
    reps = 1 if args.quick else args.reps
    shape = Shape(args.workers, args.groups, args.nodes, args.fast, args.slow)
    t0, load, source = time.monotonic(), [round(x, 2) for x in os.getloadavg()], source_state()
    budget_s = args.budget_min * 60 if args.budget_min else math.inf
    runs, topology, failures = run_all(
        [r for r in competitors(shape, args.only) if r.rc.name not in args.skip],
        shape,
        s,
        reps,
        budget_s,
    )
    rows = cs.merge_reps(runs)
    for r in rows:
        r["step_ms_runs"] = [x["step_ms"] for x in runs if x["config"] == r["config"]]
    for r in rows + runs:
        r.pop("timeline", None)
    result = {
        "command": "python3 benchmarks/bench_tier_cluster.py"
        + " ".join([""] + (argv or sys.argv[1:])),
        "shape": dataclasses.asdict(shape),
        "settings": dataclasses.asdict(s),
        "num_params": s.num_params,
        "reps": max((r["reps"] for r in rows), default=0),
        "failures": failures,
        "topology": topology,
        "machine": cs.machine(),
        "source": source,
        "loadavg_before": load,
        "rows": rows,
        "ratios": ratios(rows),
        "summary": [  # for run_all: the issue sets no number to reach here
            {"benchmark": f"{k}: {label}", "ratio": round(v[c], 3), "target": None, "verdict": "-"}
            for k, v in ratios(rows).items()
            for c, label in RATIO_COLS
            if c in v
        ],
        "tier_fp32_equals_flat_fp32": same_curves(rows),
        "runs": runs,
        "elapsed_s": time.monotonic() - t0,
    }
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    cs.write("bench_tier_cluster", result, "(tables: --replot)", quick=args.quick, out=args.out)
    cs.write("bench_tier_cluster", result, markdown(result), quick=args.quick, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An out-of-core node inside a memory cgroup trains as an in-RAM node does (issue 34, the capped node).

One node process (``luwu node``) joins a fresh memory cgroup before Python starts (a ``sh`` wrapper
writes its own pid to ``cgroup.procs`` and execs the node), so everything it maps is charged there.
Two streaming workers (``RemoteOptimizer(stream_weights=True, compression=False)``, the model built on
the meta device: ``bench_memory.make_model``, ``--depth`` blocks of width ``--width``) train it for
``--steps`` steps of AdamW. Runs, one after another:

1. **baseline**: the node alone (no worker, no state), in a cgroup with no binding limit: the
   cgroup's peak once it is ready is the node's own baseline (Python, torch, ZeroMQ).
2. **in RAM** (the reference): the same training against a node without ``node.state_dir``, in a
   cgroup with no binding limit (only to read its peak).
3. **capped**: the node with ``node.state_dir`` and ``node.state_memory_bytes`` = a quarter of the
   shard's state (12 B/param: fp32 weights and AdamW's two moments; ``--state-memory-mib``
   overrides, e.g. to cap the cgroup itself at a quarter of the state), in a cgroup limited to
   baseline + state / 4 (``--limit-mib`` overrides). Its final weights are compared with the
   reference's (max abs difference; expected 0, bit for bit: compression off, the same sums).
   Where it is killed, the same run again under the in-RAM node's peak less half the state (room for
   what node.state_memory_bytes might not cover), and failing that less a quarter: the comparison is
   made on the run that trained, and the table shows every attempt. ``over_budget``: what the node
   held above the idle node at its peak, per node.state_memory_bytes (about 1: the budget covers
   the node's state window, seeds, pushes and replies).
4. **no state_dir**: the in-RAM node under the last capped run's limit, one short attempt (one
   step): it is expected to be killed by the cgroup (the failure out-of-core state removes).

Reported per run: the cgroup's peak (``memory.max_usage_in_bytes``, page cache included), its limit
hits (``memory.failcnt``) and OOM kills, the node's VmHWM, the workers' median step time (rank 0,
the first step left out), and the node's state bytes read / written and I/O wait from its /metrics.
Needs root and a cgroup memory controller (v1 or v2); it says so and stops without.

    .venv/bin/python benchmarks/bench_ooc_node.py [--quick] [--width 1024] [--depth 8] [--steps 20] [--dir DIR] [--limit-mib M]

``--dir`` (the state files) defaults to a new folder under /var/tmp or /tmp on a disk (state on a
tmpfs would be charged to the cgroup as memory), removed at the end. Writes
benchmarks/results/bench_ooc_node.json and .md (``--quick``: bench_ooc_node.quick.*, 24 MB of
state, about 1.5 minutes). The default size (0.8 GB of state, 20 steps) takes 6-7 minutes on a
2-core VM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repo root: `benchmarks` as a package, also as a script
from benchmarks.bench_memory import make_model, memory_cgroup, status_bytes  # noqa: E402
from benchmarks.common import LoadMonitor, machine_info, md_table, write_results  # noqa: E402

MIB = 1 << 20
MB = 1 / MIB
STATE_METRICS = (
    "luwu_node_state_bytes_read_total",
    "luwu_node_state_bytes_written_total",
    "luwu_node_state_io_wait_seconds_total",
    "luwu_node_state_buffer_bytes",
    "luwu_node_state_memory_bytes",
    "luwu_node_inflight_peak_bytes",
    "luwu_node_inflight_limit_bytes",
    "luwu_node_inflight_blocked_seconds_total",
    "luwu_node_inflight_overdrafts_total",
)
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}
KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)


def state_bytes(numel: int) -> int:
    """The shard's state for AdamW: fp32 weights and two moments (the step counters are a few bytes)."""
    return 12 * numel


def model_numel(width: int, depth: int) -> int:
    """Parameters of ``bench_memory.make_model(width, depth)``: input layer, blocks, head."""
    return 65 * width + depth * (8 * width * width + 7 * width) + 11 * width + 10


# ----------------------------------------------------------------- one node process
@dataclass
class Node:
    """A node process started by :func:`node_process`."""

    proc: subprocess.Popen
    address: str
    metrics_url: str
    log: Path
    secret: str = field(repr=False)

    def metrics(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The node's ``luwu_node_state_*`` samples (0.0 for a metric it does not show)."""
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
        return parse_metrics(text, STATE_METRICS)


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Samples ``names`` of a Prometheus text exposition, a labelled one summed over its labels (0.0
    where absent)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.partition("{")[0]
        if name in out:
            out[name] += float(value)
    return out


def node_command(node_args: list[str], cgroup_procs: str | None) -> list[str]:
    """``luwu node`` on a free loopback port with /metrics; inside the cgroup from its first byte."""
    cmd = [sys.executable, "-m", "luwu", "-v", "node", "--node.bind", "tcp://127.0.0.1:0"]
    cmd += ["--node.index", "0", "--metrics.port", "0", *node_args]
    if cgroup_procs is None:
        return cmd
    return ["sh", "-c", f'echo $$ > "{cgroup_procs}" && exec "$@"', "sh", *cmd]


@contextlib.contextmanager
def node_process(
    node_args: list[str], cgroup_procs: str | None, log: Path, start_timeout_s: float = 120.0
):
    """Start one node (in the cgroup ``cgroup_procs`` when given) with a join secret of its own; yield a
    :class:`Node` once it printed its address and metrics URL; SIGTERM (then SIGKILL) it at the end."""
    from luwu.switch_nodes.lines import METRICS_LINE, READY_LINE

    secret = secrets.token_hex(16)
    env = dict(os.environ, PYTHONUNBUFFERED="1", LUWU_NODE__JOIN_SECRET=secret)
    with open(log, "w") as err:
        proc = subprocess.Popen(
            node_command(node_args, cgroup_procs),
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
        )
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # reads stdout for the node's whole life: it never blocks on a full pipe
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        address = url = ""
        deadline = time.monotonic() + start_timeout_s
        while not (address and url):
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(
                    f"node did not start within {start_timeout_s:g} s (exit {proc.poll()}): "
                    f"{log.read_text()[-2000:]}"
                )
            if line.startswith(READY_LINE):
                address = line.split()[1]
            elif line.startswith(METRICS_LINE):
                url = line.split()[1]
        yield Node(proc, address, url, log, secret)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


# ----------------------------------------------------------------- the workers
def worker(spec: dict) -> None:
    """One rank's training (a process of its own): step times and losses on stdout as JSON; rank 0
    saves the final weights (``model_state_dict()``, gathered from the node) to ``spec['out']``."""
    import torch

    import luwu

    torch.set_num_threads(1)
    rank, ws = spec["rank"], spec["world_size"]
    model = make_model(spec["width"], spec["depth"], meta=True)
    opt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=[spec["node"]],
        rank=rank,
        world_size=ws,
        stream_weights=True,
        compression=False,
        bucket_bytes=spec["bucket_bytes"],
        timeout_s=spec["timeout_s"],
        prefetch=2,
        lr=1e-3,
        weight_decay=0.01,
    )
    times, losses = [], []
    for step in range(spec["steps"]):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = (
            torch.randn(spec["batch"], 64, generator=g),
            torch.randint(0, 10, (spec["batch"],), generator=g),
        )
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"STEP {step} {times[-1]:.3f} s", file=sys.stderr, flush=True)
    if rank == 0:
        torch.save(opt.model_state_dict(), spec["out"])
    opt.close()
    print(json.dumps({"rank": rank, "step_s": times, "loss": losses}), flush=True)


def train(spec: dict, node: Node, timeout_s: float) -> dict:
    """Two worker processes against ``node``: {'ok', 'ranks' (their JSON), 'why' (when not ok)}. A node
    that exits meanwhile (killed by the cgroup) ends the workers at once."""
    env = dict(os.environ, LUWU_TRANSPORT__JOIN_SECRET=node.secret, PYTHONUNBUFFERED="1")
    procs, logs = [], []
    for rank in range(spec["world_size"]):
        logs.append(tempfile.TemporaryFile("w+"))
        s = dict(spec, rank=rank, node=node.address)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(s)],
                stdout=subprocess.PIPE,
                stderr=logs[-1],
                env=env,
                text=True,
            )
        )
    outs: list = [""] * len(procs)

    def read(i: int) -> None:
        outs[i] = procs[i].stdout.read()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline, why = time.monotonic() + timeout_s, ""
    while any(p.poll() is None for p in procs):
        if node.proc.poll() is not None:
            why = f"the node exited ({node.proc.returncode}) during training"
            break
        if time.monotonic() > deadline:
            why = f"not done within {timeout_s:g} s"
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    for t in readers:
        t.join(10)
    tails = []
    for rank, (p, f) in enumerate(zip(procs, logs)):
        f.seek(0)
        tails.append(f"rank {rank} (exit {p.returncode}): {f.read()[-600:]}")
        f.close()
    if not why and any(p.returncode for p in procs):
        why = "a worker failed"
    if why:
        return {"ok": False, "why": why, "workers": tails}
    return {"ok": True, "ranks": [json.loads(o.strip().splitlines()[-1]) for o in outs]}


# ----------------------------------------------------------------- one run in a cgroup
def run_case(
    name: str, spec: dict, node_args: list[str], limit: int, tmp: Path, timeout_s: float
) -> dict:
    """The node in a fresh cgroup of ``limit`` bytes, trained by the workers (``spec['steps']`` > 0) or
    left idle a second (0 steps: the baseline). The row of the run."""
    row: dict = {"run": name, "limit_mib": round(limit * MB, 1)}
    log = tmp / f"node-{re.sub(r'[^A-Za-z0-9.-]+', '_', name)}.log"
    with memory_cgroup(limit) as (procs, read):
        if procs is None:
            raise SystemExit(f"SKIPPED: {read}")
        counted = count_limit_hits(Path(procs).parent)
        t0 = time.perf_counter()
        try:
            with node_process(node_args, procs, log) as node:
                if spec["steps"]:
                    out = train(spec, node, timeout_s)
                else:
                    time.sleep(1.0)
                    out = {"ok": True, "ranks": []}
                alive = node.proc.poll() is None
                rc = node.proc.returncode
                if alive:
                    row["node_hwm_mib"] = round(status_bytes("VmHWM", node.proc.pid) * MB, 1)
                    row["node_rss_mib"] = round(status_bytes("VmRSS", node.proc.pid) * MB, 1)
                    row.update(short_metrics(node.metrics()))
        except RuntimeError as exc:  # the node did not even start
            out, alive, rc = {"ok": False, "why": str(exc)}, False, None
        if not alive:
            row["node_exit"] = {"code": rc, "log": node_exit(log)}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        cg = read()
    row.update(
        trained=out["ok"],
        cgroup_peak_mib=round(cg.get("peak_mb") or 0.0, 1),
        limit_hits=cg.get("limit_hits") if counted else None,
        oom_kills=cg.get("oom_kills", 0),
    )
    if out["ok"] and out["ranks"]:
        times = out["ranks"][0]["step_s"][1:] or out["ranks"][0]["step_s"]
        row["step_s_median"] = round(sorted(times)[len(times) // 2], 3)
        row["step_s"] = [round(t, 3) for t in out["ranks"][0]["step_s"]]
        row["loss_first_last"] = [round(out["ranks"][0]["loss"][i], 4) for i in (0, -1)]
    if not out["ok"]:
        row["why"] = out["why"]
        row["workers"] = out.get("workers", [])
    row["state_line"] = state_line(log)
    print(json.dumps(row), flush=True)
    return row


def count_limit_hits(cgroup: Path) -> bool:
    """Whether ``memory.failcnt`` will count the times the limit is hit. Cgroup v1 counts none while
    ``memory.memsw.limit_in_bytes`` (memory + swap) is as low as the limit (seen here: 0 after an OOM
    kill), so on a machine without swap that second limit, which binds nothing there, is lifted."""
    memsw, failcnt = cgroup / "memory.memsw.limit_in_bytes", cgroup / "memory.failcnt"
    if not failcnt.exists():
        return False
    if not memsw.exists():
        return True
    with open("/proc/meminfo") as f:
        swap = next((int(ln.split()[1]) for ln in f if ln.startswith("SwapTotal:")), 0)
    if swap:
        return False
    memsw.write_text("-1")
    return True


def short_metrics(m: dict[str, float]) -> dict:
    return {
        "state_read_mib": round(m["luwu_node_state_bytes_read_total"] * MB, 1),
        "state_written_mib": round(m["luwu_node_state_bytes_written_total"] * MB, 1),
        "state_io_wait_s": round(m["luwu_node_state_io_wait_seconds_total"], 2),
        "state_buffer_mib": round(m["luwu_node_state_buffer_bytes"] * MB, 1),
        "state_memory_mib": round(m["luwu_node_state_memory_bytes"] * MB, 1),
        # pushes in flight (node.push_memory_bytes: a share of state_memory_bytes out of core)
        "inflight_peak_mib": round(m["luwu_node_inflight_peak_bytes"] * MB, 1),
        "inflight_limit_mib": round(m["luwu_node_inflight_limit_bytes"] * MB, 1),
        "inflight_blocked_s": round(m["luwu_node_inflight_blocked_seconds_total"], 2),
        "inflight_overdrafts": int(m["luwu_node_inflight_overdrafts_total"]),
    }


def state_line(log: Path) -> str:
    """The node's start-up line that says where its state lives ('' when it logged none)."""
    text = log.read_text() if log.exists() else ""
    found = re.findall(r"node \d+: state [^\n]*", text)
    return found[-1] if found else ""


def node_exit(log: Path) -> str:
    """How a node that is gone ended, as far as its log tells (the exit code is the wrapper's)."""
    text = log.read_text() if log.exists() else ""
    return text.strip().splitlines()[-1][-300:] if text.strip() else "(no output: killed)"


def pick_dir() -> Path:
    """A new folder for the state files under /var/tmp or /tmp, on a disk (not a tmpfs)."""
    kinds = {}
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            kinds[mnt] = typ
    for base in ("/var/tmp", "/tmp"):
        mnt = max((m for m in kinds if base.startswith(m)), key=len, default="/")
        if os.path.isdir(base) and kinds.get(mnt) not in MEMORY_FS:
            return Path(tempfile.mkdtemp(prefix="luwu-bench-ooc-node-", dir=base))
    raise SystemExit("no disk-backed /var/tmp or /tmp: pass --dir on a real disk")


# ----------------------------------------------------------------- the study
def study(args, folder: Path) -> tuple[dict, str]:
    numel = model_numel(args.width, args.depth)
    state = state_bytes(numel)
    # a quarter of the state, but at least what one bucket needs out of core: two slots of its state
    # (12 B/param each) and its pushes in flight (16 B/param: node.push_memory_bytes' minimum)
    budget = args.state_memory_mib * MIB or max(state // 4, 10 * args.bucket_mib * MIB)
    spec = {
        "width": args.width,
        "depth": args.depth,
        "steps": args.steps,
        "batch": args.batch,
        "world_size": 2,
        "bucket_bytes": args.bucket_mib * MIB,
        "timeout_s": args.worker_timeout,
    }
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # a limit that never binds
    rows, limits = [], {}

    def capped(name: str, limit: int, tag: str) -> dict:
        ooc_args = ["--node.state_dir", str(folder / f"state-{tag}")]
        ooc_args += ["--node.state_memory_bytes", str(budget)]
        out = dict(spec, out=str(folder / f"ooc-{tag}.pt"))
        row = run_case(name, out, ooc_args, limit, folder, args.timeout)
        row["disk_state_mib"] = disk_state_mib(row.get("state_line", ""))
        rows.append(row)
        limits[tag] = limit
        return row

    with LoadMonitor() as load:
        base = run_case("baseline (idle node)", dict(spec, steps=0), [], free, folder, 120)
        rows.append(base)
        baseline = int(base["cgroup_peak_mib"] * MIB)
        ref = run_case(
            "in RAM", dict(spec, out=str(folder / "ref.pt")), [], free, folder, args.timeout
        )
        rows.append(ref)
        peak_ram = int(ref["cgroup_peak_mib"] * MIB)
        rule = "--limit-mib" if args.limit_mib else "baseline + state / 4"
        cap = capped(f"state_dir, {rule}", args.limit_mib * MIB or baseline + budget, "a")
        if not cap["trained"] and not args.limit_mib and peak_ram:
            # room for what the budget might not cover: what the in-RAM node used besides its
            # state, and half the state (the window is still a quarter)
            cap = capped("state_dir, in-RAM peak - state / 2", peak_ram - state // 2, "b")
            if not cap["trained"]:
                cap = capped("state_dir, in-RAM peak - state / 4", peak_ram - state // 4, "c")
        limit = limits[max(limits)]
        fail_steps = 1
        nodir = run_case(
            "no state_dir, same limit",
            dict(spec, steps=fail_steps, out=str(folder / "nodir.pt")),
            [],
            limit,
            folder,
            min(args.timeout, 300),
        )
        nodir["steps"] = fail_steps
        rows.append(nodir)
    ok = ref["trained"] and cap["trained"]
    diff = compare(folder / "ref.pt", Path(cap_out(folder, limits))) if ok else None
    result = {
        "width": args.width,
        "depth": args.depth,
        "params": numel,
        "steps": args.steps,
        "batch": args.batch,
        "bucket_mib": args.bucket_mib,
        "state_mib": round(state * MB, 1),
        "state_memory_bytes": budget,
        "baseline_mib": round(baseline * MB, 1),
        "in_ram_peak_mib": round(peak_ram * MB, 1),
        "in_flight_mib": round((peak_ram - baseline - state) * MB, 1),
        "limits_mib": {k: round(v * MB, 1) for k, v in limits.items()},
        "limit_over_state": round(limit / state, 3),
        "compared_run": cap["run"],
        "max_abs_diff": diff,
        # what the compared run's node held above the idle node, per node.state_memory_bytes
        "over_budget": round((cap["cgroup_peak_mib"] * MIB - baseline) / budget, 3),
        "argv": sys.argv[1:],
        "rows": rows,
        "load": load.info(),
        "machine": machine_info(),
    }
    return result, markdown(result, load.line())


def per_step(row: dict, key: str, r: dict) -> str:
    v = row.get(key)
    return f"{v / r['steps']:.0f}" if isinstance(v, (int, float)) else "n/a"


def cap_out(folder: Path, limits: dict) -> Path:
    return folder / f"ooc-{max(limits)}.pt"


def disk_state_mib(line: str) -> float | None:
    """The state's bytes on disk (one slot per bucket), from the node's start-up line."""
    m = re.search(r"(\d+) B on disk", line)
    return round(int(m.group(1)) * MB, 1) if m else None


def compare(a: Path, b: Path) -> float:
    """Max abs difference between two saved ``model_state_dict()`` s (inf where the names differ)."""
    import torch

    x, y = torch.load(a), torch.load(b)
    if x.keys() != y.keys():
        return float("inf")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def markdown(r: dict, load_line: str) -> str:
    rows = r["rows"]
    cap = next(x for x in rows if x["run"] == r["compared_run"])
    nodir = rows[-1]
    state_b = r["state_mib"] * MIB
    md = (
        "# An out-of-core node in a memory cgroup (bench_ooc_node)\n\n"
        f"A streaming model of {r['params'] / 1e6:.1f} M parameters (width {r['width']}, {r['depth']} "
        f"blocks): the node's AdamW state is {r['state_mib']:.0f} MiB (12 B/param; on disk "
        f"{cap.get('disk_state_mib')} MiB a slot, two slots a bucket). "
        f"node.state_memory_bytes = {r['state_memory_bytes'] * MB:.0f} MiB, {r['state_memory_bytes'] / state_b:.3g} "
        "of the state (the state window and "
        "the pushes in flight share it: node.push_memory_bytes, by default a quarter). The node alone "
        f"(Python, torch, ZeroMQ, no state) peaks at {r['baseline_mib']:.0f} MiB in its cgroup; the in-RAM "
        f"node at {r['in_ram_peak_mib']:.0f} MiB, {r['in_flight_mib']:.0f} MiB above baseline + state "
        "(gradient accumulators and replies in flight). Limits tried (MiB): "
        f"{r['limits_mib']}. 2 workers, {r['steps']} steps, batch {r['batch']}, buckets of "
        f"{r['bucket_mib']} MiB, compression off.\n\n"
    )
    cols = [
        "run",
        "limit_mib",
        "trained",
        "cgroup_peak_mib",
        "limit_hits",
        "oom_kills",
        "node_hwm_mib",
        "step_s_median",
        "state_read_mib",
        "state_written_mib",
        "state_io_wait_s",
        "inflight_peak_mib",
        "inflight_limit_mib",
        "inflight_blocked_s",
        "inflight_overdrafts",
        "seconds",
    ]
    md += md_table(rows, cols)
    diff = r["max_abs_diff"]
    md += (
        f"\n\n- weights after {r['steps']} steps, '{cap['run']}' vs in RAM: max abs difference "
        f"**{diff if diff is not None else 'n/a (a run failed)'}** (expected 0: compression off); "
        f"its limit is {r['limit_over_state']:.2f}x the state\n"
        f"- '{cap['run']}' held {cap['cgroup_peak_mib'] - r['baseline_mib']:.0f} MiB above the idle node "
        f"at its peak: **{r['over_budget']:.2f}x node.state_memory_bytes** (everything the node holds "
        "for its state, seeds, pushes and replies counts against it)\n"
        f"- '{cap['run']}' moved {per_step(cap, 'state_read_mib', r)} MiB read and "
        f"{per_step(cap, 'state_written_mib', r)} MiB written per step (the seed and the final "
        f"model_state_dict() included), against "
        f"{cap.get('disk_state_mib')} MiB of state on disk (the design's floor: the state once each "
        "way); the capped runs killed before they opened their state files: "
        f"{[x['run'] for x in rows if x['run'].startswith('state_dir') and not x['trained'] and not x.get('state_line')]}\n"
        f"- without state_dir under that limit ({nodir.get('steps')} step tried): "
        f"{'trained' if nodir['trained'] else 'failed: ' + nodir.get('why', '')}, "
        f"{nodir['oom_kills']} OOM kill(s)\n"
        "- cgroup_peak_mib: memory.max_usage_in_bytes (v1; page cache included); limit_hits: "
        "memory.failcnt (blank where the kernel does not count them: v1 with swap, whose "
        "memory+swap limit must stay); node_hwm_mib: the "
        "node's VmHWM (with shared library pages the cgroup does not pay for); step_s_median: rank 0's "
        "step (forward, backward, step), the first left out; state_*: the node's /metrics at the end. "
        "The baseline and in-RAM runs sit in cgroups limited to the machine's memory (never binding).\n"
        f"- {load_line}\n"
    )
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024, help="block width (default 1024)")
    ap.add_argument("--depth", type=int, default=8, help="blocks (default 8: 0.8 GB of state)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mib", type=int, default=4, help="transport.bucket_bytes in MiB")
    ap.add_argument(
        "--limit-mib",
        type=int,
        default=0,
        help="the capped runs' limit (default: baseline + state/4)",
    )
    ap.add_argument(
        "--state-memory-mib",
        type=int,
        default=0,
        help="node.state_memory_bytes of the capped runs (default: a quarter of the state); with "
        "--limit-mib at a quarter of the state, what the cgroup leaves besides the node's baseline",
    )
    ap.add_argument("--dir", type=Path, default=None, help="folder for the state files (on a disk)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds a training run may take")
    ap.add_argument("--worker-timeout", type=float, default=120, help="the workers' timeout_s")
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: width 256, 4 blocks, 4 steps"
    )
    ap.add_argument(
        "--name",
        default="bench_ooc_node",
        help="results file name (benchmarks/results/NAME.json, .md)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.quick:
        args.width, args.depth, args.steps, args.bucket_mib = 256, 4, 4, 1
    own = args.dir is None
    folder = pick_dir() if own else args.dir
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result, md = study(args, folder)
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    write_results(args.name, result, md, quick=args.quick)


if __name__ == "__main__":
    main()

"""One training process of the emulated-cluster head-to-head: the task, DDP or LuWu, and what it measures.

``cluster_study.py`` starts this script once per worker host, inside that
host's network namespace, with the path of a JSON spec (:class:`RunSpec` as a
dict). The process trains the teacher-student task for ``steps`` steps with
either DDP over gloo (``fp32``, ``bf16`` compression hook, ``powersgd``), torch
FSDP2 over gloo, or ``luwu.RemoteOptimizer`` (nodes, capacities, delayed update,
streaming and compression read from a cluster file, as a real job would), and
writes one JSON result, with the process's peak RSS above its runtime floor.

The task: inputs ``x = z @ U`` with ``z ~ N(0, I_k)`` (a fixed k-dimensional
subspace of R^d_in), labels ``argmax teacher(x)`` of a fixed random ReLU MLP.
Every worker draws its own batches from a seed of (task seed, rank), the same
in every competitor, so all of them see the same global batches; the eval set
is fixed. The student is an MLP ``dims`` (default 1024 -> 2048 x4 -> 1000,
16.7M parameters) with the same initial weights everywhere.

Measured over the timed window (steps ``warmup``.. ``steps``-1): per-step wall
time, forward+backward and optimizer time; the process's CPU seconds (all
threads); its host's kernel byte counters (``/proc/self/net/dev``: every byte
on the emulated wire, headers included). Rank 0 also reads the node
processes' CPU and their hosts' counters (``/proc/<pid>/...``: the same pid
namespace, their network namespace) and the machine's busy cores. Rank 0
keeps a copy of the weights every ``eval_every`` steps with the training clock
(wall seconds of steps since step 0, copies excluded) and evaluates them after
training, so evaluation never perturbs the timing.

Imports nothing from the benchmarks folder, so it starts alone in a namespace.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repo root: `benchmarks` as a package, also when run by path inside a host
from benchmarks.common import bf16_allreduce_hook, make_student, node_threads_delta, threads_cpu_s  # noqa: E402

IFACE = "eth0"


# ----------------------------------------------------------------------------- the task


class TeacherTask:
    """Teacher-student classification on a low-dimensional input subspace (all tensors from fixed seeds)."""

    def __init__(
        self,
        *,
        d_in: int,
        classes: int,
        subspace: int = 16,
        teacher_hidden: int = 256,
        seed: int = 1234,
    ):
        self.d_in, self.classes, self.subspace, self.seed = d_in, classes, subspace, seed
        g = torch.Generator().manual_seed(seed)
        self.basis = torch.randn(subspace, d_in, generator=g) / math.sqrt(subspace)
        self.w1 = torch.randn(d_in, teacher_hidden, generator=g) / math.sqrt(d_in)
        self.w2 = torch.randn(teacher_hidden, classes, generator=g) / math.sqrt(teacher_hidden)

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.subspace, generator=gen) @ self.basis
        return x, (torch.relu(x @ self.w1) @ self.w2).argmax(1)

    def batches(self, rank: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batch of every step: the same in every competitor."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + 17 + rank)
        return [self.sample(batch, gen) for _ in range(steps)]

    def eval_set(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(n, torch.Generator().manual_seed(self.seed * 1000 + 999))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> float:
    total = 0.0
    for i in range(0, len(x), chunk):
        total += float(
            torch.nn.functional.cross_entropy(
                model(x[i : i + chunk]), y[i : i + chunk], reduction="sum"
            )
        )
    return total / len(x)


# ----------------------------------------------------------------------------- /proc readers


def net_bytes(pid: int | str = "self", iface: str = IFACE) -> tuple[int, int]:
    """(rx, tx) bytes of ``iface`` in the network namespace of process ``pid``; (-1, -1) if unreadable."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == iface:
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    except OSError:
        pass
    return -1, -1


def tcp_counters(pid: int | str = "self") -> tuple[int, int]:
    """(segments retransmitted, retransmission timeouts) of the network namespace of process ``pid``."""
    retrans = timeouts = -1
    try:
        for path, table, key in (
            (f"/proc/{pid}/net/snmp", "Tcp:", "RetransSegs"),
            (f"/proc/{pid}/net/netstat", "TcpExt:", "TCPTimeouts"),
        ):
            with open(path) as f:
                rows = [line.split() for line in f if line.startswith(table)]
            value = int(dict(zip(rows[0][1:], rows[1][1:]))[key])
            if key == "RetransSegs":
                retrans = value
            else:
                timeouts = value
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return retrans, timeouts


def disk_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(read, written) bytes a process made the block layer move (``/proc/<pid>/io``: O_DIRECT
    included, the page cache's hits not); (-1, -1) if unreadable."""
    try:
        with open(f"/proc/{pid}/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines())
        return int(io["read_bytes"]), int(io["write_bytes"])
    except (OSError, KeyError, ValueError):
        return -1, -1


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, all threads (NaN if unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


_PF_KTHREAD = 0x00200000


def all_processes_cpu() -> dict[int, tuple[float, bool]]:
    """pid -> (CPU seconds so far, is a kernel thread) of every process on the machine."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(name)] = (
                (int(fields[11]) + int(fields[12])) / tck,
                bool(int(fields[6]) & _PF_KTHREAD),
            )
        except (OSError, ValueError, IndexError):
            continue
    return out


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def node_io_wait_s(client, node: int) -> float:
    """Seconds ``node`` has waited for its out-of-core state so far (its STATS ``state_io_wait_s``:
    the loop and the optimizer thread blocked on the state window's reads and write-backs; 0 for a
    node whose state is in RAM)."""
    from luwu.protocol.messages import Op

    client.send(node, {"op": Op.STATS}, [])
    (msg,) = client.wait(
        [(Op.STATS, node, None, -1)], what="STATS (state I/O wait)", errors_of=(Op.STATS,)
    )
    return float(msg.header.get("detail", {}).get("state_io_wait_s", 0.0))


def _snapshot(
    node_pids: list[int], client=None, *, machine: bool = False, watch: list[dict] = ()
) -> dict:
    """Counters at one point of the run; ``node_pids`` in the nodes' index order (rank 0 only);
    ``watch``: more processes to read (``{"name", "pid", "iface"}``: its CPU and the counters of
    ``iface`` in its network namespace), e.g. aggregators, or an idle process beside a switch."""
    return {
        "watch": [
            (w["name"], cpu_seconds(w["pid"]), net_bytes(w["pid"], w["iface"])) for w in watch
        ],
        "procs": all_processes_cpu() if machine else {},
        "node_pids": list(node_pids),
        "payload": (client.bytes_sent, client.bytes_received) if client is not None else (0, 0),
        "t": time.perf_counter(),
        "cpu": time.process_time(),
        "net": net_bytes(),
        "tcp": tcp_counters(),
        "nodes": [
            (
                cpu_seconds(p),
                net_bytes(p),
                threads_cpu_s(p),
                tcp_counters(p),
                disk_bytes(p),
                node_io_wait_s(client, i) if client is not None else 0.0,
            )
            for i, p in enumerate(node_pids)
        ],
        "machine": busy_jiffies(),
    }


def _window(a: dict, b: dict, steps: int, ours: set[int]) -> dict:
    """Per-step numbers between two snapshots."""
    wall = b["t"] - a["t"]
    out = {
        "wall_s": wall,
        "cpu_s": b["cpu"] - a["cpu"],
        "cpu_share": (b["cpu"] - a["cpu"]) / wall,
        "rx_bytes_per_step": (b["net"][0] - a["net"][0]) / steps,
        "tx_bytes_per_step": (b["net"][1] - a["net"][1]) / steps,
        "payload_tx_per_step": (b["payload"][0] - a["payload"][0]) / steps,
        "payload_rx_per_step": (b["payload"][1] - a["payload"][1]) / steps,
        "tcp_retrans_per_step": (b["tcp"][0] - a["tcp"][0]) / steps,
        "tcp_timeouts_per_step": (b["tcp"][1] - a["tcp"][1]) / steps,
    }
    nodes = []
    for pid, (c0, n0, t0, r0, d0, w0), (c1, n1, t1, r1, d1, w1) in zip(
        a["node_pids"], a["nodes"], b["nodes"]
    ):
        roles = {k: v / steps for k, v in node_threads_delta(pid, t0, t1).items()}
        nodes.append(
            {
                "cpu_s": c1 - c0,
                "cpu_share": (c1 - c0) / wall,
                "cpu_s_per_step_by_role": roles,
                "tcp_retrans_per_step": (r1[0] - r0[0]) / steps,
                "tcp_timeouts_per_step": (r1[1] - r0[1]) / steps,
                "rx_bytes_per_step": (n1[0] - n0[0]) / steps,
                "tx_bytes_per_step": (n1[1] - n0[1]) / steps,
                "disk_bytes_per_step": (d1[0] - d0[0] + d1[1] - d0[1]) / steps,
                "io_wait_s_per_step": (w1 - w0) / steps,
            }
        )
    out["nodes"] = nodes
    out["watched"] = _watched(a, b, steps, wall)
    (busy0, tot0), (busy1, tot1) = a["machine"], b["machine"]
    out["machine_busy_cores"] = (busy1 - busy0) / max(1, tot1 - tot0) * (os.cpu_count() or 1)
    # everyone else's CPU: user processes not in this run, and kernel threads (softirq work of the
    # emulated links lands partly there); a process born during the window counts from zero
    other = kernel = 0.0
    for pid, (cpu, is_kernel) in b["procs"].items():
        if pid in ours:
            continue
        used = cpu - a["procs"].get(pid, (0.0, is_kernel))[0]
        if is_kernel:
            kernel += used
        else:
            other += used
    out["other_user_cores"], out["kernel_thread_cores"] = other / wall, kernel / wall
    return out


def _watched(a: dict, b: dict, steps: int, wall: float) -> dict:
    """The watched processes between two snapshots, by name: CPU share, bytes per step."""
    out = {}
    for (name, c0, n0), (_, c1, n1) in zip(a["watch"], b["watch"]):
        out[name] = {
            "cpu_share": (c1 - c0) / wall,
            "rx_bytes_per_step": (n1[0] - n0[0]) / steps,
            "tx_bytes_per_step": (n1[1] - n0[1]) / steps,
        }
    return out


# ----------------------------------------------------------------------------- the process


def _barrier(run_dir: Path, name: str, rank: int, world: int, timeout_s: float = 120.0) -> None:
    """All workers share the machine's file system (only the network is namespaced): a file barrier.
    Each rank's file holds its pid."""
    (run_dir / f"{name}.{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + timeout_s
    while not all((run_dir / f"{name}.{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not (run_dir / f"{name}.{r}").exists()]
            raise TimeoutError(
                f"rank {rank}: ranks {missing} did not reach barrier {name!r} in {timeout_s:.0f} s"
            )
        time.sleep(0.005)


def _init_gloo(spec: dict) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = (
        spec["master_addr"],
        str(spec["master_port"]),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", IFACE)
    dist.init_process_group(
        "gloo",
        rank=spec["rank"],
        world_size=spec["world"],
        timeout=__import__("datetime").timedelta(seconds=spec["timeout_s"]),
    )


def _setup_fsdp(spec: dict, model: torch.nn.Module):
    """torch FSDP2 as a new user sets it up: ``fully_shard`` on every layer with parameters (one unit per
    block, as LuWu streams them), then on the model; AdamW on the sharded parameters, over gloo."""
    from torch.distributed.fsdp import fully_shard

    _init_gloo(spec)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    try:
        opt = torch.optim.AdamW(
            model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"], fused=True
        )
    except (
        RuntimeError,
        TypeError,
    ):  # a torch without fused AdamW for sharded (DTensor) CPU parameters
        opt = torch.optim.AdamW(
            model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"]
        )
    return model, opt


def _weights(spec: dict, model: torch.nn.Module, opt) -> list[torch.Tensor] | None:
    """A copy of the current weights in parameter order (FSDP2: gathered, a collective every rank joins;
    LuWu streaming: fetched from the nodes); None on ranks that keep nothing."""
    if spec["kind"] == "fsdp":
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        return full if spec["rank"] == 0 else None
    if spec["rank"] != 0:
        return None
    if spec["kind"] == "luwu" and opt.streamer is not None:
        sd = opt.model_state_dict()
        return [sd[n] for n, _ in model.named_parameters()]
    return [p.detach().clone() for p in model.parameters()]


class Timeline:
    """When each bucket of one step was pushed (handed to the I/O thread), answered (its reply delivered by
    the I/O thread) and written into the parameters (the training thread's wait for it over), in ms from the
    step's start (``zero_grad``), with the step's own marks: forward done, backward done, ``step()``
    returned, and the next step's forward done (per-layer waits write the weights there)."""

    def __init__(self, opt, step: int):
        from luwu.protocol.messages import Op

        self.step, self.t0, self.on = step, None, False
        self.buckets: dict[int, dict] = {}
        self.marks: dict[str, float] = {}
        w, c = opt.worker, opt.client
        send, deliver, write = c.send, c.channels.deliver, w.writer.write

        def timed_send(node, header, payload=(), priority=None):
            if self.on and header.get("op") == Op.PUSH and header.get("step") == step:
                self._at(header["bucket"], "pushed")
            return send(node, header, payload, priority)

        def timed_deliver(node, msg):
            h = msg.header
            if self.on and h["op"] == Op.UPDATE and h.get("seq") == step:
                self._at(h["bucket"], "answered")
            return deliver(node, msg)

        def timed_write(bid, msg):
            out = write(bid, msg)
            if self.on and "answered" in self.buckets.get(bid, {}):
                self._at(bid, "written")
            return out

        c.send, c.channels.deliver, w.writer.write = timed_send, timed_deliver, timed_write

    def _at(self, bid: int, what: str) -> None:
        self.buckets.setdefault(bid, {}).setdefault(what, (time.perf_counter() - self.t0) * 1e3)

    def mark(self, i: int, what: str) -> None:
        """The loop's marks: ``start`` of step ``self.step`` turns recording on; the next step's ``forward`` ends it."""
        now = time.perf_counter()
        if i == self.step and what == "start":
            self.t0, self.on = now, True
        if self.on and i in (self.step, self.step + 1):
            self.marks[what if i == self.step else f"next {what}"] = (now - self.t0) * 1e3
        if i == self.step + 1 and what == "forward":
            self.on = False

    def result(self, layout) -> dict:
        """Buckets in forward order (the first layer's first) with their sizes and times."""
        rows = [
            {"bucket": b.id, "numel": b.numel, "node": b.node, **self.buckets.get(b.id, {})}
            for b in reversed(layout.buckets)
        ]
        return {"step": self.step, "marks": self.marks, "buckets": rows}


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _setup_ddp(spec: dict, model: torch.nn.Module):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    _init_gloo(spec)
    variant = spec["variant"]
    # PowerSGD chains collectives in future callbacks; over gloo, those of several buckets reach the wire in
    # different orders on different ranks (a collective mismatch that aborts gloo), so it gets one bucket
    bucket_mb = (
        {"bucket_cap_mb": 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1}
        if variant == "powersgd"
        else {}
    )
    net = torch.nn.parallel.DistributedDataParallel(model, **bucket_mb)
    if variant == "bf16":
        net.register_comm_hook(None, bf16_allreduce_hook)
    elif variant == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=spec["powersgd_rank"],
            start_powerSGD_iter=spec["powersgd_start"],
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif variant != "fp32":
        raise ValueError(f"unknown DDP variant {variant!r}")
    opt = torch.optim.AdamW(
        net.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"], fused=True
    )
    return net, opt


def _setup_luwu(spec: dict, model: torch.nn.Module):
    import luwu
    from luwu.config import load_config

    secret = "LUWU_TRANSPORT__JOIN_SECRET"  # the study's nodes ask for it: the one setting not in the cluster file
    cfg = load_config(
        spec["cluster_file"], env={secret: os.environ[secret]} if secret in os.environ else {}
    )
    opt = luwu.RemoteOptimizer.from_config(
        model,
        cfg,
        rank=spec["rank"],
        world_size=spec["world"],
        lr=spec["lr"],
        weight_decay=spec["weight_decay"],
    )
    return model, opt


def train(spec: dict) -> dict:
    import luwu  # noqa: F401  (in the runtime floor of every competitor)

    torch.set_num_threads(1)
    floor = _vm_hwm()  # the peak of a process that imported torch and luwu and built nothing
    rank, world, steps, warmup = spec["rank"], spec["world"], spec["steps"], spec["warmup"]
    run_dir = Path(spec["run_dir"])
    task = TeacherTask(
        d_in=spec["dims"][0],
        classes=spec["dims"][-1],
        subspace=spec["subspace"],
        seed=spec["task_seed"],
    )
    data = task.batches(rank, steps, spec["batch"])
    eval_xy = task.eval_set(spec["eval_samples"]) if rank == 0 else None
    model = make_student(spec["dims"])
    net, opt = {"ddp": _setup_ddp, "fsdp": _setup_fsdp, "luwu": _setup_luwu}[spec["kind"]](
        spec, model
    )
    # rank 0's timeline of one timed step (and the next forward, where per-layer waits write its weights)
    # (a step after which no eval snapshot reads the weights: it would wait for all of them at once)
    at = next(
        k
        for k in range(warmup + 1, warmup + 1 + spec["eval_every"])
        if (k + 1) % spec["eval_every"]
    )
    tl = Timeline(opt, at) if spec["kind"] == "luwu" and rank == 0 and steps > at + 1 else None
    node_pids = spec.get("node_pids", []) if rank == 0 else []
    watch = spec.get("watch", []) if rank == 0 else []
    client = opt.client if spec["kind"] == "luwu" else None
    _barrier(run_dir, "start", rank, world)

    recs, snaps, clock = [], [], 0.0
    if (w := _weights(spec, model, opt)) is not None:
        snaps.append((0, 0.0, w))
    start = end = None
    for i, (x, y) in enumerate(data):
        if i == warmup:
            if spec["kind"] == "luwu":
                opt.synchronize()  # the replies of the steps before arrived (per-layer waits): exact byte counters
            # every rank between the same two steps: the byte counters of all hosts cover the same steps
            _barrier(run_dir, "window", rank, world)
            start = _snapshot(node_pids, client, machine=rank == 0, watch=watch)
            _barrier(
                run_dir, "window_go", rank, world
            )  # nobody sends step `warmup` before every snapshot
        t0, c0 = time.perf_counter(), time.thread_time()
        tl and tl.mark(i, "start")
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        tl and tl.mark(i, "forward")
        loss.backward()
        t1, c1 = time.perf_counter(), time.thread_time()
        tl and tl.mark(i, "backward")
        opt.step()
        t2, c2 = time.perf_counter(), time.thread_time()
        tl and tl.mark(i, "step")
        clock += t2 - t0
        # wall and training-thread CPU seconds of forward+backward (gradient hooks included) and of step()
        recs.append(
            {
                "step_s": t2 - t0,
                "fb_s": t1 - t0,
                "opt_s": t2 - t1,
                "fb_cpu_s": c1 - c0,
                "opt_cpu_s": c2 - c1,
                "loss": float(loss.detach()),
                "fetch_s": getattr(getattr(opt, "last_report", None), "fetch_wait_s", 0.0),
            }
        )
        if (
            (i + 1) % spec["eval_every"] == 0
            and i + 1 < steps
            and (w := _weights(spec, model, opt)) is not None
        ):
            snaps.append((i + 1, clock, w))
    t0 = time.perf_counter()
    if spec["kind"] == "luwu":
        opt.synchronize()  # the last step's weights (delayed update, per-layer waits)
    clock += time.perf_counter() - t0
    _barrier(run_dir, "window_end", rank, world)
    end = _snapshot(node_pids, client, machine=rank == 0, watch=watch)
    ours = (
        {int((run_dir / f"start.{r}").read_text()) for r in range(world)}
        | set(node_pids)
        | {w["pid"] for w in watch}
        | {spec["study_pid"]}
    )
    if (w := _weights(spec, model, opt)) is not None:
        snaps.append((steps, clock, w))
    result = {
        "rank": rank,
        "recs": recs,
        "window": _window(start, end, steps - warmup, ours) if start else None,
        "train_clock_s": clock,
        "peak_mb": (_vm_hwm() - floor) / 2**20,
        "floor_mb": floor / 2**20,
    }
    if spec["kind"] == "luwu":
        result["payload_sent"], result["payload_received"] = (
            opt.client.bytes_sent,
            opt.client.bytes_received,
        )
        result["layout"] = {
            "buckets": [[b.numel, b.node] for b in opt.layout.buckets],
            "hash": opt.layout.hash,
        }
        result["timeline"] = tl.result(opt.layout) if tl is not None else None
    if rank == 0:
        curve, plain = (
            [],
            make_student(spec["dims"]),
        )  # a plain copy to evaluate (sharded or streamed weights are not)
        for step, at, weights in snaps:
            with torch.no_grad():
                for p, w in zip(plain.parameters(), weights):
                    p.copy_(w)
            curve.append({"step": step, "clock_s": at, "eval_loss": eval_loss(plain, *eval_xy)})
        result["curve"] = curve
    _barrier(run_dir, "done", rank, world)
    if spec["kind"] == "luwu":
        opt.close()
    else:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


def burn(dims: list[int], batch: int) -> None:
    """Forward + backward in a loop until killed: keeps a core busy the way a worker does (calibration)."""
    torch.set_num_threads(1)
    model = make_student(dims)
    x, y = torch.randn(batch, dims[0]), torch.randint(0, dims[-1], (batch,))
    print("ready", flush=True)
    while True:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--burn"]:
        burn([int(d) for d in argv[1].split(",")], int(argv[2]))
        return 0
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(spec["result_path"])
    try:
        result = train(spec)
    except BaseException as exc:
        out.write_text(
            json.dumps(
                {
                    "rank": spec.get("rank"),
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            )
        )
        raise
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

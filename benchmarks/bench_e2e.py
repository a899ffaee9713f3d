"""End to end training throughput: LuWu vs DDP over gloo vs one process (issue 4, benchmark 4).

An MLP of 16.7M parameters (1024 -> 2048 x4 -> 1000, ReLU), batch 64 per
worker of random data, cross-entropy, AdamW (lr 1e-3, weight decay 0.01).
Each configuration runs in fresh processes with 1 torch thread each, on
loopback:

- ``single``: one process, ``torch.optim.AdamW(fused=True)``, batch 64;
- ``ddp``: 2 processes, ``DistributedDataParallel`` over gloo, AdamW(fused=True)
  (the strongest plain-torch competitor), and ``ddp_default`` with torch's
  default AdamW (what most scripts write);
- ``ddp_bf16``: DDP with torch's ``bf16_compress_hook`` (the competitor's own
  gradient compression, halving its all-reduce bytes);
- ``luwu_sync`` and ``luwu_delayed``: 2 worker processes with
  ``RemoteOptimizer`` (``delayed_update`` off / on) and 1 node daemon, fp32
  both ways; ``luwu_hybrid_sync`` / ``luwu_hybrid_delayed``: the same with
  ``compression=CompressionConfig(link_gbps=...)``: the hybrid policy told the
  link's speed (``--link-gbps``, default 40: loopback moves ~44 Gbit/s between
  two processes here, see bench_links), so its cost rule picks what pays on it
  (on loopback: bf16 both ways, int8's encode costs more than the wire time it
  saves); after 10 bf16 warm-up steps, which ``--warmup 12`` skips.
  A ``_stepwait`` suffix (``luwu_sync_stepwait``...) turns the per-layer waits off
  (``optimizer.layer_waits = false``): ``step()`` waits for every bucket's weights.

Samples/s = global batch / median step time over the steps after warm-up (the
slower rank's median); configurations alternate over repetitions and the
ratios vs DDP are also given per repetition (``_paired``). LuWu's step is
broken down into forward+backward (gradient hooks push buckets during it),
pushing the rest (``Worker.finish``), waiting for the weights, writing them,
and the node's optimizer seconds per step (its ``/metrics``). Targets: sync
>= 1.0x DDP, delayed >= 1.3x DDP.

    python3 benchmarks/bench_e2e.py [--quick] [--steps N] [--reps R]

Writes benchmarks/results/bench_e2e.json and .md (``--quick``: .quick.*).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from pathlib import Path

import torch
from common import (
    RESULTS,
    LoadMonitor,
    bf16_allreduce_hook,
    machine_info,
    make_student,
    md_table,
    median,
    node_threads_delta,
    proc_usage,
    threads_cpu_s,
    verdict,
    write_results,
)

BATCH = 64
WORLD = 2
LR = 1e-3
WD = 0.01
DIMS = (1024, 2048, 2048, 2048, 2048, 1000)


def make_model() -> torch.nn.Module:
    return make_student(list(DIMS), seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_opt_seconds(url: str) -> tuple[float, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    vals = {}
    for ln in text.splitlines():
        if ln.startswith("luwu_node_optimizer_step_seconds_"):
            name, _, v = ln.rpartition(" ")
            vals[name] = float(v)
    return vals.get("luwu_node_optimizer_step_seconds_sum", 0.0), vals.get(
        "luwu_node_optimizer_step_seconds_count", 0.0
    )


def _train(kind: str, rank: int, world: int, cfg: dict, q) -> None:
    """One training process: ``cfg['warmup'] + cfg['steps']`` steps; reports per-step times on ``q``."""
    import luwu  # before any tensor, in every competitor: torch's huge pages for all (luwu/__init__)

    try:
        torch.set_num_threads(1)
        model = make_model()
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(BATCH, DIMS[0], generator=g)
        y = torch.randint(0, DIMS[-1], (BATCH,), generator=g)
        opt = timed = None
        if kind.startswith("ddp"):
            import torch.distributed as dist

            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(cfg["port"])
            dist.init_process_group("gloo", rank=rank, world_size=world)
            net = torch.nn.parallel.DistributedDataParallel(model)
            if kind == "ddp_bf16":
                net.register_comm_hook(None, bf16_allreduce_hook)
            opt = torch.optim.AdamW(
                net.parameters(), lr=LR, weight_decay=WD, fused=kind != "ddp_default"
            )
        elif kind == "single":
            net = model
            opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)
        else:
            net = model
            compression = False  # fp32 both ways unless the kind says hybrid
            if "hybrid" in kind:
                from luwu.protocol.policy import CompressionConfig

                compression = CompressionConfig(
                    link_gbps="auto" if "_auto" in kind else cfg["link_gbps"]
                )  # (_auto: measured)
            opt = luwu.RemoteOptimizer(
                model,
                "adamw",
                nodes=cfg["nodes"],
                rank=rank,
                world_size=world,
                job=cfg["job"],
                lr=LR,
                weight_decay=WD,
                delayed_update=kind.endswith("delayed"),
                compression=compression,
                layer_waits=not kind.endswith("_stepwait"),
            )
            timed = {"finish": 0.0, "wait": 0.0}

            def timing(name, inner):
                def call(*args):
                    t0 = time.perf_counter()
                    try:
                        return inner(*args)
                    finally:
                        timed[name] += time.perf_counter() - t0

                return call

            opt.worker.finish = timing("finish", opt.worker.finish)
            # the whole of Worker.wait: waiting for the replies, then writing the weights into the parameters
            opt.worker.wait = timing("wait", opt.worker.wait)
        recs = []
        node0 = None
        t_start = 0.0
        for i in range(cfg["warmup"] + cfg["steps"]):
            if i == cfg["warmup"]:
                if rank == 0 and cfg.get("metrics_url"):
                    node0 = _node_opt_seconds(cfg["metrics_url"]) + (
                        proc_usage(cfg["node_pid"])[0],
                        threads_cpu_s(cfg["node_pid"]),
                    )
                t_start = time.perf_counter()
                c_start = time.process_time()
                if timed is not None:
                    opt.synchronize()
                    bytes0 = (opt.client.bytes_sent, opt.client.bytes_received)
            t0 = time.perf_counter()
            if timed is not None:
                timed["finish"] = timed["wait"] = 0.0
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i >= cfg["warmup"]:
                r = {"step": t2 - t0, "fb": t1 - t0, "opt": t2 - t1}
                if timed is not None:
                    r["finish"] = timed["finish"]
                    r["wait_all"] = timed["wait"]
                    r["wait"] = opt.last_report.update_wait_s
                recs.append(r)
        elapsed = time.perf_counter() - t_start
        cpu_s = time.process_time() - c_start
        wire = None
        if timed is not None:
            opt.synchronize()
            wire = (
                (opt.client.bytes_sent - bytes0[0]) / cfg["steps"],
                (opt.client.bytes_received - bytes0[1]) / cfg["steps"],
            )
        node = None
        if node0 is not None:
            cpu1, th1 = proc_usage(cfg["node_pid"])[0], threads_cpu_s(cfg["node_pid"])
            s1, c1 = _node_opt_seconds(cfg["metrics_url"])
            node = {
                "opt_s": s1 - node0[0],
                "buckets": c1 - node0[1],
                "cpu_s": cpu1 - node0[2],
                "threads_s": node_threads_delta(cfg["node_pid"], node0[3], th1),
            }
        if kind.startswith("luwu"):
            opt.synchronize()
            opt.close()
        elif kind.startswith("ddp"):
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
        q.put(
            (
                "ok",
                rank,
                {
                    "recs": recs,
                    "elapsed": elapsed,
                    "cpu_s": cpu_s,
                    "node": node,
                    "loss": float(loss.detach()),
                    "wire": wire,
                },
            )
        )
    except BaseException as exc:
        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def run_config(kind: str, cfg: dict, timeout_s: float = 600.0) -> dict:
    world = 1 if kind == "single" else WORLD
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cluster_cm = None
    cfg = dict(cfg)
    if kind.startswith("luwu"):
        import luwu

        cfg["job"] = f"bench-e2e-{kind}-{os.getpid()}-{time.monotonic_ns()}"
        cluster_cm = luwu.local_cluster(1, job=cfg["job"], node_args=["--metrics.port", "0"])
        cluster = cluster_cm.__enter__()
        cfg["nodes"], cfg["metrics_url"], cfg["node_pid"] = (
            cluster.addresses,
            cluster.metrics_urls[0],
            cluster.procs[0].pid,
        )
    elif kind.startswith("ddp"):
        cfg["port"] = free_port()
    procs = [
        ctx.Process(target=_train, args=(kind, r, world, cfg, q), daemon=True) for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        out: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            try:
                status, rank, payload = q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"{kind}: a process failed or timed out (exit codes {[p.exitcode for p in procs]})"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"{kind} rank {rank} failed: {payload}")
            out[rank] = payload
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if cluster_cm is not None:
            cluster_cm.__exit__(None, None, None)
    return summarize(kind, world, out)


def summarize(kind: str, world: int, out: dict[int, dict]) -> dict:
    meds = {r: median([s["step"] for s in o["recs"]]) for r, o in out.items()}
    slow = max(meds, key=meds.get)
    recs = out[slow]["recs"]
    t_step = meds[slow]
    steps = len(recs)
    res = {
        "kind": kind,
        "world": world,
        "step_ms": t_step * 1e3,
        "samples_per_s": world * BATCH / t_step,
        "samples_per_s_wall": world * BATCH * steps / max(o["elapsed"] for o in out.values()),
        "fb_ms": median([s["fb"] for s in recs]) * 1e3,
        "opt_ms": median([s["opt"] for s in recs]) * 1e3,
        "loss": out[0]["loss"],
    }
    # CPU seconds of every process (workers, and the node) over the timed steps: what the step costs the
    # machine, which other processes' load inflates far less than wall time
    cpu = sum(o["cpu_s"] for o in out.values())
    node = out[0].get("node")
    if node:
        cpu += node["cpu_s"]
    res["worker_cpu_ms_per_step"] = sum(o["cpu_s"] for o in out.values()) / len(out) / steps * 1e3
    res["node_cpu_ms_per_step"] = node["cpu_s"] / steps * 1e3 if node else float("nan")
    res["cpu_ms_per_step"] = cpu / steps * 1e3
    res["samples_per_cpu_s"] = world * BATCH * steps / cpu
    if kind.startswith("luwu"):
        res["push_MB_per_step"], res["pull_MB_per_step"] = (x / 1e6 for x in out[0]["wire"])
        res["finish_ms"] = median([s["finish"] for s in recs]) * 1e3
        res["wait_weights_ms"] = median([s["wait"] for s in recs]) * 1e3
        # per-layer waits write the weights inside the next forward (in fb), where they are not timed apart
        res["write_ms"] = (
            median([s["wait_all"] - s["wait"] for s in recs]) * 1e3
            if kind.endswith("_stepwait") or "delayed" in kind
            else float("nan")
        )
        node = out[0]["node"]
        res["node_opt_ms_per_step"] = node["opt_s"] / steps * 1e3 if node else float("nan")
        res["node_buckets_per_step"] = node["buckets"] / steps if node else float("nan")
        for k, v in (node["threads_s"] if node else {}).items():
            res[f"node_{k}_cpu_ms_per_step"] = v / steps * 1e3
    return res


def why_lines(by: dict[str, dict]) -> list[str]:
    """Where LuWu's step goes against DDP's, from this run's numbers."""
    if "ddp" not in by or not any(k.startswith("luwu") for k in by):
        return []
    d = by["ddp"]
    out = ["Where the time goes (this run):", ""]
    for kind in ("luwu_sync", "luwu_delayed", "luwu_hybrid_sync", "luwu_hybrid_delayed"):
        r = by.get(kind)
        if r is None:
            continue
        out.append(
            f"- {kind}: {r['cpu_ms_per_step']:.0f} CPU-ms per step against DDP's {d['cpu_ms_per_step']:.0f} (per worker {r['worker_cpu_ms_per_step']:.0f} "
            f"vs {d['worker_cpu_ms_per_step']:.0f}; the node {r['node_cpu_ms_per_step']:.0f}: ZeroMQ I/O {r.get('node_zmq_io_cpu_ms_per_step', float('nan')):.0f}, "
            f"event loop {r.get('node_loop_cpu_ms_per_step', float('nan')):.0f}, optimizer thread {r.get('node_optimizer_thread_cpu_ms_per_step', float('nan')):.0f}). "
            f"Forward+backward {r['fb_ms']:.0f} ms (DDP {d['fb_ms']:.0f}, one process {by['single']['fb_ms'] if 'single' in by else float('nan'):.0f}), "
            f"waiting for weights {r['wait_weights_ms']:.0f} ms, writing them "
            + (
                f"{r['write_ms']:.0f} ms."
                if r["write_ms"] == r["write_ms"]
                else "inside the next forward (per-layer waits)."
            )
        )
    others = max(r.get("other_cores", 0.0) for r in by.values())
    out += [
        f"- The node shares the 2 cores with both workers here, and other processes used up to {others:.1f} cores during the runs: "
        "the runs are CPU-bound, so extra CPU per step is wall time, and a delayed update hides waiting but not work.",
        "",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="1 repetition of a few steps, no ddp_default: a smoke run",
    )
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run")
    ap.add_argument(
        "--warmup",
        type=int,
        default=12,
        help="untimed steps per run (> the hybrid policy's 10 warm-up steps)",
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="repetitions of every configuration (alternating)"
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        default=[
            "single",
            "ddp",
            "ddp_default",
            "ddp_bf16",
            "luwu_sync",
            "luwu_delayed",
            "luwu_hybrid_sync",
            "luwu_hybrid_delayed",
        ],
    )
    ap.add_argument(
        "--link-gbps",
        type=float,
        default=40.0,
        help="link speed the hybrid configs tell their policy (loopback ~40)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.reps = 6, 12, 1
        args.configs = [c for c in args.configs if c != "ddp_default"]
    nparams = sum(p.numel() for p in make_model().parameters())
    runs: dict[str, list[dict]] = {k: [] for k in args.configs}
    with LoadMonitor() as load:
        for rep in range(args.reps):
            order = (
                args.configs[rep % len(args.configs) :] + args.configs[: rep % len(args.configs)]
            )
            for kind in order:
                with LoadMonitor() as run_load:
                    r = run_config(
                        kind,
                        {"steps": args.steps, "warmup": args.warmup, "link_gbps": args.link_gbps},
                    )
                r["rep"] = rep
                r["other_cores"] = run_load.info()["other_cores"]
                runs[kind].append(r)
                print(
                    f"rep {rep} {kind}: {r['samples_per_s']:.0f} samples/s, step {r['step_ms']:.0f} ms, other processes {r['other_cores']} cores",
                    flush=True,
                )

    ref = "ddp" if "ddp" in runs else None
    rows = []
    for kind, rs in runs.items():
        row = {"config": kind}
        for key in rs[0]:
            if key in ("kind", "rep", "world", "loss") or isinstance(rs[0][key], str):
                continue
            row[key] = median([r[key] for r in rs])
        if ref:
            row["vs_ddp_cpu"] = row["samples_per_cpu_s"] / median(
                [r["samples_per_cpu_s"] for r in runs[ref]]
            )
            row["vs_ddp"] = row["samples_per_s"] / median([r["samples_per_s"] for r in runs[ref]])
            row["vs_ddp_paired"] = median(
                [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(rs, runs[ref])]
            )
        if "single" in runs:
            row["vs_single"] = row["samples_per_s"] / median(
                [r["samples_per_s"] for r in runs["single"]]
            )
        rows.append(row)
    per_rep = []
    for rep in range(args.reps):
        row = {"rep": rep}
        for kind, rs in runs.items():
            row[kind] = rs[rep]["samples_per_s"]
            row[f"{kind} other_cores"] = rs[rep]["other_cores"]
        per_rep.append(row)
    by = {r["config"]: r for r in rows}
    summary = []
    for kind, target in (
        ("luwu_sync", 1.0),
        ("luwu_delayed", 1.3),
        ("luwu_hybrid_sync", 1.0),
        ("luwu_hybrid_delayed", 1.3),
    ):
        if kind in by and ref:
            summary.append(
                {
                    "benchmark": f"4. e2e {kind} vs DDP (fused AdamW)",
                    "ratio": by[kind]["vs_ddp_paired"],
                    "ratio_cpu": by[kind]["vs_ddp_cpu"],
                    "target": target,
                    "verdict": verdict(by[kind]["vs_ddp_paired"], target),
                }
            )
            if "ddp_bf16" in by:
                v = median(
                    [
                        a["samples_per_s"] / b["samples_per_s"]
                        for a, b in zip(runs[kind], runs["ddp_bf16"])
                    ]
                )
                vc = by[kind]["samples_per_cpu_s"] / by["ddp_bf16"]["samples_per_cpu_s"]
                summary.append(
                    {
                        "benchmark": f"4. e2e {kind} vs DDP (bf16 compress hook)",
                        "ratio": v,
                        "ratio_cpu": vc,
                        "target": target,
                        "verdict": verdict(v, target),
                    }
                )
            if "ddp_default" in by:
                v = median(
                    [
                        a["samples_per_s"] / b["samples_per_s"]
                        for a, b in zip(runs[kind], runs["ddp_default"])
                    ]
                )
                vc = by[kind]["samples_per_cpu_s"] / by["ddp_default"]["samples_per_cpu_s"]
                summary.append(
                    {
                        "benchmark": f"4. e2e {kind} vs DDP (default AdamW)",
                        "ratio": v,
                        "ratio_cpu": vc,
                        "target": target,
                        "verdict": verdict(v, target),
                    }
                )
    result = {
        "quick": args.quick,
        "params": nparams,
        "batch_per_worker": BATCH,
        "world": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "machine": machine_info(),
        "load": load.info(),
        "rows": rows,
        "runs": runs,
        "summary": summary,
    }
    md = [
        f"# bench_e2e: MLP {' -> '.join(map(str, DIMS))} ({nparams / 1e6:.1f}M params), batch {BATCH}/worker, {WORLD} workers, "
        f"1 torch thread per process, loopback; {args.steps} steps after {args.warmup}, median of {args.reps} run(s)"
        + (" (quick)" if args.quick else ""),
        "",
        load.line(),
        "",
        "ratio: median over repetitions of the per-repetition samples/s ratio; ratio_cpu: ratio of samples per CPU-second "
        "(all processes of the run, the node included), which load from other processes inflates far less. Verdicts use ratio.",
        "",
        md_table(summary, ["benchmark", "ratio", "ratio_cpu", "target", "verdict"]),
        "",
        *why_lines(by),
        "samples/s from the median step time (slower rank); _wall from the timed steps' total wall time. vs_ddp: against "
        "DDP with fused AdamW; _paired: median of per-repetition ratios. Times in ms per step (medians).",
        "",
        md_table(
            rows,
            [
                "config",
                "samples_per_s",
                "samples_per_s_wall",
                "vs_ddp",
                "vs_ddp_paired",
                "vs_single",
                "step_ms",
                "fb_ms",
                "opt_ms",
                "other_cores",
            ],
        ),
        "",
        "## CPU per step (ms of CPU, all threads; medians over runs)",
        "",
        "cpu_ms_per_step: all processes of the run; worker: per training process; node: the node daemon.",
        "",
        md_table(
            rows,
            [
                "config",
                "cpu_ms_per_step",
                "worker_cpu_ms_per_step",
                "node_cpu_ms_per_step",
                "samples_per_cpu_s",
                "vs_ddp_cpu",
            ],
        ),
        "",
        "## Every run (samples/s; other_cores: CPU used by other processes during that run, of 2 cores)",
        "",
        md_table(per_rep, ["rep", *[f"{k}" for k in runs], *[f"{k} other_cores" for k in runs]]),
        "",
        "## LuWu step breakdown (ms per step, medians)",
        "",
        md_table(
            [r for r in rows if r["config"].startswith("luwu")],
            [
                "config",
                "step_ms",
                "fb_ms",
                "finish_ms",
                "wait_weights_ms",
                "write_ms",
                "node_opt_ms_per_step",
                "node_buckets_per_step",
                "push_MB_per_step",
                "pull_MB_per_step",
            ],
        ),
        "",
        "The node's CPU per step by thread (ms): loop = event loop (receiving, decoding pushes into the accumulators, "
        "sending), optimizer_thread = AdamW + reply encode, zmq_io = ZeroMQ's I/O threads.",
        "",
        md_table(
            [r for r in rows if r["config"].startswith("luwu")],
            [
                "config",
                "node_cpu_ms_per_step",
                "node_loop_cpu_ms_per_step",
                "node_optimizer_thread_cpu_ms_per_step",
                "node_zmq_io_cpu_ms_per_step",
                "node_other_cpu_ms_per_step",
            ],
        ),
        "",
        "fb: forward + backward (the gradient hooks copy and push full buckets during it); finish: Worker.finish, pushing "
        "what the hooks did not; wait_weights: waiting for the UPDATE replies (delayed: those of the previous step); "
        "write: decoding the weights into the parameters (as each reply arrives; with per-layer waits inside the next forward, in fb and wait_weights, not apart); push/pull MB: payload bytes per step of worker 0; node_opt: luwu_node_optimizer_step_seconds summed per step (wall "
        "time from handing a bucket to the optimizer thread until the event loop resumes, hand-offs included).",
        "",
    ]
    write_results("bench_e2e", result, "\n".join(md), quick=args.quick, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

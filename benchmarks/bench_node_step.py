"""The node's step on one shard, against plain torch on the same tensors (issue 4, benchmarks 1 and 2).

1. **Optimizer step**: a 64M-parameter shard held the node's way (one
   ``BucketState`` per bucket of 1M parameters, ``BucketState.apply`` = torch's
   fused AdamW over the flat segment views, the average over workers folded in
   as ``grad_scale``) against ``torch.optim.AdamW(fused=True)`` stepping one
   64M parameter. Also with 8 segments per bucket (a model of many small
   tensors). Target: >= 0.95x, with 1 torch thread (the node's default) and 2.
2. **Whole step for 2 workers**: per bucket, the node decodes the first push
   into the accumulator (``decode_``) and adds the second (``decode_add_``),
   applies AdamW, and encodes the reply from the new weights into its reused
   reply buffer, exactly the calls of ``NodeServer._on_push`` / ``_apply``
   without the socket. Against the same work as plain torch calls in the
   allocate-and-convert style (``frombuffer -> .float() -> add -> /2 ->
   optimizer.step() -> .to(bfloat16)``), per bucket with fused AdamW (same
   granularity, same kernel: the primary competitor), per bucket with
   torch's default AdamW, and as one shard-sized tensor. Pushes and replies in
   fp32 (codec ``none``) and in bf16. Target: >= 1.5x. Also the fraction of
   the memory-bandwidth floor: the bytes the step cannot avoid (read two
   pushes, read+write weights and both moments, write the reply) over the
   in-place bandwidth ``x.add_(1)`` measured in the same run.

    python3 benchmarks/bench_node_step.py [--quick] [--numel N] [--reps R]

Writes benchmarks/results/bench_node_step.json and .md (``--quick``: .quick.*).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from common import RESULTS, LoadMonitor, interleaved, machine_info, md_table, median, paired_ratio, verdict, write_results
from luwu.protocol.codecs import get_codec
from luwu.switch_nodes.optimizers import ADAMW
from luwu.switch_nodes.server import ReplyBuffers
from luwu.switch_nodes.store import BucketState, SegmentSpec

HYPER = dict(ADAMW.defaults) | {"lr": 1e-3, "weight_decay": 0.01}
NUM_WORKERS = 2


def make_shard(numel: int, bucket_numel: int, segs_per_bucket: int, init: torch.Tensor) -> list[BucketState]:
    """The node's shard: buckets of ``bucket_numel`` fp32 parameters, each cut into equal segments."""
    buckets = []
    for bid, start in enumerate(range(0, numel, bucket_numel)):
        n = min(bucket_numel, numel - start)
        k = max(1, min(segs_per_bucket, n))
        cuts = [n * i // k for i in range(k + 1)]
        segs = [SegmentSpec(bid * k + i, 0, cuts[i], cuts[i + 1] - cuts[i]) for i in range(k)]
        b = BucketState(bid, 0, n, segs, ADAMW)
        b.params.copy_(init[start : start + n])
        b.initialized = True
        buckets.append(b)
    return buckets


def slices(numel: int, bucket_numel: int) -> list[tuple[int, int]]:
    return [(s, min(s + bucket_numel, numel)) for s in range(0, numel, bucket_numel)]


# ---------------------------------------------------------------------------- 1. optimizer step
def bench_optimizer(numel: int, bucket_numel: int, threads: int, reps: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=g) * 0.02
    grad = torch.randn(numel, generator=g)

    def node_shard(segs: int):
        buckets = make_shard(numel, bucket_numel, segs, init)
        accs = []
        for b, (s, e) in zip(buckets, slices(numel, bucket_numel)):
            acc = b.accumulator(0, 0)
            acc.buf.copy_(grad[s:e]).mul_(NUM_WORKERS)  # the sum of the workers' pushes
            acc.hyper = HYPER
            accs.append(acc)

        def step():
            for b, acc in zip(buckets, accs):
                b.apply(acc, float(NUM_WORKERS))

        return buckets, step

    b1, node1 = node_shard(1)
    b8, node8 = node_shard(8)
    p = torch.nn.Parameter(init.clone())
    p.grad = grad.clone()
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)
    # control: torch itself on the node's granularity (one tensor per bucket, one fused call over the list)
    pl = [torch.nn.Parameter(init[s:e].clone()) for s, e in slices(numel, bucket_numel)]
    for q, (s, e) in zip(pl, slices(numel, bucket_numel)):
        q.grad = grad[s:e].clone()
    opt_list = torch.optim.AdamW(pl, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)
    times = interleaved({"node": node1, "node8": node8, "torch": opt.step, "torch_buckets": opt_list.step}, reps, warmup=2)
    # Same steps on the same numbers: the shard must equal torch's parameter (else we timed other work).
    diff = max(float((b.params - p.detach()[s:e]).abs().max()) for b, (s, e) in zip(b1, slices(numel, bucket_numel)))
    t_torch = median(times["torch"])
    rows = []
    labels = (
        ("torch", "torch.optim.AdamW(fused=True), one tensor"),
        ("node", "node: BucketState.apply, 1 segment/bucket"),
        ("node8", "node: BucketState.apply, 8 segments/bucket"),
        ("torch_buckets", "control: torch AdamW(fused=True), one tensor per bucket"),
    )
    for key, label in labels:
        t = median(times[key])
        rows.append(
            {
                "threads": threads,
                "impl": label,
                "ms": t * 1e3,
                "Gparams_per_s": numel / t / 1e9,
                "vs_torch": t_torch / t,
                "vs_torch_paired": paired_ratio(times["torch"], times[key]) if key != "torch" else 1.0,
            }
        )
    del b1, b8, p, opt, pl, opt_list
    return {"threads": threads, "rows": rows, "times_s": times, "max_abs_diff_vs_torch": diff}


# ---------------------------------------------------------------------------- 2. whole step
def received(frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the node gets from ZeroMQ: uint8 views over the payload bytes."""
    return [f.contiguous().view(torch.uint8) for f in frames]


def bytes_per_element(push: str, pull: str) -> tuple[float, float]:
    """(floor, as implemented) bytes of memory traffic per parameter for the 2-worker step."""
    bp, br = get_codec(push).bytes_per_element(), get_codec(pull).bytes_per_element()
    floor = NUM_WORKERS * bp + 3 * 8 + br  # read the pushes; read+write weights, exp_avg, exp_avg_sq; write the reply
    # decode_ (read push, write acc), decode_add_ (read push, read+write acc), AdamW (+ read acc),
    # encode (read weights again, write reply)
    implemented = (bp + 4) + (bp + 8) + (4 + 24) + (4 + br)
    return floor, implemented


def bench_whole_step(numel: int, bucket_numel: int, push: str, pull: str, threads: int, reps: int) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    init = torch.randn(numel, generator=g) * 0.02
    grads = [torch.randn(numel, generator=g) for _ in range(NUM_WORKERS)]
    sl = slices(numel, bucket_numel)
    pc, rc = get_codec(push), get_codec(pull)
    wire = torch.float32 if push == "none" else torch.bfloat16
    # Every worker's pushes, encoded once (as the workers would), kept as received byte frames.
    pushes = []  # [worker][bucket] -> (frames, meta)
    for w in range(NUM_WORKERS):
        per = []
        for s, e in sl:
            enc = pc.encode(grads[w][s:e].contiguous(), pc.alloc(e - s))
            per.append((received([f.clone() for f in enc.frames]), enc.meta))
        pushes.append(per)
    sizes = [[e - s] for s, e in sl]

    # -- the node's way: the calls of NodeServer._on_push and _apply
    buckets = make_shard(numel, bucket_numel, 1, init)
    replies = [ReplyBuffers() for _ in buckets]

    def node_step():
        for i, b in enumerate(buckets):
            step = b.version
            acc = b.accumulator(step, 2)
            for w in range(NUM_WORKERS):
                frames, meta = pushes[w][i]
                pc.validate(b.numel, [f.numel() for f in frames], meta)
                if acc.workers:
                    pc.decode_add_(acc.buf, frames, meta)
                else:
                    pc.decode_(acc.buf, frames, meta)
                acc.workers.add(w)
            acc.hyper = HYPER
            b.apply(acc, float(len(acc.workers)))
            b.version = step + 1
            out = replies[i].take(rc, b.numel, b.version & 1)
            rc.encode(b.params, out)
            b.release(step)

    # -- plain torch, allocate-and-convert: what one writes without the node's buffers
    mvs = [[memoryview(f[0].numpy()) for f, _ in per] for per in pushes]

    def plain(params, opt, views):
        def run():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i, p in enumerate(params):
                    total = None
                    for w in range(NUM_WORKERS):
                        x = torch.frombuffer(views[w][i], dtype=wire).float()
                        total = x if total is None else total + x
                    p.grad = total / NUM_WORKERS
            opt.step()
            return [p.detach().to(torch.bfloat16) if pull == "bf16" else p.detach().clone() for p in params]

        return run

    pb = [torch.nn.Parameter(init[s:e].clone()) for s, e in sl]
    opt_fused = torch.optim.AdamW(pb, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)
    pd = [torch.nn.Parameter(init[s:e].clone()) for s, e in sl]
    opt_default = torch.optim.AdamW(pd, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    # one shard-sized tensor: the pushes as whole-shard frames
    whole = []
    for w in range(NUM_WORKERS):
        enc = pc.encode(grads[w], pc.alloc(numel))
        whole.append([memoryview(enc.frames[0].contiguous().view(torch.uint8).numpy())])
    pw = [torch.nn.Parameter(init.clone())]
    opt_whole = torch.optim.AdamW(pw, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)

    big = torch.zeros(numel)
    fns = {
        "bandwidth": lambda: big.add_(1.0),  # in-place: 8 bytes per element; interleaved so it sees the same load
        "node": node_step,
        "plain_fused": plain(pb, opt_fused, mvs),
        "plain_default": plain(pd, opt_default, mvs),
        "plain_whole_fused": plain(pw, opt_whole, whole),
    }
    times = interleaved(fns, reps, warmup=2)
    diff = max(float((b.params - p.detach()).abs().max()) for b, p in zip(buckets, pb))
    floor_b, impl_b = bytes_per_element(push, pull)
    bw_gbps = 8 * numel / median(times["bandwidth"]) / 1e9
    t_floor = floor_b * numel / (bw_gbps * 1e9)
    # per repetition: time the floor would take at that repetition's bandwidth
    floor_rep = [floor_b / 8 * t for t in times["bandwidth"]]
    t_node = median(times["node"])
    labels = {
        "node": "node: decode_/decode_add_ + apply + encode (reused buffers)",
        "plain_fused": "plain per bucket, AdamW(fused=True)",
        "plain_default": "plain per bucket, AdamW() default",
        "plain_whole_fused": "plain one tensor, AdamW(fused=True)",
    }
    rows = []
    for key, label in labels.items():
        t = median(times[key])
        rows.append(
            {
                "wire": f"push {push} / reply {pull}",
                "impl": label,
                "ms": t * 1e3,
                "node_speedup": t / t_node,
                "node_speedup_paired": paired_ratio(times[key], times["node"]) if key != "node" else 1.0,
                "of_bw_floor": t_floor / t,
                "of_bw_floor_paired": paired_ratio(floor_rep, times[key]),
            }
        )
    del big, buckets, pb, pd, pw, opt_fused, opt_default, opt_whole
    return {
        "push": push,
        "pull": pull,
        "threads": threads,
        "rows": rows,
        "times_s": times,
        "floor_bytes_per_param": floor_b,
        "implemented_bytes_per_param": impl_b,
        "inplace_bandwidth_gbps": bw_gbps,
        "floor_ms": t_floor * 1e3,
        "node_of_bw_floor": t_floor / t_node,
        "node_implemented_gbps": impl_b * numel / t_node / 1e9,
        "max_abs_diff_node_vs_plain": diff,
    }


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8M parameters, 3 repetitions: a smoke run")
    ap.add_argument("--numel", type=int, default=64 << 20, help="parameters in the shard (default 64M)")
    ap.add_argument("--bucket-numel", type=int, default=1 << 20, help="parameters per bucket (default 1M = 4 MiB)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads for the optimizer benchmark")
    ap.add_argument("--step-threads", type=int, default=1, help="torch threads for the whole-step benchmark (node default 1)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = ap.parse_args(argv)
    if args.quick:
        args.numel, args.reps = 8 << 20, 3

    with LoadMonitor() as load:
        opt_runs = [bench_optimizer(args.numel, args.bucket_numel, t, args.reps) for t in args.threads]
        step_runs = [bench_whole_step(args.numel, args.bucket_numel, push, pull, args.step_threads, args.reps) for push, pull in (("none", "none"), ("bf16", "bf16"))]

    opt_rows = [r for run in opt_runs for r in run["rows"]]
    step_rows = [r for run in step_runs for r in run["rows"]]
    summary = []
    for run in opt_runs:
        node = next(r for r in run["rows"] if r["impl"].startswith("node: BucketState.apply, 1"))
        summary.append({"benchmark": f"1. optimizer step, {run['threads']} thread(s)", "ratio": node["vs_torch"], "target": 0.95, "verdict": verdict(node["vs_torch"], 0.95)})
    for run in step_runs:
        prim = next(r for r in run["rows"] if r["impl"].startswith("plain per bucket, AdamW(fused"))
        summary.append({"benchmark": f"2. whole step, push {run['push']} / reply {run['pull']}", "ratio": prim["node_speedup"], "target": 1.5, "verdict": verdict(prim["node_speedup"], 1.5)})
    result = {
        "quick": args.quick,
        "numel": args.numel,
        "bucket_numel": args.bucket_numel,
        "reps": args.reps,
        "machine": machine_info(),
        "load": load.info(),
        "optimizer": opt_runs,
        "whole_step": step_runs,
        "summary": summary,
    }
    n_m = args.numel / (1 << 20)
    md = [
        f"# bench_node_step: {n_m:.0f}M-parameter shard, buckets of {args.bucket_numel / (1 << 20):.0f}M, median of {args.reps}" + (" (quick)" if args.quick else ""),
        "",
        load.line(),
        "",
        "## Summary",
        "",
        md_table(summary, ["benchmark", "ratio", "target", "verdict"]),
        "",
        "## 1. Optimizer step (AdamW) vs torch.optim.AdamW(fused=True) on the same numbers",
        "",
        "vs_torch = torch ms / ours (> 1: the node is faster); _paired = median over repetitions of the per-repetition ratio. "
        f"Shard and torch parameter agree to {max(r['max_abs_diff_vs_torch'] for r in opt_runs):.2g} after the same steps.",
        "",
        md_table(opt_rows, ["threads", "impl", "ms", "Gparams_per_s", "vs_torch", "vs_torch_paired"]),
        "",
        f"## 2. Whole node step for {NUM_WORKERS} workers ({args.step_threads} thread), vs plain torch calls",
        "",
        "node_speedup = that row's ms / the node's ms. of_bw_floor = (bytes the step must touch / in-place bandwidth) / ms, "
        "the bandwidth being x.add_(1) on a shard-sized tensor timed interleaved with the steps; _paired: per repetition.",
        "",
        md_table(step_rows, ["wire", "impl", "ms", "node_speedup", "node_speedup_paired", "of_bw_floor", "of_bw_floor_paired"]),
        "",
    ]
    for run in step_runs:
        md.append(
            f"- push {run['push']} / reply {run['pull']}: in-place bandwidth {run['inplace_bandwidth_gbps']:.1f} GB/s; "
            f"floor {run['floor_bytes_per_param']:.0f} B/param ({run['floor_ms']:.0f} ms), "
            f"the node's calls move {run['implemented_bytes_per_param']:.0f} B/param ({run['node_implemented_gbps']:.1f} GB/s); "
            f"node vs plain fused max |diff| {run['max_abs_diff_node_vs_plain']:.2g}"
        )
    md.append("")
    write_results("bench_node_step", result, "\n".join(md), quick=args.quick, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

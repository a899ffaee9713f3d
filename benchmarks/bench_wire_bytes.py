"""Wire bytes per step: the hybrid compression default against fp32, both directions.

2 worker processes push to 2 node daemons on loopback (``luwu.local_cluster``)
and count the payload bytes their sockets carried (``opt.client.bytes_sent``:
gradients pushed; ``bytes_received``: weights pulled) over the steps after the
policy's warm-up (the first ``CompressionConfig().warmup_steps`` go bf16 by
design). Models: the 16.7M-parameter MLP 1024 -> 2048x4 -> 1000 (random
batches: byte counts do not depend on the data) and the character-level
transformer of benchmarks/convergence.py, each as a user would hand it over
(``RemoteOptimizer(model)``, default 4 MiB buckets) and, for the LM, as the
convergence study does (decay / no-decay parameter groups, 256 KiB buckets).
Variants: fp32 (``CompressionConfig(enabled=False)``), the hybrid default
(``CompressionConfig()``: int8 + error feedback on large matrices, bf16 on the
rest and on the weights sent back), and the hybrid default with
``pull_codec="int8_delta"``. Byte counts are exact, not timings: one run is
enough.

Targets (issue 5): the hybrid default pushes >= 3x fewer bytes than fp32; its
pull stays bf16 (2x) by default, so both directions together are reported
without a target; with ``int8_delta`` pull, both directions >= 3x. The layout
keeps small and 1-D parameters in buckets of their own (protocol/layout.py),
so with the default 4 MiB buckets the large matrices are not dragged to bf16
by a bias sharing their bucket.

    python3 benchmarks/bench_wire_bytes.py [--quick] [--measure-steps N]

Writes benchmarks/results/bench_wire_bytes.json and .md (``--quick``:
bench_wire_bytes.quick.*).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repo root: `benchmarks` as a package, also when run as a script
from benchmarks.common import LoadMonitor, machine_info, md_table, verdict, write_results  # noqa: E402

TARGET = 3.0
WORLD_SIZE = 2
NUM_NODES = 2
from luwu.protocol.codec_facts import (
    FEEDBACK_CODECS as AGGRESSIVE,
)  # the compressing codecs (int8, int4, topk)


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    model: str
    """``mlp16m`` or ``charlm``."""
    bucket_bytes: int
    groups: bool
    """Decay / no-decay parameter groups (buckets never mix groups) instead of the bare module."""


SETTINGS = [
    Setting("MLP 16.7M, default buckets", "mlp16m", 4 * 1024 * 1024, False),
    Setting("char LM 1.1M, default buckets", "charlm", 4 * 1024 * 1024, False),
    Setting("char LM 1.1M, 256 KiB buckets + decay groups", "charlm", 256 * 1024, True),
]
VARIANTS = {
    "fp32": {"enabled": False},
    "hybrid": {},
    "hybrid, int8_delta pull": {"pull_codec": "int8_delta"},
}


def build(setting: Setting):
    """(model, what to hand RemoteOptimizer, parameter names in its flat order, batch(step, rank), loss)."""
    if setting.model == "mlp16m":
        torch.manual_seed(0)
        widths = [1024, 2048, 2048, 2048, 2048, 1000]
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1])

        def batch(step: int, rank: int):
            g = torch.Generator().manual_seed(1000 * step + rank)
            return torch.randn(32, 1024, generator=g), torch.randint(0, 1000, (32,), generator=g)

        def loss(m, b):
            return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    elif setting.model == "charlm":
        from benchmarks.convergence import CharLMTask

        task = CharLMTask()
        model = task.model()

        def batch(step: int, rank: int):
            return task.batch(step, rank, WORLD_SIZE)

        loss = task.loss
    else:
        raise ValueError(f"unknown model {setting.model!r}")
    if setting.groups:
        from benchmarks.convergence import param_groups

        params, names = param_groups(model, 0.01)
    else:
        params, names = model, [n for n, _ in model.named_parameters()]
    return model, params, names, batch, loss


def _worker(
    rank: int,
    setting: Setting,
    compression: dict,
    job: str,
    nodes: list[str],
    warmup: int,
    measure: int,
    q,
) -> None:
    import luwu
    from benchmarks.convergence import CodecRecorder
    from luwu.protocol.policy import CompressionConfig

    torch.set_num_threads(1)
    try:
        model, params, names, batch, loss_fn = build(setting)
        opt = luwu.RemoteOptimizer(
            params,
            "adamw",
            nodes=nodes,
            rank=rank,
            world_size=WORLD_SIZE,
            job=job,
            lr=1e-4,
            compression=CompressionConfig(**compression),
            bucket_bytes=setting.bucket_bytes,
        )
        try:
            rec = CodecRecorder(opt.worker, names, warmup)
            mark = (0, 0)
            for step in range(warmup + measure):
                if (
                    step == warmup
                ):  # every reply of the steps before has arrived: the counters are exact
                    opt.synchronize()
                    mark = (opt.client.bytes_sent, opt.client.bytes_received)
                opt.zero_grad(set_to_none=True)
                loss_fn(model, batch(step, rank)).backward()
                opt.step()
            opt.synchronize()  # (per-layer waits: the last step's replies are read at the next forward)
            numel = sum(b.numel for b in opt.layout.buckets)
            q.put(
                (
                    "done",
                    rank,
                    {
                        "numel": numel,
                        "buckets": len(opt.layout.buckets),
                        "push_bytes_per_step": (opt.client.bytes_sent - mark[0]) / measure,
                        "pull_bytes_per_step": (opt.client.bytes_received - mark[1]) / measure,
                        "codec_raw_bytes": rec.raw_bytes,
                    },
                )
            )
        finally:
            opt.close()
    except BaseException as exc:  # report, then re-raise so the exit code says it too
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise


def measure(
    setting: Setting, variant: str, warmup: int, steps: int, timeout_s: float = 600.0
) -> dict:
    """Run ``warmup + steps`` steps of one setting and variant; per-worker bytes per measured step."""
    import luwu

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    job = "wire-" + "".join(
        c if c.isalnum() else "-" for c in f"{setting.model}-{setting.bucket_bytes}-{variant}"
    )
    results: dict[int, dict] = {}
    with luwu.local_cluster(NUM_NODES, job=job) as cluster:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, setting, VARIANTS[variant], job, cluster.addresses, warmup, steps, q),
                daemon=True,
            )
            for r in range(WORLD_SIZE)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < WORLD_SIZE:
                try:
                    kind, rank, payload = q.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{setting.name} / {variant}: workers did not finish within {timeout_s:.0f} s"
                        ) from None
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(
                            f"{setting.name} / {variant}: a worker died (exit codes {[p.exitcode for p in procs]})"
                        ) from None
                    continue
                if kind == "error":
                    raise RuntimeError(f"{setting.name} / {variant}: worker {rank}: {payload}")
                results[rank] = payload
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    r0 = results[0]
    raw = r0["codec_raw_bytes"]
    total = sum(raw.values())
    push = sum(r["push_bytes_per_step"] for r in results.values()) / WORLD_SIZE
    pull = sum(r["pull_bytes_per_step"] for r in results.values()) / WORLD_SIZE
    return {
        "setting": setting.name,
        "variant": variant,
        "numel": r0["numel"],
        "buckets": r0["buckets"],
        "push_bytes_per_step": push,
        "pull_bytes_per_step": pull,
        "codec_share": {k: v / total for k, v in sorted(raw.items())} if total else {},
        "compressed_share": sum(v for k, v in raw.items() if k.partition(":")[0] in AGGRESSIVE)
        / total
        if total
        else 0.0,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| setting | variant | buckets | push MB/step | pull MB/step | push x fewer | pull x fewer | total x fewer | int8 share of push |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['setting']} | {r['variant']} | - | - | - | - | - | - | failed: {r['error'][:120]} |"
            )
            continue
        lines.append(
            f"| {r['setting']} | {r['variant']} | {r['buckets']} | {r['push_bytes_per_step'] / 1e6:.2f} | {r['pull_bytes_per_step'] / 1e6:.2f} "
            f"| {r['push_x']:.2f} | {r['pull_x']:.2f} | {r['total_x']:.2f} | {r['compressed_share']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from luwu.protocol.policy import CompressionConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="1 measured step per run (writes bench_wire_bytes.quick.*)",
    )
    ap.add_argument("--measure-steps", type=int, default=5, help="steps measured after the warm-up")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # +1: the first compressed step carries int8_delta's initial full resync; measure the steady state
    warmup = CompressionConfig().warmup_steps + 1
    steps = 1 if args.quick else args.measure_steps
    rows = []
    with LoadMonitor() as load:
        for setting in SETTINGS:
            base = None
            for variant in VARIANTS:
                t0 = time.perf_counter()
                try:
                    row = measure(setting, variant, warmup, steps)
                except (RuntimeError, TimeoutError) as exc:
                    rows.append({"setting": setting.name, "variant": variant, "error": str(exc)})
                    print(f"{setting.name} / {variant}: FAILED: {exc}", flush=True)
                    continue
                if variant == "fp32":
                    base = row
                ref = base or row
                row["push_x"] = ref["push_bytes_per_step"] / row["push_bytes_per_step"]
                row["pull_x"] = ref["pull_bytes_per_step"] / row["pull_bytes_per_step"]
                row["total_x"] = (ref["push_bytes_per_step"] + ref["pull_bytes_per_step"]) / (
                    row["push_bytes_per_step"] + row["pull_bytes_per_step"]
                )
                rows.append(row)
                print(
                    f"{setting.name} / {variant}: push {row['push_x']:.2f}x, pull {row['pull_x']:.2f}x fewer bytes ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    summary = []
    for r in rows:
        if r["variant"] == "fp32" or "error" in r:
            continue
        for what, key in (("push", "push_x"), ("both directions", "total_x")):
            # the default pull is bf16 (2x): both directions of the plain hybrid are reported, not targeted
            target = None if (r["variant"], what) == ("hybrid", "both directions") else TARGET
            summary.append(
                {
                    "benchmark": f"wire bytes fp32 / {r['variant']}, {what}: {r['setting']}",
                    "ratio": round(r[key], 3),
                    "target": target,
                    "verdict": verdict(r[key], target) if target else "- (bf16 pull by default)",
                }
            )
    md = (
        "\n".join(
            [
                f"# bench_wire_bytes: {WORLD_SIZE} workers x {NUM_NODES} nodes, bytes per worker per step, steps {warmup}..{warmup + steps - 1}{' (quick)' if args.quick else ''}",
                "",
                f"Payload bytes on the worker's sockets (push = gradients sent, pull = weights received); x fewer = fp32 / variant. "
                f"Measured after the policy's {warmup - 1} bf16 warm-up steps and the first compressed step (which carries "
                "int8_delta's initial full resync; its periodic resync, every `resync_every` = 50 steps, is not in the window). "
                "int8 share = fraction of the gradient's fp32 bytes that went int8 (the rest bf16, or fp32 where the cost rule said so). "
                "Byte counts do not depend on the machine's load.",
                "",
                table(rows),
                "",
                "## Targets",
                "",
                md_table(summary, ["benchmark", "ratio", "target", "verdict"]),
            ]
        )
        + "\n"
    )
    result = {
        "quick": args.quick,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "machine": machine_info(),
        "load": load.info(),
        "settings": [asdict(s) for s in SETTINGS],
        "rows": rows,
        "summary": summary,
    }
    write_results("bench_wire_bytes", result, md, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

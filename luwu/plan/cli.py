"""The ``luwu plan`` command: options, the spec they describe, and the printed table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from luwu.plan.model import (
    ADAMW_PARAMS_PER_S_PER_THREAD,
    DEFAULT_BUCKET_BYTES,
    Plan,
    PlanSpec,
    plan,
    spec_with_codecs,
    stream_refetch_share,
)
from luwu.plan.recommend import Recommendation, recommend
from luwu.protocol.errors import ConfigError

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")


def parse_count(text: str) -> int:
    """``16.7M``, ``1.5B``, ``7e9``, ``350k``, ``16_700_000`` -> an integer count."""
    match = _COUNT_RE.match(str(text))
    if not match:
        raise ConfigError(f"not a count: {text!r} (use e.g. 16.7M, 1.5B, 7e9)")
    value = float(match.group(1).replace("_", "")) * _SUFFIX[match.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"count must be >= 1: {text!r}")
    return round(value)


def _floats(text: str) -> float | tuple[float, ...]:
    parts = [p for p in str(text).split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a number or comma-separated numbers: {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"empty: {text!r}")
    return values[0] if len(values) == 1 else values


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``luwu plan``."""
    parser.add_argument(
        "--params", type=_count_arg, required=True, help="model parameters: 16.7M, 1.5B, 7e9"
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="training workers, one per host (default 4)"
    )
    parser.add_argument(
        "--nodes", type=int, default=1, help="optimizer nodes, one per host (default 1)"
    )
    parser.add_argument(
        "--worker-gbps", type=float, default=10.0, help="worker link, Gbit/s (default 10)"
    )
    parser.add_argument(
        "--node-gbps",
        type=_floats,
        default=None,
        help="node link, Gbit/s; one number or one per node, comma-separated (default: --worker-gbps)",
    )
    parser.add_argument(
        "--capacities", type=_floats, default=None, help="relative node capacities, comma-separated"
    )
    parser.add_argument(
        "--push-codec",
        default="hybrid",
        help="gradient codec: none, bf16, fp16, int8, hybrid, "
        "int4, topk, topk:<density> (default hybrid, ~int8 for large models)",
    )
    parser.add_argument(
        "--pull-codec",
        default=None,
        help="weights codec: none, bf16, bf16_steps, int8_delta, int8 (default: as the "
        "defaults pick it, compression.pull_codec = auto by the cost rule at --worker-gbps; with --stream, "
        "compression.stream_codec, int8)",
    )
    parser.add_argument("--no-codec-cost", action="store_true", help="ignore encode/decode time")
    parser.add_argument(
        "--compute-ms", type=float, required=True, help="forward+backward ms per step on a worker"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="samples per worker per step, for samples/s"
    )
    parser.add_argument("--delayed-update", action="store_true", help="the job uses delayed update")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="streaming mode (stream_weights): weights fetched for forward, and for backward those not kept",
    )
    parser.add_argument(
        "--units",
        type=int,
        default=None,
        help="with --stream: how many units the model streams in (default: one per bucket)",
    )
    parser.add_argument(
        "--opt-rate",
        type=float,
        default=ADAMW_PARAMS_PER_S_PER_THREAD,
        help=f"node optimizer params/s per thread (default {ADAMW_PARAMS_PER_S_PER_THREAD:.2g}, "
        "fused AdamW)",
    )
    parser.add_argument(
        "--node-threads", type=int, default=1, help="threads per node for optimizer and codecs"
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="fraction of compute pushes overlap (default 2/3 * (1 - 1/buckets))",
    )
    parser.add_argument(
        "--efficiency", type=float, default=0.9, help="fraction of line rate achieved (default 0.9)"
    )
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help="bucket MiB (default 4)",
    )
    parser.add_argument(
        "--shared-cores",
        type=float,
        default=None,
        help="cores every worker and node share (an emulated cluster on one machine)",
    )
    parser.add_argument(
        "--net-cpu-ns",
        type=float,
        default=0.0,
        help="with --shared-cores: CPU ns the network stack spends per byte moved (default 0)",
    )
    parser.add_argument(
        "--max-nodes", type=int, default=8, help="largest node count explored (default 8)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    """The PlanSpec the CLI options describe (codec bytes and costs from the table)."""
    node_gbps = args.node_gbps if args.node_gbps is not None else args.worker_gbps
    capacities = args.capacities
    if isinstance(capacities, float):
        capacities = (capacities,)
    if args.bucket_mb is None or not args.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {args.bucket_mb!r}")
    spec = PlanSpec(
        num_params=args.params,
        workers=args.workers,
        nodes=args.nodes,
        capacities=capacities,
        worker_gbps=args.worker_gbps,
        node_gbps=node_gbps,
        opt_params_per_s=args.opt_rate,
        node_threads=args.node_threads,
        compute_s=args.compute_ms / 1e3,
        delayed_update=args.delayed_update,
        stream_weights=args.stream,
        stream_units=args.units,
        overlap_fraction=args.overlap,
        protocol_efficiency=args.efficiency,
        bucket_bytes=max(1, round(args.bucket_mb * 2**20)),
        batch_per_worker=args.batch,
        shared_cores=args.shared_cores,
        net_cpu_s_per_byte=args.net_cpu_ns * 1e-9,
    )
    spec = spec_with_codecs(
        spec, args.push_codec, default_pull_codec(args), codec_costs=not args.no_codec_cost
    )
    if not args.stream:
        return spec
    units = args.units or max(
        1, math.ceil(spec.num_params * 4 / spec.bucket_bytes)
    )  # (default: one unit per bucket)
    return dataclasses.replace(
        spec, stream_refetch=stream_refetch_share(units, 2, spec.pull_bytes_per_elem)
    )


def default_pull_codec(args: argparse.Namespace) -> str:
    """``--pull-codec``, else what the default policy sends the weights of a large bucket with at the
    worker link's speed (streaming: the stream codec of its fetches)."""
    if args.pull_codec is not None:
        return args.pull_codec
    from luwu.protocol.compression import CompressionConfig
    from luwu.protocol.layout import Bucket, Segment
    from luwu.protocol.policy import choose_fetch_codec, choose_pull_codec

    cfg = CompressionConfig(link_gbps=args.worker_gbps)
    rows = max(1 << 10, round(args.bucket_mb * 2**20 / 4) // 64)  # a bucket of one large matrix
    large = Bucket(0, 0, 0, rows * 64, (Segment(0, "w", (rows, 64), 0, 0, rows * 64),))
    return (choose_fetch_codec if args.stream else choose_pull_codec)(large, cfg.warmup_steps, cfg)


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def _rows(p: Plan) -> list[tuple[str, str, str]]:
    label = "compute (fwd+bwd)"
    if abs(p.compute_eff_s - p.spec.compute_s) > 1e-12:
        label = f"compute (fwd+bwd {_ms(p.spec.compute_s)}, with encoding and sharing cores)"
    rows = [
        (label, "", _ms(p.compute_eff_s)),
        ("worker uplink (push)", _mb(p.worker_up_bytes), _ms(p.worker_up_s)),
        ("worker downlink (pull)", _mb(p.worker_down_bytes), _ms(p.worker_down_s)),
    ]
    for j in range(p.spec.nodes):
        rows += [
            (f"node {j} downlink (incast)", _mb(p.node_down_bytes[j]), _ms(p.node_down_s[j])),
            (f"node {j} uplink (replies)", _mb(p.node_up_bytes[j]), _ms(p.node_up_s[j])),
            (f"node {j} cpu (opt {_ms(p.node_opt_s[j])})", "", _ms(p.node_cpu_s[j])),
        ]
    rows.append(
        (
            f"worker codec (in backward {_ms(p.worker_codec_s - p.spec.num_params * p.spec.pull_decode_s_per_elem)})",
            "",
            _ms(p.worker_codec_s),
        )
    )
    if p.spec.shared_cores is not None:
        rows.append((f"shared cores (network {_ms(p.net_cpu_s)})", "", _ms(p.shared_cpu_s)))
    return rows


def _summary(p: Plan, args: argparse.Namespace, rec: Recommendation) -> list[str]:
    mode = "delayed update" if p.spec.delayed_update else "sync"
    sps = f", {p.samples_per_s:,.0f} samples/s" if p.samples_per_s is not None else ""
    lines = [
        f"step ({mode}): {_ms(p.step_s)}{sps}   [sync {_ms(p.sync_step_s)}, delayed update {_ms(p.delayed_step_s)}]",
        f"pipeline: {p.num_buckets} buckets, push {_ms(p.push_s)}, node {_ms(p.node_s)}, pull {_ms(p.pull_s)}, "
        f"path {_ms(p.path_s)}, overlap {p.overlap_fraction:.2f} of compute",
        f"bottleneck: {p.bottleneck}",
        f"recommended: {rec.nodes} node(s), push {rec.push_codec}, pull {rec.pull_codec}, "
        f"{'delayed update' if rec.delayed_update else 'sync'} -> {_ms(rec.step_s)} "
        f"({rec.speedup:.2f}x the current {_ms(rec.current_step_s)})",
    ]
    if rec.nodes_unbind_links is None:
        lines.append(
            f"node links still bind at {args.max_nodes} nodes: compress more or use faster node links"
        )
    else:
        lines.append(f"node links stop binding at {rec.nodes_unbind_links} node(s)")
    return lines


def _print_table(p: Plan, args: argparse.Namespace, rec: Recommendation) -> None:
    title = (
        f"luwu plan: {p.spec.num_params / 1e6:,.1f}M params, {p.spec.workers} workers, {p.spec.nodes} node(s), "
        f"push {args.push_codec} / pull {default_pull_codec(args)}"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for name, nbytes, secs in _rows(p):
            print(f"  {name:<32} {nbytes:>12} {secs:>12}")
        print("\n".join(_summary(p, args, rec)))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("resource")
    table.add_column("bytes/step", justify="right")
    table.add_column("time/step", justify="right")
    for name, nbytes, secs in _rows(p):
        style = "bold red" if name.split(" (")[0] == p.bottleneck else None
        table.add_row(name, nbytes, secs, style=style)
    console = Console(file=sys.stdout, soft_wrap=True)
    console.print(table)
    for line in _summary(p, args, rec):
        console.print(line, highlight=False, markup=False)


def run(args: argparse.Namespace) -> int:
    """Print the plan of the options in ``args``; 0 on success, 2 on a bad setting."""
    try:
        spec = spec_from_args(args)
        p = plan(spec)
        fetch = (
            {"pull_codecs": ("none", "bf16", "int8")} if args.stream else {}
        )  # (a fetch carries full weights: no deltas)
        rec = recommend(spec, max_nodes=args.max_nodes, codec_costs=not args.no_codec_cost, **fetch)
    except ConfigError as exc:
        print(f"luwu plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": p.to_dict(), "recommendation": rec.to_dict()}, indent=2))
    else:
        _print_table(p, args, rec)
    return 0

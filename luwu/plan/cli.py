"""The ``luwu plan`` command: options, the spec they describe, presets, and what it prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from luwu.plan.disk import state_bytes_per_param
from luwu.plan.model import (
    ADAMW_PARAMS_PER_S_PER_THREAD,
    DEFAULT_BUCKET_BYTES,
    PlanSpec,
    plan,
    spec_with_codecs,
    stream_refetch_share,
)
from luwu.plan.presets import PRESETS
from luwu.plan.recommend import recommend
from luwu.plan.report import assumption_lines, print_table, sizing_lines, summary_lines
from luwu.plan.sizing import size_cluster
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


_SIZE_UNITS = {
    "": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``256GiB``, ``1.5TB``, ``512G``, ``4e9`` -> bytes (kB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary)."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (use e.g. 256GiB, 1.5TB, 512G)")
    value = float(match.group(1).replace("_", "")) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"size must be >= 1 byte: {text!r}")
    return round(value)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The defaults of the options a preset may set: a preset sets an option the command line left at its
#: default (one table, read by the options and by :func:`with_preset`).
DEFAULTS = {
    "params": None,
    "workers": 4,
    "nodes": 1,
    "worker_gbps": 10.0,
    "node_gbps": None,
    "compute_ms": None,
    "tokens": None,
    "worker_tflops": None,
    "stream": False,
    "units": None,
    "node_threads": 1,
    "optimizer": "adamw",
    "node_ram": None,
    "disks": 0,
    "disk_read_gb_s": 3.0,
    "disk_write_gb_s": 2.0,
    "disk_mixed_gb_s": None,
    "push_codec": "hybrid",
    "pull_codec": None,
    "gpu_codecs": False,
}


def _model_options(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named setup (luwu-paper: the LuWu paper's testbed); it prints every number it assumed, "
        "and options given on the command line win",
    )
    parser.add_argument("--params", type=_count_arg, help="model parameters: 16.7M, 1.5B, 7e9")
    parser.add_argument(
        "--workers",
        type=int,
        default=d["workers"],
        help="training workers, one per host (default 4)",
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=d["compute_ms"],
        help="forward+backward ms per step on a worker (or --tokens and --worker-tflops)",
    )
    parser.add_argument(
        "--tokens",
        type=_count_arg,
        default=d["tokens"],
        help="tokens per worker per step: compute = 6 * params * tokens / --worker-tflops",
    )
    parser.add_argument(
        "--worker-tflops",
        type=float,
        default=d["worker_tflops"],
        help="TFLOP/s a worker achieves (peak x utilisation), with --tokens",
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
        default=d["units"],
        help="with --stream: how many units the model streams in (default: one per bucket)",
    )


def _link_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-gbps",
        type=float,
        default=DEFAULTS["worker_gbps"],
        help="worker link, Gbit/s (default 10)",
    )
    parser.add_argument(
        "--node-gbps",
        type=_floats,
        default=DEFAULTS["node_gbps"],
        help="node link, Gbit/s; one number or one per node, comma-separated (default: --worker-gbps)",
    )
    parser.add_argument(
        "--efficiency", type=float, default=0.9, help="fraction of line rate achieved (default 0.9)"
    )
    parser.add_argument(
        "--push-codec",
        default=DEFAULTS["push_codec"],
        help="gradient codec: none, bf16, fp16, int8, hybrid, "
        "int4, topk, topk:<density> (default hybrid, ~int8 for large models)",
    )
    parser.add_argument(
        "--pull-codec",
        default=DEFAULTS["pull_codec"],
        help="weights codec: none, bf16, bf16_steps, int8_delta, int8 (default: as the "
        "defaults pick it, compression.pull_codec = auto by the cost rule at --worker-gbps; with --stream, "
        "compression.stream_codec, int8)",
    )
    parser.add_argument("--no-codec-cost", action="store_true", help="ignore encode/decode time")
    parser.add_argument(
        "--gpu-codecs",
        action="store_true",
        help="workers encode and decode on their accelerators: count no worker codec time (the "
        "nodes' still counts)",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="fraction of compute pushes overlap (default 2/3 * (1 - 1/buckets))",
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


def _node_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes",
        type=int,
        default=DEFAULTS["nodes"],
        help="optimizer nodes, one per host (default 1)",
    )
    parser.add_argument(
        "--capacities", type=_floats, default=None, help="relative node capacities, comma-separated"
    )
    parser.add_argument(
        "--opt-rate",
        type=float,
        default=ADAMW_PARAMS_PER_S_PER_THREAD,
        help=f"node optimizer params/s per thread (default {ADAMW_PARAMS_PER_S_PER_THREAD:.2g}, "
        "fused AdamW)",
    )
    parser.add_argument(
        "--node-threads",
        type=int,
        default=DEFAULTS["node_threads"],
        help="threads per node for optimizer and codecs",
    )
    parser.add_argument(
        "--optimizer",
        default=DEFAULTS["optimizer"],
        help="the nodes' optimizer, for its state per parameter (default adamw: 12 B)",
    )
    parser.add_argument(
        "--state-bytes",
        type=float,
        default=None,
        help="state bytes per parameter instead of --optimizer's (e.g. 8 for sgd with momentum)",
    )
    parser.add_argument(
        "--node-ram",
        type=_size_arg,
        default=DEFAULTS["node_ram"],
        help="RAM a node gives its state (node.state_memory_bytes), e.g. 256GiB; a larger state "
        "lives on --disks (default: all in RAM)",
    )


def _disk_options(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument(
        "--disks", type=int, default=d["disks"], help="disks per node for out-of-core state"
    )
    parser.add_argument(
        "--disk-read-gb-s",
        type=float,
        default=d["disk_read_gb_s"],
        help="read GB/s (bytes) of one disk (default 3)",
    )
    parser.add_argument(
        "--disk-write-gb-s",
        type=float,
        default=d["disk_write_gb_s"],
        help="write GB/s (bytes) of one disk (default 2)",
    )
    parser.add_argument(
        "--disk-mixed-gb-s",
        type=float,
        default=d["disk_mixed_gb_s"],
        help="GB/s of one disk under a 50/50 read/write mix, where measured (default: reads and "
        "writes take turns)",
    )
    parser.add_argument(
        "--disk-size", type=_size_arg, default=None, help="capacity of one disk, e.g. 3.84TB"
    )


def _tier_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="the switch tier: workers per aggregator (default: flat; the output recommends one)",
    )
    parser.add_argument(
        "--group-gbps", type=float, default=None, help="aggregator's group link (default: worker's)"
    )
    parser.add_argument(
        "--aggregator-gbps",
        type=float,
        default=None,
        help="aggregator's uplink to the nodes, Gbit/s (default: the slowest node link)",
    )
    parser.add_argument(
        "--aggregator-threads", type=int, default=1, help="aggregator decode threads (default 1)"
    )


def _search_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-nodes", type=int, default=8, help="largest node count explored (default 8)"
    )
    parser.add_argument(
        "--max-disks", type=int, default=16, help="most disks per node explored (default 16)"
    )
    parser.add_argument(
        "--target-ms",
        type=float,
        default=None,
        help="step-time target: the sizing picks the fewest nodes, then disks, that meet it",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``luwu plan``."""
    _model_options(parser)
    _link_options(parser)
    _node_options(parser)
    _disk_options(parser)
    _tier_options(parser)
    _search_options(parser)


def with_preset(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with its preset's options set where the command line left them at their default."""
    if getattr(args, "preset", None) is None or hasattr(args, "preset_given"):
        return args  # no preset, or applied already
    preset = PRESETS[args.preset]
    out = argparse.Namespace(**vars(args))
    given = set()
    for key, value in preset.options.items():
        if getattr(args, key) == DEFAULTS[key]:
            setattr(out, key, value)
        elif getattr(args, key) != value:
            given.add(key)
    out.preset_given = given
    return out


def _compute_s(args: argparse.Namespace) -> float:
    if args.compute_ms is not None:
        return args.compute_ms / 1e3
    if args.tokens is not None and args.worker_tflops is not None:
        if not args.worker_tflops > 0:
            raise ConfigError(f"--worker-tflops must be > 0, got {args.worker_tflops!r}")
        return 6.0 * args.params * args.tokens / (args.worker_tflops * 1e12)
    raise ConfigError("give --compute-ms, or --tokens and --worker-tflops (or a --preset)")


def _state_fields(args: argparse.Namespace) -> dict:
    per_param = args.state_bytes
    if per_param is None:
        per_param = state_bytes_per_param(args.optimizer)
    return {
        "state_bytes_per_param": per_param,
        "state_memory_bytes": args.node_ram,
        "disks": args.disks,
        "disk_read_gb_s": args.disk_read_gb_s,
        "disk_write_gb_s": args.disk_write_gb_s,
        "disk_mixed_gb_s": args.disk_mixed_gb_s,
        "disk_bytes": args.disk_size,
    }


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    """The PlanSpec the CLI options describe (codec bytes and costs from the table, a preset's values)."""
    args = with_preset(args)
    if args.params is None:
        raise ConfigError("give --params (e.g. 70B), or a --preset")
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
        compute_s=_compute_s(args),
        delayed_update=args.delayed_update,
        stream_weights=args.stream,
        stream_units=args.units,
        overlap_fraction=args.overlap,
        protocol_efficiency=args.efficiency,
        bucket_bytes=max(1, round(args.bucket_mb * 2**20)),
        batch_per_worker=args.batch,
        shared_cores=args.shared_cores,
        net_cpu_s_per_byte=args.net_cpu_ns * 1e-9,
        group_size=args.group_size,
        group_gbps=args.group_gbps,
        aggregator_gbps=args.aggregator_gbps,
        aggregator_threads=args.aggregator_threads,
        **_state_fields(args),
    )
    spec = spec_with_codecs(
        spec,
        args.push_codec,
        default_pull_codec(args),
        codec_costs=not args.no_codec_cost,
        worker_costs=not args.gpu_codecs,
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


def run(args: argparse.Namespace) -> int:
    """Print the plan of the options in ``args``; 0 on success, 2 on a bad setting."""
    args = with_preset(args)
    try:
        spec = spec_from_args(args)
        p = plan(spec)
        fetch = (
            {"pull_codecs": ("none", "bf16", "int8")} if args.stream else {}
        )  # (a fetch carries full weights: no deltas)
        costs = {"codec_costs": not args.no_codec_cost, "worker_codec_costs": not args.gpu_codecs}
        rec = recommend(spec, max_nodes=args.max_nodes, **costs, **fetch)
        sizing = None
        if spec.state_memory_bytes is not None or args.target_ms is not None:
            target = args.target_ms / 1e3 if args.target_ms is not None else None
            sizing = size_cluster(
                spec, target_step_s=target, max_nodes=args.max_nodes, max_disks=args.max_disks
            )
    except ConfigError as exc:
        print(f"luwu plan: {exc}", file=sys.stderr)
        return 2
    preset = PRESETS[args.preset] if args.preset else None
    if args.json:
        out = {"plan": p.to_dict(), "recommendation": rec.to_dict()}
        if sizing is not None:
            out["sizing"] = sizing.to_dict()
        if preset is not None:
            out["preset"] = {
                "name": preset.name,
                "assumptions": [dataclasses.asdict(a) for a in preset.assumptions],
            }
        print(json.dumps(out, indent=2))
        return 0
    title = (
        f"luwu plan: {p.spec.num_params / 1e6:,.1f}M params, {p.spec.workers} workers, {p.spec.nodes} node(s), "
        f"push {args.push_codec} / pull {default_pull_codec(args)}"
    )
    lines = summary_lines(p, args, rec)
    if sizing is not None:
        lines += sizing_lines(sizing)
    if preset is not None:
        lines += assumption_lines(preset, args.preset_given)
    print_table(p, title, lines)
    return 0

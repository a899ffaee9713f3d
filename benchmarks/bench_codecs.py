"""Codec throughput, wire size and error; fast top-k against torch.topk.

Encode, encode with error feedback, and decode-add throughput per codec in GB/s
of fp32 input (medians over repetitions, one thread), bytes per element,
relative error (||decoded - x|| / ||x||), the int8 block-size sweep, the
per-message cost on small tensors, and the top-k selection time against
``torch.topk`` measured side by side in the same run.

    python3 benchmarks/bench_codecs.py [--quick] [--numel N] [--reps R] [--threads T]

Writes benchmarks/results/bench_codecs.json and .md (``--quick``:
bench_codecs.quick.*). The policy's cost-rule
constants (luwu.protocol.policy.CODEC_GBPS) were calibrated from this script.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from luwu.protocol.codecs import get_codec, has_nonfinite, topk_indices

RESULTS = Path(__file__).resolve().parent / "results"

CODECS = ["none", "bf16", "fp16", "int8", "int4", "topk", "topk:0.01"]


def median_s(fn, reps: int) -> float:
    fn()  # warm: scratch buffers, page faults
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def as_received(frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the receiver gets: uint8 views over the bytes."""
    return [f.contiguous().view(torch.uint8) for f in frames]


def bench_codec(name: str, x: torch.Tensor, reps: int, *, values: str = "fp32") -> dict:
    codec = get_codec(name) if values == "fp32" else get_codec(name, values=values)
    n = x.numel()
    gb = 4 * n / 1e9
    out = codec.alloc(n)
    enc = codec.encode(x, out)
    frames = as_received(enc.frames)
    acc = torch.zeros(n)
    residual = torch.zeros(n)
    t_enc = median_s(lambda: codec.encode(x, out), reps)
    t_ef = median_s(lambda: (residual.zero_(), codec.encode_feedback_(x, residual, out)), reps)
    t_zero = median_s(lambda: residual.zero_(), reps)
    t_dec = median_s(lambda: codec.decode_add_(acc, frames, enc.meta), reps)
    dec = torch.zeros(n)
    codec.decode_(dec, frames, enc.meta)
    rel = float((dec - x).norm() / x.norm())
    label = name if values == "fp32" else f"{name} ({values} values)"
    return {
        "codec": label,
        "bytes_per_element": codec.bytes_per_element(),
        "wire_bytes": codec.wire_bytes(n),
        "ratio_vs_fp32": 4 * n / max(1, codec.wire_bytes(n)),
        "encode_gbps": gb / t_enc,
        "encode_ef_gbps": gb / max(1e-9, t_ef - t_zero),
        "decode_add_gbps": gb / t_dec,
        "rel_error": rel,
    }


def bench_blocks(x: torch.Tensor, reps: int) -> list[dict]:
    rows = []
    for name in ("int8", "int4"):
        for block in (32, 64, 128, 256, 512):
            r = bench_codec(f"{name}:{block}", x, reps)
            r["codec"] = f"{name} block {block}"
            rows.append(r)
    return rows


def bench_small(reps: int) -> list[dict]:
    """Encode + decode-add time of small messages: the fixed cost per message."""
    rows = []
    for n in (1024, 16384, 65536):
        x = torch.randn(n)
        for name in ("none", "bf16", "fp16", "int8", "int4", "topk"):
            c = get_codec(name)
            out = c.alloc(n)
            enc = c.encode(x, out)
            frames = as_received(enc.frames)
            acc = torch.zeros(n)
            t = median_s(lambda: (c.encode(x, out), c.decode_add_(acc, frames, enc.meta)), max(reps, 20))
            rows.append({"numel": n, "codec": name, "encode_decode_us": t * 1e6})
    return rows


def bench_topk(x: torch.Tensor, reps: int, density: float) -> dict:
    n = x.numel()
    k = max(1, math.ceil(density * n))
    g = torch.Generator().manual_seed(1)
    t_ours = median_s(lambda: topk_indices(x, k, generator=g), reps)
    t_torch = median_s(lambda: torch.topk(x.abs(), k, sorted=False), reps)
    ours = topk_indices(x, k, generator=g)
    exact = torch.topk(x.abs(), k, sorted=False).indices
    hit = torch.zeros(n, dtype=torch.bool)
    hit[exact] = True
    recall = float(hit[ours].sum()) / k
    return {
        "numel": n,
        "density": density,
        "k": k,
        "selected": int(ours.numel()),
        "recall_vs_exact": recall,
        "ours_ms": t_ours * 1e3,
        "torch_topk_ms": t_torch * 1e3,
        "speedup": t_torch / t_ours,
    }


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M elements, 3 repetitions: a smoke run")
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.numel, args.reps = 1 << 20, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.numel)

    codecs = [bench_codec(n, x, args.reps) for n in CODECS[:-1]]
    codecs.append(bench_codec("topk", x, args.reps, values="bf16"))
    blocks = bench_blocks(x, args.reps)
    small = bench_small(args.reps)
    topk = [bench_topk(x, args.reps, d) for d in (0.01, 0.001, 0.05)]
    nonfinite_gbps = 4 * args.numel / 1e9 / median_s(lambda: has_nonfinite(x), args.reps)

    result = {
        "numel": args.numel,
        "reps": args.reps,
        "threads": args.threads,
        "quick": args.quick,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "codecs": codecs,
        "blocks": blocks,
        "small_messages": small,
        "topk": topk,
        "has_nonfinite_gbps": nonfinite_gbps,
    }
    cols = ["codec", "bytes_per_element", "ratio_vs_fp32", "encode_gbps", "encode_ef_gbps", "decode_add_gbps", "rel_error"]
    md = [
        f"# bench_codecs: {args.numel} fp32 elements, {args.threads} thread(s), median of {args.reps}",
        "",
        "GB/s of fp32 input. encode_ef = encode with error feedback (x + residual, residual update).",
        "",
        table(codecs, cols),
        "",
        "## Block size sweep",
        "",
        table(blocks, cols),
        "",
        "## Small messages (encode + decode-add, microseconds)",
        "",
        table(small, ["numel", "codec", "encode_decode_us"]),
        "",
        "## Fast top-k vs torch.topk(x.abs(), k, sorted=False), same run",
        "",
        table(topk, ["numel", "density", "k", "selected", "recall_vs_exact", "ours_ms", "torch_topk_ms", "speedup"]),
        "",
        f"has_nonfinite (the check before encoding): {nonfinite_gbps:.3g} GB/s",
        "",
    ]
    text = "\n".join(md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_codecs.quick" if args.quick else "bench_codecs"  # a smoke run keeps the real results
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

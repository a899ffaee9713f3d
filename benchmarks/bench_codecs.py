"""Codec throughput, wire size and error; fast top-k against torch.topk.

Encode, encode with error feedback, and decode-add throughput per codec in GB/s
of fp32 input (medians over repetitions, one thread), bytes per element,
relative error (||decoded - x|| / ||x||), the int8 block-size sweep, the
per-message cost on small tensors, and the top-k selection time against
``torch.topk`` measured side by side in the same run.

    python3 benchmarks/bench_codecs.py [--quick] [--numel N] [--reps R] [--threads T] [--write-facts]

Writes benchmarks/results/bench_codecs.json and .md (``--quick``:
bench_codecs.quick.*). ``--write-facts`` re-calibrates the codec table that the
compression policy and ``luwu plan`` read: it rewrites the MEASURED block of
``protocol/codec_facts.py`` with this run's throughputs and per-message costs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from luwu.protocol import codec_facts
from luwu.protocol.codecs import get_codec, has_nonfinite, topk_indices
from luwu.protocol.feedback import DeltaEncoder, apply_pull_

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


def bench_delta(x: torch.Tensor, reps: int) -> dict:
    """The pull direction's int8 deltas: weights - shadow, int8 encode, decode into the shadow (node); the
    worker's decode-add of the delta."""
    n = x.numel()
    gb = 4 * n / 1e9
    enc = DeltaEncoder("int8", resync_every=1 << 60)
    enc.encode("b", x, 0)  # the first reply is a full resync
    step = iter(range(1, 1 << 60))
    t_enc = median_s(lambda: enc.encode("b", x, next(step)), reps)
    reply = enc.encode("b", x, next(step))
    frames = as_received(reply.encoded.frames)
    acc = torch.zeros(n)
    t_dec = median_s(lambda: apply_pull_(acc, reply.codec, True, frames, reply.encoded.meta), reps)
    codec = get_codec("int8")
    return {
        "codec": "int8_delta",
        "bytes_per_element": codec.bytes_per_element(),
        "wire_bytes": codec.wire_bytes(n),
        "ratio_vs_fp32": 4 * n / codec.wire_bytes(n),
        "encode_gbps": gb / t_enc,
        "encode_ef_gbps": gb / t_enc,
        "decode_add_gbps": gb / t_dec,
        "rel_error": math.nan,
    }


def _steps_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, the weights a step before): weights of 0.02 typical size moved by AdamW-like steps of ~1e-4
    (about 0.5% of the steps escape, as on the cluster task after its first steps)."""
    g = torch.Generator().manual_seed(1)
    w = x * 0.02
    return w, w - 1e-4 * torch.randn(x.numel(), generator=g)


def bench_steps(x: torch.Tensor, reps: int) -> dict:
    """The pull direction's bf16 steps: the node's snapshot of the weights before the step and its encode
    after (encode); the worker's stepping of its bf16 copy (decode)."""
    n = x.numel()
    gb = 4 * n / 1e9
    codec = get_codec("bf16_steps")
    w, before = _steps_pair(x)
    out = codec.alloc(n)[0]
    t_enc = median_s(lambda: codec.encode_steps(w, codec.snapshot(before), out), reps)
    enc = codec.encode_steps(w, codec.snapshot(before), out)
    frames = as_received(enc.frames)
    held = before.to(torch.bfloat16).float()
    t_dec = median_s(
        lambda: (held.copy_(before.to(torch.bfloat16)), codec.decode_add_(held, frames, enc.meta)),
        reps,
    )
    t_reset = median_s(lambda: held.copy_(before.to(torch.bfloat16)), reps)
    wire = sum(f.numel() for f in frames)
    return {
        "codec": "bf16_steps",
        "bytes_per_element": wire / n,
        "wire_bytes": wire,
        "ratio_vs_fp32": 4 * n / wire,
        "encode_gbps": gb / t_enc,
        "encode_ef_gbps": gb / t_enc,
        "decode_add_gbps": gb / max(1e-9, t_dec - t_reset),
        "rel_error": float((held - w).norm() / w.norm()),
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
            t = median_s(
                lambda: (c.encode(x, out), c.decode_add_(acc, frames, enc.meta)), max(reps, 20)
            )
            rows.append({"numel": n, "codec": name, "encode_decode_us": t * 1e6})
        enc = DeltaEncoder("int8", resync_every=1 << 60)
        enc.encode("b", x, 0)
        step = iter(range(1, 1 << 60))
        reply = enc.encode("b", x, next(step))
        frames = as_received(reply.encoded.frames)
        acc = torch.zeros(n)
        t = median_s(
            lambda: (
                enc.encode("b", x, next(step)),
                apply_pull_(acc, "int8", True, frames, reply.encoded.meta),
            ),
            max(reps, 20),
        )
        rows.append({"numel": n, "codec": "int8_delta", "encode_decode_us": t * 1e6})
        c, (w, before) = get_codec("bf16_steps"), _steps_pair(x)
        held = before.to(torch.bfloat16).float()
        enc = c.encode_steps(w, c.snapshot(before))
        frames = as_received(enc.frames)
        t = median_s(
            lambda: (
                c.encode_steps(w, c.snapshot(before)),
                c.decode_add_(held.clone(), frames, enc.meta),
            ),
            max(reps, 20),
        )
        rows.append({"numel": n, "codec": "bf16_steps", "encode_decode_us": t * 1e6})
    return rows


def _sig(v: float) -> float:
    """Three significant digits (inf stays inf)."""
    return v if not math.isfinite(v) or v == 0 else float(f"{v:.3g}")


def measured_facts(codecs: list[dict], small: list[dict]) -> dict[str, dict[str, float]]:
    """The MEASURED table of luwu.protocol.codec_facts from this run's rows."""
    by_name = {r["codec"]: r for r in codecs}
    us = {r["codec"]: r["encode_decode_us"] for r in small if r["numel"] == 1024}
    facts = {}
    for name in codec_facts.MEASURED:
        r = by_name[name]
        free = name == "none"  # fp32 is sent as is: no encode pass
        facts[name] = {
            "encode_gbps": math.inf if free else _sig(r["encode_gbps"]),
            "encode_ef_gbps": math.inf if free else _sig(r["encode_ef_gbps"]),
            "decode_gbps": _sig(r["decode_add_gbps"]),
            "overhead_us": 0.0 if free else _sig(max(0.0, us[name] - us["none"])),
        }
    return facts


def write_facts(facts: dict[str, dict[str, float]], measured_on: str) -> Path:
    """Rewrite the MEASURED block of protocol/codec_facts.py: the one home of these numbers."""
    path = Path(codec_facts.__file__)
    text = path.read_text()
    fmt = lambda v: "math.inf" if v == math.inf else repr(float(v))  # noqa: E731
    rows = "\n".join(
        f'    "{n}": {{' + ", ".join(f'"{k}": {fmt(v)}' for k, v in row.items()) + "},"
        for n, row in facts.items()
    )
    block = (
        f'MEASURED_ON = "{measured_on}"\nMEASURED: dict[str, dict[str, float]] = {{\n{rows}\n}}\n'
    )
    pattern = re.compile(r"MEASURED_ON = .*?\n}\n(?=# END MEASURED)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: MEASURED block not found")
    path.write_text(pattern.sub(lambda _: block, text, count=1))
    return path


def facts_table(before: dict, after: dict) -> str:
    rows = []
    for name in after:
        for key in after[name]:
            rows.append(
                {
                    "codec": name,
                    "fact": key,
                    "before": before.get(name, {}).get(key, math.nan),
                    "after": after[name][key],
                }
            )
    return table(rows, ["codec", "fact", "before", "after"])


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
    ap.add_argument(
        "--write-facts",
        action="store_true",
        help="rewrite the MEASURED table of protocol/codec_facts.py with this run's numbers",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.numel, args.reps = 1 << 20, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.numel)

    codecs = [bench_codec(n, x, args.reps) for n in CODECS[:-1]]
    codecs.append(bench_codec("topk", x, args.reps, values="bf16"))
    codecs.append(bench_delta(x, args.reps))
    codecs.append(bench_steps(x, args.reps))
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
        "loadavg": _loadavg(),
    }
    facts = measured_facts(codecs, small)
    result["facts"] = facts
    cols = [
        "codec",
        "bytes_per_element",
        "ratio_vs_fp32",
        "encode_gbps",
        "encode_ef_gbps",
        "decode_add_gbps",
        "rel_error",
    ]
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
        table(
            topk,
            [
                "numel",
                "density",
                "k",
                "selected",
                "recall_vs_exact",
                "ours_ms",
                "torch_topk_ms",
                "speedup",
            ],
        ),
        "",
        f"has_nonfinite (the check before encoding): {nonfinite_gbps:.3g} GB/s",
        "",
        f"## Codec facts (luwu.protocol.codec_facts.MEASURED), load average {result['loadavg']}",
        "",
        facts_table(codec_facts.MEASURED, facts),
        "",
    ]
    text = "\n".join(md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (
        "bench_codecs.quick" if args.quick else "bench_codecs"
    )  # a smoke run keeps the real results
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    if args.write_facts:
        note = f"{args.numel} elements, {args.threads} thread(s), median of {args.reps}, loadavg {result['loadavg']}"
        print(f"wrote {write_facts(facts, note)}")
    return 0


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return (
            "unknown"
            if not hasattr(os, "getloadavg")
            else " ".join(f"{v:.2f}" for v in os.getloadavg())
        )


if __name__ == "__main__":
    raise SystemExit(main())

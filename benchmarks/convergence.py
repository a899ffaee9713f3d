"""Convergence of compressed training on real data: does the eval loss stay on the uncompressed curve?

Two tasks on data that ships with the machine, each trained with
``RemoteOptimizer`` (AdamW) by 2 worker processes against 2 node daemons on
loopback (``luwu.local_cluster``), fixed seeds, the same global batches in
every variant:

* ``digits``: scikit-learn's handwritten digits (1797 real 8x8 images), an MLP
  64-1024-1024-10, eval = cross-entropy on 360 held-out images.
* ``charlm``: a character-level language model on the Python reference
  documentation that ships with CPython (``pydoc_data.topics``, ~465K
  characters of English prose and code), a 2-layer causal transformer
  (d=256, 4 heads), eval = cross-entropy on 256 windows of the last 10%.

Variants: uncompressed sync, the hybrid default (``CompressionConfig()``),
int8 / int4 / top-k 1% on the large matrices with and without error feedback
(small and 1-D tensors bf16 as the policy does, warm-up as the default, the
cost rule told the link is 1 Gbit/s so it never vetoes the codec under test).
The pull direction is bf16 in every compressed variant. The final eval loss
of each is compared with the uncompressed run; the targets of issue 5 are
hybrid and int8+EF within 2%, int4+EF within 3%, top-k 1%+EF within 5%.

Parameters go in two groups (weight decay on matrices, none on biases and
norms, as GPT-style training does); buckets never mix groups, so the large
matrices fill buckets of their own and really get the lossy codec. Each worker
records the codec the policy picked for every bucket (the share of gradient
bytes compressed is in the table). Learning rate: linear warm-up then cosine
decay to zero, so the final loss is not one noisy point of a constant-lr run.

    python3 benchmarks/convergence.py [--quick] [--tasks digits,charlm] [--variants hybrid,int8+EF]

Writes benchmarks/results/convergence.json, .md and .png (``--quick``:
convergence.quick.*). Needs matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
WORLD_SIZE = 2
NUM_NODES = 2
#: Bytes are compared from this step on (the default policy's warm-up, sent uncompressed).
MEASURE_FROM = 10
AGGRESSIVE = ("int8", "int4", "topk")


# ----------------------------------------------------------------------------- tasks


class DigitsTask:
    """scikit-learn's digits: 1437 training images, 360 held out."""

    name = "digits"

    def __init__(self, hidden: int = 1024, batch_per_worker: int = 32):
        self.hidden, self.batch_per_worker = hidden, batch_per_worker
        self.title = f"digits, MLP 64-{hidden}-{hidden}-10"

    @functools.cached_property
    def data(self) -> tuple[torch.Tensor, ...]:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        return x[360:], y[360:], x[:360], y[:360]

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        h = self.hidden
        return torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 10))

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank*b, (rank+1)*b) of the step's global batch (rank 0 of world 1 = all of it)."""
        xtr, ytr = self.data[0], self.data[1]
        b = self.batch_per_worker
        idx = torch.randint(0, len(xtr), (b * WORLD_SIZE,), generator=torch.Generator().manual_seed(step))
        idx = idx[rank * b * WORLD_SIZE // world : (rank + 1) * b * WORLD_SIZE // world]
        return xtr[idx], ytr[idx]

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module) -> float:
        return float(torch.nn.functional.cross_entropy(model(self.data[2]), self.data[3]))


class CharTransformer(torch.nn.Module):
    """A small pre-norm causal transformer over characters."""

    def __init__(self, vocab: int, *, d_model: int = 256, layers: int = 2, heads: int = 4, ff: int = 512, context: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True) for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.emb(idx) + self.pos.weight[:t]
        for block in self.blocks:
            h = block(h, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class CharLMTask:
    """Next-character prediction on CPython's reference documentation (``pydoc_data.topics``)."""

    name = "charlm"
    context = 64

    def __init__(self, batch_per_worker: int = 16, eval_windows: int = 256):
        self.batch_per_worker, self.eval_windows = batch_per_worker, eval_windows
        self.title = "char LM on pydoc_data.topics, transformer 2x256"

    @functools.cached_property
    def data(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        import pydoc_data.topics

        text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        n = int(len(ids) * 0.9)
        return ids[:n], ids[n:], len(chars)

    @functools.cached_property
    def eval_batch(self) -> torch.Tensor:
        ev = self.data[1]
        starts = torch.randint(0, len(ev) - self.context - 1, (self.eval_windows,), generator=torch.Generator().manual_seed(123))
        return torch.stack([ev[s : s + self.context + 1] for s in starts.tolist()])

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return CharTransformer(self.data[2], context=self.context)

    def batch(self, step: int, rank: int, world: int) -> torch.Tensor:
        tr = self.data[0]
        b = self.batch_per_worker
        starts = torch.randint(0, len(tr) - self.context - 1, (b * WORLD_SIZE,), generator=torch.Generator().manual_seed(step))
        starts = starts[rank * b * WORLD_SIZE // world : (rank + 1) * b * WORLD_SIZE // world]
        return torch.stack([tr[s : s + self.context + 1] for s in starts.tolist()])

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module) -> float:
        return float(self.loss(model, self.eval_batch))


TASKS = {"digits": DigitsTask, "charlm": CharLMTask}


@dataclass(kw_only=True, slots=True)
class TaskRun:
    """How long and how fast one task trains (the same in every variant)."""

    task: str
    """Key of :data:`TASKS`."""
    steps: int
    """Optimizer steps."""
    lr: float
    """Peak AdamW learning rate."""
    eval_every: int
    """Rank 0 evaluates after every this many steps (and after the last)."""
    bucket_bytes: int = 256 * 1024
    """fp32 bytes per bucket."""
    lr_warmup: int = 20
    """Linear learning-rate warm-up steps before the cosine decay."""
    weight_decay: float = 0.01
    """AdamW weight decay of the matrices (biases and norms get none)."""
    task_args: dict = field(default_factory=dict)
    """Keyword arguments of the task's constructor."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {self.task!r}")
        for name in ("steps", "eval_every", "bucket_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


STUDY = {
    "digits": TaskRun(task="digits", steps=300, lr=1e-3, eval_every=10),
    "charlm": TaskRun(task="charlm", steps=300, lr=2e-3, eval_every=25),
}
QUICK = {
    "digits": TaskRun(task="digits", steps=40, lr=1e-3, eval_every=10),
    "charlm": TaskRun(task="charlm", steps=30, lr=2e-3, eval_every=10),
}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    compression: dict | None
    """Keyword arguments of ``CompressionConfig``."""
    target: float | None = None
    """Largest allowed |relative difference| of the final eval loss against uncompressed."""


FORCED = {"link_gbps": 1.0}  # the cost rule must not veto the codec under test
VARIANTS = [
    Variant("uncompressed", {"enabled": False}),
    Variant("hybrid", {}, 0.02),
    Variant("int8+EF", {"large_codec": "int8", **FORCED}, 0.02),
    Variant("int4+EF", {"large_codec": "int4", **FORCED}, 0.03),
    Variant("topk1%+EF", {"large_codec": "topk", "topk_density": 0.01, **FORCED}, 0.05),
    Variant("int8 noEF", {"large_codec": "int8", "error_feedback": False, **FORCED}),
    Variant("int4 noEF", {"large_codec": "int4", "error_feedback": False, **FORCED}),
    Variant("topk1% noEF", {"large_codec": "topk", "topk_density": 0.01, "error_feedback": False, **FORCED}),
]
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}


# ----------------------------------------------------------------------------- training


def param_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], list[str]]:
    """Decay on matrices, none on biases and norms; returns the groups and the names in flat order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    other = [(n, p) for n, p in named if p.ndim < 2]
    groups = [{"params": [p for _, p in decay], "weight_decay": weight_decay}, {"params": [p for _, p in other], "weight_decay": 0.0}]
    return groups, [n for n, _ in decay + other]


def lr_factor(run: TaskRun):
    def f(step: int) -> float:
        return min(1.0, (step + 1) / run.lr_warmup) * 0.5 * (1.0 + math.cos(math.pi * step / run.steps))

    return f


class CodecRecorder:
    """Wraps the worker's codec choice to count the raw gradient bytes each codec carried."""

    def __init__(self, worker, names: list[str], measure_from: int):
        self._choose = worker._codec_for
        self._names = names
        self.measure_from = measure_from
        self.raw_bytes: dict[str, int] = {}
        self.last: dict[int, tuple[str, bool]] = {}
        worker._codec_for = self

    def __call__(self, bucket, step: int) -> tuple[str, bool]:
        name, ef = self._choose(bucket, step)
        if step >= self.measure_from:
            self.raw_bytes[name] = self.raw_bytes.get(name, 0) + 4 * bucket.numel
        self.last[bucket.id] = (name, ef)
        return name, ef

    def buckets(self, layout) -> list[dict]:
        out = []
        for b in layout.buckets:
            name, ef = self.last.get(b.id, ("?", False))
            out.append({"bucket": b.id, "node": b.node, "numel": b.numel, "codec": name, "feedback": ef, "params": [self._names[s.param] for s in b.segments]})
        return out


def train_worker(spec: dict) -> dict:
    """One worker process of a variant (RANK / WORLD_SIZE from the environment)."""
    import luwu
    from luwu.protocol.policy import CompressionConfig

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = TaskRun(**spec["run"])
    task = TASKS[run.task](**run.task_args)
    model = task.model()
    groups, names = param_groups(model, run.weight_decay)
    cc = CompressionConfig(**spec["compression"]) if spec["compression"] is not None else None
    opt = luwu.RemoteOptimizer(
        groups, "adamw", nodes=spec["nodes"], rank=rank, world_size=world, job=spec["job"], lr=run.lr, compression=cc, bucket_bytes=run.bucket_bytes, timeout_s=120.0
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(run))
    rec = CodecRecorder(opt.worker, names, MEASURE_FROM)
    evals, train = [], []
    if rank == 0:
        evals.append((0, task.eval_loss(model)))
    mark = (0, 0)
    t0 = time.perf_counter()
    try:
        for step in range(run.steps):
            if step == MEASURE_FROM:
                mark = (opt.client.bytes_sent, opt.client.bytes_received)
            batch = task.batch(step, rank, world)
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model, batch)
            loss.backward()
            opt.step()
            sched.step()
            train.append(float(loss.detach()))
            done = step + 1
            if rank == 0 and (done % run.eval_every == 0 or done == run.steps):
                evals.append((done, task.eval_loss(model)))
        wall = time.perf_counter() - t0
        measured = max(0, run.steps - MEASURE_FROM)
        numel = sum(b.numel for b in opt.layout.buckets)
        return {
            "rank": rank,
            "evals": evals,
            "train": train,
            "wall_s": wall,
            "numel": numel,
            "bytes_sent": opt.client.bytes_sent,
            "bytes_received": opt.client.bytes_received,
            "measured_steps": measured,
            "push_bytes_per_step": (opt.client.bytes_sent - mark[0]) / measured if measured else None,
            "pull_bytes_per_step": (opt.client.bytes_received - mark[1]) / measured if measured else None,
            "codec_raw_bytes": rec.raw_bytes,
            "buckets": rec.buckets(opt.layout),
        }
    finally:
        opt.close()


def reference(run: TaskRun) -> list[tuple[int, float]]:
    """The same training with torch.optim.AdamW in this process on the global batches."""
    torch.set_num_threads(1)
    task = TASKS[run.task](**run.task_args)
    model = task.model()
    groups, _ = param_groups(model, run.weight_decay)
    opt = torch.optim.AdamW(groups, lr=run.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(run))
    evals = [(0, task.eval_loss(model))]
    for step in range(run.steps):
        opt.zero_grad(set_to_none=True)
        task.loss(model, task.batch(step, 0, 1)).backward()
        opt.step()
        sched.step()
        if (step + 1) % run.eval_every == 0 or step + 1 == run.steps:
            evals.append((step + 1, task.eval_loss(model)))
    return evals


def run_variant(run: TaskRun, variant: Variant, *, timeout_s: float = 900.0, workdir: str | Path | None = None) -> dict:
    """Train ``run`` with ``variant`` on a fresh 2-node local cluster and 2 worker processes."""
    import luwu

    job = f"conv-{run.task}-{''.join(c if c.isalnum() else '-' for c in variant.name)}"
    with tempfile.TemporaryDirectory(dir=workdir) as tmp, luwu.local_cluster(NUM_NODES, job=job) as cluster:
        spec_path = Path(tmp) / "spec.json"
        spec = {"run": asdict(run), "compression": variant.compression, "nodes": cluster.addresses, "job": job, "out": str(Path(tmp) / "result")}
        spec_path.write_text(json.dumps(spec))
        procs = []
        for r in range(WORLD_SIZE):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(r), PYTHONUNBUFFERED="1")
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(spec_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout_s
        outs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                outs.append(out)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{run.task} / {variant.name}: workers did not finish within {timeout_s:.0f} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
        for r, (p, out) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"{run.task} / {variant.name}: worker {r} exited with {p.returncode}:\n{out[-4000:]}")
        ranks = [json.loads(Path(f"{spec['out']}.rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return summarize(run, variant, ranks)


def run_variants(run: TaskRun, variants: list[Variant], *, parallel: int = 1, timeout_s: float = 900.0) -> list[dict]:
    """:func:`run_variant` for each variant, ``parallel`` at a time (each on its own cluster), rows compared."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        rows = list(pool.map(lambda v: run_variant(run, v, timeout_s=timeout_s), variants))
    compare(rows)
    return rows


def summarize(run: TaskRun, variant: Variant, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    raw = r0["codec_raw_bytes"]
    total_raw = sum(raw.values())
    raw_step = 4 * r0["numel"]
    push = sum(r["push_bytes_per_step"] for r in ranks) / len(ranks) if r0["push_bytes_per_step"] is not None else None
    pull = sum(r["pull_bytes_per_step"] for r in ranks) / len(ranks) if r0["pull_bytes_per_step"] is not None else None
    return {
        "task": run.task,
        "variant": variant.name,
        "compression": variant.compression,
        "target": variant.target,
        "evals": r0["evals"],
        "final_eval_loss": r0["evals"][-1][1],
        "train_loss": [sum(v) / len(v) for v in zip(*(r["train"] for r in ranks))],
        "wall_s": max(r["wall_s"] for r in ranks),
        "codec_share": {k: v / total_raw for k, v in sorted(raw.items())} if total_raw else {},
        "compressed_share": sum(v for k, v in raw.items() if k.partition(":")[0] in AGGRESSIVE) / total_raw if total_raw else 0.0,
        "push_bytes_per_step": push,
        "pull_bytes_per_step": pull,
        "push_ratio": raw_step / push if push else None,
        "pull_ratio": raw_step / pull if pull else None,
        "buckets": r0["buckets"],
    }


def compare(rows: list[dict]) -> None:
    """Fill in each row's relative difference against its task's uncompressed run, and the verdict."""
    base = {r["task"]: r["final_eval_loss"] for r in rows if r["variant"] == "uncompressed"}
    for r in rows:
        b = base.get(r["task"])
        r["rel_diff"] = r["final_eval_loss"] / b - 1.0 if b else None
        r["ok"] = None if r["target"] is None or r["rel_diff"] is None else abs(r["rel_diff"]) <= r["target"]


# ----------------------------------------------------------------------------- report


def fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    return format(v, spec)


def table(rows: list[dict]) -> str:
    lines = [
        "| task | variant | final eval loss | vs uncompressed | target | within | compressed share | push x | pull x | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = None if r.get("rel_diff") is None else f"{r['rel_diff']:+.2%}"
        tgt = None if r["target"] is None else f"{r['target']:.0%}"
        lines.append(
            f"| {r['task']} | {r['variant']} | {r['final_eval_loss']:.4f} | {fmt(rel, 's')} | {fmt(tgt, 's')} | {fmt(r.get('ok'))} "
            f"| {r['compressed_share']:.0%} | {fmt(r['push_ratio'], '.2f')} | {fmt(r['pull_ratio'], '.2f')} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 8), squeeze=False)
    colors = {"uncompressed": "black", "hybrid": "tab:blue", "int8": "tab:green", "int4": "tab:orange", "topk1%": "tab:red"}
    for col, task in enumerate(tasks):
        mine = [r for r in rows if r["task"] == task]
        base = {s: v for s, v in next((r["evals"] for r in mine if r["variant"] == "uncompressed"), [])}
        top, bottom = axes[0][col], axes[1][col]
        for r in mine:
            key = r["variant"].replace("+EF", "").replace(" noEF", "")
            style = dict(color=colors.get(key, "gray"), linestyle="--" if "noEF" in r["variant"] else "-", linewidth=1.8 if r["variant"] == "uncompressed" else 1.2)
            steps, losses = zip(*r["evals"])
            top.plot(steps, losses, label=r["variant"], **style)
            rel = [(s, 100.0 * (v / base[s] - 1.0)) for s, v in r["evals"] if base.get(s)]
            if rel:
                bottom.plot(*zip(*rel), **style)
        top.set_yscale("log")
        top.set_title(f"{mine[0].get('title', task)}: eval loss")
        top.set_xlabel("step")
        top.set_ylabel("eval cross-entropy")
        top.legend(fontsize=8)
        bottom.axhline(0.0, color="black", linewidth=0.8)
        for t, c in ((2, "tab:green"), (5, "tab:red")):
            bottom.axhline(t, color=c, linewidth=0.6, linestyle=":")
        bottom.set_ylim(-10, 40)
        bottom.set_title("eval loss vs uncompressed (%, clipped to -10..40)")
        bottom.set_xlabel("step")
        bottom.set_ylabel("relative difference, %")
        bottom.grid(alpha=0.3)
    fig.suptitle(f"LuWu compression convergence: {WORLD_SIZE} workers x {NUM_NODES} nodes, AdamW, bf16 pull; dashed = no error feedback")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few steps per task: smoke run (writes convergence.quick.*)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {sorted(TASKS)}")
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS), help="comma-separated variant names")
    ap.add_argument("--steps", type=int, default=None, help="override the steps of every task")
    ap.add_argument("--no-reference", action="store_true", help="skip the torch.optim.AdamW single-process reference")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        result = train_worker(spec)
        Path(f"{spec['out']}.rank{result['rank']}.json").write_text(json.dumps(result))
        return 0
    torch.set_num_threads(1)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANT_BY_NAME]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANT_BY_NAME)}")
    if "uncompressed" not in names:
        names.insert(0, "uncompressed")
    plans = QUICK if args.quick else STUDY
    rows, refs = [], {}
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        if task not in plans:
            ap.error(f"unknown task {task!r}; known: {sorted(plans)}")
        run = plans[task]
        if args.steps:
            run = TaskRun(**(asdict(run) | {"steps": args.steps}))
        title = TASKS[task](**run.task_args).title
        for name in names:
            t0 = time.perf_counter()
            row = run_variant(run, VARIANT_BY_NAME[name])
            row["title"] = title
            rows.append(row)
            print(f"{task:7s} {name:14s} final eval loss {row['final_eval_loss']:.4f}  compressed {row['compressed_share']:.0%}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if not args.no_reference:
            evals = reference(run)
            refs[task] = {"evals": evals, "final_eval_loss": evals[-1][1]}
            print(f"{task:7s} torch AdamW    final eval loss {evals[-1][1]:.4f}", flush=True)
    compare(rows)
    plan_txt = ", ".join(f"{t}: {plans[t].steps if not args.steps else args.steps} steps, lr {plans[t].lr}, bucket {plans[t].bucket_bytes // 1024} KiB" for t in dict.fromkeys(r["task"] for r in rows))
    md = [
        f"# convergence: {WORLD_SIZE} workers x {NUM_NODES} nodes, AdamW, real data{' (quick)' if args.quick else ''}",
        "",
        f"{plan_txt}. Final eval loss vs the uncompressed run. Forced codecs on matrices >= 64K elements "
        "(others bf16), cost rule at 1 Gbit/s; hybrid = `CompressionConfig()` defaults. Pull direction bf16 in every "
        "compressed variant (`int8_delta` not used). compressed share = gradient bytes (after the 10 warm-up steps) "
        "sent with int8/int4/top-k; push x / pull x = fp32 bytes / wire bytes per step after warm-up.",
        "",
        table(rows),
    ]
    if refs:
        md += ["", "Single-process `torch.optim.AdamW` on the same global batches (the uncompressed run should equal it):", ""]
        for task, ref in refs.items():
            mine = next((r for r in rows if r["task"] == task and r["variant"] == "uncompressed"), None)
            diff = abs(ref["final_eval_loss"] - mine["final_eval_loss"]) if mine else float("nan")
            md.append(f"- {task}: {ref['final_eval_loss']:.6f} (|difference| {diff:.1e})")
    text = "\n".join(md) + "\n"
    print(text)
    stem = "convergence.quick" if args.quick else "convergence"
    RESULTS.mkdir(exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "plans": {t: asdict(p) for t, p in plans.items()}, "rows": rows, "reference": refs}, indent=1))
    (RESULTS / f"{stem}.md").write_text(text)
    try:
        plot(rows, RESULTS / f"{stem}.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
The pull direction is bf16 in every forced variant. ``hybrid 1gbit`` is the
defaults told the link is 1 Gbit/s: int8 + error feedback pushes and, by the
cost rule of ``pull_codec = "auto"``, bf16-steps pulls (bit for bit the bf16
pull); ``hybrid 1gbit int8delta`` the same with int8-delta pulls, the default
before bf16 steps. ``stream 1gbit`` is
streaming mode (``stream_weights``) on the same defaults: int8 weights
fetched and int8 gradients pushed, without error feedback, compared with
streaming uncompressed (the optimizer takes the model there, so weight decay
applies to every parameter in both). The final eval loss
of each is compared with its baseline; the targets of issue 5 are
hybrid and int8+EF within 2%, int4+EF within 3%, top-k 1%+EF within 5%. On
digits, a pair with SGD + momentum on the nodes (uncompressed, top-k 1% + EF)
tells a top-k gap that comes from the codec from one that comes from AdamW.

Top-k runs three ways under AdamW: with torch's AdamW on the nodes; with the
nodes' frozen variance mode (``freeze`` rows: ``variance_freeze_step`` in the
param groups, = the 10 warm-up steps (bf16, no error feedback), as 1-bit Adam does;
switch_nodes/optimizers.py), since sparse, bursty top-k gradients inflate
Adam's second moment and shrink its steps; and with momentum correction
(``+MC`` rows, the configuration the top-k target is held to, against plain
uncompressed AdamW): each worker accumulates its momentum instead of its
gradient (Deep Gradient Compression), with the variance frozen after 5 steps.
``uncompressed freeze`` / ``uncompressed freeze5`` show what the frozen mode
alone does to the loss.

Parameters go in two groups (weight decay on matrices, none on biases and
norms, as GPT-style training does); buckets never mix groups, so the large
matrices fill buckets of their own and really get the lossy codec. Each worker
records the codec the policy picked for every bucket (the share of gradient
bytes compressed is in the table). Learning rate: linear warm-up then cosine
decay to zero, so the final loss is not one noisy point of a constant-lr run.

The ``tier`` variants train the same way through the switch tier: both workers
connect to one ``luwu aggregator`` (``local_cluster(aggregators=1)``, ranks
0-1), which sums their pushes of each (step, bucket) in the nodes' order and
sends one push up, under the workers' own ``CompressionConfig`` for its uplink
(compressed pushes are decoded, summed in fp32 and re-encoded, with the
uplink's error feedback kept at the aggregator). Each is compared with its
baseline (the same target) and with the variant it is without the tier: with
compression off, the same weights bit for bit (a SHA-256 of rank 0's).

    python3 benchmarks/convergence.py [--quick] [--tasks digits,charlm] [--variants hybrid,int8+EF] [--merge]
    python3 benchmarks/convergence.py --replot     # table and plot again from the saved JSON

Writes benchmarks/results/convergence.json, .md and .png (``--quick``:
convergence.quick.*). Needs matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repo root: `benchmarks` as a package, also when run as a script
from benchmarks.common import RESULTS, machine_info, write_results  # noqa: E402

WORLD_SIZE = 2
NUM_NODES = 2
#: Bytes are compared from this step on (the default policy's warm-up, sent uncompressed).
MEASURE_FROM = 10
from luwu.protocol.codec_facts import (
    FEEDBACK_CODECS as AGGRESSIVE,
)  # the compressing codecs (int8, int4, topk)

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
        return torch.nn.Sequential(
            torch.nn.Linear(64, h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, 10),
        )

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank*b, (rank+1)*b) of the step's global batch (rank 0 of world 1 = all of it)."""
        xtr, ytr = self.data[0], self.data[1]
        b = self.batch_per_worker
        idx = torch.randint(
            0, len(xtr), (b * WORLD_SIZE,), generator=torch.Generator().manual_seed(step)
        )
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

    def __init__(
        self,
        vocab: int,
        *,
        d_model: int = 256,
        layers: int = 2,
        heads: int = 4,
        ff: int = 512,
        context: int = 64,
    ):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )

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
        starts = torch.randint(
            0,
            len(ev) - self.context - 1,
            (self.eval_windows,),
            generator=torch.Generator().manual_seed(123),
        )
        return torch.stack([ev[s : s + self.context + 1] for s in starts.tolist()])

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return CharTransformer(self.data[2], context=self.context)

    def batch(self, step: int, rank: int, world: int) -> torch.Tensor:
        tr = self.data[0]
        b = self.batch_per_worker
        starts = torch.randint(
            0,
            len(tr) - self.context - 1,
            (b * WORLD_SIZE,),
            generator=torch.Generator().manual_seed(step),
        )
        starts = starts[rank * b * WORLD_SIZE // world : (rank + 1) * b * WORLD_SIZE // world]
        return torch.stack([tr[s : s + self.context + 1] for s in starts.tolist()])

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )

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
    """Largest allowed |relative difference| of the final eval loss against the baseline."""
    optimizer: str = "adamw"
    """The nodes' optimizer."""
    hyper: dict | None = None
    """Its hyperparameters (``weight_decay``: of the matrices); None: the task's lr and weight decay."""
    baseline: str = "uncompressed"
    """The variant this one is compared with."""
    tasks: tuple[str, ...] | None = None
    """Only for these tasks (None: all)."""
    variance_freeze_step: int | None = None
    """Adam / AdamW on the nodes: ``exp_avg_sq`` frozen after this many steps (a param-group hyperparameter)."""
    stream: bool = False
    """Streaming mode (``stream_weights``, the default units): the optimizer takes the model, so every
    parameter has the task's weight decay (one group); compared with a streaming baseline."""
    aggregators: int = 0
    """The switch tier: this many ``luwu aggregator`` daemons in front of the nodes, each summing a
    contiguous group of the ranks' pushes (0: the workers push to the nodes)."""
    flat: str | None = None
    """A tier variant: the variant it is without the tier (its final loss, weights and bytes are
    compared with that one's too)."""


FORCED = {
    "link_gbps": 1.0,
    "pull_codec": "bf16",
}  # the cost rule must not veto the codec under test; bf16 pulls
#: SGD with momentum on the nodes (digits only): top-k + error feedback is built for it (DGC), and the
#: pair shows whether a top-k gap under AdamW comes from the codec or from Adam's reaction to sparse,
#: bursty gradients.
SGD = {
    "optimizer": "sgd",
    "hyper": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
    "tasks": ("digits",),
}
#: The nodes' AdamW freezes its variance when the compressed steps start (1-bit Adam's recipe for compressed gradients).
FREEZE = {"variance_freeze_step": MEASURE_FROM}
#: Momentum correction (DGC) under AdamW: the variance frozen after 5 dense steps (of the 10 fp32 ones).
FREEZE5 = {"variance_freeze_step": 5}
TOPK1 = {"large_codec": "topk", "topk_density": 0.01, **FORCED}
MC = {**TOPK1, "momentum_correction": True}
VARIANTS = [
    Variant("uncompressed", {"enabled": False}),
    # the defaults at a 10 Gbit/s link (the default link_gbps = "auto" measures loopback faster, where int8 may not pay)
    Variant("hybrid", {"link_gbps": 10.0}, 0.02),
    # the defaults told the link is 1 Gbit/s: int8 + EF pushes and, by the cost rule, int8-delta pulls
    Variant("hybrid 1gbit", {"link_gbps": 1.0}, 0.02),
    Variant("hybrid 1gbit int8delta", {"link_gbps": 1.0, "pull_codec": "int8_delta"}, 0.02),
    Variant("int8+EF", {"large_codec": "int8", **FORCED}, 0.02),
    Variant("int4+EF", {"large_codec": "int4", **FORCED}, 0.03),
    # the error-feedback residual as fp32 (compression.residual_dtype; the default keeps it bf16, half the memory)
    Variant("hybrid 1gbit fp32res", {"link_gbps": 1.0, "residual_dtype": "float32"}, 0.02),
    Variant(
        "int4+EF fp32res", {"large_codec": "int4", "residual_dtype": "float32", **FORCED}, 0.03
    ),
    Variant("topk1%+EF+MC", MC, 0.05, **FREEZE5),
    Variant("uncompressed freeze5", {"enabled": False}, **FREEZE5),
    Variant("topk1%+EF", TOPK1),
    Variant("topk1%+EF freeze", TOPK1, baseline="uncompressed freeze", **FREEZE),
    Variant("uncompressed freeze", {"enabled": False}, **FREEZE),
    # ablations: 1-bit Adam's longer warm-up (~17% of the run), and a 10x denser top-k
    Variant(
        "topk1%+EF freeze w50",
        {"large_codec": "topk", "topk_density": 0.01, "warmup_steps": 50, **FORCED},
        variance_freeze_step=50,
    ),
    Variant("topk10%+EF", {"large_codec": "topk", "topk_density": 0.1, **FORCED}),
    Variant("int8 noEF", {"large_codec": "int8", "error_feedback": False, **FORCED}),
    Variant("int4 noEF", {"large_codec": "int4", "error_feedback": False, **FORCED}),
    Variant(
        "topk1% noEF",
        {"large_codec": "topk", "topk_density": 0.01, "error_feedback": False, **FORCED},
    ),
    # streaming mode: fp32 both ways (exact), and the defaults at 1 Gbit/s: int8 weights and gradients, no EF
    Variant("uncompressed stream", {"enabled": False}, baseline="uncompressed stream", stream=True),
    Variant("stream 1gbit", {"link_gbps": 1.0}, 0.02, baseline="uncompressed stream", stream=True),
    Variant("uncompressed SGD", {"enabled": False}, baseline="uncompressed SGD", **SGD),
    Variant("topk1%+EF SGD", TOPK1, baseline="uncompressed SGD", **SGD),
    Variant("topk1%+EF+MC SGD", MC, baseline="uncompressed SGD", **SGD),
]


def tiered(v: Variant, aggregators: int = 1) -> Variant:
    """``v`` trained through the switch tier: the same workers, batches and compression, each
    group's pushes summed at its aggregator, whose uplink follows the same ``CompressionConfig``
    (:func:`aggregator_args`); same baseline and target, and compared with ``v`` itself."""
    return replace(v, name=f"{v.name} tier", aggregators=aggregators, flat=v.name)


#: The variants also trained through the tier (both ranks summed at one aggregator).
TIER_OF = ("uncompressed", "hybrid", "hybrid 1gbit", "uncompressed stream", "stream 1gbit")
VARIANTS += [tiered(v) for v in VARIANTS if v.name in TIER_OF]
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}


def aggregator_args(compression: dict | None) -> list[str]:
    """An aggregator's command-line settings for a variant: its /metrics on a free port, and its
    uplink's policy as the workers' (``--compression.FIELD VALUE`` for each keyword of theirs)."""
    args = ["--metrics.port", "0"]
    for key, value in (compression if compression is not None else {"enabled": False}).items():
        args += [f"--compression.{key}", str(value)]
    return args


# ----------------------------------------------------------------------------- training


def param_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], list[str]]:
    """Decay on matrices, none on biases and norms, as named parameters (torch.optim's ``(name, tensor)``
    pairs: RemoteOptimizer's per-name compression rules see the names); returns the groups and the names in
    flat order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    other = [(n, p) for n, p in named if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return groups, [n for n, _ in decay + other]


def lr_factor(run: TaskRun):
    def f(step: int) -> float:
        return (
            min(1.0, (step + 1) / run.lr_warmup)
            * 0.5
            * (1.0 + math.cos(math.pi * step / run.steps))
        )

    return f


class CodecRecorder:
    """Stands in for the codec plan of the worker's gradient encoder (its pushes) to count the raw
    gradient bytes each codec carried; the plan still decides."""

    def __init__(self, worker, names: list[str], measure_from: int):
        self._plan = worker.encoder.codecs
        self._names = names
        self.measure_from = measure_from
        self.raw_bytes: dict[str, int] = {}
        self.last: dict[int, tuple[str, bool]] = {}
        worker.encoder.codecs = self

    def push(self, bucket, step: int) -> tuple[str, bool]:
        name, ef = self._plan.push(bucket, step)
        if step >= self.measure_from:
            self.raw_bytes[name] = self.raw_bytes.get(name, 0) + 4 * bucket.numel
        self.last[bucket.id] = (name, ef)
        return name, ef

    def buckets(self, layout) -> list[dict]:
        out = []
        for b in layout.buckets:
            name, ef = self.last.get(b.id, ("?", False))
            out.append(
                {
                    "bucket": b.id,
                    "node": b.node,
                    "numel": b.numel,
                    "codec": name,
                    "feedback": ef,
                    "params": [self._names[s.param] for s in b.segments],
                }
            )
        return out


def aggregator_counters(url: str) -> dict[str, float]:
    """What an aggregator's /metrics (``url``: http://host:port) says it sent up and refused: the
    push bytes to the nodes, the blocks sent up partial (a rank late), the messages refused."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {"uplink_push_bytes": 0.0, "blocks_late": 0.0, "errors": 0.0}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.startswith("luwu_aggregator_bytes_sent_total{") and 'direction="nodes"' in sample:
            if 'op="push"' in sample:
                out["uplink_push_bytes"] += float(value)
        elif sample == "luwu_aggregator_blocks_late_total":
            out["blocks_late"] += float(value)
        elif sample.startswith("luwu_aggregator_errors_total"):
            out["errors"] += float(value)
    return out


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes, in order: equal digests, equal weights bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_variant(run: TaskRun, variant: dict, cluster: dict, rank: int, world: int) -> dict:
    """Train one variant in this worker process against the ``cluster`` the parent announced (its
    ``nodes``, each rank's ``aggregator`` and, for the first rank of a group, its aggregator's
    ``metrics`` URL); returns what the parent needs of this rank."""
    import luwu
    from luwu.protocol.policy import CompressionConfig

    task = TASKS[run.task](**run.task_args)
    model = task.model()
    hyper = dict(variant["hyper"] or {"lr": run.lr})
    groups, names = param_groups(model, hyper.pop("weight_decay", run.weight_decay))
    if variant.get("stream"):  # the optimizer needs the model to find the units: one group
        groups, names = model, [n for n, p in model.named_parameters() if p.requires_grad]
        hyper["weight_decay"] = run.weight_decay
    if variant.get("variance_freeze_step") is not None:
        for g in groups:  # (not with stream)
            g["variance_freeze_step"] = variant["variance_freeze_step"]
    cc = (
        CompressionConfig(**variant["compression"]) if variant["compression"] is not None else False
    )  # None: fp32
    opt = luwu.RemoteOptimizer(
        groups,
        variant["optimizer"],
        nodes=cluster["nodes"],
        aggregator=cluster["aggregator"][rank],
        rank=rank,
        world_size=world,
        job=variant["job"],
        compression=cc,
        bucket_bytes=run.bucket_bytes,
        timeout_s=120.0,
        stream_weights=bool(variant.get("stream")),
        **hyper,
    )
    try:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(run))
        rec = CodecRecorder(opt.worker, names, MEASURE_FROM)
        evals, train = [], []
        if rank == 0:
            evals.append((0, task.eval_loss(model)))
        mark = (0, 0)
        # the first rank of a group reads its aggregator's counters: no sum of a step it has not
        # pushed can have gone up, and all of those before its last reply have
        metrics = cluster["metrics"][rank]
        up_mark = None
        t0 = time.perf_counter()
        for step in range(run.steps):
            if (
                step == MEASURE_FROM
            ):  # every reply of the steps before has arrived: the counters are exact
                opt.synchronize()
                mark = (opt.client.bytes_sent, opt.client.bytes_received)
                up_mark = aggregator_counters(metrics) if metrics else None
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
        opt.synchronize()  # (per-layer waits: the last step's replies are read at the next forward)
        wall = time.perf_counter() - t0
        measured = max(0, run.steps - MEASURE_FROM)
        up = aggregator_counters(metrics) if metrics else None
        if up is not None and up_mark is not None:
            up["uplink_push_bytes_per_step"] = (
                up["uplink_push_bytes"] - up_mark["uplink_push_bytes"]
            ) / measured
        return {
            "rank": rank,
            "evals": evals,
            "train": train,
            "wall_s": wall,
            "numel": sum(b.numel for b in opt.layout.buckets),
            "push_bytes_per_step": (opt.client.bytes_sent - mark[0]) / measured
            if measured
            else None,
            "pull_bytes_per_step": (opt.client.bytes_received - mark[1]) / measured
            if measured
            else None,
            "codec_raw_bytes": rec.raw_bytes,
            "buckets": rec.buckets(opt.layout),
            # (a streaming model holds no weights of its units between uses: its eval curve tells)
            "weights_sha256": None if variant.get("stream") else weights_digest(model),
            "aggregator": up,
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def worker_main(spec_path: str) -> int:
    """A worker process: trains the spec's variants one after the other, each on the cluster the parent
    announces in ``nodes<i>.json``, and leaves ``result<i>.rank<r>.json`` (imports are paid once)."""
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    run, folder = TaskRun(**spec["run"]), Path(spec["dir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + spec["timeout_s"]
    for i, variant in enumerate(spec["variants"]):
        nodes_file = folder / f"nodes{i}.json"
        while not nodes_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker {rank}: no cluster announced for variant {variant['name']!r} in {nodes_file}"
                )
            time.sleep(0.05)
        result = train_variant(run, variant, json.loads(nodes_file.read_text()), rank, world)
        _write_atomic(folder / f"result{i}.rank{rank}.json", json.dumps(result))
    return 0


def _serve_variant(
    run: TaskRun,
    i: int,
    variant: Variant,
    job: str,
    folder: Path,
    procs: list,
    deadline: float,
    stop,
) -> dict:
    """Start variant ``i``'s cluster (its nodes and aggregators), announce it to the workers, wait
    for their results, stop it."""
    import luwu

    with luwu.local_cluster(
        NUM_NODES,
        job=job,
        aggregators=variant.aggregators,
        world_size=WORLD_SIZE,
        aggregator_args=aggregator_args(variant.compression),
    ) as cluster:
        firsts = {g[0]: url for g, url in zip(cluster.groups, cluster.aggregator_metrics_urls)}
        announced = {
            "nodes": cluster.addresses,
            "aggregator": [cluster.aggregator_for(r) for r in range(WORLD_SIZE)],
            "metrics": [firsts.get(r) for r in range(WORLD_SIZE)],
        }
        _write_atomic(folder / f"nodes{i}.json", json.dumps(announced))
        paths = [folder / f"result{i}.rank{r}.json" for r in range(WORLD_SIZE)]
        while not all(p.exists() for p in paths):
            if stop.is_set():
                raise RuntimeError(f"{run.task} / {variant.name}: stopped (another variant failed)")
            for r, p in enumerate(procs):
                if p.poll() is not None and not paths[r].exists():
                    log = (folder / f"worker{r}.log").read_text()[-4000:]
                    raise RuntimeError(
                        f"{run.task} / {variant.name}: worker {r} exited with {p.returncode}:\n{log}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{run.task} / {variant.name}: no result within the deadline (ranks missing: {[r for r, p in enumerate(paths) if not p.exists()]})"
                )
            time.sleep(0.1)
        ranks = [json.loads(p.read_text()) for p in paths]
    return summarize(run, variant, ranks)


SECRET_VAR = "LUWU_TRANSPORT__JOIN_SECRET"


def run_variants(
    run: TaskRun, variants: list[Variant], *, parallel: int = 1, timeout_s: float = 3600.0
) -> list[dict]:
    """Train ``run`` once per variant: 2 worker processes (started once, variants in order), a fresh 2-node
    local cluster per variant, up to ``parallel`` clusters up at a time (the next one starts while the
    workers train). Returns one summary row per variant, compared with the ``uncompressed`` one."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    deadline = time.monotonic() + timeout_s
    jobs = [
        f"conv-{run.task}-{i}-{''.join(c if c.isalnum() else '-' for c in v.name)}"
        for i, v in enumerate(variants)
    ]
    with tempfile.TemporaryDirectory(prefix="luwu-convergence-") as tmp:
        folder = Path(tmp)
        spec = {
            "run": asdict(run),
            "dir": tmp,
            "timeout_s": timeout_s,
            "variants": [
                {
                    "name": v.name,
                    "compression": v.compression,
                    "optimizer": v.optimizer,
                    "hyper": v.hyper,
                    "variance_freeze_step": v.variance_freeze_step,
                    "stream": v.stream,
                    "job": j,
                }
                for v, j in zip(variants, jobs)
            ],
        }
        spec_path = folder / "spec.json"
        spec_path.write_text(json.dumps(spec))
        procs = []
        stop = threading.Event()
        # The workers start before any variant's cluster: they and every local_cluster here share one join
        # secret through the environment (local_cluster takes the one it finds there).
        saved = os.environ.get(SECRET_VAR)
        os.environ[SECRET_VAR] = saved or secrets.token_hex(16)
        try:
            for r in range(WORLD_SIZE):
                env = dict(
                    os.environ,
                    RANK=str(r),
                    WORLD_SIZE=str(WORLD_SIZE),
                    LOCAL_RANK=str(r),
                    PYTHONUNBUFFERED="1",
                )
                with open(folder / f"worker{r}.log", "w") as out:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, __file__, "--worker", str(spec_path)],
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                        )
                    )
            with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
                futures = [
                    pool.submit(_serve_variant, run, i, v, jobs[i], folder, procs, deadline, stop)
                    for i, v in enumerate(variants)
                ]
                try:
                    rows = [f.result() for f in futures]
                except BaseException:
                    stop.set()
                    raise
            for r, p in enumerate(procs):
                if p.wait(max(1.0, deadline - time.monotonic())) != 0:
                    raise RuntimeError(
                        f"worker {r} exited with {p.returncode}:\n{(folder / f'worker{r}.log').read_text()[-4000:]}"
                    )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
            if saved is None:
                os.environ.pop(SECRET_VAR, None)
    compare(rows)
    return rows


def summarize(run: TaskRun, variant: Variant, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    raw = r0["codec_raw_bytes"]
    total_raw = sum(raw.values())
    raw_step = 4 * r0["numel"]
    push = (
        sum(r["push_bytes_per_step"] for r in ranks) / len(ranks)
        if r0["push_bytes_per_step"] is not None
        else None
    )
    pull = (
        sum(r["pull_bytes_per_step"] for r in ranks) / len(ranks)
        if r0["pull_bytes_per_step"] is not None
        else None
    )
    aggs = [r["aggregator"] for r in ranks if r.get("aggregator")]
    up = [a["uplink_push_bytes_per_step"] for a in aggs if "uplink_push_bytes_per_step" in a]
    up = sum(up) / len(up) if up else None
    return {
        "task": run.task,
        "variant": variant.name,
        "compression": variant.compression,
        "optimizer": variant.optimizer,
        "hyper": variant.hyper or {"lr": run.lr},
        "variance_freeze_step": variant.variance_freeze_step,
        "stream": variant.stream,
        "aggregators": variant.aggregators,
        "flat": variant.flat,
        "baseline": variant.baseline,
        "target": variant.target,
        "evals": r0["evals"],
        "final_eval_loss": r0["evals"][-1][1],
        "train_loss": [sum(v) / len(v) for v in zip(*(r["train"] for r in ranks))],
        "wall_s": max(r["wall_s"] for r in ranks),
        "codec_share": {k: v / total_raw for k, v in sorted(raw.items())} if total_raw else {},
        "compressed_share": sum(v for k, v in raw.items() if k.partition(":")[0] in AGGRESSIVE)
        / total_raw
        if total_raw
        else 0.0,
        "push_bytes_per_step": push,
        "pull_bytes_per_step": pull,
        "push_ratio": raw_step / push if push else None,
        "pull_ratio": raw_step / pull if pull else None,
        # the tier: each aggregator's push payload bytes to the nodes per step after warm-up
        "uplink_bytes_per_step": up,
        "uplink_ratio": raw_step / up if up else None,
        "blocks_late": sum(a["blocks_late"] for a in aggs) if aggs else None,
        "aggregator_errors": sum(a["errors"] for a in aggs) if aggs else None,
        "weights_sha256": r0["weights_sha256"],
        "buckets": r0["buckets"],
    }


def refresh_targets(rows: list[dict]) -> None:
    """Saved rows take the baseline and target their variant has now (``--replot``, ``--merge``)."""
    for r in rows:
        v = VARIANT_BY_NAME.get(r["variant"])
        if v is not None:
            r["baseline"], r["target"], r["flat"] = v.baseline, v.target, v.flat


def compare(rows: list[dict]) -> None:
    """Fill in each row's relative difference against its baseline (same task), and the verdict; a
    tier row's against its flat variant too (``flat_diff``), and whether it trained the same bits
    (``flat_exact``: the same eval curve and, where both have them, the same final weights)."""
    by = {(r["task"], r["variant"]): r for r in rows}
    for r in rows:
        b = by.get((r["task"], r.get("baseline", "uncompressed")))
        r["rel_diff"] = r["final_eval_loss"] / b["final_eval_loss"] - 1.0 if b else None
        # a lower loss passes: the target bounds what compression may cost, not what it may gain
        r["ok"] = (
            None if r["target"] is None or r["rel_diff"] is None else r["rel_diff"] <= r["target"]
        )
        f = by.get((r["task"], r["flat"])) if r.get("flat") else None
        r["flat_diff"] = r["final_eval_loss"] / f["final_eval_loss"] - 1.0 if f else None
        digests = (r.get("weights_sha256"), f.get("weights_sha256")) if f else (None, None)
        r["flat_exact"] = (
            None
            if f is None
            else r["evals"] == f["evals"] and (None in digests or digests[0] == digests[1])
        )


# ----------------------------------------------------------------------------- report


def fmt(v, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    return format(v, spec)


def vs_flat(r: dict) -> str | None:
    """A tier row's difference from its flat variant: ``exact`` when it trained the same bits."""
    if r.get("flat_exact"):
        return "exact"
    return None if r.get("flat_diff") is None else f"{r['flat_diff']:+.2%}"


def table(rows: list[dict]) -> str:
    lines = [
        "| task | variant | final eval loss | vs baseline | target | within | vs flat | compressed share "
        "| push x | pull x | uplink x |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = None if r.get("rel_diff") is None else f"{r['rel_diff']:+.2%}"
        tgt = None if r["target"] is None else f"{r['target']:.0%}"
        lines.append(
            f"| {r['task']} | {r['variant']} | {r['final_eval_loss']:.4f} | {fmt(rel, 's')} | {fmt(tgt, 's')} | {fmt(r.get('ok'))} "
            f"| {fmt(vs_flat(r), 's')} | {r['compressed_share']:.0%} | {fmt(r['push_ratio'], '.2f')} "
            f"| {fmt(r['pull_ratio'], '.2f')} | {fmt(r.get('uplink_ratio'), '.2f')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.5 * len(tasks), 8), squeeze=False)
    colors = {
        "uncompressed": "black",
        "hybrid": "tab:blue",
        "int8": "tab:green",
        "int4": "tab:orange",
        "topk1%": "tab:red",
        "topk10%": "tab:brown",
    }
    for col, task in enumerate(tasks):
        mine = [r for r in rows if r["task"] == task]
        evals = {r["variant"]: dict(r["evals"]) for r in mine}
        top, bottom = axes[0][col], axes[1][col]
        for r in mine:
            sgd = r.get("optimizer", "adamw") == "sgd"
            key = r["variant"].split()[0].replace("+EF", "")
            color = (
                ("dimgray" if key == "uncompressed" else "tab:purple")
                if sgd
                else "darkred"
                if " w50" in r["variant"]
                else colors.get(key, "gray")
            )
            frozen = r.get("variance_freeze_step") is not None
            dash = (
                "--"
                if "noEF" in r["variant"]
                else ":"
                if sgd
                else (0, (5, 1, 1, 1, 1, 1))
                if " w50" in r["variant"]
                else "-."
                if frozen
                else "-"
            )
            style = dict(
                color=color,
                linestyle=dash,
                linewidth=1.8 if key == "uncompressed" and not frozen else 1.2,
                marker="o" if r.get("aggregators") else None,  # through the tier
                markersize=3,
                markerfacecolor="none",
            )
            steps, losses = zip(*r["evals"])
            top.plot(steps, losses, label=r["variant"], **style)
            base = evals.get(r.get("baseline", "uncompressed"), {})
            rel = [(s, 100.0 * (v / base[s] - 1.0)) for s, v in r["evals"] if base.get(s)]
            if rel:
                bottom.plot(*zip(*rel), **style)
        top.set_yscale("log")
        top.set_title(f"{mine[0].get('title', task)}: eval loss")
        top.set_xlabel("step")
        top.set_ylabel("eval cross-entropy")
        top.legend(fontsize=7, ncol=2)
        bottom.axhline(0.0, color="black", linewidth=0.8)
        for t, c in ((2, "tab:green"), (5, "tab:red")):
            bottom.axhline(t, color=c, linewidth=0.6, linestyle=":")
        bottom.set_yscale("symlog", linthresh=5.0, linscale=3.0)
        bottom.set_ylim(-60, 200)
        ticks = [-50, -10, -2, 0, 2, 5, 20, 100]
        bottom.set_yticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
        bottom.set_title("eval loss vs its uncompressed baseline")
        bottom.set_xlabel("step")
        bottom.set_ylabel("relative difference, % (log beyond +-5)")
        bottom.grid(alpha=0.3)
    fig.suptitle(
        f"LuWu compression convergence: {WORLD_SIZE} workers x {NUM_NODES} nodes, AdamW on the nodes, bf16 pull unless named\n"
        "dashed: no error feedback; dotted: SGD momentum; dash-dot: AdamW with its variance frozen after the warm-up; "
        "circles: through the switch tier",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[dict], refs: dict, runs: dict[str, dict], *, quick: bool) -> str:
    """The markdown report of a study (``runs``: the TaskRun of each task, as dicts)."""
    made_by = dict.fromkeys(r["command"] for r in rows if r.get("command"))
    plan_txt = "; ".join(
        f"{t}: {r['steps']} steps, peak lr {r['lr']}, buckets {r['bucket_bytes'] // 1024} KiB"
        for t, r in runs.items()
    )
    md = [
        f"# convergence: {WORLD_SIZE} workers x {NUM_NODES} nodes, AdamW on the nodes, real data{' (quick)' if quick else ''}",
        "",
        f"{plan_txt}. Final eval loss against the uncompressed run (same seeds, same global batches). "
        "Forced variants: the codec on matrices of >= 64K elements, bf16 on the rest, the cost rule told 1 Gbit/s "
        "so it does not veto; hybrid = `CompressionConfig()` defaults told a 10 Gbit/s link. The first 10 steps go bf16 both ways, without "
        'error feedback (the default warm-up). Pull direction bf16 in every forced variant; `hybrid 1gbit` = the defaults told the link is 1 Gbit/s (int8 + EF pushes, bf16-steps pulls by the cost rule of `pull_codec = "auto"`: the bf16 pull\'s very bits); `hybrid 1gbit int8delta`: the same with int8-delta pulls (the default before bf16 steps); `stream 1gbit`: streaming mode on the same defaults (int8 weights and gradients, no error feedback) against `uncompressed stream` (one param group: weight decay on every parameter). The workers keep their error-feedback residuals as bf16 (`compression.residual_dtype`, the default); the `fp32res` rows keep them fp32. compressed share = '
        "fraction of the gradient bytes after warm-up sent with int8 / int4 / top-k; push x / pull x = fp32 bytes / "
        "wire bytes per worker per step after warm-up. The `SGD` rows run SGD + momentum (lr 0.05, 0.9, no weight decay) on the nodes "
        "and compare with their own uncompressed SGD run. The `freeze` rows run the nodes' AdamW with `variance_freeze_step` = 10 "
        "(exp_avg_sq frozen when the compressed steps start, 1-bit Adam's recipe; switch_nodes/optimizers.py) and compare with "
        "`uncompressed freeze`. `+MC`: momentum correction (Deep Gradient Compression's: each worker accumulates its momentum, "
        "not its gradient, sends the top-k of it and clears what it sent; the nodes take it as their momentum, which restarts "
        "from zero at the first compressed step; "
        "`compression.momentum_correction`), under AdamW with `variance_freeze_step` = 5; it holds the top-k 1% target against "
        "plain uncompressed AdamW, and `uncompressed freeze5` shows the same optimizer without compression. A target bounds "
        "how much higher the loss may end (a lower loss passes).",
        "",
        "`tier` rows: the same run through the switch tier, both workers behind one `luwu aggregator` (ranks 0-1; "
        "the same global batches), which sums their pushes of each (step, bucket) in the nodes' order and sends one "
        "push up, its uplink under the variant's own `CompressionConfig` (`--compression.FIELD VALUE` for each of "
        "the workers' settings: told the same link, int8 + error feedback at the aggregator after it decoded and "
        "summed the int8 pushes in fp32). vs flat = the final eval loss against the same variant without the tier; "
        "`exact` = the same eval curve and the same final weights (a SHA-256 of rank 0's parameters; streaming "
        "rows: the eval curve). uplink x = fp32 bytes / the aggregator's push payload bytes to the nodes per step "
        "after warm-up, where the nodes receive one push a bucket from the aggregator instead of one from each "
        "worker.",
        "",
        table(rows),
        *topk_findings(rows),
    ]
    if refs:
        md += [
            "",
            "Single-process `torch.optim.AdamW` on the same global batches (the uncompressed run should equal it):",
            "",
        ]
        for task, ref in refs.items():
            mine = next(
                (r for r in rows if r["task"] == task and r["variant"] == "uncompressed"), None
            )
            diff = abs(ref["final_eval_loss"] - mine["final_eval_loss"]) if mine else float("nan")
            md.append(f"- {task}: {ref['final_eval_loss']:.6f} (|difference| {diff:.1e})")
    if made_by:
        md += ["", "Rows made by:", "", *(f"- `{c}`" for c in made_by)]
        unnamed = sum(1 for r in rows if not r.get("command"))
        if unnamed:
            md.append(
                f"- the other {unnamed} rows: an earlier run kept by `--merge` (it did not record its "
                "command; its machine may not be this one), compared with this run's baselines"
            )
    return "\n".join(md) + "\n"


def topk_findings(rows: list[dict]) -> list[str]:
    """What the top-k rows say about AdamW's variance, per task, from the numbers of this run."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        by = {r["variant"]: r for r in rows if r["task"] == task}
        live, frozen, base_frozen = (
            by.get("topk1%+EF"),
            by.get("topk1%+EF freeze"),
            by.get("uncompressed freeze"),
        )
        if not (live and frozen and base_frozen) or None in (
            live.get("rel_diff"),
            frozen.get("rel_diff"),
            base_frozen.get("rel_diff"),
        ):
            continue
        plain = by.get("uncompressed")
        vs_plain = (
            frozen["final_eval_loss"] / plain["final_eval_loss"] - 1.0 if plain else float("nan")
        )
        line = (
            f"- {task}: top-k 1% + EF ends {live['rel_diff']:+.1%} from uncompressed AdamW with torch's AdamW on the nodes, "
            f"{vs_plain:+.1%} with the variance frozen after the warm-up; the frozen mode without compression ends "
            f"{base_frozen['rel_diff']:+.1%}, so top-k's own cost under the frozen mode (the `freeze` row's verdict) is {frozen['rel_diff']:+.1%}."
        )
        w50, dense10 = by.get("topk1%+EF freeze w50"), by.get("topk10%+EF")
        if w50 and w50.get("rel_diff") is not None:
            line += f" With 50 bf16 warm-up steps before top-k and the freeze there: {w50['rel_diff']:+.1%}."
        if dense10 and dense10.get("rel_diff") is not None:
            line += f" Top-k at 10% density (torch's AdamW): {dense10['rel_diff']:+.1%}."
        sgd, sgd_base = by.get("topk1%+EF SGD"), by.get("uncompressed SGD")
        if sgd and sgd_base and sgd.get("rel_diff") is not None:
            line += f" With SGD + momentum on the nodes (linear in the gradient), top-k 1% + EF ends {sgd['rel_diff']:+.1%} from its own uncompressed run."
        mc, f5 = by.get("topk1%+EF+MC"), by.get("uncompressed freeze5")
        if mc and f5 and mc.get("rel_diff") is not None:
            line += (
                f" **With momentum correction** (variance frozen after 5 steps): {mc['rel_diff']:+.1%} from uncompressed AdamW; "
                f"the same optimizer without compression ends {f5['rel_diff']:+.1%}, so top-k's own cost there is "
                f"{mc['final_eval_loss'] / f5['final_eval_loss'] - 1.0:+.1%}."
            )
        mcs = by.get("topk1%+EF+MC SGD")
        if mcs and mcs.get("rel_diff") is not None:
            line += f" Momentum correction under SGD: {mcs['rel_diff']:+.1%} from uncompressed SGD."
        out.append(line)
    if not out:
        return []
    return [
        "",
        "Top-k under AdamW, from the rows above:",
        "",
        *out,
        "",
        "Reading: with torch's AdamW, top-k's bursts (an element is sent about once every 1/density steps, carrying "
        "what it accumulated) inflate `exp_avg_sq` and shrink the steps; freezing the variance after the dense warm-up "
        "removes that part (the `freeze` rows). What it cannot remove is top-k's delay under normalised steps: Adam "
        "moves every element by about lr per step whatever its gradient's scale, so an element held back by error "
        "feedback for ~1/density steps lags by ~lr/density, of the order of the weights at lr 2e-3 and 1%. Momentum "
        "SGD, whose steps scale with the gradient, does not pay it (the SGD rows, digits); a denser top-k pays less, "
        "and on the LM so does a longer bf16 warm-up (the `topk10%` and `w50` rows). Momentum correction removes most of "
        "the rest: an element held back arrives with the momentum it would have built while it waited, applied in one "
        "step (bounded at Adam's bound / density), instead of as a raw gradient sum that the node's momentum then spreads "
        "over the steps after it arrives. The momentum restarts at the handover: applying the nodes' warm-up momentum "
        "as a decaying tail (open loop, to every element, while new gradient reaches 1% of them per step) left the LM at "
        "+10.2% in the previous version of this table.",
    ]


def save(rows: list[dict], refs: dict, runs: dict[str, dict], *, quick: bool) -> None:
    """Write convergence(.quick).json, .md and .png."""
    summary = [
        {
            "benchmark": f"{r['task']} {r['variant']}",
            "rel_diff": r["rel_diff"],
            "target": r["target"],
            "verdict": "met" if r["ok"] else f"MISSED ({r['rel_diff']:+.1%} vs {r['target']:.0%})",
        }
        for r in rows
        if r["target"] is not None
    ]
    result = {
        "quick": quick,
        "machine": machine_info(),
        "plans": runs,
        "summary": summary,
        "rows": rows,
        "reference": refs,
    }
    path = write_results("convergence", result, report(rows, refs, runs, quick=quick), quick=quick)
    try:
        plot(rows, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")


def variants_for(task: str, names: list[str]) -> list[Variant]:
    """The named variants that apply to ``task``, with the baselines they are compared with (and a
    tier variant's flat variant), in study order."""
    want = {
        n for n in names if VARIANT_BY_NAME[n].tasks is None or task in VARIANT_BY_NAME[n].tasks
    }
    want |= {VARIANT_BY_NAME[n].flat for n in want} - {None}
    want |= {VARIANT_BY_NAME[n].baseline for n in want}
    return [v for v in VARIANTS if v.name in want]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a few steps per task: smoke run (writes convergence.quick.*)",
    )
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {sorted(TASKS)}")
    ap.add_argument(
        "--variants",
        default=",".join(v.name for v in VARIANTS),
        help="comma-separated variant names (their baselines run too)",
    )
    ap.add_argument("--steps", type=int, default=None, help="override the steps of every task")
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the torch.optim.AdamW single-process reference",
    )
    ap.add_argument(
        "--merge", action="store_true", help="keep the saved rows of variants and tasks not run now"
    )
    ap.add_argument(
        "--replot", action="store_true", help="only rewrite the table and plot from the saved JSON"
    )
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    saved_path = RESULTS / f"convergence{'.quick' if args.quick else ''}.json"
    if args.replot:
        saved = json.loads(saved_path.read_text())
        refresh_targets(saved["rows"])
        compare(saved["rows"])
        save(saved["rows"], saved["reference"], saved["plans"], quick=args.quick)
        return 0
    torch.set_num_threads(1)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANT_BY_NAME]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANT_BY_NAME)}")
    plans = QUICK if args.quick else STUDY
    rows, refs, runs = [], {}, {}
    command = shlex.join(
        ["python3", "benchmarks/convergence.py", *(sys.argv[1:] if argv is None else argv)]
    )
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        if task not in plans:
            ap.error(f"unknown task {task!r}; known: {sorted(plans)}")
        run = plans[task]
        if args.steps:
            run = TaskRun(**(asdict(run) | {"steps": args.steps}))
        runs[task] = asdict(run)
        title = TASKS[task](**run.task_args).title
        t0 = time.perf_counter()
        mine = run_variants(run, variants_for(task, names), parallel=2)
        for row in mine:
            row["title"] = title
            row["command"] = command
            tier = (
                f"  vs flat {vs_flat(row)}  uplink x {fmt(row['uplink_ratio'], '.2f')}"
                f"  late blocks {fmt(row['blocks_late'], '.0f')}"
                if row["aggregators"]
                else ""
            )
            print(
                f"{task:7s} {row['variant']:18s} final eval loss {row['final_eval_loss']:.4f} ({fmt(row['rel_diff'], '+.2%')})  compressed {row['compressed_share']:.0%}  train {row['wall_s']:.0f} s{tier}",
                flush=True,
            )
        print(f"{task}: {len(mine)} variants in {time.perf_counter() - t0:.0f} s", flush=True)
        rows += mine
        if not args.no_reference:
            evals = reference(run)
            refs[task] = {"evals": evals, "final_eval_loss": evals[-1][1]}
            print(f"{task:7s} torch AdamW        final eval loss {evals[-1][1]:.4f}", flush=True)
    if args.merge and saved_path.exists():
        saved = json.loads(saved_path.read_text())
        done = {(r["task"], r["variant"]) for r in rows}
        rows += [r for r in saved["rows"] if (r["task"], r["variant"]) not in done]
        refs = saved["reference"] | refs
        runs = saved["plans"] | runs
        order = {v.name: i for i, v in enumerate(VARIANTS)}
        tasks = list(dict.fromkeys([*runs, *(r["task"] for r in rows)]))
        rows.sort(key=lambda r: (tasks.index(r["task"]), order.get(r["variant"], len(order))))
        refresh_targets(rows)
        compare(rows)
    save(rows, refs, runs, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real training worker process for the integration tests.

Run as ``python tests/workers/train.py SPEC.json`` with torchrun's RANK and
WORLD_SIZE set; it trains a small deterministic model with RemoteOptimizer as
the spec says and saves the final parameters (and per-step losses) with
torch.save to the spec's ``out`` path with ``.rank<r>`` appended. The same
module computes the single-process reference (``reference(spec)``) so a test
compares like with like.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

import torch

DEFAULTS = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01},
    "steps": 20,
    "batch": 8,
    "seed": 0,
    "bucket_bytes": 4096,
    "timeout_s": 30.0,
    "scheduler": None,
    "max_grad_norm": None,
    "delayed_update": False,
    "delayed_update_warmup": 0,
    "mode": "sync",
    "compression": None,
    "model": "mlp",
    "accumulate": 1,
    "amp": False,
    "inject_inf": None,
    "resilient": False,
    "step_sleep": 0.0,
    "late_ranks": [],  # ranks that sleep 30 ms before each backward: their pushes arrive last
    "clip_call": None,  # call opt.clip_grad_norm_(clip_call) after backward (torch's clip_grad_norm_ in the reference)
    "aggregators": None,  # per rank, the address of its aggregator (the switch tier), or None
    "hidden": 64,  # the mlp's hidden width
}


def make_model(spec) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    if spec["model"] == "mlp":
        h = spec["hidden"]
        return torch.nn.Sequential(
            torch.nn.Linear(20, h), torch.nn.Tanh(), torch.nn.LayerNorm(h), torch.nn.Linear(h, 5)
        )
    if spec["model"] == "digits":  # real data: scikit-learn's handwritten digits
        from luwu.demo import make_model as digits_model

        return digits_model()
    raise ValueError(spec["model"])


def batch(spec, step: int, world_size: int):
    """The global batch of a step: rows [r*b, (r+1)*b) belong to worker r."""
    n = spec["batch"] * world_size
    if spec["model"] == "digits":
        from luwu.demo import global_batch, load_digits_split

        xtr, ytr, _, _ = load_digits_split()
        idx = global_batch(step, len(xtr), n)
        return xtr[idx], ytr[idx]
    g = torch.Generator().manual_seed(1000 + step + 7919 * spec["seed"])
    x = torch.randn(n, 20, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return x, y


def eval_loss(spec, model) -> float | None:
    """Loss on the held-out digits (the tests average it over the last 50 steps: one eval is noisy)."""
    if spec["model"] != "digits":
        return None
    from luwu.demo import evaluate, load_digits_split

    _, _, xte, yte = load_digits_split()
    return evaluate(model, xte, yte)[0]


def make_scheduler(spec, opt):
    s = spec["scheduler"]
    if s is None:
        return None
    name, kw = s[0], s[1]
    return getattr(torch.optim.lr_scheduler, name)(opt, **kw)


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def reference(spec, norms: list | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """The same training in one process with the torch optimizer on the concatenated batch (``norms``:
    filled with what torch's clip_grad_norm_ returned at each step)."""
    spec = DEFAULTS | spec
    ws = spec["world_size"]
    model = make_model(spec)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[
        spec["optimizer"]
    ]
    opt = cls(model.parameters(), **spec["hyper"])
    sched = make_scheduler(spec, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if spec["amp"] else None
    losses, scales = [], []
    k = spec["accumulate"]
    for step in range(spec["steps"]):
        opt.zero_grad()
        for micro in range(k):
            x, y = batch(spec, step * k + micro, ws)
            loss = loss_fn(model, x, y) / k
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if spec["inject_inf"] is not None and spec["inject_inf"][1] == step:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if spec["clip_call"] is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip_call"])
            if norms is not None:
                norms.append(float(norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        else:
            if spec["max_grad_norm"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return [p.detach().clone() for p in model.parameters()], (
        scales if scaler is not None else losses
    )


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def main(path: str) -> None:
    import luwu

    torch.set_num_threads(1)
    with open(path) as fh:
        spec = DEFAULTS | json.load(fh)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = make_model(spec)
    if rank != 0:  # other workers start from different weights: rank 0 seeds the nodes
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    compression = (
        False  # no compression in the spec: fp32 both ways, bit-exact against the reference
    )
    if spec["compression"] is not None:
        from luwu.protocol.policy import CompressionConfig

        compression = CompressionConfig(**spec["compression"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if spec["amp"] else None
    opt = luwu.RemoteOptimizer(
        model,
        spec["optimizer"],
        nodes=spec["nodes"],
        bucket_bytes=spec["bucket_bytes"],
        timeout_s=spec["timeout_s"],
        max_grad_norm=spec["max_grad_norm"],
        delayed_update=spec["delayed_update"],
        delayed_update_warmup=spec["delayed_update_warmup"],
        mode=spec["mode"],
        compression=compression,
        job=spec.get("job", "luwu"),
        aggregator=(spec["aggregators"] or {}).get(str(rank)),
        amp=scaler if scaler is not None and spec["clip_call"] is not None else spec["amp"],
        **spec["hyper"],
    )
    sched = make_scheduler(spec, opt)
    losses, scales, evals, norms = [], [], [], []
    b, k = spec["batch"], spec["accumulate"]

    def one_step(step: int) -> None:
        opt.zero_grad()
        for micro in range(k):
            x, y = batch(spec, step * k + micro, ws)
            x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
            loss = loss_fn(model, x, y) / k
            ctx = opt.no_sync() if micro < k - 1 else contextlib.nullcontext()
            hook = None
            if spec["inject_inf"] == [rank, step] and micro == k - 1:
                hook = next(model.parameters()).register_hook(
                    _poison
                )  # before the gradient hooks push
            if rank in spec["late_ranks"]:
                time.sleep(0.03)
            with ctx:
                (scaler.scale(loss) if scaler else loss).backward()
            if hook is not None:
                hook.remove()
        if spec["clip_call"] is not None:
            norms.append(float(opt.clip_grad_norm_(spec["clip_call"])))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        else:
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
        if spec["model"] == "digits" and step >= spec["steps"] - 100 and step % 10 == 9:
            opt.synchronize()
            evals.append(eval_loss(spec, model))

    step = opt.worker.step_num  # a worker joining a running job starts at the cluster's step
    recoveries = 0
    while step < spec["steps"]:
        try:
            one_step(step)
        except (luwu.RollbackError, luwu.WorkerLostError) as exc:
            if not spec["resilient"] or recoveries > 5:
                raise
            recoveries += 1
            step = opt.recover()  # data is indexed by step: resuming at `step` rewinds it too
            print(f"RECOVERED {step} after {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"STEP {step}", flush=True)
        step += 1
        if spec["step_sleep"]:
            time.sleep(spec["step_sleep"])
    opt.synchronize()
    result = {
        "recoveries": recoveries,
        "params": [p.detach().clone() for p in model.parameters()],
        "losses": losses,
        "scales": scales,
        "norms": norms,
        "eval_loss": statistics.median(evals) if evals else None,
        "evals": evals,
    }
    torch.save(result, f"{spec['out']}.rank{rank}")
    opt.close()


if __name__ == "__main__":
    main(sys.argv[1])

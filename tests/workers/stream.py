"""A streaming-mode training worker process for the integration tests.

Run as ``python tests/workers/stream.py SPEC.json`` with RANK and WORLD_SIZE set: it
trains a model of repeated blocks (an ``nn.ModuleList``) with
``RemoteOptimizer(stream_weights=True)`` on the batches of ``train.py`` and saves,
with ``.rank<r>`` appended to the spec's ``out``: the final weights
(``model_state_dict()``), the eval loss, and what it checked on the way: bytes the
streamed parameters held after each step, whether a forward after ``step()`` equals
a resident copy, and what an evaluation under ``no_grad`` fetched and pushed.
``reference(spec)`` is the same training with local ``torch.optim.AdamW``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(
    0, os.path.dirname(os.path.abspath(__file__))
)  # train.py, also when imported by a test
from train import batch, loss_fn, make_scheduler  # noqa: E402

DEFAULTS = {
    "hyper": {"lr": 0.01, "weight_decay": 0.05},
    "steps": 10,
    "batch": 8,
    "seed": 0,
    "blocks": 4,
    "width": 32,
    "bucket_bytes": 2048,
    "timeout_s": 30.0,
    "scheduler": None,
    "max_grad_norm": None,
    "prefetch": 2,
    "model": "mlp",
    "resilient": False,
    "step_sleep": 0.0,
    "accumulate": 1,
    "meta": False,
}


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    """An input layer and a head around repeated blocks: the root stays resident, the blocks stream."""

    def __init__(self, blocks: int, d: int):
        super().__init__()
        self.inp = torch.nn.Linear(20, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = torch.nn.Linear(d, 5)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model(spec) -> Net:
    torch.manual_seed(spec["seed"])
    return Net(spec["blocks"], spec["width"])


def eval_batch():
    g = torch.Generator().manual_seed(424242)
    return torch.randn(64, 20, generator=g), torch.randint(0, 5, (64,), generator=g)


def reference(spec) -> tuple[dict[str, torch.Tensor], float]:
    """The same training in one process: local AdamW on the concatenated batch (clipping, scheduler),
    its gradient the average of each rank's slice's, as DDP and the nodes make it (the full batch's
    mean in one pass differs in the last bits on some CPUs' kernels, and AdamW makes that visible
    in an element whose gradient is near zero)."""
    spec = DEFAULTS | spec
    model = make_model(spec)
    opt = torch.optim.AdamW(model.parameters(), **spec["hyper"])
    sched = make_scheduler(spec, opt)
    k, ws, b = spec["accumulate"], spec["world_size"], spec["batch"]
    for step in range(spec["steps"]):
        opt.zero_grad()
        for micro in range(k):
            x, y = batch(spec, step * k + micro, ws)
            for r in range(ws):
                (
                    loss_fn(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]) / (k * ws)
                ).backward()
        if spec["max_grad_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        opt.step()
        if sched is not None:
            sched.step()
    with torch.no_grad():
        ev = float(loss_fn(model, *eval_batch()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, ev


def count_ops(client) -> dict:
    """Count the ops this worker sends (wrapping the client's ``send``)."""
    counts: dict = {}
    send = client.send

    def counting(node, header, payload=(), priority=None):
        counts[int(header["op"])] = counts.get(int(header["op"]), 0) + 1
        if header.get("partial"):
            counts["partial"] = counts.get("partial", 0) + 1
        return send(node, header, payload, priority)

    client.send = counting
    return counts


def main(path: str) -> None:
    import luwu
    from luwu.protocol.messages import Op

    torch.set_num_threads(1)
    with open(path) as fh:
        spec = DEFAULTS | json.load(fh)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec[
        "meta"
    ]:  # never built whole: the optimizer initializes it unit by unit (rank 1 with another seed)
        torch.manual_seed(spec["seed"] + rank)
        with torch.device("meta"):
            model = Net(spec["blocks"], spec["width"])
    else:
        model = make_model(spec)
        if rank != 0:  # rank 0 seeds the nodes: the others must take its weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
    peak = [0]
    if spec[
        "meta"
    ]:  # the storage all blocks hold together each time one of their modules is initialized

        def measured(reset):
            def run():
                reset()
                peak[0] = max(
                    peak[0],
                    sum(p.untyped_storage().nbytes() for b in model.blocks for p in b.parameters()),
                )

            return run

        for mod in model.modules():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters = measured(mod.reset_parameters)
    opt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=spec["nodes"],
        bucket_bytes=spec["bucket_bytes"],
        timeout_s=spec["timeout_s"],
        compression=False,
        max_grad_norm=spec["max_grad_norm"],
        stream_weights=True,
        prefetch=spec["prefetch"],
        aggregator=(spec.get("aggregators") or {}).get(str(rank)),
        **spec["hyper"],
    )
    counts = count_ops(opt.client)
    forward_pulls: dict[int, list[int]] = {}  # step -> buckets asked for outside backward
    request = opt.worker.request_weights

    def logged(bids, **kw):
        if torch._C._current_graph_task_id() == -1:
            forward_pulls.setdefault(opt.worker.step_num, []).extend(bids)
        return request(bids, **kw)

    opt.worker.request_weights = logged
    initial_equals_eager = None
    if spec["meta"]:
        eager = make_model(spec)
        got = opt.model_state_dict()
        initial_equals_eager = all(
            torch.equal(got[n], p.detach()) for n, p in eager.named_parameters()
        )
    streamed = [p for u in opt.streamer.units for p in u.params]
    sched = make_scheduler(spec, opt)
    b = spec["batch"]
    held_after_step, same_as_resident = {}, []

    k = spec["accumulate"]

    def one_step(step: int) -> None:
        opt.zero_grad()
        for micro in range(
            k
        ):  # gradient accumulation: the micro-batches' sum is added up on the nodes
            x, y = batch(spec, step * k + micro, ws)
            with opt.no_sync() if micro < k - 1 else contextlib.nullcontext():
                (
                    loss_fn(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]) / k
                ).backward()
        opt.step()
        if sched is not None:
            sched.step()
        held_after_step[step] = sum(p.untyped_storage().nbytes() for p in streamed)
        if step in (
            0,
            spec["steps"] - 1,
        ):  # the module still works, as a resident copy of its weights does
            resident = make_model(spec)
            resident.load_state_dict(opt.model_state_dict())
            with torch.no_grad():
                same_as_resident.append(bool(torch.equal(model(x), resident(x))))

    step, recoveries = opt.worker.step_num, 0
    while step < spec["steps"]:
        try:
            one_step(step)
        except (
            luwu.RollbackError,
            luwu.WorkerLostError,
        ) as exc:  # raised by step() or, streaming, by forward / backward
            if not spec["resilient"] or recoveries > 5:
                raise
            recoveries += 1
            step = opt.recover()  # data is indexed by step: resuming at `step` rewinds it too
            print(f"RECOVERED {step} after {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"STEP {step}", flush=True)
        step += 1
        time.sleep(spec["step_sleep"])
    before, fetches = dict(counts), opt.streamer.fetches
    with torch.no_grad():
        ev = float(loss_fn(model, *eval_batch()))
    evaluation = {
        "pushes": counts.get(Op.PUSH, 0) - before.get(Op.PUSH, 0),
        "pulls": counts.get(Op.PULL, 0) - before.get(Op.PULL, 0),
        "units_fetched": opt.streamer.fetches - fetches,
        "held_after": sum(p.untyped_storage().nbytes() for p in streamed),
    }
    result = {
        "params": opt.model_state_dict(),
        "eval_loss": ev,
        "held_after_step": [held_after_step[s] for s in sorted(held_after_step)],
        "recoveries": recoveries,
        "same_as_resident": same_as_resident,
        "evaluation": evaluation,
        "num_units": len(opt.streamer.units),
        "num_streamed": len(streamed),
        "lrs": [g["lr"] for g in opt.param_groups],
        "partial_pushes": counts.get("partial", 0),
        "forward_pulls": forward_pulls,
        "first_units": sorted(b for u in opt.streamer.units[: spec["prefetch"]] for b in u.buckets),
        "initial_equals_eager": initial_equals_eager,
        "peak_unit_bytes": peak[0],
        "largest_unit_bytes": max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks),
        "streamed_buckets": len(opt.worker.streamed),
    }
    torch.save(result, f"{spec['out']}.rank{rank}")
    opt.close()


if __name__ == "__main__":
    main(sys.argv[1])

"""``luwu demo``: the main job on an embedded local cluster.

Trains an MLP on scikit-learn's handwritten digits (real data, shipped inside
the package) with 2 worker processes and 2 node daemons on loopback, then the
same training with ``torch.optim.AdamW`` in one process on the same global
batches, and prints both results and the bytes that crossed the wire.

LuWu runs with its defaults, the hybrid compression policy included (a bf16
warm-up, then the large matrix's gradient as int8 with error feedback and the
rest as bf16; weights come back as bf16), so the two runs differ by what
compression costs. With compression off (``compression=False``, or
``LUWU_COMPRESSION__ENABLED=false`` in the environment) LuWu sends fp32 and
matches AdamW to float rounding.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

HIDDEN = 256
BATCH_PER_WORKER = 32
LR = 3e-3
BUCKET_BYTES = 256 * 1024  # the 256 x 256 matrix fills one bucket: large enough for int8 to pay


def load_digits_split():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    n_test = 360
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 10),
    )


def global_batch(step: int, n: int, global_bs: int) -> torch.Tensor:
    """Indices of a step's global batch (the same on every worker and in the local run)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, n, (global_bs,), generator=g)


def evaluate(model, x, y) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
        return float(torch.nn.functional.cross_entropy(out, y)), float(
            (out.argmax(1) == y).float().mean()
        )


def _worker(rank: int, world: int, nodes: list[str], steps: int, q) -> None:
    import luwu

    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_digits_split()
    model = make_model()
    opt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=nodes,
        rank=rank,
        world_size=world,
        job="demo",
        lr=LR,
        weight_decay=0.01,
        bucket_bytes=BUCKET_BYTES,
    )
    try:
        for step in range(steps):
            idx = global_batch(step, len(xtr), BATCH_PER_WORKER * world)[
                rank * BATCH_PER_WORKER : (rank + 1) * BATCH_PER_WORKER
            ]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            if rank == 0:
                q.put(("step", step, float(loss.detach())))
        opt.synchronize()
        raw = (
            4 * steps * sum(p.numel() for p in model.parameters())
        )  # what fp32 would have sent each way
        q.put(
            (
                "done",
                rank,
                evaluate(model, xte, yte),
                opt.client.bytes_sent,
                opt.client.bytes_received,
                raw,
                opt.config.compression.enabled,
            )
        )
    except BaseException as exc:  # report, then re-raise so the exit code says it too
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        opt.close()


def _local(steps: int, world: int) -> tuple[float, float, float]:
    xtr, ytr, xte, yte = load_digits_split()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    t0 = time.perf_counter()
    for step in range(steps):
        idx = global_batch(step, len(xtr), BATCH_PER_WORKER * world)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    loss, acc = evaluate(model, xte, yte)
    return loss, acc, time.perf_counter() - t0


def _collect(console, procs, q, workers: int, steps: int) -> dict[int, tuple] | None:
    """The workers' results by rank, drawing their steps as a progress bar (None: one failed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[int, tuple] = {}
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("training on LuWu", total=steps)
        deadline = time.monotonic() + 600
        while len(results) < workers:
            try:
                kind, *rest = q.get(timeout=1.0)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    console.print("[red]a worker failed[/]")
                    return None
                continue
            if kind == "step":
                progress.update(
                    task,
                    completed=rest[0] + 1,
                    description=f"training on LuWu (loss {rest[1]:.3f})",
                )
            elif kind == "error":
                console.print(f"[red]worker {rest[0]} failed: {rest[1]}[/]")
                return None
            else:
                results[rest[0]] = tuple(rest[1:])
    return results


def _report(console, results: dict[int, tuple], wall: float, steps: int, workers: int, nodes: int):
    """LuWu's results beside torch.optim.AdamW's on the same global batches."""
    from rich.table import Table

    (loss, acc), sent, recv = (
        results[0][0],
        sum(r[1] for r in results.values()),
        sum(r[2] for r in results.values()),
    )
    raw, compressed = sum(r[3] for r in results.values()), results[0][4]
    how = "hybrid compression" if compressed else "fp32, compression off"
    l_loss, l_acc, l_wall = _local(steps, workers)
    table = Table(title=f"digits test set ({360} images) after {steps} steps")
    for col in ("run", "eval loss", "accuracy", "wall s"):
        table.add_column(col, justify="right" if col != "run" else "left")
    table.add_row(
        f"LuWu RemoteOptimizer ({workers} workers, {nodes} nodes, {how})",
        f"{loss:.4f}",
        f"{acc:.2%}",
        f"{wall:.1f}",
    )
    table.add_row(
        "torch.optim.AdamW (1 process, same global batch)",
        f"{l_loss:.4f}",
        f"{l_acc:.2%}",
        f"{l_wall:.1f}",
    )
    console.print(table)
    console.print(
        f"wire bytes: {sent / 1e6:.1f} MB pushed (gradients), {recv / 1e6:.1f} MB received (weights), all workers (fp32 payload: {raw / 1e6:.1f} MB each way)"
    )
    if compressed:
        why = "the cost of compression; RemoteOptimizer(..., compression=False) sends fp32 and matches AdamW to float rounding"
    else:
        why = "fp32 both ways: float rounding only"
    console.print(f"difference in eval loss: {abs(loss - l_loss):.2e} ({why})")


def run_demo(steps: int = 150, workers: int = 2, nodes: int = 2, argv=None) -> int:
    from rich.console import Console

    import luwu

    console = Console()
    console.print(
        f"[bold]LuWu demo[/]: MLP on scikit-learn digits, {workers} workers x {nodes} nodes on loopback, {steps} steps, global batch {BATCH_PER_WORKER * workers}"
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with luwu.local_cluster(nodes, job="demo") as cluster:
        console.print(f"nodes: {', '.join(cluster.addresses)}")
        procs = [
            ctx.Process(target=_worker, args=(r, workers, cluster.addresses, steps, q), daemon=True)
            for r in range(workers)
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        results = _collect(console, procs, q, workers, steps)
        if results is None:
            return 1
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(30)
    _report(console, results, wall, steps, workers, nodes)
    return 0

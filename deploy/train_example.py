"""A small LuWu training job driven by a cluster file: the worker side of every deploy recipe.

    luwu up --nodes 2                                   # writes .luwu-run/luwu/cluster.toml and keys/
    torchrun --nproc-per-node 2 deploy/train_example.py --config .luwu-run/luwu/keys/join.toml
    luwu top                                            # in another terminal

The nodes ask for the job's join secret: keys/join.toml is the cluster file plus that secret (with
CURVE keys, rank r uses keys/worker<r>.toml instead); the bare cluster.toml is refused.

Each process is one worker (rank and world size from torchrun's RANK / WORLD_SIZE
/ LOCAL_RANK). It trains an MLP on a synthetic task (labels from a fixed random
teacher network, so the loss really falls) with ``RemoteOptimizer`` on the
cluster file's nodes, feeds batches through LuWu's ``Prefetcher`` and serves
its Prometheus metrics (worker and prefetch series) on ``--metrics-port``.
Settings of the cluster file can be overridden with ``--section.field=value``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

from luwu import RemoteOptimizer
from luwu.config import load_config
from luwu.gpu_workers.prefetch import Prefetcher

IN, HIDDEN, CLASSES = 32, 128, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights everywhere (rank 0's seed the nodes anyway)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def batches(rank: int, steps: int, batch: int):
    """This rank's shard of a synthetic classification task, one batch per step."""
    teacher = torch.nn.Linear(IN, CLASSES)
    torch.nn.init.normal_(teacher.weight, std=2.0, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(10_000 + rank)
    for _ in range(steps):
        x = torch.randn(batch, IN, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        yield x, y


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        required=True,
        action="append",
        help="cluster file with what lets this worker in: keys/join.toml (or keys/worker<r>.toml with CURVE) of `luwu up` "
        "and the launchers; repeat to layer a file of your own over it (a later file's settings win)",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve /metrics on P+LOCAL_RANK; 0 = any free port (printed); -1 = off",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        help="interface of /metrics (default: metrics.host of the config)",
    )
    p.add_argument(
        "--targets-dir",
        default=None,
        help="write DIR/worker-<rank>.json, a Prometheus file_sd target for this worker",
    )
    p.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="keep serving /metrics this long after training, for a last scrape (SIGTERM ends it)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of this worker (default 1)"
    )
    args, rest = p.parse_known_args(argv)
    cfg = load_config(args.config, argv=rest)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(args.threads)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # run the finally blocks: close sockets and endpoint

    model = make_model()
    port = (
        None
        if args.metrics_port < 0
        else args.metrics_port + local_rank
        if args.metrics_port
        else 0
    )
    # every setting of the cluster file (nodes, capacities, job, optimizer, transport, compression, delayed
    # update, clipping); rank and world size from torchrun's variables
    opt = RemoteOptimizer.from_config(
        model, cfg, lr=args.lr, metrics_port=port, metrics_host=args.metrics_host
    )
    rank = opt.rank
    try:
        if opt.metrics_url:
            print(f"LUWU_WORKER_METRICS {opt.metrics_url}", flush=True)
            if args.targets_dir:
                os.makedirs(args.targets_dir, exist_ok=True)
                target = [
                    {
                        "targets": [opt.metrics_url.split("://", 1)[1]],
                        "labels": {
                            "luwu_job": cfg.cluster.job,
                            "luwu_rank": str(rank),
                            "luwu_role": "worker",
                        },
                    }
                ]
                with open(os.path.join(args.targets_dir, f"worker-{rank}.json"), "w") as fh:
                    json.dump(target, fh)
        loss = torch.tensor(float("nan"))
        started = time.monotonic()
        with Prefetcher(
            batches(rank, args.steps, args.batch), registry=opt.metrics.registry
        ) as data:
            for step, (x, y) in enumerate(data):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                if rank == 0 and step % 20 == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
        took = time.monotonic() - started
        print(
            f"LUWU_WORKER_DONE rank {rank} steps {args.steps} loss {loss.item():.4f} in {took:.1f} s",
            flush=True,
        )
        if args.linger_s > 0:
            time.sleep(args.linger_s)
    finally:
        opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

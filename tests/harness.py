"""Starting real worker processes for the integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
TRAIN = ROOT / "workers" / "train.py"
STREAM = ROOT / "workers" / "stream.py"


def job_secret() -> str:
    """The join secret the nodes of this process's local clusters ask for (they set it in the environment
    while open): what the tests' own sockets show to be let in, as a worker does."""
    return os.environ.get("LUWU_TRANSPORT__JOIN_SECRET", "")


def member_socket(sock):
    """``sock`` (a libzmq socket, not connected yet) showing :func:`job_secret` in its handshake."""
    import zmq

    from luwu.protocol.messages import join_metadata

    if job_secret():
        sock.setsockopt(zmq.METADATA, join_metadata(job_secret()))
    return sock


def start_workers(
    script: Path, spec: dict, world_size: int, tmp: Path, env: dict | None = None
) -> list[subprocess.Popen]:
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    procs = []
    for r in range(world_size):
        e = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(r),
            PYTHONUNBUFFERED="1",
            **(env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(path)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Wait for every process; on timeout kill them all. Returns their outputs; raises if one failed.

    Every output pipe is read at the same time (a thread each): read one after another, a worker
    that prints more than a pipe holds (64 KiB: ~6,600 lines of ``STEP n``) blocks in ``print`` while
    the one being read waits for its pushes, and the job stalls until the timeouts."""
    deadline = time.monotonic() + timeout_s
    outs: list = [None] * len(procs)

    def read(i: int, p: subprocess.Popen) -> None:
        outs[i] = p.stdout.read() if p.stdout is not None else ""

    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for t in readers:
            t.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    for i, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise AssertionError(f"worker {i} exited with {p.returncode}:\n{(out or '')[-4000:]}")
    return [out or "" for out in outs]


def run_training(
    spec: dict, nodes: list[str], tmp: Path, world_size: int = 2, timeout_s: float = 120
) -> list[dict]:
    """Train with RemoteOptimizer in ``world_size`` real processes; returns each rank's saved result."""
    spec = dict(
        spec, nodes=nodes, world_size=world_size, out=str(tmp / f"result-{time.monotonic_ns()}")
    )
    wait_all(start_workers(TRAIN, spec, world_size, tmp), timeout_s)
    return [torch.load(f"{spec['out']}.rank{r}") for r in range(world_size)]


def run_streaming(
    spec: dict, nodes: list[str], tmp: Path, world_size: int = 2, timeout_s: float = 150
) -> list[dict]:
    """Train in streaming mode (``workers/stream.py``) in ``world_size`` real processes; returns each
    rank's saved result."""
    spec = dict(
        spec, nodes=nodes, world_size=world_size, out=str(tmp / f"result-{time.monotonic_ns()}")
    )
    wait_all(start_workers(STREAM, spec, world_size, tmp), timeout_s)
    return [torch.load(f"{spec['out']}.rank{r}") for r in range(world_size)]


def assert_params_close(
    got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = 1e-6, atol: float = 1e-7
) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=atol, msg=lambda m, i=i: f"parameter {i}: {m}"
        )


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def kill_node_after_step(
    cluster, proc: subprocess.Popen, step: int, node: int = 1, timeout_s: float = 120
) -> list[str]:
    """Read ``proc``'s stdout until it prints ``STEP <step>``, then SIGKILL ``node`` of ``cluster`` and
    restart it (from its checkpoints). Returns the lines read, for failure messages."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.strip() == f"STEP {step}":
            break
    cluster.procs[node].send_signal(signal.SIGKILL)
    cluster.procs[node].wait(10)
    cluster.restart(node)
    return seen


def tanh_mlp(seed: int = 0, width: int = 16, depth: int = 4) -> torch.nn.Sequential:
    """``depth`` x (Linear(width, width), Tanh), seeded: with 1088-byte buckets, one bucket per layer."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)

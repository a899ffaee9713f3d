"""GPU head-to-head: LuWu against what a user would pick instead, on one GPU and its host's cores.

On the device machine (16 cores, 128 GiB, one H100 80 GB or H200 141 GB), one call of ~8 minutes
(give the call a 600 s limit: the run ends inside its budget and writes what it has; with the
device tool, ``--out "$OUT"`` brings the files back):

    python3 benchmarks/bench_gpu.py --budget-s 480 --out benchmarks/results/bench_gpu

Requirements there: torch with CUDA (the project pins torch==2.13.0) and luwu-runtime installed
with its dependencies (``pip install -e .``: pyzmq, pynacl, tomli-w, msgpack, uvloop, ...), so
that ``python3 -m luwu node`` starts. DeepSpeed runs only where ``import deepspeed`` works; this
script installs nothing.

The model: a GPT-style decoder (pre-norm blocks, causal ``scaled_dot_product_attention``, a 4x GELU
MLP, untied embedding and head) on synthetic tokens, under bf16 autocast, with AdamW (lr 1e-4,
weight decay 0.1). Each competitor runs in a process of its own (clean peaks), on the same model
and batch:

- ``local_adamw``: the model and ``torch.optim.AdamW(fused=True)`` on the GPU.
- ``fsdp2_offload``: torch FSDP2 at world size 1 (nccl with a GPU, else gloo), ``fully_shard`` per
  block and at the root with ``CPUOffloadPolicy`` and a bf16 ``MixedPrecisionPolicy`` (what its
  users pick; the residual stream is then bf16), and ``torch.optim.AdamW(fused=True)`` on the CPU
  parameters: torch's fastest CPU AdamW.
- ``deepspeed_offload``: ZeRO-2 with the optimizer on the CPU (bf16), where deepspeed imports.
- ``luwu_streaming`` / ``luwu_resident``: ``RemoteOptimizer`` on its defaults, ``stream_weights``
  on / off, against ``luwu.local_cluster(n)`` nodes on this machine's cores: a quarter of them for
  the worker (it compresses the gradients on the CPU), the rest for the nodes, 4 cores each (an
  event loop and 3 optimizer threads; 16 cores: 4 + 3 nodes x 4). The model is built whole on the
  GPU, and streaming releases it unit by unit: a model built on the meta device would be
  materialized on the CPU (``gpu_workers/materialize.py``) and train there.

Sizes, from the GPU's memory and the host's, printed with the numbers: (a) the model whose local
AdamW state (16 B/param) is over 1.1x the GPU's memory, where the host holds FSDP2 + offload's state
(~17 B/param) and LuWu's nodes (12 B/param); where it does not (an H200 on 128 GiB), every
competitor's GPU is capped (``set_per_process_memory_fraction``) to the largest size the host
allows, and the output says so. (b) A ~1B-parameter model that every competitor fits. A competitor
predicted not to fit is skipped with its predicted need; local AdamW at (a) runs anyway, to show
that it runs out of memory.

Per competitor: tokens/s (the median over the timed steps after warm-up; a step is the interval
between the ends of two consecutive steps, so the work a step leaves in flight counts in the next),
the GPU allocator's peaks while training (allocated, reserved) and while setting up, and the host
peaks (VmHWM of the worker process, and the sum over the LuWu node processes). Targets, at size (a):
LuWu streaming >= 1.5x FSDP2 + offload's tokens/s, with a training GPU peak no higher.

``--budget-s`` bounds the whole run: each competitor gets a slice of the time left (by weight;
time a run leaves over passes on) and is killed at its end, keeping the steps it reported.
``--tiny`` (the default without CUDA) runs every competitor that can on the CPU with a
~1M-parameter model. Writes ``bench_gpu.json`` and ``.md`` (tiny: ``bench_gpu_cpu_tiny.*``) under
``--out``. The exit status is 1 when a competitor failed: an error, out of memory where it was
predicted to fit, or no timed step within its slice.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repo root, for `benchmarks.common` when run as a script
from benchmarks.common import RESULTS, md_table
from benchmarks.profile_worker import _ours, _py_spy

GIB = 1 << 30
LR, WEIGHT_DECAY = 1e-4, 0.1
COMPETITORS = ("local_adamw", "fsdp2_offload", "deepspeed_offload")
COMPETITORS += ("luwu_streaming", "luwu_resident")
ADAM_B = 16  # per parameter: fp32 weights, gradients and AdamW's two moments
NODE_B = 12  # per parameter on a LuWu node: fp32 master and two moments
# per parameter on FSDP2 + offload's host: ADAM_B, and the pinned allocator rounding sizes up
FSDP2_HOST_B = 17
# per parameter: the bf16 copies of the weights that autocast makes in forward, kept for backward
CAST_B = 2
HOST_SHARE = 0.85  # of MemAvailable at start: what one competitor may hold on the host
HOST_BASE = 4 * GIB  # a process with torch and CUDA loaded, and slack
NODE_INFLIGHT = 2 * GIB  # node.inflight_bytes' default: gradient accumulators kept per node
# (size, competitor, weight of its time slice): the headline pair first, what may be cut last
JOBS = [("large", "fsdp2_offload", 4), ("large", "luwu_streaming", 4)]
JOBS += [("base", c, 1) for c in COMPETITORS]
JOBS += [("large", "deepspeed_offload", 2), ("large", "luwu_resident", 1.5)]
JOBS += [("large", "local_adamw", 0.5)]
EXPECTED_OOM = {("large", "local_adamw")}  # run to show that it does not fit


@dataclass(frozen=True)
class Shape:
    """The decoder's dimensions and the batch."""

    vocab: int
    d: int
    heads: int
    layers: int
    seq: int
    batch: int

    @property
    def params(self) -> int:
        d = self.d
        return self.layers * (12 * d * d + 4 * d) + 2 * self.vocab * d + self.seq * d + 2 * d

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def activation_bytes(self) -> int:
        """bf16 autocast, no recomputation: ~40 B per token, layer and width, and the logits."""
        return self.tokens * (self.layers * 40 * self.d + 10 * self.vocab)

    def block_params(self) -> int:
        return 12 * self.d * self.d + 4 * self.d


def shape_for(
    params: float, d: int, heads: int, *, vocab: int = 32768, seq: int = 1024, batch: int = 4
) -> Shape:
    """The shape of width ``d`` with the fewest layers holding at least ``params`` parameters."""
    base = Shape(vocab, d, heads, 0, seq, batch)
    layers = max(1, math.ceil((params - base.params) / base.block_params()))
    return Shape(vocab, d, heads, layers, seq, batch)


TINY = Shape(vocab=512, d=128, heads=4, layers=4, seq=64, batch=2)  # 0.93M parameters


# ----------------------------------------------------------------- the model
class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.fc1 = torch.nn.Linear(d, 4 * d, bias=False)
        self.fc2 = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    """Token and position embeddings, the blocks (the units LuWu streams), a final norm, a head."""

    def __init__(self, s: Shape):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(s.vocab, s.d), torch.nn.Embedding(s.seq, s.d)
        self.blocks = torch.nn.ModuleList(Block(s.d, s.heads) for _ in range(s.layers))
        self.ln_f = torch.nn.LayerNorm(s.d)
        self.head = torch.nn.Linear(s.d, s.vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


@torch.no_grad()
def init_weights_(model: torch.nn.Module, draw: torch.device, seed: int = 0) -> None:
    """GPT-2's init (matrices N(0, 0.02), norms 1 and 0), drawn on ``draw`` whatever device the
    parameters live on (FSDP2's are DTensors on the CPU: their local shard is written)."""
    gen = torch.Generator(device=draw).manual_seed(seed)
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if p.dim() < 2:
            t.fill_(1.0 if name.endswith("weight") else 0.0)
        elif t.device == draw:
            t.normal_(0.0, 0.02, generator=gen)
        else:
            t.copy_(torch.empty(t.shape, device=draw).normal_(0.0, 0.02, generator=gen))


def lm_loss(model, x, y):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------- competitors (in the child)
def _torch_step(model, opt):
    """One training step with a torch optimizer (LuWu's is one)."""

    def step(x, y):
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def setup_local(spec, shape, device, stack):
    """The model and torch's fused AdamW, all on the device."""
    with torch.device(device):
        model = GPT(shape)
    init_weights_(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return _torch_step(model, opt), {"optimizer": "torch.optim.AdamW(fused=True) on " + device.type}


def setup_fsdp2(spec, shape, device, stack):
    """FSDP2 at world size 1 with its parameters, gradients and optimizer on the CPU: built on the
    meta device, sharded per block, materialized on the CPU and initialized from the device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{spec['scratch']}/pg", rank=0, world_size=1
    )
    stack.callback(dist.destroy_process_group)
    kw = {
        "mesh": init_device_mesh(device.type, (1,)),
        "offload_policy": CPUOffloadPolicy(pin_memory=cuda),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    with torch.device("meta"):
        model = GPT(shape)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu")  # offloaded: the sharded parameters live on the CPU
    init_weights_(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    where = {p.to_local().device.type for p in model.parameters()}
    return _torch_step(model, opt), {
        "backend": backend,
        "param_devices": sorted(where),
        "pinned": cuda,
    }


def setup_deepspeed(spec, shape, device, stack):
    """ZeRO-Offload as DeepSpeed ships it: stage 2, bf16, the optimizer on the CPU."""
    import deepspeed

    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec["port"]),
    )
    deepspeed.init_distributed(dist_backend="nccl")
    with torch.device(device):
        model = GPT(shape)
    init_weights_(model, device)
    config = {
        "train_micro_batch_size_per_gpu": shape.batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(x, y):
        logits = engine(x)  # bf16 weights: no autocast needed
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"zero": "stage 2, offload_optimizer cpu"}


def setup_luwu(spec, shape, device, stack, *, stream: bool):
    """``RemoteOptimizer`` on its defaults against node daemons on this machine's cores."""
    import luwu

    node_args = ["--node.torch_threads", str(spec["node_threads"])]
    cluster = stack.enter_context(
        luwu.local_cluster(spec["nodes"], node_args=node_args, start_timeout_s=120)
    )
    with torch.device(device):
        model = GPT(shape)
    init_weights_(model, device)
    opt = luwu.RemoteOptimizer(
        model,
        "adamw",
        nodes=cluster.addresses,
        job=cluster.job,
        rank=0,
        world_size=1,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        stream_weights=stream,
        timeout_s=spec["luwu_timeout_s"],
    )
    stack.callback(opt.close)
    info = {
        "nodes": spec["nodes"],
        "node_threads": spec["node_threads"],
        "node_pids": [p.pid for p in cluster.procs],
    }
    return _torch_step(model, opt), info


SETUPS = {
    "local_adamw": setup_local,
    "fsdp2_offload": setup_fsdp2,
    "deepspeed_offload": setup_deepspeed,
    "luwu_streaming": lambda *a: setup_luwu(*a, stream=True),
    "luwu_resident": lambda *a: setup_luwu(*a, stream=False),
}


# ----------------------------------------------------------------- the child process
def vm_hwm(pid: int | str = "self") -> int:
    """A process's peak resident memory in bytes (VmHWM), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _peaks(device: torch.device, node_pids: list[int]) -> dict:
    cuda = device.type == "cuda"
    return {
        "gpu_alloc": torch.cuda.max_memory_allocated(device) if cuda else None,
        "gpu_reserved": torch.cuda.max_memory_reserved(device) if cuda else None,
        "host_worker": vm_hwm(),
        "host_nodes": [vm_hwm(p) for p in node_pids],
    }


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train(step, shape: Shape, device: torch.device, spec: dict, note, node_pids: list[int]) -> None:
    """Warm-up steps (one at least), then timed steps until ``spec['steps']`` or the slice's
    deadline (one timed step at least; warm-up is cut short to make room for it), each reported as
    it ends."""
    gen = torch.Generator(device=device).manual_seed(1)
    data = [
        torch.randint(shape.vocab, (shape.batch, shape.seq + 1), device=device, generator=gen)
        for _ in range(2)
    ]
    i, timed, n_timed, last = 0, False, 0, _now(device)
    while n_timed < spec["steps"]:
        loss = float(step(data[i % 2][:, :-1], data[i % 2][:, 1:]))
        t = _now(device)
        dt, last = t - last, t
        note(event="step", i=i, timed=timed, dt=dt, loss=loss, **_peaks(device, node_pids))
        n_timed, i = n_timed + timed, i + 1
        left = spec["deadline"] - time.time()
        if n_timed and left < dt:
            break
        timed = timed or i >= spec["warmup"] or left < 2 * dt
    note(event="done", **_peaks(device, node_pids))


def child(spec_path: str) -> int:
    """One competitor's run, its events appended to ``spec['progress']`` as they happen (the parent
    reads them even when it had to kill this process). A failure is reported before the teardown
    (closing LuWu's optimizer, stopping its nodes) runs, and a failing teardown is reported too.
    Exit status 0, 1 on an error, 3 out of memory."""
    spec = json.loads(Path(spec_path).read_text())
    with open(spec["progress"], "a", buffering=1) as out:

        def note(**kw) -> None:
            out.write(json.dumps(kw) + "\n")

        try:
            with contextlib.ExitStack() as stack:
                return run_reported(spec, note, stack)
        except Exception:  # noqa: BLE001 -- the teardown's failure is the row's result
            note(event="error", message="teardown: " + traceback.format_exc()[-3000:])
            return 1


def run_reported(spec: dict, note, stack: contextlib.ExitStack) -> int:
    try:
        run_competitor(spec, note, stack)
    except torch.OutOfMemoryError as exc:
        note(event="oom", message=str(exc)[:600])
        return 3
    except Exception:  # noqa: BLE001 -- any failure is the row's result, with its traceback
        note(event="error", message=traceback.format_exc()[-3000:])
        return 1
    return 0


def run_competitor(spec: dict, note, stack: contextlib.ExitStack) -> None:
    """Set the competitor up (what it starts is closed by ``stack``), then train it."""
    device, shape = torch.device(spec["device"]), Shape(**spec["shape"])
    torch.set_num_threads(spec["threads"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec["gpu_cap_bytes"]:
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = min(1.0, spec["gpu_cap_bytes"] / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
    t0 = time.perf_counter()
    step, info = SETUPS[spec["competitor"]](spec, shape, device, stack)
    pids = info.get("node_pids", [])
    note(event="setup", setup_s=time.perf_counter() - t0, info=info, **_peaks(device, pids))
    if device.type == "cuda":  # the training peak from here: what setup freed goes back first
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    train(step, shape, device, spec, note, pids)


# ----------------------------------------------------------------- sizes (in the parent)
def probe_device() -> dict:
    """The GPU's name and memory, and torch's version, asked in a subprocess (the parent keeps no
    CUDA context, which would take memory from the competitors)."""
    code = (
        "import json, torch\n"
        "c = torch.cuda.is_available()\n"
        "p = torch.cuda.get_device_properties(0) if c else None\n"
        "print(json.dumps({'cuda': c, 'name': p.name if c else 'cpu',\n"
        "                  'total': p.total_memory if c else 0, 'torch': torch.__version__,\n"
        "                  'cuda_version': torch.version.cuda}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))


def needs(s: Shape, competitor: str, nodes: int) -> tuple[int, int]:
    """Predicted (GPU bytes, host bytes) of a competitor training shape ``s``: what it holds per
    parameter, the activations, and the blocks in flight (LuWu streaming: ``stream_prefetch`` + 2
    units; FSDP2: ~4 blocks gathered, in bf16 and their fp32 copies from the host)."""
    n, act, block = s.params, s.activation_bytes, s.block_params()
    root = s.params - s.layers * block  # embeddings, head, final norm: never streamed
    luwu_host = HOST_BASE + nodes * NODE_INFLIGHT + NODE_B * n
    return {
        "local_adamw": ((ADAM_B + CAST_B) * n + act, HOST_BASE),
        "fsdp2_offload": (act + 4 * 6 * block + 6 * root, HOST_BASE + FSDP2_HOST_B * n),
        "deepspeed_offload": (4 * n + act, HOST_BASE + 16 * n),  # bf16 weights and gradients
        # the units in flight on the GPU (fp32 weights and gradients) and in the host's buffer pool
        "luwu_streaming": (act + CAST_B * n + 4 * 8 * block + 8 * root, luwu_host + 4 * 4 * block),
        "luwu_resident": ((8 + CAST_B) * n + act, luwu_host + 4 * n),  # host: the gradient buckets
    }[competitor]


def plan(total: int, available: int, nodes: int, cap_gib: float = 0.0) -> tuple[dict, int, list]:
    """The sizes (name -> shape), the GPU memory every competitor may use (bytes) and the reasons,
    for a GPU of ``total`` bytes and a host with ``available`` bytes (MemAvailable); ``cap_gib``: a
    cap given by hand (0: the whole GPU, or less where the host cannot hold FSDP2 + offload's
    state)."""
    host = HOST_SHARE * available
    cap = int(cap_gib * GIB) if cap_gib else total
    why = [f"host limit per competitor: {HOST_SHARE} x MemAvailable = {host / GIB:.1f} GiB"]
    large = shape_for(1.1 * cap / ADAM_B, 4096, 32)
    while not cap_gib and needs(large, "fsdp2_offload", nodes)[1] > host:
        cap -= GIB  # every competitor gets a smaller GPU: the host cannot hold the whole GPU's size
        large = shape_for(1.1 * cap / ADAM_B, 4096, 32)
    if cap != total:
        reason = (
            "--gpu-cap-gib"
            if cap_gib
            else f"the host cannot hold FSDP2 + offload's state ({FSDP2_HOST_B} B/param)"
        )
        why.append(
            f"GPU capped at {cap / GIB:.1f} of {total / GIB:.1f} GiB for every competitor "
            f"(set_per_process_memory_fraction): {reason}"
        )
    base = shape_for(min(1e9, 0.25 * cap / ADAM_B), 2048, 16)
    fits = [
        f"{c} ~{needs(large, c, nodes)[1] / GIB:.1f} GiB"
        for c in ("fsdp2_offload", "luwu_streaming")
    ]
    over = any(needs(large, c, nodes)[1] > host for c in ("fsdp2_offload", "luwu_streaming"))
    why.append(
        f"(a) large: {large.params / 1e9:.2f}B params ({large.layers} blocks of width {large.d}): "
        f"local AdamW's {ADAM_B} B/param = {ADAM_B * large.params / GIB:.1f} GiB > 1.1 x "
        f"{cap / GIB:.1f} GiB of GPU; host: {', '.join(fits)}: "
        f"{'OVER' if over else 'under'} the limit"
    )
    why.append(
        f"(b) base: {base.params / 1e9:.2f}B params ({base.layers} blocks of width {base.d}): "
        f"local AdamW needs ~{needs(base, 'local_adamw', nodes)[0] / GIB:.1f} GiB of GPU"
    )
    return {"large": large, "base": base}, cap, why


def skip_reason(size: str, competitor: str, s: Shape, cap: int, host: float, nodes: int) -> str:
    """Why a job does not run ('' when it does): DeepSpeed missing, or predicted not to fit ``cap``
    bytes of GPU and ``host`` bytes of host memory (local AdamW at size (a) runs to show it)."""
    if competitor == "deepspeed_offload":
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not importable here (not installed; this script installs nothing)"
        if not cap:
            return "DeepSpeed's CPU-offload optimizer needs a CUDA device"
    if not cap or (size, competitor) in EXPECTED_OOM:
        return ""
    gpu, host_need = needs(s, competitor, nodes)
    if gpu > 0.95 * cap or host_need > host:
        return (
            f"predicted not to fit: GPU {gpu / GIB:.1f} GiB (of {cap / GIB:.1f}), "
            f"host {host_need / GIB:.1f} GiB (of {host / GIB:.1f})"
        )
    return ""


# ----------------------------------------------------------------- running the children
def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip().endswith("}")]


def _kill_group(proc: subprocess.Popen) -> None:
    """End the child and what it started (its nodes share its process group): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


def run_job(
    job: dict, slice_s: float, hard_end: float, scratch: Path
) -> tuple[list[dict], int | None, dict]:
    """Run one competitor in its own process group until it ends or its slice does; returns its
    events, its exit status (None: killed at the slice's end) and the peaks read before the kill."""
    name = f"{job['size']}-{job['competitor']}"
    start = time.time()
    spec = dict(job, progress=str(scratch / f"{name}.jsonl"), deadline=start + 0.9 * slice_s - 5)
    (scratch / f"{name}.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(scratch / f"{name}.json")]
    if job.get("profile"):  # every process of the run: the worker and its nodes
        raw = ["record", "--format", "raw", "--rate", str(PROFILE_HZ), "--subprocesses"]
        cmd = [job["profile"], *raw, "-o", str(scratch / f"{name}.prof.txt"), "--", *cmd]
    with open(scratch / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sampled: dict = {}
    try:
        rc = proc.wait(timeout=max(1.0, min(start + slice_s, hard_end) - time.time()))
    except subprocess.TimeoutExpired:
        rc = None
        setup = next((e for e in read_events(Path(spec["progress"])) if e["event"] == "setup"), {})
        pids = setup.get("info", {}).get("node_pids", [])
        sampled = {"host_worker": vm_hwm(proc.pid), "host_nodes": [vm_hwm(p) for p in pids]}
    finally:
        _kill_group(proc)
    return read_events(Path(spec["progress"])), rc, sampled


def status_of(events: list[dict], rc: int | None) -> tuple[str, str]:
    """(status, message) of a child's run: ok, partial (killed at its slice's end after timed
    steps), oom, error, or timeout (killed before a timed step)."""
    failed = next((e for e in events if e["event"] in ("oom", "error")), None)
    if failed:
        return failed["event"], failed["message"]
    if any(e["event"] == "step" and e["timed"] for e in events):
        done = any(e["event"] == "done" for e in events)
        return ("ok", "") if done else ("partial", "killed at the end of its time slice")
    if rc is None:
        return "timeout", "killed at the end of its time slice before a timed step"
    return "error", f"exit status {rc} with no timed step (see log_tail)"


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 2)


def summarize(job: dict, events: list[dict], rc: int | None, sampled: dict, wall_s: float) -> dict:
    """One row of the table from a child's events (and the peaks read before a kill)."""
    shape = Shape(**job["shape"])
    steps = [e for e in events if e["event"] == "step"]
    timed = [e["dt"] for e in steps if e["timed"]]
    last = next((e for e in reversed(events) if "host_worker" in e), {})
    last = last | {k: v for k, v in sampled.items() if v}
    setup = next((e for e in events if e["event"] == "setup"), {})
    status, message = status_of(events, rc)
    step_s = statistics.median(timed) if timed else None
    nodes = sum(last.get("host_nodes") or [])
    return {
        "size": job["size"],
        "competitor": job["competitor"],
        "status": status,
        "params": shape.params,
        "tokens_per_step": shape.tokens,
        "steps_timed": len(timed),
        "step_s": step_s,
        "step_s_all": [round(t, 4) for t in timed],
        "tokens_per_s": shape.tokens / step_s if step_s else None,
        "gpu_peak_alloc_gib": gib(last.get("gpu_alloc")),
        "gpu_peak_reserved_gib": gib(last.get("gpu_reserved")),
        "gpu_setup_peak_gib": gib(setup.get("gpu_alloc")),
        "host_worker_peak_gib": gib(last.get("host_worker")),
        "host_nodes_peak_gib": gib(nodes) if nodes else None,
        "host_total_peak_gib": gib((last.get("host_worker") or 0) + nodes),
        "setup_s": setup.get("setup_s"),
        "wall_s": round(wall_s, 1),
        "rc": rc,
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "info": {k: v for k, v in setup.get("info", {}).items() if k != "node_pids"},
        "message": message,
    }


# ----------------------------------------------------------------- where the time goes
PROFILE_HZ = 50


def profile_summary(raw: Path, steps: int, top: int = 12) -> dict:
    """Seconds per training step on the CPU, by process (the worker, the nodes together) and by
    where: the innermost LuWu function on the stack, else the leaf frame. Setup (building the model,
    the nodes' start, imports) is left out: stacks through ``setup_luwu`` or importlib, and the
    parent's. py-spy samples threads that hold the CPU, so a thread waiting costs nothing here."""
    per_step = 1.0 / (PROFILE_HZ * max(steps, 1))
    where: dict[str, Counter] = {"worker": Counter(), "nodes": Counter()}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        if not count.isdigit() or not procs or "_bootstrap>" in stack or "setup_luwu" in stack:
            continue
        kind = (
            "nodes" if "-m luwu node" in procs[-1] else "worker" if "--child" in procs[-1] else ""
        )
        if not kind:
            continue
        code = [f for f in frames if not f.startswith(("process ", "thread ("))]
        mine = [f for f in code if _ours(f)]
        leaf = mine[-1] if mine else (code[-1] if code else "(no Python frame)")
        where[kind][
            leaf.split(" (", 1)[0] + " (" + (_ours(leaf) or leaf.partition("(")[2][:-1]) + ")"
        ] += int(count)
    return {
        kind: {
            "cpu_s_per_step": round(sum(c.values()) * per_step, 3),
            "top": [
                {"where": k, "s_per_step": round(v * per_step, 3)} for k, v in c.most_common(top)
            ],
        }
        for kind, c in where.items()
    }


# ----------------------------------------------------------------- the run (in the parent)
def cpu_split(args, cores: int) -> tuple[int, int, int]:
    """(LuWu worker threads, nodes, optimizer threads per node): the worker copies the gradients
    out of the GPU and compresses them on the CPU, so it gets a quarter of the cores; the nodes
    share the rest, each with a core for its event loop. Tiny: one thread each."""
    if args.tiny:
        return args.worker_threads or 1, args.nodes or 1, args.node_threads or 1
    worker = args.worker_threads or max(2, cores // 4)
    nodes = args.nodes or max(1, (cores - worker) // 4)
    return worker, nodes, args.node_threads or max(1, (cores - worker) // nodes - 1)


def make_jobs(args, total: int, shapes: dict[str, Shape], cap: int, host: float) -> list[dict]:
    """The runs, in order, each with its spec for the child and its weight in the time budget."""
    cores = os.cpu_count() or 1
    worker_threads, nodes, node_threads = cpu_split(args, cores)
    plan_ = [(size, c, 1) for size in shapes for c in COMPETITORS] if args.tiny else JOBS
    jobs = []
    for size, competitor, weight in plan_:
        if args.only and f"{size}:{competitor}" not in args.only and competitor not in args.only:
            continue
        luwu = competitor.startswith("luwu")
        jobs.append(
            {
                "size": size,
                "competitor": competitor,
                "weight": weight,
                "shape": asdict(shapes[size]),
                "device": "cuda:0" if not args.tiny else "cpu",
                "gpu_cap_bytes": cap if cap != total else 0,
                "threads": worker_threads if luwu else 1 if args.tiny else cores,
                "nodes": nodes,
                "node_threads": node_threads,
                "warmup": args.warmup,
                "steps": args.steps,
                "luwu_timeout_s": 300.0,
                "port": 29500 + os.getpid() % 1000,
                "skip": skip_reason(size, competitor, shapes[size], cap, host, nodes),
                "profile": _py_spy() if args.profile and luwu else None,
                "profile_dir": str(args.out),
            }
        )
    return jobs


def run_all(jobs: list[dict], end: float, scratch: Path) -> list[dict]:
    """Each job in turn, its slice its weight's share of the time left; a skipped job has a row."""
    rows = []
    for k, job in enumerate(jobs):
        job["scratch"] = str(scratch)
        left = sum(j["weight"] for j in jobs[k:] if not j["skip"])
        slice_s = (end - time.time()) * job["weight"] / left if left else 0.0
        if job["skip"] or slice_s < 20:
            shape = Shape(**job["shape"])
            why = job["skip"] or f"no time left in the budget ({slice_s:.0f} s)"
            rows.append(
                {
                    "size": job["size"],
                    "competitor": job["competitor"],
                    "status": "skipped",
                    "params": shape.params,
                    "message": why,
                }
            )
            print(f"[{job['size']}] {job['competitor']}: skipped: {why}", flush=True)
            continue
        print(f"[{job['size']}] {job['competitor']}: running, slice {slice_s:.0f} s", flush=True)
        t0 = time.time()
        events, rc, sampled = run_job(job, slice_s, end, scratch)
        row = summarize(job, events, rc, sampled, time.time() - t0)
        raw = scratch / f"{job['size']}-{job['competitor']}.prof.txt"
        if job.get("profile") and raw.exists():
            row["profile"] = profile_summary(raw, sum(e["event"] == "step" for e in events))
            Path(job["profile_dir"]).mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, Path(job["profile_dir"]) / f"prof_{raw.name}")
        if (job["size"], job["competitor"]) in EXPECTED_OOM:
            fits = row["status"] in ("ok", "partial")
            said = "it FITS: size (a) is not past its reach" if fits else "as predicted"
            row["message"] = f"{said}; {row['message']}"
        if row["status"] not in ("ok", "partial"):
            log = scratch / f"{job['size']}-{job['competitor']}.log"
            row["log_tail"] = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        rows.append(row)
        print(
            f"[{job['size']}] {job['competitor']}: {row['status']}, "
            f"tokens/s {row['tokens_per_s']}, "
            f"GPU peak {row['gpu_peak_alloc_gib']} GiB, host {row['host_total_peak_gib']} GiB "
            + row["message"][-300:],
            flush=True,
        )
    return rows


RATIOS = {
    "tokens/s": "tokens_per_s",
    "GPU peak": "gpu_peak_alloc_gib",
    "host peak": "host_total_peak_gib",
}
COLUMNS = ["size", "competitor", "status", "params_b", "tokens_per_s", "step_s", "steps_timed"]
COLUMNS += ["gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "gpu_setup_peak_gib"]
COLUMNS += ["host_worker_peak_gib", "host_nodes_peak_gib", "host_total_peak_gib", "setup_s"]
COLUMNS += ["loss", "note"]


def compare(rows: list[dict], tiny: bool) -> tuple[dict, list[dict]]:
    """Ratios side by side within each size (against FSDP2 + offload and local AdamW), and the
    targets at size (a)."""
    by = {(r["size"], r["competitor"]): r for r in rows}
    ratios = {}
    for size in dict.fromkeys(r["size"] for r in rows):
        for ref in ("fsdp2_offload", "local_adamw"):
            for c in COMPETITORS:
                for what, key in RATIOS.items():
                    num = by.get((size, c), {}).get(key)
                    den = by.get((size, ref), {}).get(key)
                    if c != ref and num is not None and den:
                        ratios[f"{size}: {c} / {ref}, {what}"] = round(num / den, 3)
    speed = ratios.get("large: luwu_streaming / fsdp2_offload, tokens/s")
    peak = ratios.get("large: luwu_streaming / fsdp2_offload, GPU peak")
    na = "n/a (tiny CPU run)" if tiny else "n/a (not measured)"
    targets = [
        {
            "target": "size (a): LuWu streaming tokens/s >= 1.5x FSDP2 + offload's",
            "value": speed,
            "verdict": na if speed is None else "met" if speed >= 1.5 else "not met",
        },
        {
            "target": "size (a): LuWu streaming training GPU peak <= FSDP2 + offload's",
            "value": peak,
            "verdict": na if peak is None else "met" if peak <= 1.0 else "not met",
        },
    ]
    return ratios, targets


def report(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        first, last = r.get("loss_first"), r.get("loss_last")
        loss = "" if first is None else f"{first:.3f} -> {last:.3f}"
        info = ", ".join(f"{k} {v}" for k, v in r.get("info", {}).items())
        note = (r.get("message", "").strip().splitlines() or [info])[-1][:160].replace("|", "/")
        rows.append(r | {"params_b": r["params"] / 1e9, "loss": loss, "note": note})
    m, title = result["machine"], "# GPU head-to-head"
    head = (
        f"`{result['command']}` on {m['device']} (torch {m['torch']}, CUDA {m['cuda']}), "
        f"{m['cores']} cores, {m['mem_total_gib']} GiB host, commit {result['commit']}; "
        f"budget {result['budget_s']} s, used {result['wall_s']} s."
    )
    lines = [title + (" (CPU tiny run: a smoke test, not a result)" if result["tiny"] else ""), ""]
    lines += [
        head,
        "",
        *[f"- {w}" for w in result["sizes"]["why"]],
        "",
        md_table(rows, COLUMNS),
        "",
    ]
    lines += ["Ratios (side by side in this run):", ""]
    lines += [f"- {k}: {v}x" for k, v in result["ratios"].items()]
    lines += ["", "Targets:", ""]
    lines += [f"- {t['target']}: {t['value']} -> **{t['verdict']}**" for t in result["targets"]]
    lines += ["", PEAKS_NOTE]
    for r in result["rows"]:
        for kind, prof in r.get("profile", {}).items():
            lines += ["", f"Where the CPU goes, {r['size']} {r['competitor']}, {kind}: "]
            lines += [f"{prof['cpu_s_per_step']} s per step in all (py-spy, {PROFILE_HZ} Hz)", ""]
            lines += [md_table(prof["top"], ["where", "s_per_step"])]
    return "\n".join(lines) + "\n"


PEAKS_NOTE = (
    "tokens/s: tokens per step over the median of the timed steps, a step being the interval "
    "between the ends of two steps. GPU peaks: the allocator's while training; setup: while "
    "building the model and the optimizer (LuWu builds the model whole on the GPU, streaming then "
    "releases it unit by unit). Host peaks: VmHWM of the worker process, and the sum over LuWu's "
    "node processes."
)


def git_commit() -> str:
    def git(*a: str) -> str:
        cmd = ["git", *a]
        return subprocess.run(
            cmd, cwd=HERE.parent, capture_output=True, text=True, check=False
        ).stdout.strip()

    if os.environ.get("LUWU_COMMIT"):  # a copy of the tree (the device tool's): the caller names it
        return os.environ["LUWU_COMMIT"]
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run's wall-clock limit")
    p.add_argument(
        "--out", type=Path, default=RESULTS / "bench_gpu", help="folder for the JSON and markdown"
    )
    p.add_argument(
        "--tiny",
        "--quick",  # (run_all.py --quick passes it to every benchmark)
        dest="tiny",
        action="store_true",
        help="~1M parameters on the CPU (the default without CUDA)",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (2; tiny: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (5; tiny: 2)")
    p.add_argument("--worker-threads", type=int, default=0, help="LuWu worker (0: cores // 4)")
    p.add_argument(
        "--nodes", type=int, default=0, help="LuWu nodes (0: the rest of the cores // 4)"
    )
    p.add_argument(
        "--node-threads", type=int, default=0, help="optimizer threads per node (0: auto)"
    )
    p.add_argument(
        "--gpu-cap-gib",
        type=float,
        default=0.0,
        help="cap every competitor's GPU memory (0: as needed)",
    )
    p.add_argument(
        "--only", nargs="*", default=[], help="run only these: competitor or size:competitor"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy LuWu's runs (worker and nodes): CPU seconds per step by function, in the "
        "results, and the raw stacks as prof_*.txt beside them (needs py-spy)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child(args.child)
    # a TERM (a caller's timeout) unwinds through run_job, which ends the running child's group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    end = t0 + args.budget_s - 10  # the last seconds: writing the results
    dev = probe_device()
    if not dev["cuda"] and not args.tiny:
        print("no CUDA device: the tiny CPU run instead", flush=True)
    args.tiny = args.tiny or not dev["cuda"]
    args.warmup = args.warmup if args.warmup is not None else 1 if args.tiny else 2
    args.steps = args.steps if args.steps is not None else 2 if args.tiny else 5
    cores, available = os.cpu_count() or 1, mem_available()
    if args.tiny:
        shapes, cap, why = {"tiny": TINY}, 0, ["tiny: a ~1M-parameter model on the CPU"]
    else:
        nodes = cpu_split(args, cores)[1]
        shapes, cap, why = plan(dev["total"], available, nodes, args.gpu_cap_gib)
    print("\n".join(why), flush=True)
    jobs = make_jobs(args, dev["total"], shapes, cap, HOST_SHARE * available)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as scratch:
        rows = run_all(jobs, end, Path(scratch))
    ratios, targets = compare(rows, args.tiny)
    result = {
        "command": " ".join(["python3", "benchmarks/bench_gpu.py", *(argv or sys.argv[1:])]),
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "wall_s": round(time.time() - t0, 1),
        "commit": git_commit(),
        "machine": machine(dev, cores),
        "sizes": {"why": why, "gpu_cap_gib": round(cap / GIB, 1)}
        | {k: asdict(s) | {"params": s.params} for k, s in shapes.items()},
        "jobs": [{k: v for k, v in j.items() if k not in ("shape", "scratch")} for j in jobs],
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
    }
    write(result, args.out, "bench_gpu_cpu_tiny" if args.tiny else "bench_gpu")
    failed = [r for r in rows if r["status"] not in ("ok", "partial", "skipped")]
    return 1 if any((r["size"], r["competitor"]) not in EXPECTED_OOM for r in failed) else 0


def machine(dev: dict, cores: int) -> dict:
    with open("/proc/meminfo") as f:
        total = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
    return {
        "device": dev["name"],
        "gpu_total_gib": round(dev["total"] / GIB, 1),
        "torch": dev["torch"],
        "cuda": dev["cuda_version"],
        "cores": cores,
        "mem_total_gib": round(total / GIB, 1),
    }


def write(result: dict, out: Path, stem: str) -> None:
    md = report(result)
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    sys.exit(main())

"""Named setups for ``luwu plan --preset``: the options they set, and every number they had to assume.

``luwu-paper`` is the testbed of the LuWu paper (arXiv 2409.00918): a 175B-parameter model, 8 A100
workers, 100 Gbit/s links, one optimizer node with 12 SSDs. The paper gives those four facts; every
other input the model needs is assumed here, and says so, so that a reader can replace any of them
with a measured number (an option given on the command line wins over the preset's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from luwu.plan.model import ADAMW_PARAMS_PER_S_PER_THREAD

PAPER, ASSUMED, MEASURED, DEFAULT = "paper", "assumed", "measured here", "LuWu's default"

A100_BF16_TFLOPS = 312.0
"""An A100's dense bf16 tensor-core peak (NVIDIA's data sheet)."""
A100_MFU = 0.4
"""Share of that peak a 175B model's forward and backward achieve (assumed)."""


@dataclass(frozen=True, slots=True)
class Assumption:
    """One input of a preset: what it is, its value, where it comes from and why."""

    what: str
    value: str
    source: str
    """``paper``, ``assumed``, ``measured here`` or ``LuWu's default``."""
    why: str
    option: str | None = None
    """The option (argparse dest) it sets, so that a value given on the command line is shown as such."""


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    description: str
    options: dict[str, Any]
    """argparse dests -> values, applied where the command line leaves an option at its default."""
    assumptions: tuple[Assumption, ...]


_TFLOPS = A100_BF16_TFLOPS * A100_MFU
_PAPER_OPTIONS = {
    "params": 175_000_000_000,
    "workers": 8,
    "nodes": 1,
    "worker_gbps": 100.0,
    "node_gbps": 100.0,
    "disks": 12,
    "disk_read_gb_s": 3.0,
    "disk_write_gb_s": 2.0,
    "node_ram": 512 * 2**30,
    "optimizer": "adamw",
    "stream": True,
    "units": 96,
    "tokens": 8192,
    "worker_tflops": _TFLOPS,
    "node_threads": 32,
    "push_codec": "bf16",
    "pull_codec": "bf16",
    "gpu_codecs": True,
}
_PAPER_ASSUMPTIONS = (
    Assumption("model", "175B parameters", PAPER, "the paper's largest trained model", "params"),
    Assumption("workers", "8 A100 GPUs, one per worker", PAPER, "the paper's cluster", "workers"),
    Assumption(
        "links", "100 Gbit/s, workers and node", PAPER, "the paper's network", "worker_gbps"
    ),
    Assumption("nodes", "1 optimizer node", PAPER, "the paper's single in-network node", "nodes"),
    Assumption("disks", "12 SSDs in the node", PAPER, "the paper's node", "disks"),
    Assumption(
        "SSD read",
        "3.0 GB/s per SSD",
        ASSUMED,
        "a PCIe 3.0 x4 data-center NVMe drive's sequential read, derated; the paper's drive is not used",
        "disk_read_gb_s",
    ),
    Assumption(
        "SSD write",
        "2.0 GB/s per SSD, reads and writes taking turns (no mixed rate)",
        ASSUMED,
        "the same class of drive's sustained write; taking turns is the pessimistic case",
        "disk_write_gb_s",
    ),
    Assumption(
        "node RAM for state",
        "512 GiB (node.state_memory_bytes)",
        ASSUMED,
        "a server's DRAM less room for buffers; 2.1 TB of state does not fit whatever it is",
        "node_ram",
    ),
    Assumption(
        "optimizer state",
        "AdamW, 12 B/param",
        ASSUMED,
        "fp32 master + two moments",
        "optimizer",
    ),
    Assumption(
        "mode",
        "streaming (model in the network), 96 units",
        ASSUMED,
        "350 GB of bf16 weights do not fit an A100's 80 GB; one unit per layer of GPT-3 175B",
        "units",
    ),
    Assumption(
        "compute",
        f"6 FLOP per parameter per token, 8192 tokens per worker per step, {_TFLOPS:.1f} TFLOP/s",
        ASSUMED,
        f"an A100's {A100_BF16_TFLOPS:.0f} TFLOP/s bf16 peak at {A100_MFU:.0%} utilisation, 4 sequences "
        "of 2048 tokens, no activation recomputation",
        "tokens",
    ),
    Assumption(
        "node optimizer",
        f"{ADAMW_PARAMS_PER_S_PER_THREAD:.2g} params/s per thread x 32 threads",
        MEASURED + " (per thread) / " + ASSUMED + " (threads)",
        "fused AdamW on this machine's one core (bench_node_step); 32 cores of a two-socket server, "
        "memory bandwidth not modelled",
        "node_threads",
    ),
    Assumption(
        "codecs",
        "bf16 gradients and bf16 weights, encoded and decoded on the GPUs (no worker codec time)",
        ASSUMED,
        "16-bit as mixed-precision training keeps them, no lossy compression; the recommendation "
        "line explores int8 and the other codecs; the node's decoding (summing 8 pushes) counts",
        "push_codec",
    ),
    Assumption(
        "protocol efficiency",
        "90% of line rate",
        DEFAULT,
        "TCP + ZeroMQ; the paper's RDMA and SmartNIC path is not modelled",
    ),
    Assumption(
        "layout",
        "flat: every worker's pushes and fetches cross the node's link",
        ASSUMED,
        "the paper's SmartSwitch aggregates and multicasts, which would cut the node link's bytes 8-fold; "
        "LuWu's aggregator tier is not in this model",
    ),
    Assumption(
        "fetches",
        "served from the bf16 weights of the last replies, kept in RAM (350 GB, beside the window)",
        ASSUMED,
        "a fetch adds no disk reads; reading the fp32 master for each fetch instead would add 4 B/param "
        "per fetch round, ~1.4 TB or ~38 s a step on the 12 SSDs, hidden behind the node link here",
    ),
)
LUWU_PAPER = Preset(
    "luwu-paper",
    "the LuWu paper's testbed: 175B parameters, 8 A100 workers, 100 Gbit/s, one node with 12 SSDs",
    _PAPER_OPTIONS,
    _PAPER_ASSUMPTIONS,
)


PRESETS: dict[str, Preset] = {p.name: p for p in (LUWU_PAPER,)}

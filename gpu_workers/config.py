"""Settings of the worker side: the transport and the data prefetch (``transport`` and ``prefetch``
sections of the cluster file). Importing this module does not import torch, so the configuration
tree loads without it."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

from luwu.protocol.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """The ``[transport]`` section: a worker's connection to the nodes (buckets, deadlines, queues, keys)."""

    timeout_s: float = 60.0
    """Deadline of every wait for a node (weights, norms, welcome); the error names node, rank, step, bucket."""
    connect_timeout_s: float = 30.0
    """Deadline for a node to answer HELLO at start-up."""
    bucket_bytes: int = 4 * 1024 * 1024
    """fp32 bytes per bucket; 1-4 MiB frames are where ZeroMQ matches raw TCP."""
    sndhwm: int = 64
    """ZeroMQ send high-water mark (messages per node); beyond it messages wait in the I/O thread's queue,
    where the first layers' pushes overtake the others (priority)."""
    sndbuf_bytes: int = 0
    """Kernel send buffer of each node connection (SO_SNDBUF; 0 = the kernel's autotuning). Small keeps
    the queue where priority reorders it; it must stay above the link's bandwidth x round trip."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest message accepted from a node."""
    heartbeat_s: float = 5.0
    """Idle interval after which the worker pings a node (0 = off)."""
    curve_server_key: str = ""
    """Z85 public key of the nodes; with it, traffic is CURVE-encrypted and authenticated."""
    curve_public_key: str = ""
    """This worker's Z85 CURVE public key (must be authorized on the nodes)."""
    curve_secret_key: str = ""
    """This worker's Z85 CURVE secret key."""
    join_secret: str = ""
    """Shown to the nodes in the ZeroMQ handshake, for nodes that ask for one (node.join_secret). A secret:
    never in argv (LUWU_TRANSPORT__JOIN_SECRET or a mode-600 --config file)."""
    retain_freed_memory: bool = True
    """Keep freed memory in the training process (glibc mallopt) so gradients, received weights and
    activations reuse already touched memory instead of fresh pages (~10x slower to fill); costs
    resident memory up to the peak the process ever held."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"transport.{name} must be > 0, got {getattr(self, name)}")
        if self.bucket_bytes < 16:
            raise ConfigError(f"transport.bucket_bytes must be >= 16, got {self.bucket_bytes}")
        if self.sndhwm < 1 or self.max_message_bytes < self.bucket_bytes:
            raise ConfigError(
                f"transport.sndhwm must be >= 1 and max_message_bytes >= bucket_bytes, got {self.sndhwm}, {self.max_message_bytes}"
            )
        if self.sndbuf_bytes < 0:
            raise ConfigError(
                f"transport.sndbuf_bytes must be >= 0 (0 = the kernel's), got {self.sndbuf_bytes}"
            )
        if self.heartbeat_s < 0:
            raise ConfigError(f"transport.heartbeat_s must be >= 0, got {self.heartbeat_s}")
        keys = (self.curve_server_key, self.curve_public_key, self.curve_secret_key)
        if any(keys) and not all(keys):
            raise ConfigError(
                "transport.curve_server_key, curve_public_key and curve_secret_key must be given together"
            )


DEFAULT_MAX_BYTES = 1 << 30

#: Device types torch knows without plugins (c10's DeviceType names), checked without importing torch.
TORCH_DEVICE_TYPES = frozenset(
    "cpu cuda mkldnn opengl opencl ideep hip ve fpga maia xla lazy vulkan mps meta hpu mtia ipu xpu privateuseone".split()
)
_DEVICE = re.compile(r"([a-z][a-z0-9_]*)(:(0|[1-9][0-9]*))?")


@dataclass(kw_only=True, slots=True)
class PrefetchConfig:
    """Settings of :class:`luwu.gpu_workers.prefetch.Prefetcher` (``prefetch`` section of the cluster file)."""

    depth: int = 2
    """Batches held ahead of the training loop (being fetched or ready). Two hide one
    slow batch behind one step; more only help when load times vary."""
    max_bytes: int = DEFAULT_MAX_BYTES
    """Budget for the tensors held ahead: no new fetch starts while the ready batches
    total this much, so at most max_bytes plus one batch is held. Batches a
    DataLoader keeps in its own workers (its prefetch_factor) are not counted."""
    num_threads: int = 1
    """Threads pulling from the source. Its next() is serialised (iterators are not
    thread-safe); extra threads overlap the pinning and device copy of one batch
    with the fetch of the next."""
    pin_memory: bool | None = None
    """Copy batches into pinned host memory (needed for a copy that does not block the
    host). None: on when the device is CUDA."""
    device: str | None = None
    """Where batches go ('cuda', 'cuda:1'); None leaves them where the loader put them."""
    timeout_s: float | None = None
    """Longest a next() waits for a batch before raising TimeoutError; None waits as
    long as the loader takes (like DataLoader's timeout=0)."""
    shutdown_timeout_s: float = 10.0
    """How long close() waits for a thread stuck inside the source's next(); past it
    the (daemon) thread is left to finish on its own and a warning is logged."""
    name: str = "train"
    """Value of the ``loader`` label of the metrics, telling loaders that share a
    registry apart (train, val)."""

    def __post_init__(self) -> None:
        for field in ("depth", "max_bytes", "num_threads"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"prefetch.{field} must be an int >= 1, got {value!r}")
        if self.num_threads > self.depth:
            raise ConfigError(
                f"prefetch.num_threads must be <= depth ({self.depth}), got {self.num_threads!r}: "
                "a thread beyond depth never gets a slot"
            )
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ConfigError(
                f"prefetch.pin_memory must be true, false or unset, got {self.pin_memory!r}"
            )
        if self.device is not None and not is_device_name(self.device):
            raise ConfigError(f"prefetch.device must name a torch device, got {self.device!r}")
        if self.timeout_s is not None and not _positive_finite(self.timeout_s):
            raise ConfigError(
                f"prefetch.timeout_s must be > 0 and finite, or unset, got {self.timeout_s!r}"
            )
        if not (_positive_finite(self.shutdown_timeout_s) or self.shutdown_timeout_s == 0):
            raise ConfigError(
                f"prefetch.shutdown_timeout_s must be >= 0 and finite, got {self.shutdown_timeout_s!r}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"prefetch.name must be a non-empty string, got {self.name!r}")


def is_device_name(name) -> bool:
    """Whether ``name`` reads as a torch device (``type`` or ``type:index``), without importing torch.

    A type outside torch's built-in ones (a renamed private backend) is asked of torch when torch is
    already loaded, and otherwise left to the Prefetcher, which builds the ``torch.device``."""
    m = _DEVICE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return False
    if m.group(1) in TORCH_DEVICE_TYPES:
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        return False
    return True


def _positive_finite(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )

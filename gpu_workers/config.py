"""Settings of the worker side: the transport (``transport`` section of the cluster file)."""

from __future__ import annotations

from dataclasses import dataclass

from luwu.protocol.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    timeout_s: float = 60.0
    """Deadline of every wait for a node (weights, norms, welcome); the error names node, rank, step, bucket."""
    connect_timeout_s: float = 30.0
    """Deadline for a node to answer HELLO at start-up."""
    bucket_bytes: int = 4 * 1024 * 1024
    """fp32 bytes per bucket; 1-4 MiB frames are where ZeroMQ matches raw TCP."""
    sndhwm: int = 64
    """ZeroMQ send high-water mark (messages per node); beyond it the I/O thread waits."""
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
            raise ConfigError(f"transport.sndhwm must be >= 1 and max_message_bytes >= bucket_bytes, got {self.sndhwm}, {self.max_message_bytes}")
        if self.heartbeat_s < 0:
            raise ConfigError(f"transport.heartbeat_s must be >= 0, got {self.heartbeat_s}")
        keys = (self.curve_server_key, self.curve_public_key, self.curve_secret_key)
        if any(keys) and not all(keys):
            raise ConfigError("transport.curve_server_key, curve_public_key and curve_secret_key must be given together")

"""Batches as trees of tensors, and the copies that move them to the training device.

A batch is a tensor or nested dicts, lists and tuples of them (other leaves
pass through). :func:`make_transfer` picks what a prefetch thread does to each
batch: pin it and copy it to a CUDA device on a side stream (:class:`CudaCopy`),
pin it or move it to another device (:class:`HostCopy`), or nothing.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from luwu.gpu_workers.config import PrefetchConfig
from luwu.protocol.errors import ConfigError


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch: a tensor, or nested dicts/lists/tuples of them."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors(value)


def batch_nbytes(batch: Any) -> int:
    """Bytes of the tensors (and numpy arrays) in a batch; other leaves count 0."""
    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, (Mapping, list, tuple)):
        values = batch.values() if isinstance(batch, Mapping) else batch
        return sum(batch_nbytes(v) for v in values)
    if isinstance(batch, torch.Tensor):
        return batch.nelement() * batch.element_size()
    return 0


def map_tensors(batch: Any, fn) -> Any:
    """The batch with ``fn`` applied to every tensor, containers rebuilt with their own type."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, MutableMapping):
        out = copy.copy(batch)  # keeps the type and e.g. a defaultdict's factory
        out.update({k: map_tensors(v, fn) for k, v in batch.items()})
        return out
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


class CudaCopy:
    """Pins a batch and copies it to a CUDA device on a side stream, in a producer thread.

    The consumer's stream waits on an event recorded after the copy (no host
    sync), and ``record_stream`` tells the caching allocator that the consumer's
    stream uses the memory, which was allocated on the side stream: without it
    the allocator could hand the block to the next batch's copy while the
    training step still reads it. The pinned source buffers are safe to drop
    after a non-blocking copy: the caching host allocator keeps them until the
    copy's event completes.
    """

    def __init__(self, device: torch.device, pin: bool):
        assert device.type == "cuda" and device.index is not None
        self.device = device
        self.pin = pin
        self._local = threading.local()  # one side stream per producer thread

    def __call__(self, batch: Any) -> tuple[Any, Any]:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)
        # The current device is per host thread: name it, never inherit device 0.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            out = map_tensors(batch, self._copy)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def hand_over(self, batch: Any, event: Any) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for t in tensors(batch):
            if t.device == self.device:
                t.record_stream(stream)


class HostCopy:
    """Pins (for a later copy by the caller) and/or moves batches to a non-CUDA device."""

    def __init__(self, device: torch.device | None, pin: bool):
        self.device = device
        self.pin = pin

    def __call__(self, batch: Any) -> tuple[Any, None]:
        return map_tensors(batch, self._copy), None

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t if self.device is None else t.to(self.device)

    def hand_over(self, batch: Any, event: None) -> None:
        pass


def make_transfer(cfg: PrefetchConfig) -> CudaCopy | HostCopy | None:
    """What the prefetch threads do to each batch for ``cfg``'s device and pinning; None: nothing."""
    try:
        device = None if cfg.device is None else torch.device(cfg.device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"prefetch.device must name a torch device, got {cfg.device!r}") from exc
    cuda = device is not None and device.type == "cuda"
    pin = cuda if cfg.pin_memory is None else cfg.pin_memory
    if (cuda or pin) and not torch.cuda.is_available():
        what = f"prefetch.device={cfg.device!r}" if cuda else "prefetch.pin_memory=True"
        raise ConfigError(f"{what} needs CUDA, and torch.cuda.is_available() is False")
    if cuda:
        if device.index is None:  # the threads' current device is 0: pin the caller's now
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaCopy(device, pin)
    if device is not None and device.type == "cpu":
        device = None
    if device is None and not pin:
        return None
    return HostCopy(device, pin)

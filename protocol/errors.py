"""The exception classes of LuWu, shared by every part.

Every error takes its facts in the constructor (the node, worker, step and
bucket it concerns, the op it answers, the node's ``detail`` map, the boot id
of a restarted node) and keeps them as attributes of the same names, ``None``
when unknown. An ERROR message carries a ``code``; :func:`error_for_code` maps
it back to the class, so a node's refusal is raised on the worker as the same
type it was on the node. ``luwu`` re-exports all of these.
"""

from __future__ import annotations

from typing import Any


class LuwuError(Exception):
    """Root of every error LuWu raises on purpose."""

    code = "luwu"

    def __init__(
        self,
        message: str = "",
        *,
        node: str | None = None,
        worker: int | None = None,
        step: int | None = None,
        bucket: int | None = None,
        detail: dict | None = None,
        ref_op: int | None = None,
        boot: str | None = None,
    ):
        super().__init__(message)
        self.node = node
        self.worker = worker
        self.step = step
        self.bucket = bucket
        self.detail = detail
        self.ref_op = ref_op
        self.boot = boot


class ConfigError(LuwuError, ValueError):
    """A setting has a bad value or an unknown key; the message names both."""

    code = "config"


class ProtocolError(LuwuError):
    """A message broke the wire contract (bad header, size, dtype, op...)."""

    code = "protocol"


class LayoutMismatchError(LuwuError):
    """Peers disagree on the layout of parameters into buckets (different model)."""

    code = "layout_mismatch"


class JobMismatchError(ProtocolError):
    """A message belongs to another job id."""

    code = "job_mismatch"


class StepMismatchError(LuwuError):
    """A message names a step the receiver cannot accept (too old, too far ahead,
    or workers disagreeing on which parameters have a gradient)."""

    code = "step_mismatch"


class NodeTimeoutError(LuwuError, TimeoutError):
    """A wait passed its deadline; the message names the node, worker, step and bucket."""

    code = "timeout"


class WorkerLostError(LuwuError):
    """In strict mode, a worker died or stalled past the deadline (names the rank)."""

    code = "worker_lost"


class RollbackError(LuwuError):
    """A node restarted from an older checkpoint; the job must roll back to ``step``
    (``boot`` identifies the restarted node process)."""

    code = "rollback"


class NodeStateLostError(LuwuError):
    """A node restarted with nothing to restore (no checkpoint_dir): the weights and optimizer state of its
    shard are gone, so the job cannot go on from it; restart the job from a checkpoint of your own (or run
    the nodes with ``node.checkpoint_dir`` so that a restart rolls back instead)."""

    code = "node_state_lost"


class CorruptCheckpointError(LuwuError):
    """A checkpoint file is unreadable: bad magic, malformed header, truncated, or its checksum fails."""

    code = "corrupt_checkpoint"


class JobExistsError(LuwuError):
    """A new worker without ``resume=True`` met nodes that hold its job at a step past 0 (restored from a
    checkpoint, or left by an earlier run) with nobody training it: continuing from there is a choice the
    worker makes (``RemoteOptimizer(..., resume=True)``), never a silent default. ``step``: the nodes' step."""

    code = "job_exists"


class RemoteError(LuwuError):
    """A node answered ERROR with a code this side does not know (kept in ``code``)."""

    code = "remote"

    def __init__(self, message: str = "", *, code: str | None = None, **facts: Any):
        super().__init__(message, **facts)
        if code is not None:
            self.code = code


_BY_CODE: dict[str, type[LuwuError]] = {
    cls.code: cls
    for cls in (
        LuwuError,
        ConfigError,
        ProtocolError,
        LayoutMismatchError,
        JobMismatchError,
        StepMismatchError,
        NodeTimeoutError,
        WorkerLostError,
        RollbackError,
        NodeStateLostError,
        CorruptCheckpointError,
        JobExistsError,
    )
}


def error_for_code(code: str, message: str, *, node: str | None = None, **fields: Any) -> LuwuError:
    """The exception a worker raises for an ERROR message from ``node``, with the message's facts
    (``step``, ``bucket``, ``detail``, ``ref_op``...) as ``fields``."""
    cls = _BY_CODE.get(code)
    text = f"node {node}: {message}" if node else message
    if cls is None:
        return RemoteError(text, node=node, code=code, **fields)
    return cls(text, node=node, **fields)

"""What a node's rooms share: its context, passed to each room in place of the server.

As FSDP2 hands its parameter groups one ``FSDPCommContext`` (the streams and process groups they
share) instead of the module that owns them, the node hands its rooms one :class:`NodeContext`:
the config, the clock, the job's identity (job name, node index, boot id) and the job as the
workers described it in HELLO, who is in it (peers, members, last heard from), the metrics and
the optimizer thread's queue. A room reads and writes these; it never reaches another room
through them. What a room makes happen elsewhere (a send, a step to queue) it returns as an
effect (:mod:`.effects`) for the server to dispatch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: the rooms import this module, so it imports none of them)
    from luwu.switch_nodes.checkpoint import CheckpointStore
    from luwu.switch_nodes.config import NodeConfig
    from luwu.switch_nodes.inflight import PushBudget
    from luwu.switch_nodes.listener import Listener
    from luwu.switch_nodes.metrics import NodeMetrics
    from luwu.switch_nodes.optimizers import OptimizerKind

__all__ = ["NodeContext", "OptimizerQueue"]

log = logging.getLogger(__name__)


class OptimizerQueue:
    """The optimizer thread and the queue of jobs in front of it. Queued jobs (coroutine functions)
    run one at a time in queue order, their shard work on the one optimizer thread (torch releases
    the GIL) while the event loop goes on receiving. ``gen`` is bumped by a rollback: the jobs of the
    abandoned timeline still queued are dropped."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics
        self.gen = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="luwu-opt")
        self._jobs: asyncio.Queue | None = None
        self._running = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the optimizer thread (the only thread that touches the shard)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()`` on the optimizer thread, from outside the event loop (shutdown)."""
        return self._executor.submit(fn).result(timeout_s)

    def submit(self, job: Callable[[], Awaitable[None]]) -> None:
        """Queue ``job`` behind the optimizer work already queued."""
        self._jobs.put_nowait((self.gen, job))

    def idle(self) -> bool:
        """No job queued or running (nothing on its way to give memory back)."""
        return not self._running and (self._jobs is None or self._jobs.empty())

    def open(self) -> None:
        """Make the queue (on the event loop, before anything is submitted)."""
        self._jobs = asyncio.Queue()

    async def serve(self, index: Callable[[], int]) -> None:
        """Run the queued jobs one at a time. A failing job is logged and counted; the node goes on."""
        while True:
            gen, job = await self._jobs.get()
            if gen != self.gen:
                continue  # queued before a rollback: that timeline is gone
            self._running = True
            try:
                await job()
            except Exception as exc:
                self.metrics.errors.labels(getattr(exc, "code", "internal")).inc()
                log.exception("node %s: optimizer job failed", index())
            finally:
                self._running = False

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


@dataclass(eq=False)
class NodeContext:
    """What the rooms of one node share (see the module's doc)."""

    cfg: NodeConfig
    job: str
    metrics: NodeMetrics
    queue: OptimizerQueue
    #: the node's index (a node started without one takes the index its first HELLO names)
    index: int
    clock: Callable[[], float] = time.monotonic
    #: identifies this process: a rollback is done once per boot
    boot: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started: float = field(default_factory=time.monotonic)
    address: str | None = None
    listener: Listener | None = None
    ckpt: CheckpointStore | None = None
    #: the checkpointed step this process restarted from (None: it started fresh)
    restored_step: int | None = None
    # the job as the workers described it in HELLO
    layout_hash: str | None = None
    world_size: int | None = None
    kind: OptimizerKind | None = None
    param_names: dict[int, str] = field(default_factory=dict)
    # who is in it
    peers: dict[int, bytes] = field(default_factory=dict)  # worker rank -> ZeroMQ routing id
    last_seen: dict[int, float] = field(default_factory=dict)
    members: set[int] = field(default_factory=set)  # expected in each step (elastic drops some)
    #: connections of aggregators (HELLO ``relay``): each stands for the ranks that said HELLO through it
    relays: set[bytes] = field(default_factory=set)
    #: the pushes in flight against node.push_memory_bytes (:mod:`.inflight`)
    inflight: PushBudget = field(init=False)

    def __post_init__(self) -> None:
        from luwu.switch_nodes.inflight import PushBudget

        self.inflight = PushBudget(self)

    def job_description(self, kind=None) -> dict:
        """The job as a checkpoint or out-of-core state files record it (``kind``: the optimizer's,
        where the context has none yet)."""
        kind = self.kind or kind
        return {
            "job": self.job,
            "node": self.index,
            "layout": self.layout_hash,
            "world_size": self.world_size,
            "optimizer": kind.name if kind else None,
            "param_names": {str(k): v for k, v in self.param_names.items()},
        }

    def rank_of(self, ident: bytes) -> int | None:
        """The worker rank ``ident`` said HELLO as (None: it did not)."""
        return next((r for r, i in self.peers.items() if i == ident), None)

    def peer_key(self, ident: bytes) -> str | None:
        """The CURVE key ``ident`` authenticated with (None without CURVE, or before binding)."""
        return self.listener.peer_key(ident) if self.listener is not None else None

    def who(self, ident: bytes) -> str:
        """A connection as a log line names it."""
        rank = self.rank_of(ident)
        if rank is not None:
            return f"worker rank {rank}"
        key = self.peer_key(ident)
        return "a peer that did not say HELLO" + (f" (CURVE key {key})" if key else "")

    def connected(self, worker: int) -> bool:
        """Whether ``worker``'s connection is still open (from any thread)."""
        ident = self.peers.get(worker)
        return ident is not None and self.listener is not None and self.listener.connected(ident)

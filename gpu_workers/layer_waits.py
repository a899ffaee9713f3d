"""Per-layer waits (resident mode): each module waits for its parameters' new weights as it runs.

The first layers' gradients come last in backward, so their round trip (push, the nodes' step,
the weights back) is the tail of a sync step, and waiting in ``step()`` for every reply puts the
whole tail before the next forward. With per-layer waits (``optimizer.layer_waits``, on by
default) ``step()`` pushes what is left, runs the two-phase round when clipping or AMP asks for
it, and returns; the next forward waits for each bucket's reply when the first module holding its
parameters runs (FSDP2's per-unit all-gather wait, with the nodes in place of the all-gather). The
first layers' pushes go out first and the nodes answer them first (priority), so the next forward
starts on the first layers while the later layers' replies are still on the wire. A reply that
lands before its module runs is written into the parameters by the I/O thread at once (its frames
are freed instead of held until the forward).

How a forward is seen: a forward pre-hook on each module that directly holds parameters of such
buckets (as streaming mode's units have, :mod:`luwu.gpu_workers.streaming`) writes their weights
in before the module runs. The hooks are registered once, at build, and are graph breaks under
``torch.compile`` (``torch.compiler.disable``): the compiled pieces between them stay the same
from step to step, nothing recompiles (``fullgraph=True`` refuses them: use
``layer_waits=False``). A parameter is left to the hooks of the modules holding it only when one
of them ran in the step before; the buckets of the others (read by a module that does not hold
them, as a parent's ``F.linear(x, self.head.weight)`` without calling ``head``, or held by a
module that did not run) are written by the model's own pre-hook at the start of the next
forward, as is every bucket in the first step, before any forward has shown what it covers. Tied
weights held by two modules are written by whichever runs first.

The forward must go through the model's ``__call__``. In a step where the model's pre-hook did
not run (``model.forward(x)``, submodules called on their own, or a model that ``torch.compile``
ran before the optimizer was built: it does not see hooks added after its first run), the hooks
cannot be trusted to see the next forward, so that step's replies are waited for in ``step()``
and a warning says so once. Without a model (a plain iterable of tensors) nothing can be hooked:
every reply is waited for in ``step()``, as with ``layer_waits=False``.

Outside a forward, ``model.state_dict()`` and ``model.load_state_dict()`` (pre-hooks on the
model and each hooked module), ``RemoteOptimizer.state_dict()``, ``model_state_dict()``,
``synchronize()``, ``close()`` and the next ``step()`` write what is owed first. Any other read of
an owed parameter on the training thread (``p.detach()``, ``p.data``, an EMA of the weights,
``copy.deepcopy``, ``torch.save``, printing) waits for its buckets first: a torch function mode is
on that thread's stack while replies are owed (:mod:`luwu.gpu_workers.owed_reads`), and the
model's pre-hook takes it off before the first module runs. The parameters stay plain
``nn.Parameter`` objects throughout (nothing changes their class), so ``torch.compile`` sees the
same tensors at every step. Metadata (``p.grad``, shapes) never waits, so ``zero_grad()`` leaves
the replies on the wire. What no forward wrote is
written at the next ``step()``, before the gradient buffers are refilled (a bucket's buffer is its
push's frame until the reply).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from luwu.gpu_workers.channel import Reply
from luwu.gpu_workers.landing import WRITTEN
from luwu.gpu_workers.owed_reads import OwedReads
from luwu.protocol import messages as wire
from luwu.protocol.errors import LuwuError

log = logging.getLogger(__name__)

#: Why the forward pre-hooks break torch.compile's graphs (in its error under ``fullgraph=True``)
_GRAPH_BREAK = (
    "LuWu's per-layer waits: the module waits here for the new weights of its parameters; "
    "torch.compile(fullgraph=True) needs RemoteOptimizer(..., layer_waits=False)"
)


class _Inert:
    """What a copy of a hooked module (``copy.deepcopy``, ``torch.save``) holds for a hook."""

    def __call__(self, *_args) -> None:
        return None


class _Hook:
    """A hook of the waits on a module: calls ``fn``. A copy of the module gets an inert hook: it is
    not trained by this optimizer (and the waits, with their locks and sockets, are neither copied
    nor pickled)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo) -> _Inert:
        return _Inert()

    def __reduce__(self):
        return (_Inert, ())


class LayerWaits:
    """The replies a worker still owes its parameters, written when a module holding them next runs.

    The worker hands the futures of the deferrable buckets' replies here (:meth:`owe`) instead of
    waiting for them in ``step()``; the modules' forward pre-hooks and :meth:`settle` wait for
    some or all of them."""

    def __init__(self, worker, model: torch.nn.Module):
        self.worker, self.model = worker, model
        # bucket -> the future of the reply that brings its new weights
        self.owed: dict[int, Reply] = {}
        self.waited_s = 0.0  # seconds waited for replies since the last step() took the count
        self.skips = 0  # buckets the nodes skipped (non-finite gradient), found as they landed
        self.order: dict[int, int] = {}  # bucket -> when a forward first read it (pushes' priority)
        self._lock = threading.Lock()  # ``owed`` between the training thread and the I/O thread
        self._bucket_params = {
            b.id: sorted({s.param for s in b.segments}) for b in worker.layout.buckets
        }
        # param index -> id() of the modules holding it directly; id() -> those modules
        self._owners, held = _owners(model, worker.params)
        #: the buckets whose replies can wait for a forward: resident, not delayed, all in the model
        self.deferrable = frozenset(
            b
            for b, params in self._bucket_params.items()
            if b not in worker.streamed
            and b not in worker.delayed
            and all(i in self._owners for i in params)
        )
        self._module_bids = self._buckets_of_modules()
        self._ran: set[int] = set()  # id() of the modules whose pre-hook ran since the last wait
        self._model_ran = False  # the model's own pre-hook ran since then
        # this step's view of its forwards (_begin_wait): the step, whether its replies may be
        # owed, the parameters whose modules' hooks ran
        self._step, self._deferring, self._covered = -1, False, frozenset()
        self._sweep: list[int] = []  # owed buckets the model's pre-hook writes (not covered)
        self._warned = False
        self._index = {id(p): i for i, p in enumerate(worker.params)}
        #: reads outside a forward (an EMA, p.detach(), deepcopy, torch.save) wait for what is owed
        self.reads = OwedReads(self._owed_buckets_of, self.settle)
        hooked = [held[mid] for mid in self._module_bids if mid != id(model)]
        self._hooks = self._register_hooks(hooked)

    def _buckets_of_modules(self) -> dict[int, list[int]]:
        """``id(module)`` -> the deferrable buckets of the parameters it holds directly."""
        out: dict[int, set[int]] = {}
        for i, owners in self._owners.items():
            bids = {bid for bid, _ in self.worker.where.get(i, ()) if bid in self.deferrable}
            for mid in owners if bids else ():
                out.setdefault(mid, set()).update(bids)
        return {mid: sorted(bids) for mid, bids in out.items()}

    def _register_hooks(self, modules: list[torch.nn.Module]) -> list:
        """Pre-hooks on the model and ``modules`` (those holding parameters of deferrable buckets),
        first in line (a user's pre-hook may read the weights): forward (the per-layer waits),
        ``state_dict`` and ``load_state_dict`` (the model's settle everything owed, a module's its
        own buckets)."""
        hooks = []
        for m in (self.model, *modules):
            bids = None if m is self.model else self._module_bids[id(m)]
            on_state_dict = _Hook(lambda _m, _prefix, _keep, b=bids: self.settle(b))
            on_load = _Hook(lambda _m, *_args, b=bids: self.settle(b))
            hooks.append(m.register_forward_pre_hook(_Hook(self._pre_forward), prepend=True))
            hooks.append(m.register_state_dict_pre_hook(on_state_dict))
            hooks.append(m.register_load_state_dict_pre_hook(on_load))
        return hooks

    def _on_update(self, reply: Reply, msg: wire.Message) -> wire.Message:
        """On the I/O thread, before an owed reply resolves: its weights are written into the
        parameters as it lands, so its frames are freed at once instead of waiting for the forward
        (a step's replies would otherwise all be held, a second copy of the weights); the future
        resolves with its header alone. A reply no longer owed resolves as it came."""
        with self._lock:
            if self.owed.get(reply.bucket) is reply:
                self.worker.land(reply.bucket, msg)
                msg = wire.Message({**msg.header, WRITTEN: True}, [])
        return msg

    @torch.compiler.disable(reason=_GRAPH_BREAK)
    def _pre_forward(self, module: torch.nn.Module, _args) -> None:
        """Forward pre-hook: the model's writes what no module's hook is known to cover; each
        module's writes the owed buckets of the parameters it holds. A graph break under
        ``torch.compile``, so it runs at every call."""
        if module is self.model:
            self.reads.off()  # (the forward's reads wait in the modules' hooks)
            self._model_ran = True
            if self._sweep:
                bids, self._sweep = self._sweep, []
                self.settle(bids)
        self._ran.add(id(module))
        if self.owed:
            self.settle(self._module_bids.get(id(module), ()))

    def takes(self, bid: int) -> bool:
        """Whether bucket ``bid``'s reply of this step can wait for the next forward: deferrable,
        and the model's pre-hook ran in this step (else the hooks are not being called, and
        nothing would wait for the weights in the forward)."""
        if self._step != self.worker.step_num:
            self._begin_wait()
        return self._deferring and bid in self.deferrable

    def _begin_wait(self) -> None:
        """The step's first question: what its forwards showed (whether the model's hook ran;
        which modules' hooks ran, so the parameters they cover), and a fresh record for the next
        step's forwards."""
        self._step = self.worker.step_num
        self._deferring = self._model_ran
        ran = self._ran
        self._covered = frozenset(i for i, mids in self._owners.items() if not ran.isdisjoint(mids))
        self._ran, self._model_ran = set(), False
        if not self._deferring and self.deferrable and not self._warned:
            self._warned = True
            log.warning(
                "rank %d, step %d: the model's forward pre-hook did not run in this step, so the "
                "per-layer waits cannot see the next forward and step() waits for the new weights "
                "(call the model itself, not model.forward() or submodules alone; build the "
                "RemoteOptimizer before the first run of a torch.compile'd model, which does not "
                "see hooks added after it; or set layer_waits=False)",
                self.worker.rank,
                self._step,
            )

    def owe(self, replies: list[Reply]) -> None:
        """Owe ``replies`` (futures of this step's): from now on the I/O thread writes each as it
        lands, else the next forward's hooks do. One that is here already (it came between the
        release of held replies and now) is written at once, not at the next forward: its frames
        would be a second copy of those weights until then. The buckets of parameters whose
        modules' hooks did not run in this step are left to the model's pre-hook."""
        with self._lock:
            for reply in replies:
                self.owed[reply.bucket] = reply
                reply.then = self._on_update
        covered, params = self._covered, self._bucket_params
        self._sweep = [r.bucket for r in replies if not covered.issuperset(params[r.bucket])]
        if here := [r.bucket for r in replies if r.done]:
            self.settle(here, read=False)
        if self.owed:
            self.reads.on()

    def settle(self, bids=None, timeout_s: float | None = None, read: bool = True) -> None:
        """Wait for the owed replies of ``bids`` (None: all) and write the weights in, in arrival
        order. ``read``: a forward (or any reader) asked for them: the first time counts for the
        pushes' priority."""
        if not self.owed:  # (only the training thread adds to it)
            self.reads.off()
            return
        with self._lock:  # (popped: the I/O thread no longer writes them)
            wanted = list(self.owed) if bids is None else bids
            replies = [self.owed.pop(b) for b in wanted if b in self.owed]
        if not replies:
            return
        w = self.worker
        for r in replies if read else ():
            self.order.setdefault(r.bucket, len(self.order))
        t0 = time.perf_counter()
        with w._noting_errors():  # (a wait in a forward: recover() acts on its error)
            for r in w.client.arrivals(replies, timeout_s, what="updated weights"):
                t1 = time.perf_counter()
                self.waited_s += t1 - t0
                self.skips += bool(r.msg.header["skipped"])
                w.land(r.bucket, r.msg)
                t0 = time.perf_counter()
        if not self.owed:
            self.reads.off()

    def _owed_buckets_of(self, t: torch.Tensor) -> list[int]:
        """The owed buckets of tensor ``t`` (one of the worker's parameters, else none)."""
        i = self._index.get(id(t)) if self.owed else None
        if i is None:
            return []
        return [bid for bid, _ in self.worker.where.get(i, ()) if bid in self.owed]

    def take_counts(self) -> tuple[float, int]:
        """Seconds waited and skipped buckets found since the last call."""
        out = (self.waited_s, self.skips)
        self.waited_s, self.skips = 0.0, 0
        return out

    def reset(self) -> None:
        """After a rollback or rejoin (the owed replies belong to an abandoned step)."""
        with self._lock:
            self.owed.clear()
        self._sweep, self._step = [], -1
        self.reads.off()

    def close(self, timeout_s: float) -> None:
        """Write what the last step still owes (a dead node: given up after ``timeout_s``, named in a
        warning), then remove the hooks (at close or rebuild)."""
        if self.owed:
            try:
                self.settle(timeout_s=timeout_s)
            except LuwuError as exc:
                log.warning(
                    "rank %d: the weights of the last step did not all arrive before close (%s)",
                    self.worker.rank,
                    exc,
                )
        self.reset()
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _owners(model: torch.nn.Module, params: list[torch.Tensor]):
    """``params`` index -> ``id()`` of the modules of ``model`` holding it directly (two for a tied
    weight), and ``id()`` -> each such module."""
    index = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, list[int]] = {}
    held: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) in index:
                owners.setdefault(index[id(p)], []).append(id(m))
                held[id(m)] = m
    return owners, held


def model_for(cfg, model: torch.nn.Module | None, rank: int) -> torch.nn.Module | None:
    """The model whose modules carry a (re)built worker's per-layer waits: ``model`` when
    ``cfg.layer_waits`` (the optimizer section) and the worker is resident (streaming mode waits
    per unit by itself); None otherwise, and without the model (every reply is then waited for in
    ``step()``)."""
    if not cfg.layer_waits or cfg.stream_weights or model is None:
        if cfg.layer_waits and not cfg.stream_weights:
            log.info(
                "rank %d: per-layer waits need the model (RemoteOptimizer(model, ...)); with "
                "tensors alone step() waits for every reply",
                rank,
            )
        return None
    return model

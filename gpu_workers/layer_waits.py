"""Per-layer waits (resident mode): each parameter's new weights are waited for when it is next used.

The first layers' gradients come last in backward, so their round trip (push, the nodes' step, the
weights back) is the tail of a sync step, and waiting in ``step()`` for every reply puts the whole
tail before the next forward. With per-layer waits (``optimizer.layer_waits``, on by default)
``step()`` pushes what is left, runs the two-phase round when clipping
or AMP asks for it, and returns; a parameter whose new weights are still on their way waits for its
bucket's reply the first time anything reads it: in the next forward that is when its layer runs
(FSDP2's per-unit all-gather wait, with the nodes in place of the all-gather). The first layers'
pushes go out first and the nodes answer them first (priority), so the next forward starts on the
first layers while the later layers' replies are still on the wire.

How a read is seen: between ``step()`` and its reply a parameter's class is :class:`OwedParameter`
(a ``torch.nn.Parameter``, so ``isinstance`` and module code see no difference), whose
``__torch_function__`` writes the bucket's new weights in, turns the parameter back into a plain
``Parameter`` and runs the operation. Every torch operation and attribute that reads values goes
through it: a layer's forward, ``p.data``, ``p.detach()``, ``model.state_dict()``, ``torch.save``,
``copy.deepcopy``, printing. Metadata does not wait (``p.grad``, ``shape``, ``dtype``,
``requires_grad``...), so ``zero_grad()`` and gradient clipping leave the replies on the wire. The
step stays sync: nothing ever reads a parameter's previous weights after ``step()``. Not seen: a
view or ``.data`` taken before ``step()`` and read after it (take it again, or call
``opt.synchronize()``), and raw memory (``data_ptr()``). Buckets nothing read (parameters unused this
step) are written at the next ``step()``, before their gradient buffers are refilled (a bucket's
buffer is its push's frame until the reply).
"""

from __future__ import annotations

import threading
import time

import torch

from luwu.protocol import messages as wire
from luwu.protocol.messages import Op

#: Tensor attributes that read no values: a parameter owing its weights answers them without waiting.
_METADATA = {d for n in ("grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad_fn", "is_cuda",
                          "is_sparse", "_version", "_post_accumulate_grad_hooks", "_backward_hooks")
             if (d := torch._C.TensorBase.__dict__.get(n)) is not None}
_METADATA_METHODS = {torch._C.TensorBase.size, torch._C.TensorBase.dim, torch._C.TensorBase.numel,
                     torch._C.TensorBase.data_ptr, torch._C.TensorBase.element_size, torch._C.TensorBase.stride,
                     torch._C.TensorBase.is_contiguous, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.register_hook}

#: A reply header's mark: the I/O thread wrote its weights as it landed (the frames are gone)
WRITTEN = "written_on_arrival"

#: id(parameter) -> the LayerWaits that owes it its weights
_OWNER: dict[int, LayerWaits] = {}


class OwedParameter(torch.nn.Parameter):
    """A parameter whose new weights are on their way: the first read waits for them (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA_METHODS and getattr(func, "__self__", None) not in _METADATA:
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if type(t) is OwedParameter:
                        _settle(t)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        _settle(self)
        return self.__deepcopy__(memo)

    def __reduce_ex__(self, proto):
        _settle(self)
        return self.__reduce_ex__(proto)


def _settle(p: torch.Tensor) -> None:
    """Write the weights ``p`` owes (a copy made while owed has no owner: nothing to wait for)."""
    owner = _OWNER.get(id(p))
    if owner is not None:
        owner.settle_param(p)
    else:
        _plain(p)


def _plain(p: torch.Tensor) -> None:
    """``p`` owes nothing any more: a plain ``nn.Parameter`` again."""
    _OWNER.pop(id(p), None)
    p.__class__ = torch.nn.Parameter


class LayerWaits:
    """The replies a worker still owes its parameters, written when a parameter is first read.

    The worker files the keys of the resident, not-delayed buckets' replies here (:meth:`owe`) instead
    of waiting for them in ``step()``; :meth:`settle` waits for some or all of them."""

    def __init__(self, worker):
        self.worker = worker
        self.owed: dict[int, tuple] = {}  # bucket -> the key of the reply that brings its new weights
        self.waited_s = 0.0  # seconds waited for replies since the last step() took the count
        self.skips = 0  # buckets the nodes skipped (non-finite gradient), found when their weights landed
        self.order: dict[int, int] = {}  # bucket -> when a forward first read it, for the pushes' priority
        self._bucket_params = {b.id: sorted({s.param for s in b.segments}) for b in worker.layout.buckets}
        self._index = {id(p): i for i, p in enumerate(worker.params)}
        self._lock = threading.Lock()  # ``owed`` between the training thread and the I/O thread's writes
        worker.client.on(Op.UPDATE, self._on_update)

    def _on_update(self, node: int, msg: wire.Message) -> None:
        """On the I/O thread, for every UPDATE: the reply of an owed bucket is written into the parameters as
        it lands, so its frames are freed at once instead of waiting for the read (a step's replies would
        otherwise all be held, a second copy of the weights); the waiter finds its header. Other replies
        are filed as they came."""
        client = self.worker.client
        key = client.key_of(node, msg.header)
        with self._lock:
            if self.owed.get(key[3]) == key:
                self.worker._write(self.worker.bufs[key[3]], msg)
                msg = wire.Message({**msg.header, WRITTEN: True}, [])
        client.file(key, msg)

    def takes(self, bid: int) -> bool:
        """Whether bucket ``bid``'s reply can wait for the first read: resident, not delayed, and holding
        plain ``nn.Parameter``s (a class of its own or a bare tensor cannot be swapped)."""
        w = self.worker
        return bid not in w.streamed and bid not in w.delayed and all(type(w.params[i]) in (torch.nn.Parameter, OwedParameter) for i in self._bucket_params[bid])

    def owe(self, keys: list[tuple]) -> None:
        """Owe the replies ``keys`` (this step's): from now on the I/O thread writes each as it lands, else the
        first read does. One that is here already (it came between the release of held replies and now) is
        written at once, not at the next forward: its frames would be a second copy of those weights until then."""
        with self._lock:
            for key in keys:
                self.owed[key[3]] = key
        for key in keys:
            for i in self._bucket_params[key[3]]:
                p = self.worker.params[i]
                _OWNER[id(p)] = self
                p.__class__ = OwedParameter
        if here := self.worker.client.ready(keys):
            self.settle([k[3] for k in here], read=False)

    def settle_param(self, p: torch.Tensor) -> None:
        """Write the weights of every owed bucket holding ``p``."""
        self.settle([bid for bid, _ in self.worker.where.get(self._index[id(p)], ())])

    def settle(self, bids=None, timeout_s: float | None = None, read: bool = True) -> None:
        """Wait for the owed replies of ``bids`` (None: all) and write the weights in, in arrival order.
        ``read``: a forward (or any reader) asked for them: the first time counts for the pushes' priority."""
        with self._lock:  # (popped: the I/O thread no longer writes them)
            keys = [self.owed.pop(b) for b in (list(self.owed) if bids is None else bids) if b in self.owed]
        if not keys:
            return
        w = self.worker
        for key in keys if read else ():
            self.order.setdefault(key[3], len(self.order))
        for key in keys:  # back to plain parameters before writing (a parameter in a bucket still owed stays owed)
            for i in self._bucket_params[key[3]]:
                if not any(bid in self.owed for bid, _ in w.where[i]):
                    _plain(w.params[i])
        t0 = time.perf_counter()
        with w._noting_errors():  # (a wait in a read: recover() acts on its error)
            for key, m in w.client.arrivals(keys, timeout_s, what="updated weights"):
                t1 = time.perf_counter()
                self.waited_s += t1 - t0
                self.skips += bool(m.header["skipped"])
                if not m.header.get(WRITTEN):
                    w._write(w.bufs[key[3]], m)
                t0 = time.perf_counter()

    def take_counts(self) -> tuple[float, int]:
        """Seconds waited and skipped buckets found since the last call."""
        out = (self.waited_s, self.skips)
        self.waited_s, self.skips = 0.0, 0
        return out

    def reset(self) -> None:
        """After a rollback or rejoin (the owed replies belong to an abandoned step), or at close."""
        with self._lock:
            for bid in list(self.owed):
                for i in self._bucket_params[bid]:
                    _plain(self.worker.params[i])
            self.owed.clear()


def attach(worker, cfg) -> LayerWaits | None:
    """The per-layer waits of a (re)built worker: on when ``cfg.layer_waits`` (the optimizer section) and
    the worker is resident (streaming mode waits per unit by itself)."""
    if not cfg.layer_waits or cfg.stream_weights:
        worker.client.on(Op.UPDATE, None)  # (a rebuilt worker: no earlier one's writes on arrival)
        return None
    worker.defer = LayerWaits(worker)
    return worker.defer

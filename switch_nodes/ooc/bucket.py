"""A bucket of the out-of-core shard: its tensors are views into the state window while loaded.

:class:`OocBucket` carries no tensors of its size between loads; its optimizer state is a
:class:`WindowState` over its slot. On a node that spills (:mod:`.spill`), the sum of a two-phase step
goes to the scratch file once its norm is computed and comes back when its buffer is asked for.
"""

from __future__ import annotations

import torch

from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.optimizers import OptimizerKind
from luwu.switch_nodes.store import (
    Accumulator,
    AccumulatorPool,
    BucketState,
    FlatState,
    SegmentSpec,
    SegmentState,
)

__all__ = ["OocBucket", "WindowState"]


class WindowState(FlatState):
    """A bucket's flat optimizer state as views of its slot in the window: the names the state files
    hold (:func:`~.recovery.file_state`, zeros while unused), all allocated. A name of the kind the
    files leave out reads as zeros and takes only zeros (a step that needs it is refused before)."""

    def __init__(self, tensors: dict[str, torch.Tensor], numel: int = 0, bucket: int = -1):
        super().__init__(tuple(tensors), numel)
        self._tensors, self._bucket = dict(tensors), bucket

    def write(self, name: str, value: torch.Tensor) -> None:
        t = self._tensors.get(name)
        if t is not None:
            t.copy_(value)
        elif bool(value.any()):
            raise ConfigError(
                f"bucket {self._bucket}: optimizer state {name!r} (nonzero) cannot be set on a node "
                f"with node.state_dir: its state files do not hold {name!r} (the state of an option "
                "off by default, such as amsgrad) and buckets have stepped since they were laid out: "
                "load the state before the first step (opt.load_state_dict right after building the "
                "optimizer), or into a node without node.state_dir"
            )


class OocBucket(BucketState):
    """A bucket of an :class:`OocShard`: its tensors are views into the window while it is loaded
    (:meth:`attach`), absent otherwise (``params`` is None; the gradient's norm needs none of them),
    or RAM of its own when the shard fits its budget (:meth:`make_resident`)."""

    def __init__(
        self,
        bid: int,
        group: int,
        numel: int,
        segments: list[SegmentSpec],
        kind: OptimizerKind,
        pool: AccumulatorPool | None = None,
    ):
        super().__init__(bid, group, 0, [], kind, pool)  # nothing of the bucket's size in RAM
        self.numel, self.segments = numel, segments
        self.spill = None  # the shard's Spill: where a two-phase sum waits for COMMIT
        self.detach()

    def attach(self, ts: dict[str, torch.Tensor]) -> None:
        """Take the window's views of the bucket's slot as its tensors (until :meth:`detach`)."""
        self.params = ts["params"]
        if self.kind.whole_params:  # (Adafactor's factored statistics, per segment in the slot)
            self.state = SegmentState(self.kind, self.segments, self.numel, ts)
        else:
            self.state = WindowState(
                {n: ts[n] for n in self.kind.state_names if n in ts}, self.numel, self.id
            )
        self.steps = list(ts["steps"].unbind(0))
        self.pviews, self._sviews = self._views(self.params), {}

    def detach(self) -> None:
        """Forget the views (the window may reuse their memory)."""
        nsegs = len(self.segments)
        self.params, self.state, self._sviews = None, WindowState({}), {}
        self.pviews, self.steps = [None] * nsegs, [None] * nsegs

    def make_resident(self) -> None:
        """Tensors of its own in RAM, for good (the shard fits its budget)."""
        own = BucketState(self.id, self.group, self.numel, self.segments, self.kind, self._pool)
        self.params, self.state, self.steps = own.params, own.state, own.steps
        self.pviews, self._sviews = own.pviews, {}

    def state_views(self, name: str) -> list[torch.Tensor]:
        if self.params is None:  # not loaded: a gradient's norm reads the accumulator only
            return [None] * len(self.segments)
        return super().state_views(name)

    # ----------------------------------------------------------------- two-phase sums (spill)
    def sqnorm(self, acc: Accumulator, divisor: float) -> tuple[float, bool]:
        """The norm of the complete sum; then the sum waits for COMMIT in the scratch file."""
        out = super().sqnorm(acc, divisor)
        if self.spill is not None:
            self.spill.put(self, acc)
        return out

    def buffer(self, acc: Accumulator) -> torch.Tensor:
        if self.spill is not None:
            self.spill.load(acc)  # (a spilled sum comes back; one being written stays)
        return super().buffer(acc)

    def give_back(self, acc: Accumulator) -> None:
        if self.spill is not None:
            self.spill.drop(acc)
        super().give_back(acc)

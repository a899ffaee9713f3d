"""How a bucket's gradient gathers before its push: copied into the bucket, or held where it is.

A bucket's segments are slices of its parameters' gradients. Copied in (:func:`copy_in`), they
fill the bucket's buffer, which the push encodes (or sends as it is) and which can then be the
parameters' ``.grad`` (:mod:`~luwu.gpu_workers.grad_views`): autograd's tensor is freed as soon as
it is copied. A resident bucket always copies.

A streamed bucket's int8 or int4 push (no error feedback) *holds* its segments instead: the bucket
keeps references to the gradients' own slices, and the push encodes straight from them
(``encode_pieces_``), its codes going where the copy's encode would have written them, over the
first bytes of the buffer it borrows from the pool at the push (kept until the node has the push).
That saves writing the gradient into the bucket and reading it back.

Why a resident bucket does not hold: a held gradient stays autograd's tensor until ``zero_grad()``,
and the next backward's gradients then do not fit the holes the last step's left in the heap (the
allocator's aligned chunks are larger than the freed ones), so about 2.4 B a parameter of freed
memory stays resident at the peak (``benchmarks/results/heap_trace_issue36.md``), for a few ms a
step of saved copying. Copying frees each gradient at once, into a hole the next one reuses.

Whether a bucket holds is decided as its first segment arrives, for the whole step: the worker asks
the encoder (:meth:`~luwu.gpu_workers.encoding.GradientEncoder.takes_pieces`). A segment the
kernels cannot take (not fp32, not contiguous, on a GPU) is copied in, and the push then copies the
held ones in too (:meth:`BucketBuf.gather`); so does a push whose pieces hold a NaN or an infinity
(it goes uncompressed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from luwu.gpu_workers.grad_views import copy_in
from luwu.protocol.layout import Bucket

if TYPE_CHECKING:
    from luwu.gpu_workers.encoding import GradientEncoder


@dataclass(slots=True, eq=False)
class BucketBuf:
    bucket: Bucket
    # flat, one per parity in flight (fp32; bf16 for bf16 parameters alone; streamed: borrowed)
    grads: list[torch.Tensor]
    filled: set = field(default_factory=set)  # segments whose gradient is in (counted once)
    pushed_step: int = -1
    partials: int = 0  # micro-batch pushes this step (no_sync() in streaming mode: node sums)
    finite: bool | None = True  # its gradients as copied in: all finite (None: not all checked)
    pieces: dict[int, torch.Tensor] | None = None  # held segments (this step holds: not None)

    def hold(self, si: int, src: torch.Tensor) -> bool:
        """Keep segment ``si``'s gradient slice ``src`` for the push instead of copying it in, if this
        step's push holds and the kernels can read ``src`` where it is; False: copy it in."""
        if self.pieces is None or not _readable(src):
            return False
        self.pieces[si] = src
        return True

    def held(self) -> list[torch.Tensor] | None:
        """Every segment's held slice in segment order, when all were held (else None)."""
        if self.pieces is None or len(self.pieces) != len(self.bucket.segments):
            return None
        return [self.pieces[si] for si in range(len(self.bucket.segments))]

    def buffer(self, parity: int, lend) -> torch.Tensor:
        """The gradient buffer of ``parity`` (a streamed bucket borrows one: ``lend(numel)``)."""
        if not self.grads:
            self.grads.append(lend(self.bucket.numel))
        return self.grads[parity]

    def encode(self, encoder: GradientEncoder, parity: int, step: int, hyper: dict):
        """(codec name, encoded frames, hyperparameters) of this bucket's push at ``step`` (its
        buffer of ``parity`` in ``grads``): from the held slices where all were held and they can
        be encoded there (a streamed bucket's: its codes go into its borrowed buffer), else from the
        buffer (the held slices copied into it first)."""
        pieces, x = self.held(), self.grads[parity]
        got = None if pieces is None else encoder.encode_pieces(self.bucket, pieces, step, hyper, x)
        if got is None:
            self.gather(x)
            return encoder.encode(self.bucket, x, parity, step, hyper, self.finite)
        return got

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a segment's gradient ``src`` into its place ``dst`` in the bucket's buffer."""
        self.finite = copy_in(dst, src, self.finite)

    def gather(self, dst: torch.Tensor) -> None:
        """Copy the held slices into their places in the bucket's buffer ``dst`` (the push then
        encodes from it, as for a bucket that copies), and hold no more this step."""
        for si, src in (self.pieces or {}).items():
            s = self.bucket.segments[si]
            self.copy_in(dst.narrow(0, s.offset, s.numel), src)
        self.pieces = None

    def reset(self) -> None:
        """After a push, or a recovery: empty, and copying until a step decides to hold."""
        self.filled, self.finite, self.pieces = set(), True, None


def _readable(src: torch.Tensor) -> bool:
    return src.dtype == torch.float32 and src.device.type == "cpu" and src.is_contiguous()

"""Gradients as views of the bucket buffers (resident mode): one copy of the gradients, not two.

A worker copies each parameter's gradient into its bucket's buffer when backward produces it and
pushes the bucket from there. Without views the gradient then lives twice until ``zero_grad()``:
in ``p.grad`` (autograd's tensor) and in the bucket. With ``optimizer.grads_in_buckets`` (on by
default) the worker points ``p.grad`` at the parameter's slice of the bucket right after the copy
(DDP's ``gradient_as_bucket_view``), so autograd's tensor is freed at once and the worker holds the
model, one copy of its gradients and the buckets' codec frames. A gradient that already is the view
(``zero_grad(set_to_none=False)`` keeps it, and the next backward adds into it in place) is not
copied at all.

Which parameters: those whose gradient fills one whole segment of a resident, not-delayed bucket,
contiguous, of the buffer's dtype and in host memory (a parameter split over buckets, a delayed
bucket's two buffers, a streamed unit's borrowed buffer, a bf16 parameter against an fp32 buffer or
a parameter on a GPU keep their own ``p.grad``: a CUDA parameter's gradient stays on its device and
is copied into the host bucket). A streamed bucket's int8 or int4 push encodes its gradients where
they are (:mod:`~luwu.gpu_workers.bucket_fill`), and those keep autograd's tensor too.

What it asks of a training script: ``p.grad`` after ``backward()`` is the gradient as this worker
pushed it. An uncompressed push sends the buffer itself (zero copy) while ``step()`` may already
have returned (per-layer waits), so an in-place change of such a gradient before the node has it
would change what a node receives. Such a change is refused with the parameter's name at ``step()``
or when the reply lands, whichever comes first (clip with ``opt.clip_grad_norm_`` or ``max_grad_norm=``,
scale with ``amp=``: the nodes apply both to the averaged gradient), and
``RemoteOptimizer.zero_grad(set_to_none=False)`` waits for the step's replies before zeroing.
"""

from __future__ import annotations

import torch

from luwu.gpu_workers.grad_marks import FIX
from luwu.protocol.codecs import copy_finite_
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import Bucket


def copy_in(dst: torch.Tensor, src: torch.Tensor, finite: bool | None = True) -> bool | None:
    """Copy a gradient into its bucket, unless it is the bucket's view already (nothing to copy).
    ``finite``: whether the bucket's gradients copied in before were all finite (None: not known);
    returns the same after this one: a non-finite one decides, one not checked as it was copied (a
    view, or a copy the kernels cannot make) leaves it unknown, for the push to check."""
    found = copy_finite_(dst, src) if dst.data_ptr() != src.data_ptr() else None
    if finite is False or found is False:
        return False
    return None if finite is None or found is None else True


def bucket_buffers(
    buckets: list[Bucket], params: list[torch.Tensor]
) -> tuple[dict[torch.dtype, torch.Tensor], dict[int, torch.Tensor]]:
    """The gradient buffers of ``buckets``: slices of one flat buffer per dtype (returned with them), bf16 for a
    bucket of bf16 parameters alone (a bf16 model's gradient as backward made it), else fp32. Each bucket is
    placed right after the bucket its first parameter continues from: the layout splits a parameter larger
    than a bucket into the end of one bucket, whole buckets, and the start of another, so in this order such
    a parameter's gradient is one contiguous slice, and a view can be its ``.grad``."""
    by_id = {b.id: b for b in buckets}
    dtype = {
        b.id: torch.bfloat16
        if all(params[s.param].dtype == torch.bfloat16 for s in b.segments)
        else torch.float32
        for b in buckets
    }
    starts = {
        (b.segments[0].param, b.segments[0].param_offset): b.id for b in buckets if b.segments
    }
    after: dict[int, int] = {}  # bucket -> the bucket its last parameter continues into
    for b in buckets:
        last = b.segments[-1] if b.segments else None
        j = starts.get((last.param, last.param_offset + last.numel)) if last else None
        if (
            j is not None
            and last.offset + last.numel == b.numel
            and by_id[j].segments[0].offset == 0
        ):
            after[b.id] = j
    order, placed = [], set()
    for b in buckets:  # each chain from its head, heads in bucket order
        k = b.id if b.id not in after.values() else None
        while k is not None and k not in placed:
            order.append(k)
            placed.add(k)
            k = after.get(k)
    order += [
        b.id for b in buckets if b.id not in placed
    ]  # (a chain without a head would be a cycle: none, but every bucket is placed)
    # a GPU model's gradients are copied out into page-locked buckets: DMA, not the driver's staging
    pin = torch.cuda.is_available() and any(p.is_cuda for p in params)
    flats, out = {}, {}
    for dt in sorted(set(dtype.values()), key=str):
        mine = [k for k in order if dtype[k] == dt]
        numel = sum(by_id[k].numel for k in mine)
        flat = flats[dt] = torch.zeros(numel, dtype=dt, pin_memory=pin)
        off = 0
        for k in mine:
            out[k] = flat.narrow(0, off, by_id[k].numel)
            off += by_id[k].numel
    return flats, out


class GradViews:
    """Which parameters' gradients are bucket views, and the version each aliased buffer was pushed at."""

    def __init__(self, worker):
        self.worker = worker
        self.views: dict[
            int, torch.Tensor
        ] = {}  # param index -> its slice of the bucket buffer, shaped as the parameter
        self.pushed: dict[
            int, tuple[int, dict[int, int]]
        ] = {}  # bucket -> (step, its gradients' versions) at its zero-copy push, until the reply
        for i, where in worker.where.items():
            p, flat = worker.params[i], worker.flat_grads.get(worker.params[i].dtype)
            segs = sorted(
                ((worker.bufs[bid], worker.bufs[bid].bucket.segments[si]) for bid, si in where),
                key=lambda bs: bs[1].param_offset,
            )
            if (
                flat is None
                or p.device.type != "cpu"
                or not p.is_contiguous()
                or any(len(buf.grads) != 1 or buf.grads[0].dtype != p.dtype for buf, _ in segs)
            ):
                continue
            at = [
                buf.grads[0].narrow(0, s.offset, s.numel) for buf, s in segs
            ]  # (single buffers: all in ``flat``) one slice, in order?
            if (
                all(
                    b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
                    for a, b in zip(at, at[1:])
                )
                and sum(map(torch.numel, at)) == p.numel()
            ):
                start = (at[0].data_ptr() - flat.data_ptr()) // flat.element_size()
                # not flat.narrow(): a view shares flat's version counter, and this one must count only
                # changes made through this gradient (note_push / check)
                self.views[i] = torch.empty(0, dtype=flat.dtype).set_(
                    flat.untyped_storage(), start, p.shape
                )

    def adopt(self, param: int) -> None:
        """After the gradient of ``param`` was copied into its bucket: make the bucket's slice its ``.grad``."""
        view = self.views.get(param)
        if view is not None:
            p = self.worker.params[param]
            if p.grad is not view:
                p.grad = view

    def note_push(self, bid: int, zero_copy: bool) -> None:
        """A push of bucket ``bid`` went out: while its frame is the buffer (zero copy), until the node's reply
        lands, the gradients in it must not change."""
        params = [s.param for s in self.worker.bufs[bid].bucket.segments if s.param in self.views]
        if zero_copy and params:
            self.pushed[bid] = (self.worker.step_num, {i: self.views[i]._version for i in params})
        else:
            self.pushed.pop(bid, None)

    def landed(self, bid: int) -> None:
        """The node's reply to bucket ``bid``'s push landed: its frame is free; check it was not changed before."""
        pushed = self.pushed.get(bid)
        if pushed is not None:
            self._check(bid, *pushed)
            del self.pushed[bid]

    def check(self) -> None:
        """At ``step()``: no gradient whose push is still on its way changed in place since it left."""
        for bid, pushed in list(self.pushed.items()):
            self._check(bid, *pushed)

    def _check(self, bid: int, step: int, versions: dict[int, int]) -> None:
        changed = sorted(self._name(i) for i, v in versions.items() if self.views[i]._version != v)
        if changed:
            raise ConfigError(
                f"step {step}, bucket {bid}: the gradient of {changed} changed in place while its push was on its way (the push sends that memory): {FIX}",
                step=step,
                bucket=bid,
            )

    def _name(self, param: int) -> str:
        bid, si = self.worker.where[param][0]
        return self.worker.bufs[bid].bucket.segments[si].name

"""A bucket's gradient as a push's frames.

The codec is the :class:`~luwu.gpu_workers.codec_plan.CodecPlan`'s for the bucket and step; a bf16
gradient goes as is (lossless), and a non-finite one uncompressed, so the nodes see the inf or nan
and decide the skip globally. A gradient already in the codec's dtype is its own frame (zero copy:
the buffer is next written after the node's answer). Error feedback keeps the residual on the
worker (:class:`~luwu.protocol.feedback.ErrorFeedback`), and DGC's momentum correction rides on
sparse codecs. A resident bucket's encode frames are allocated once per codec and parity and
reused; a streamed bucket's belong to its message alone: a blockwise codec (int8, int4) writes its
codes over the bucket's borrowed buffer, which is not read again before the node has the push
(nothing as large as the codes is allocated and faulted in per push), others get frames of their own.
"""

from __future__ import annotations

import torch

from luwu.gpu_workers.codec_plan import CodecPlan
from luwu.protocol.codecs import get_codec, has_nonfinite
from luwu.protocol.feedback import WORKER_MOMENTUM, worker_momentum
from luwu.protocol.layout import Bucket


class GradientEncoder:
    """Encodes the gradients of one worker's buckets (see the module docstring)."""

    def __init__(
        self,
        codecs: CodecPlan,
        feedback=None,
        *,
        optimizer: str,
        world_size: int,
        momentum_correction: bool = False,
        streamed: frozenset[int] = frozenset(),
    ):
        self.codecs, self.feedback, self.optimizer = codecs, feedback, optimizer
        self.world_size, self.streamed = world_size, streamed
        self.momentum_correction = momentum_correction  # DGC's, on sparse-codec buckets
        self._out: dict[int, dict] = {}  # bucket -> (codec, parity) -> preallocated encode frames

    def encode(
        self,
        b: Bucket,
        x: torch.Tensor,
        parity: int,
        step: int,
        hyper: dict,
        finite: bool | None = None,
    ):
        """(codec name, encoded frames, the push's hyperparameters) of gradient ``x`` of ``b``.
        ``finite``: whether ``x`` is all finite, when the copy into the bucket found out (None: not
        known, checked here when the codec compresses)."""
        name, ef = self.codecs.push(b, step) if x.dtype == torch.float32 else ("bf16", False)
        compressed = name not in ("none", "bf16")
        if compressed and (has_nonfinite(x) if finite is None else not finite):
            name, ef = "none", False  # let the node see the inf/nan and decide globally
        codec = get_codec(name)
        if b.id in self.streamed and not ef and hasattr(codec, "encode_over_"):
            # the borrowed buffer is not read again before the node has the push: codes over it
            enc = codec.encode_over_(x, num_summands=self.world_size)
            if enc is not None:
                return name, enc, hyper
        out = self._frames(b, codec, name, parity, x.dtype)
        if x.dtype == getattr(codec, "dtype", None):
            return name, codec.encode(x), hyper  # zero copy: the frame is the bucket buffer
        if ef and self.feedback is not None:
            momentum = None
            if self.momentum_correction and codec.sparse:
                momentum = worker_momentum(self.optimizer, hyper)
                hyper = hyper | {WORKER_MOMENTUM: codec.density}
            # x is finite (checked above): no second pass over it
            enc = self.feedback.encode(
                b.id,
                codec,
                x,
                out,
                num_summands=self.world_size,
                momentum=momentum,
                nonfinite=False,
            )
            return name, enc, hyper
        return name, codec.encode(x, out, num_summands=self.world_size), hyper

    def takes_pieces(self, b: Bucket, step: int) -> bool:
        """Whether ``b``'s push at ``step`` can be encoded from its gradients where they are (held as
        pieces, not copied into the bucket first), with the kernels: a streamed bucket's blockwise
        push (no error feedback: its codes go where :meth:`encode` writes them over the borrowed
        buffer). A resident bucket copies (see :mod:`~luwu.gpu_workers.bucket_fill`)."""
        return self._pieces_codec(b, step) is not None

    def _pieces_codec(self, b: Bucket, step: int) -> str | None:
        """The codec of ``b``'s push at ``step`` when it can encode held pieces (else None)."""
        if b.id not in self.streamed:
            return None
        name, ef = self.codecs.push(b, step)
        return name if not ef and get_codec(name).takes_pieces() else None

    def encode_pieces(
        self, b: Bucket, pieces: list[torch.Tensor], step: int, hyper: dict, x: torch.Tensor
    ):
        """:meth:`encode` of streamed ``b``'s gradient as the concatenation of ``pieces`` (fp32
        slices of the parameters' gradients, in segment order), read where they are, its codes
        written over ``x`` (the bucket's borrowed buffer); None when they cannot be encoded that
        way (a NaN or an infinity among them, or what :meth:`takes_pieces` rules out): the caller
        copies them into ``x`` and calls :meth:`encode`."""
        name = self._pieces_codec(b, step)
        if name is None:
            return None
        codec = get_codec(name)
        (q, qdt), (blocks, _) = codec.alloc_spec(b.numel)
        out = [x.view(qdt)[:q], torch.empty(blocks, dtype=torch.float32)]
        enc = codec.encode_pieces_(pieces, out, num_summands=self.world_size)
        return None if enc is None else (name, enc, hyper)

    def _frames(self, b: Bucket, codec, name: str, parity: int, dtype: torch.dtype):
        """The frames ``b``'s gradient is encoded into (None: the codec allocates them)."""
        kept = self._out.setdefault(b.id, {})
        out = kept.get((name, parity))
        if out is None and name != "none" and dtype == torch.float32:
            # (another codec's frames: the warm-up's bf16, once int8 takes over)
            for k in [k for k in kept if k[1] == parity]:
                del kept[k]
            out = codec.alloc(b.numel)
            if b.id not in self.streamed:
                kept[(name, parity)] = out
        return out

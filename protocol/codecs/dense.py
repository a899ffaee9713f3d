"""The dense codecs: every element travels, as fp32 (``none``), bf16, or fp16 with a scale."""

from __future__ import annotations

import math

import torch

from luwu.protocol.codecs.base import (
    FP16_MAX,
    Codec,
    Encoded,
    _amax,
    _as,
    _check_frames,
    _check_meta,
    _check_numel,
    _check_summands,
    _chunks,
    to_device,
)
from luwu.protocol.errors import ProtocolError


class _DenseCodec(Codec):
    """One frame of ``dtype`` per element, no meta: ``none`` and ``bf16``."""

    dtype: torch.dtype = torch.float32

    def __init__(self) -> None:
        super().__init__()
        self._size = torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_element(self) -> float:
        return float(self._size)

    def wire_bytes(self, numel: int) -> int:
        return numel * self._size

    def alloc_spec(self, numel: int) -> list[tuple[int, torch.dtype]]:
        return [(numel, self.dtype)]

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:  # (x of the codec's own dtype: a bf16 model's gradient as bf16)
            super()._check_input(x)
        elif x.dim() != 1 or not x.is_contiguous():
            raise ValueError(
                f"codec {self.name!r} encodes 1-D contiguous tensors, got {tuple(x.shape)}"
            )

    def encode(
        self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1
    ) -> Encoded:
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            if x.dtype == self.dtype:
                # zero-copy: the frame aliases x (fp32 as is, or a bf16 gradient), the caller must not change x until sent
                return Encoded({}, [x])
            out = self.alloc(x.numel())
        else:
            self._check_out(out, x.numel())
        out[0].copy_(x)  # rounds to nearest even
        return Encoded({}, [out[0]])

    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        _check_numel(self.name, numel)
        _check_meta(self.name, meta, {})
        _check_frames(self.name, frames, [numel * self._size])

    def decode_add_(
        self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        src = _as(frames[0], self.dtype)
        n = acc.numel()
        if (
            acc.device.type != "cpu"
        ):  # (a CUDA target: the frame crosses as it travelled, widened on the device)
            src = to_device(src, acc.device)
        if self.dtype == torch.float32 or acc.device.type != "cpu":
            acc.add_(src, alpha=alpha)
            return
        # mixed-dtype add would convert the whole source first on CPU: chunk it
        for s, e in _chunks(n):
            tmp = self._scratch("dec", e - s)
            tmp.copy_(src[s:e])
            acc[s:e].add_(tmp, alpha=alpha)

    def decode_(
        self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        src = _as(frames[0], self.dtype)
        if (
            out.device.type != "cpu" and self.dtype != torch.float32
        ):  # (a CUDA target: the frame crosses as it travelled, widened there)
            src = to_device(src, out.device)
        if alpha == 1.0:
            out.copy_(src)
        elif self.dtype == torch.float32:
            torch.mul(src, alpha, out=out)
        else:  # convert and scale a cache-sized chunk at a time: one pass over memory
            for s, e in _chunks(out.numel()):
                out[s:e].copy_(src[s:e])
                out[s:e].mul_(alpha)

    def decode_pair_(self, out, first, second, alpha: float) -> None:
        a, b = _as(first[0][0], self.dtype), _as(second[0][0], self.dtype)
        if (
            self.dtype == torch.float32
        ):  # (a + b) * alpha: the same bits whichever push came first (lerp is not)
            torch.add(a, b, out=out).mul_(alpha)
            return
        for s, e in _chunks(out.numel()):  # convert both in cache-sized chunks, one pass over out
            ta, tb = self._scratch("dec", e - s), self._scratch("dec2", e - s)
            ta.copy_(a[s:e])
            tb.copy_(b[s:e])
            torch.add(ta, tb, out=out[s:e]).mul_(alpha)

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        out = self._prepare(x, out, num_summands)
        q = out[0]
        if not self.lossy:
            torch.add(x, residual, out=q)
            residual.zero_()
            return Encoded({}, [q])
        for s, e in _chunks(x.numel()):
            r = residual[s:e]
            r.add_(x[s:e])
            q[s:e].copy_(r)
            tmp = self._scratch("ef", e - s)
            tmp.copy_(q[s:e])
            r.sub_(tmp)
        return Encoded({}, [q])


class NoneCodec(_DenseCodec):
    """fp32 as is (lossless)."""

    name = "none"
    lossy = False
    dtype = torch.float32


class Bf16Codec(_DenseCodec):
    """bf16: fp32's range, 8 bits of mantissa; no scale needed."""

    name = "bf16"
    lossy = True
    dtype = torch.bfloat16


class Fp16Codec(Codec):
    """fp16 with a power-of-two scale per message.

    The scale maps the largest magnitude to at most ``65504 / num_summands``,
    so the receiver may add ``num_summands`` payloads in fp16 without
    overflow, and small gradients are lifted out of fp16's subnormals. A
    power of two keeps the scaling itself exact.
    """

    name = "fp16"
    lossy = True

    def bytes_per_element(self) -> float:
        return 2.0

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def alloc_spec(self, numel: int) -> list[tuple[int, torch.dtype]]:
        return [(numel, torch.float16)]

    @staticmethod
    def scale_for(amax: float, num_summands: int) -> float:
        if not math.isfinite(amax) or amax <= 0.0:
            return 1.0
        target = FP16_MAX / num_summands
        _, exp = math.frexp(target / amax)  # target/amax = m * 2**exp, 0.5 <= m < 1
        # within fp32's normal range: x * scale is computed in fp32
        return math.ldexp(1.0, max(-126, min(126, exp - 1)))

    def _encode_into(self, y: torch.Tensor, q: torch.Tensor, scale: float) -> None:
        for s, e in _chunks(y.numel()):
            tmp = self._scratch("enc", e - s)
            torch.mul(y[s:e], scale, out=tmp)
            q[s:e].copy_(tmp)

    def encode(
        self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1
    ) -> Encoded:
        out = self._prepare(x, out, num_summands)
        amax = _amax(x)
        scale = self.scale_for(amax, num_summands)
        self._encode_into(x, out[0], scale)
        return Encoded({"scale": scale}, [out[0]])

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        out = self._prepare(x, out, num_summands)
        residual.add_(x)
        scale = self.scale_for(_amax(residual), num_summands)
        q = out[0]
        inv = 1.0 / scale
        for s, e in _chunks(x.numel()):
            tmp = self._scratch("enc", e - s)
            r = residual[s:e]
            torch.mul(r, scale, out=tmp)
            q[s:e].copy_(tmp)
            tmp.copy_(q[s:e])
            r.add_(tmp, alpha=-inv)
        return Encoded({"scale": scale}, [q])

    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        _check_numel(self.name, numel)
        _check_meta(self.name, meta, {"scale": (float, int)})
        sc = float(meta["scale"])
        if not (math.isfinite(sc) and 2.0**-126 <= sc <= 2.0**126):
            raise ProtocolError(
                f"codec 'fp16': meta 'scale' must be positive and finite, in [2**-126, 2**126] (what an encoder produces), got {meta['scale']!r}"
            )
        _check_frames(self.name, frames, [2 * numel])

    def decode_add_(
        self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        src = _as(frames[0], torch.float16)
        k = alpha / float(meta["scale"])
        for s, e in _chunks(acc.numel()):
            tmp = self._scratch("dec", e - s)
            tmp.copy_(src[s:e])
            acc[s:e].add_(tmp, alpha=k)

    def decode_(
        self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        out.copy_(_as(frames[0], torch.float16))
        k = alpha / float(meta["scale"])
        if k != 1.0:
            out.mul_(k)

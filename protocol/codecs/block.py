"""Blockwise int8 / int4 codecs; the fused C kernels (:mod:`luwu.protocol.native`) when they load,
else a torch path that gives the same bits."""

from __future__ import annotations

import ctypes

import torch

from luwu.protocol import native
from luwu.protocol.codec_facts import BLOCK
from luwu.protocol.codecs.base import (
    CHUNK,
    MAX_BLOCK,
    SCALE_FLOOR,
    Codec,
    Encoded,
    _as,
    _check_frames,
    _check_meta,
    _check_numel,
    _check_summands,
    _flat,
    to_device,
)
from luwu.protocol.errors import ConfigError, ProtocolError


class _BlockCodec(Codec):
    """Symmetric blockwise integer quantization with one fp32 scale per block.

    Each block of ``block`` elements is scaled so that its largest magnitude
    maps to ``levels``; values round to the nearest integer. The error per
    element is at most half a step, ``amax_block / (2 * levels)``, and an
    all-zero block stays exactly zero.
    """

    levels: int = 127
    bits: int = 8

    def __init__(self, block: int | None = None) -> None:
        super().__init__()
        if block is None:
            block = BLOCK[self.name]
        if isinstance(block, bool) or not isinstance(block, int) or not (1 <= block <= MAX_BLOCK):
            raise ConfigError(
                f"codec {self.name!r}: block must be an int in [1, {MAX_BLOCK}], got {block!r}"
            )
        if self.bits == 4 and block % 2:
            raise ConfigError(
                f"codec {self.name!r}: block must be even (two values per byte), got {block}"
            )
        self.block = block

    # -- sizes -------------------------------------------------------------
    def _qbytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def bytes_per_element(self) -> float:
        return self.bits / 8 + 4.0 / self.block

    def wire_bytes(self, numel: int) -> int:
        return self._qbytes(numel) + 4 * (-(-numel // self.block))

    def alloc_spec(self, numel: int) -> list[tuple[int, torch.dtype]]:
        qdt = torch.int8 if self.bits == 8 else torch.uint8
        return [(self._qbytes(numel), qdt), (-(-numel // self.block), torch.float32)]

    # -- encode ------------------------------------------------------------
    def _quantize(self, y2: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Rows of ``y2`` -> integer-valued floats in scratch; ``scales`` filled."""
        rows, width = y2.shape
        tmp = self._scratch("q", rows * width).view(rows, width)
        inv = self._scratch("inv", rows)
        torch.abs(y2, out=tmp)
        torch.amax(tmp, dim=1, out=scales)
        # the floor keeps levels / amax finite (and an all-zero block exact)
        scales.clamp_(min=SCALE_FLOOR)
        torch.reciprocal(scales, out=inv)
        inv.mul_(self.levels)
        scales.div_(self.levels)
        torch.mul(y2, inv.unsqueeze(1), out=tmp)
        tmp.round_()
        return tmp

    def _store(self, tmp: torch.Tensor, q: torch.Tensor) -> None:
        """Integer-valued floats (even count for int4) -> the q frame slice."""
        if self.bits == 8:
            q.copy_(tmp.view(-1))
            return
        flat = tmp.view(-1)
        flat.add_(8.0)  # [-7, 7] -> [1, 15]
        pairs = flat.view(-1, 2)
        packed = self._scratch("pack", pairs.shape[0])
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16.0, out=packed)
        q.copy_(packed)

    def _run(
        self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        n, b = x.numel(), self.block
        lib = native.kernels()
        if lib is not None and _flat(
            (x, scales) if residual is None else (x, scales, residual), (q,)
        ):
            lib.luwu_block_encode(
                x.data_ptr(),
                0 if residual is None else residual.data_ptr(),
                q.data_ptr(),
                scales.data_ptr(),
                n,
                b,
                self.bits,
                float(self.levels),
                SCALE_FLOOR,
                self._scratch("native", b).data_ptr(),
            )
            return
        full = n // b * b
        step = max(b, CHUNK // b * b)
        per = 1 if self.bits == 8 else 2
        for s in range(0, full, step):
            e = min(s + step, full)
            if residual is not None:
                y = residual[s:e]
                y.add_(x[s:e])
            else:
                y = x[s:e]
            y2 = y.view(-1, b)
            sc = scales[s // b : e // b]
            tmp = self._quantize(y2, sc)
            if residual is not None:
                y2.sub_(
                    torch.mul(
                        tmp, sc.unsqueeze(1), out=self._scratch("sent", tmp.numel()).view_as(tmp)
                    )
                )
            self._store(tmp, q[s // per : e // per])
        if full < n:
            t = n - full
            if residual is not None:
                y = residual[full:]
                y.add_(x[full:])
            else:
                y = x[full:]
            padded = t + (t % 2 if self.bits == 4 else 0)
            row = self._scratch("tail", padded)
            row[:t].copy_(y)
            row[t:].zero_()
            sc = scales[-1:]
            tmp = self._quantize(row.view(1, padded), sc)
            if residual is not None:
                y.sub_(torch.mul(tmp.view(-1)[:t], sc, out=self._scratch("sent", t)[:t]))
            self._store(tmp, q[full // per :])

    def encode(
        self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1
    ) -> Encoded:
        out = self._prepare(x, out, num_summands)
        self._run(x, out[0], out[1], None)
        return Encoded({"block": self.block}, list(out))

    def encode_over_(self, x: torch.Tensor, *, num_summands: int = 1) -> Encoded | None:
        """:meth:`encode` of ``x`` with the codes written over ``x`` itself (its first bytes): the
        same frames bit for bit, the codes' frame a view of ``x``'s memory, so nothing as large as
        the codes is allocated (and faulted in) per call. ``x`` is destroyed: for a buffer not
        read again while the frames are in use. None, with ``x`` untouched, where the kernels
        cannot take it (then :meth:`encode` into frames of its own)."""
        lib = native.kernels()
        if lib is None or not _flat((x,), ()) or x.dim() != 1:
            return None
        _check_summands(num_summands)
        n = x.numel()
        scales = torch.empty(-(-n // self.block), dtype=torch.float32)
        lib.luwu_block_encode_over(
            x.data_ptr(),
            scales.data_ptr(),
            n,
            self.block,
            self.bits,
            float(self.levels),
            SCALE_FLOOR,
            self._scratch("native", self.block).data_ptr(),
        )
        qdt = torch.int8 if self.bits == 8 else torch.uint8
        return Encoded({"block": self.block}, [x.view(qdt)[: self._qbytes(n)], scales])

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        out = self._prepare(x, out, num_summands)
        bf16 = residual.dtype == torch.bfloat16 and self.takes_bf16_residual(x)
        if residual.shape != x.shape or not (residual.dtype == torch.float32 or bf16):
            raise ValueError(
                f"residual must be fp32 (or bf16, with the kernels) of shape {tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}"
            )
        if bf16 and residual.is_contiguous() and _flat((out[1],), (out[0],)):
            native.kernels().luwu_block_encode_bf16res(
                x.data_ptr(),
                residual.data_ptr(),
                out[0].data_ptr(),
                out[1].data_ptr(),
                x.numel(),
                self.block,
                self.bits,
                float(self.levels),
                SCALE_FLOOR,
                self._scratch("native", 2 * self.block).data_ptr(),
            )
        elif bf16:  # frames the kernel cannot take by address: widen, encode, round back
            wide = residual.float()
            self._run(x, out[0], out[1], wide)
            residual.copy_(wide)
        else:
            self._run(x, out[0], out[1], residual)
        return Encoded({"block": self.block}, list(out))

    def takes_bf16_residual(self, x: torch.Tensor) -> bool:
        return native.kernels() is not None and _flat((x,), ())

    def takes_pieces(self) -> bool:
        return native.kernels() is not None

    def encode_pieces_(
        self, pieces: list[torch.Tensor], out: list[torch.Tensor], *, num_summands: int = 1
    ) -> Encoded | None:
        """:meth:`encode` of the concatenation of ``pieces``, read where they are (a streamed
        bucket's gradients in their parameters' own memory, not copied together first): the same
        frames, bit for bit. None, with nothing written, where a piece holds a NaN or an infinity
        (that push goes uncompressed) or the kernels cannot take the tensors: the caller then
        copies the pieces together and encodes those."""
        lib = native.kernels()
        n = sum(t.numel() for t in pieces)
        if (
            lib is None
            or not pieces
            or not _flat(tuple(pieces), ())
            or not _flat((out[1],), (out[0],))
        ):
            return None
        _check_summands(num_summands)
        self._check_out(out, n)
        k = len(pieces)
        bad = lib.luwu_block_encode_pieces(
            (ctypes.c_void_p * k)(*(t.data_ptr() for t in pieces)),
            (ctypes.c_int64 * k)(*(t.numel() for t in pieces)),
            k,
            out[0].data_ptr(),
            out[1].data_ptr(),
            n,
            self.block,
            self.bits,
            float(self.levels),
            SCALE_FLOOR,
            self._scratch("native", 2 * self.block).data_ptr(),
        )
        return None if bad else Encoded({"block": self.block}, list(out))

    # -- decode ------------------------------------------------------------
    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        _check_numel(self.name, numel)
        _check_meta(self.name, meta, {"block": int})
        b = meta["block"]
        if not (1 <= b <= MAX_BLOCK) or (self.bits == 4 and b % 2):
            raise ProtocolError(
                f"codec {self.name!r}: meta 'block' = {b} is not a valid block size"
            )
        _check_frames(self.name, frames, [self._qbytes(numel), 4 * (-(-numel // b))])

    def _dequant(self, q: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` quantized values from the q frame slice, as floats in scratch."""
        if self.bits == 8:
            tmp = self._scratch("dq", count)
            tmp.copy_(q)
            return tmp
        tmp = self._scratch("dq", count + (count % 2))
        nib = self._scratch("nib", q.numel(), torch.uint8)
        pairs = tmp.view(-1, 2)
        torch.bitwise_and(q, 15, out=nib)
        pairs[:, 0].copy_(nib)
        torch.bitwise_right_shift(q, 4, out=nib)
        pairs[:, 1].copy_(nib)
        tmp.sub_(8.0)
        return tmp[:count]

    def decode_add_(
        self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        n, b = acc.numel(), int(meta["block"])
        q, scales = self._frames(frames)
        if acc.device.type != "cpu":
            acc.add_(self._decoded_on(acc.device, q, scales, n, b, alpha))
            return
        lib = native.kernels()
        if lib is not None and _flat((acc, scales), (q,)) and self._fits(n, b, q, scales):
            lib.luwu_block_decode(
                acc.data_ptr(), q.data_ptr(), scales.data_ptr(), n, b, self.bits, alpha, 1
            )
            return
        for s, e, tmp in self._decoded(q, scales, n, b, alpha):
            acc[s:e].add_(tmp)

    def _decoded(self, q: torch.Tensor, scales: torch.Tensor, n: int, b: int, alpha: float):
        """The torch path: (start, end, code * (scale * alpha) in scratch) chunk by chunk. Each product is
        rounded on its own (no addcmul, which may fuse a multiply-add), as in ``blockquant.c``."""
        full = n // b * b
        step = max(b, CHUNK // b * b)
        per = 1 if self.bits == 8 else 2
        for s in range(0, full, step):
            e = min(s + step, full)
            tmp = self._dequant(q[s // per : e // per], e - s)
            sc = torch.mul(scales[s // b : e // b], alpha, out=self._scratch("dsc", (e - s) // b))
            tmp.view(-1, b).mul_(sc.unsqueeze(1))
            yield s, e, tmp
        if full < n:
            tmp = self._dequant(q[full // per :], n - full)
            tmp.mul_(torch.mul(scales[-1:], alpha, out=self._scratch("dsc", 1)[:1]))
            yield full, n, tmp

    def _decoded_on(
        self,
        device: torch.device,
        q: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        b: int,
        alpha: float,
    ) -> torch.Tensor:
        """The torch path on an accelerator (a CUDA parameter as the target): the codes and scales cross as they
        travelled (a byte or half a byte per value and a scale per block, not 4 bytes per value) and are widened
        there, with the CPU path's products (``code * (scale * alpha)``, each rounded on its own)."""
        q, scales = to_device(q, device), to_device(scales, device)
        vals = (
            q[:n].float()
            if self.bits == 8
            else torch.stack((q & 15, q >> 4), 1).reshape(-1)[:n].float().sub_(8.0)
        )
        sc = torch.mul(scales, alpha)
        full = n // b * b
        vals[:full].view(-1, b).mul_(sc[: full // b].unsqueeze(1))
        if full < n:
            vals[full:].mul_(sc[-1:])
        return vals

    def _frames(self, frames: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return _as(frames[0], torch.int8 if self.bits == 8 else torch.uint8), _as(
            frames[1], torch.float32
        )

    def _fits(self, n: int, b: int, q: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether frames hold what ``n`` elements in blocks of ``b`` need: the C kernels read by
        address, so a frame that :meth:`validate` did not see must not reach them short."""
        return (
            1 <= b <= MAX_BLOCK
            and (self.bits == 8 or b % 2 == 0)
            and q.numel() >= self._qbytes(n)
            and scales.numel() >= -(-n // b)
        )

    def decode_(
        self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        lib = native.kernels()
        q, scales = self._frames(frames)
        n, b = out.numel(), int(meta["block"])
        if out.device.type != "cpu":
            out.copy_(self._decoded_on(out.device, q, scales, n, b, alpha))
            return
        if lib is not None and _flat((out, scales), (q,)) and self._fits(n, b, q, scales):
            lib.luwu_block_decode(
                out.data_ptr(), q.data_ptr(), scales.data_ptr(), n, b, self.bits, alpha, 0
            )
            return
        for s, e, tmp in self._decoded(q, scales, n, b, alpha):
            out[s:e].copy_(tmp)

    def decode_pair_(
        self,
        out: torch.Tensor,
        first: tuple[list[torch.Tensor], dict],
        second: tuple[list[torch.Tensor], dict],
        alpha: float,
    ) -> None:
        lib = native.kernels()
        (qa, sa), (qb, sb) = self._frames(first[0]), self._frames(second[0])
        n, b = out.numel(), int(first[1]["block"])
        if (
            lib is not None
            and b == int(second[1]["block"])
            and _flat((out, sa, sb), (qa, qb))
            and self._fits(n, b, qa, sa)
            and self._fits(n, b, qb, sb)
        ):
            lib.luwu_block_decode_pair(
                out.data_ptr(),
                qa.data_ptr(),
                sa.data_ptr(),
                qb.data_ptr(),
                sb.data_ptr(),
                n,
                b,
                self.bits,
                alpha,
            )
        else:
            super().decode_pair_(out, first, second, alpha)


class Int8Codec(_BlockCodec):
    """int8 blockwise: 1 byte per element + 4 bytes per block."""

    name = "int8"
    levels = 127
    bits = 8


class Int4Codec(_BlockCodec):
    """int4 blockwise: two values per byte (nibble = q + 8, q in [-7, 7]) + 4 bytes per block."""

    name = "int4"
    levels = 7
    bits = 4

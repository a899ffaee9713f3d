"""Tensor compression codecs and their registry.

A codec turns a 1-D fp32 tensor into a small ``meta`` dict (goes in the msgpack
header) and raw frames (sent as ZeroMQ frames with ``copy=False``), and adds a
received payload straight into an fp32 accumulator. The receiving side never
needs the sender's codec parameters: whatever decoding needs (block size, k,
scale) travels in ``meta``, and :meth:`Codec.validate` checks it against the
frame lengths before any memory is touched.

Memory: the hot paths (``encode`` into preallocated ``out`` frames, and
``decode_add_``) never allocate in proportion to the tensor (a mixed-dtype
``add_`` on CPU would convert the whole source first). Where a temporary is
needed they walk the tensor in chunks of :data:`CHUNK` elements through
per-thread scratch buffers (codec instances are shared between threads).

Non-finite input is not an error of a codec: the sender calls
:func:`has_nonfinite` before encoding. The dense codecs (none, bf16, fp16,
int8, int4) carry a NaN/inf through to the decoded values (an int8 block
holding one decodes as all non-finite); top-k may drop it.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, NamedTuple

import torch

from luwu.protocol import native
from luwu.protocol.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

#: Elements per chunk on the chunked paths (2 MiB of fp32 scratch per thread).
#: Measured on 16M elements, 1 thread: int8 encode 3.8 GB/s at 64K, 6.2 at
#: 256K, 7.1 at 512K (per-op Python overhead is paid per chunk), flat beyond.
CHUNK = 1 << 19

FP16_MAX = 65504.0

#: Block magnitudes are taken as at least this (keeps the inverse scale finite);
#: the error bound of a block is then max(amax, SCALE_FLOOR) / (2 * levels).
SCALE_FLOOR = 2.0**-120

#: Largest block size accepted (from meta too): bounds scratch use.
MAX_BLOCK = 1 << 20


class Encoded(NamedTuple):
    meta: dict
    """Small msgpack-able dict (str keys; int/float/str/bool values) for the header."""
    frames: list[torch.Tensor]
    """Contiguous 1-D CPU tensors, sent as raw frames in this order."""


def has_nonfinite(x: torch.Tensor) -> bool:
    """True if ``x`` holds a NaN or an infinity.

    One reduction pass and no temporary: min and max propagate NaN, and an
    infinity is the min or the max.
    """
    if x.numel() == 0:
        return False
    lo, hi = torch.aminmax(x)
    return not (math.isfinite(lo.item()) and math.isfinite(hi.item()))


def _as(frame: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a received (uint8) or locally encoded frame as ``dtype``."""
    if frame.dtype == dtype:
        return frame
    if frame.dtype != torch.uint8:
        frame = frame.view(torch.uint8)
    return frame.view(dtype)


def _check_meta(codec: str, meta: dict, spec: dict[str, type | tuple[type, ...]]) -> None:
    """Meta must have exactly the keys of ``spec``, each of the given type."""
    if not isinstance(meta, dict):
        raise ProtocolError(f"codec {codec!r}: meta must be a dict, got {type(meta).__name__}")
    extra = set(meta) - set(spec)
    if extra:
        raise ProtocolError(f"codec {codec!r}: unknown meta key(s) {sorted(map(str, extra))}")
    for key, typ in spec.items():
        if key not in meta:
            raise ProtocolError(f"codec {codec!r}: meta key {key!r} missing")
        val = meta[key]
        # bool is an int subclass; never accept it where a number is meant
        if isinstance(val, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
            raise ProtocolError(f"codec {codec!r}: meta {key!r} must be {typ}, got bool")
        if not isinstance(val, typ):
            raise ProtocolError(f"codec {codec!r}: meta {key!r} must be {typ}, got {type(val).__name__}")


def _check_frames(codec: str, frames: list[int], expected: list[int]) -> None:
    if len(frames) != len(expected):
        raise ProtocolError(f"codec {codec!r}: expected {len(expected)} payload frame(s), got {len(frames)}")
    for i, (got, want) in enumerate(zip(frames, expected)):
        if got != want:
            raise ProtocolError(f"codec {codec!r}: frame {i} has {got} bytes, expected {want}")


def _check_numel(codec: str, numel: Any) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ProtocolError(f"codec {codec!r}: numel must be a non-negative int, got {numel!r}")


def _check_summands(num_summands: int) -> None:
    if isinstance(num_summands, bool) or not isinstance(num_summands, int) or num_summands < 1:
        raise ValueError(f"num_summands must be an int >= 1, got {num_summands!r}")


def _flat(floats: tuple[torch.Tensor, ...], codes: tuple[torch.Tensor, ...]) -> bool:
    """Whether the fused kernels may take these tensors by address: CPU, contiguous, fp32 (int8 or
    uint8 for the codes). Anything else takes the torch path."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in floats) and all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.int8, torch.uint8) for t in codes)


def _chunks(n: int, chunk: int = CHUNK):
    for s in range(0, n, chunk):
        yield s, min(s + chunk, n)


class Codec:
    """Base class: one instance per (name, params), shared, stateless but for scratch."""

    name: str = ""
    lossy: bool = True
    sparse: bool = False
    """Sends a subset of the elements (and :meth:`clear_sent_` can tell which)."""

    def __init__(self) -> None:
        self._local = threading.local()

    # -- sizes -------------------------------------------------------------
    def bytes_per_element(self) -> float:
        """Average wire bytes per fp32 element (for the policy and the planner)."""
        raise NotImplementedError

    def wire_bytes(self, numel: int) -> int:
        """Exact payload bytes (all frames) for ``numel`` elements."""
        raise NotImplementedError

    def alloc_spec(self, numel: int) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of each output frame."""
        raise NotImplementedError

    def alloc(self, numel: int) -> list[torch.Tensor]:
        """Output frames for ``encode``, to be reused every step."""
        return [torch.empty(n, dtype=d) for n, d in self.alloc_spec(numel)]

    # -- the two directions ------------------------------------------------
    def encode(self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1) -> Encoded:
        """Encode 1-D contiguous fp32 ``x`` (left unchanged), into ``out`` when given.

        ``num_summands``: how many such payloads the receiver adds up (fp16
        scales for it). The frames may alias ``out`` (or, for ``none`` without
        ``out``, ``x``): keep them unchanged until sent.
        """
        raise NotImplementedError

    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        """Check meta and the frames' byte lengths for ``numel`` elements; raise ProtocolError."""
        raise NotImplementedError

    def decode_add_(self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        """``acc += alpha * decoded``; frames are (possibly read-only) uint8 views, never written."""
        raise NotImplementedError

    def decode_(self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        """``out = alpha * decoded`` (a node folds the 1/n of the average into its decode)."""
        out.zero_()
        self.decode_add_(out, frames, meta, alpha)

    def decode_pair_(self, out: torch.Tensor, first: tuple[list[torch.Tensor], dict], second: tuple[list[torch.Tensor], dict], alpha: float) -> None:
        """``out = alpha * (decoded first + decoded second)``: two pushes of this codec, (frames, meta) each.
        Dense codecs do it in one pass over ``out`` instead of a write and a read-modify-write."""
        self.decode_(out, *first, alpha)
        self.decode_add_(out, *second, alpha)

    # -- error feedback ----------------------------------------------------
    def encode_feedback_(
        self, x: torch.Tensor, residual: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1
    ) -> Encoded:
        """Encode ``x + residual`` and leave in ``residual`` what was not sent.

        The generic path makes three passes over memory; codecs override it
        with a fused chunked one where they can.
        """
        residual.add_(x)
        enc = self.encode(residual, out, num_summands=num_summands)
        self.decode_add_(residual, enc.frames, enc.meta, alpha=-1.0)
        return enc

    def clear_sent_(self, t: torch.Tensor, enc: Encoded) -> None:
        """Zero the elements of ``t`` that ``enc`` (this codec's own encode) carried: sparse codecs only."""
        raise ConfigError(f"codec {self.name!r} is dense: every element is sent, so none is cleared alone")

    # -- helpers -----------------------------------------------------------
    def _scratch(self, key: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-thread buffer of at least ``numel`` elements, reused across calls."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        buf = bufs.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = bufs[key] = torch.empty(max(numel, 1), dtype=dtype)
        return buf[:numel]

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 1 or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"codec {self.name!r} encodes 1-D contiguous fp32 tensors, got {x.dtype} {tuple(x.shape)}")

    def _check_out(self, out: list[torch.Tensor], numel: int) -> None:
        want = self.alloc_spec(numel)
        if len(out) != len(want) or any(o.numel() != n or o.dtype != d for o, (n, d) in zip(out, want)):
            raise ValueError(f"codec {self.name!r}: out buffers do not match alloc({numel})")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


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

    def encode(self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1) -> Encoded:
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            if self.dtype == torch.float32:
                # zero-copy: the frame aliases x, the caller must not change x until sent
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

    def decode_add_(self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        src = _as(frames[0], self.dtype)
        n = acc.numel()
        if self.dtype == torch.float32:
            acc.add_(src, alpha=alpha)
            return
        # mixed-dtype add would convert the whole source first on CPU: chunk it
        for s, e in _chunks(n):
            tmp = self._scratch("dec", e - s)
            tmp.copy_(src[s:e])
            acc[s:e].add_(tmp, alpha=alpha)

    def decode_(self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        src = _as(frames[0], self.dtype)
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
        if self.dtype == torch.float32:
            if alpha == 0.5:
                torch.lerp(a, b, 0.5, out=out)  # (a + b) / 2 in one pass
            else:
                torch.add(a, b, out=out).mul_(alpha)
            return
        for s, e in _chunks(out.numel()):  # convert both in cache-sized chunks, one pass over out
            ta, tb = self._scratch("dec", e - s), self._scratch("dec2", e - s)
            ta.copy_(a[s:e])
            tb.copy_(b[s:e])
            if alpha == 0.5:
                torch.lerp(ta, tb, 0.5, out=out[s:e])
            else:
                torch.add(ta, tb, out=out[s:e]).mul_(alpha)

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            out = self.alloc(x.numel())
        else:
            self._check_out(out, x.numel())
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

    def encode(self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1) -> Encoded:
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            out = self.alloc(x.numel())
        else:
            self._check_out(out, x.numel())
        amax = _amax(x)
        scale = self.scale_for(amax, num_summands)
        self._encode_into(x, out[0], scale)
        return Encoded({"scale": scale}, [out[0]])

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            out = self.alloc(x.numel())
        else:
            self._check_out(out, x.numel())
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
            raise ProtocolError(f"codec 'fp16': meta 'scale' must be positive and finite, in [2**-126, 2**126] (what an encoder produces), got {meta['scale']!r}")
        _check_frames(self.name, frames, [2 * numel])

    def decode_add_(self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        src = _as(frames[0], torch.float16)
        k = alpha / float(meta["scale"])
        for s, e in _chunks(acc.numel()):
            tmp = self._scratch("dec", e - s)
            tmp.copy_(src[s:e])
            acc[s:e].add_(tmp, alpha=k)

    def decode_(self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        out.copy_(_as(frames[0], torch.float16))
        k = alpha / float(meta["scale"])
        if k != 1.0:
            out.mul_(k)


class _BlockCodec(Codec):
    """Symmetric blockwise integer quantization with one fp32 scale per block.

    Each block of ``block`` elements is scaled so that its largest magnitude
    maps to ``levels``; values round to the nearest integer. The error per
    element is at most half a step, ``amax_block / (2 * levels)``, and an
    all-zero block stays exactly zero.
    """

    levels: int = 127
    bits: int = 8

    def __init__(self, block: int = 256) -> None:
        super().__init__()
        if isinstance(block, bool) or not isinstance(block, int) or not (1 <= block <= MAX_BLOCK):
            raise ConfigError(f"codec {self.name!r}: block must be an int in [1, {MAX_BLOCK}], got {block!r}")
        if self.bits == 4 and block % 2:
            raise ConfigError(f"codec {self.name!r}: block must be even (two values per byte), got {block}")
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

    def _run(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor | None) -> None:
        n, b = x.numel(), self.block
        lib = native.kernels()
        if lib is not None and _flat((x, scales) if residual is None else (x, scales, residual), (q,)):
            lib.luwu_block_encode(x.data_ptr(), 0 if residual is None else residual.data_ptr(), q.data_ptr(),
                                  scales.data_ptr(), n, b, self.bits, float(self.levels), SCALE_FLOOR,
                                  self._scratch("native", b).data_ptr())
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
                y2.sub_(torch.mul(tmp, sc.unsqueeze(1), out=self._scratch("sent", tmp.numel()).view_as(tmp)))
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

    def _prepare(self, x: torch.Tensor, out: list[torch.Tensor] | None, num_summands: int) -> list[torch.Tensor]:
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            return self.alloc(x.numel())
        self._check_out(out, x.numel())
        return out

    def encode(self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1) -> Encoded:
        out = self._prepare(x, out, num_summands)
        self._run(x, out[0], out[1], None)
        return Encoded({"block": self.block}, list(out))

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        out = self._prepare(x, out, num_summands)
        if residual.shape != x.shape or residual.dtype != torch.float32:
            raise ValueError(f"residual must be fp32 of shape {tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}")
        self._run(x, out[0], out[1], residual)
        return Encoded({"block": self.block}, list(out))

    # -- decode ------------------------------------------------------------
    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        _check_numel(self.name, numel)
        _check_meta(self.name, meta, {"block": int})
        b = meta["block"]
        if not (1 <= b <= MAX_BLOCK) or (self.bits == 4 and b % 2):
            raise ProtocolError(f"codec {self.name!r}: meta 'block' = {b} is not a valid block size")
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

    def decode_add_(self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        n, b = acc.numel(), int(meta["block"])
        q, scales = self._frames(frames)
        lib = native.kernels()
        if lib is not None and _flat((acc, scales), (q,)) and self._fits(n, b, q, scales):
            lib.luwu_block_decode(acc.data_ptr(), q.data_ptr(), scales.data_ptr(), n, b, self.bits, alpha, 1)
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

    def _frames(self, frames: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return _as(frames[0], torch.int8 if self.bits == 8 else torch.uint8), _as(frames[1], torch.float32)

    def _fits(self, n: int, b: int, q: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether frames hold what ``n`` elements in blocks of ``b`` need: the C kernels read by
        address, so a frame that :meth:`validate` did not see must not reach them short."""
        return (1 <= b <= MAX_BLOCK and (self.bits == 8 or b % 2 == 0) and q.numel() >= self._qbytes(n)
                and scales.numel() >= -(-n // b))

    def decode_(self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        lib = native.kernels()
        q, scales = self._frames(frames)
        n, b = out.numel(), int(meta["block"])
        if lib is not None and _flat((out, scales), (q,)) and self._fits(n, b, q, scales):
            lib.luwu_block_decode(out.data_ptr(), q.data_ptr(), scales.data_ptr(), n, b, self.bits, alpha, 0)
            return
        for s, e, tmp in self._decoded(q, scales, n, b, alpha):
            out[s:e].copy_(tmp)

    def decode_pair_(self, out: torch.Tensor, first: tuple[list[torch.Tensor], dict], second: tuple[list[torch.Tensor], dict], alpha: float) -> None:
        lib = native.kernels()
        (qa, sa), (qb, sb) = self._frames(first[0]), self._frames(second[0])
        n, b = out.numel(), int(first[1]["block"])
        if (lib is not None and b == int(second[1]["block"]) and _flat((out, sa, sb), (qa, qb))
                and self._fits(n, b, qa, sa) and self._fits(n, b, qb, sb)):
            lib.luwu_block_decode_pair(out.data_ptr(), qa.data_ptr(), sa.data_ptr(), qb.data_ptr(), sb.data_ptr(), n, b, self.bits, alpha)
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

    def __init__(self, block: int = 64) -> None:
        super().__init__(block)


#: Below this many elements (or above this density) top-k goes straight to torch.topk.
TOPK_DIRECT_NUMEL = 1 << 16
TOPK_DIRECT_DENSITY = 0.2
#: Sample size for the threshold estimate, and the candidate margin over k.
TOPK_SAMPLE = 1 << 14
TOPK_MARGIN = 1.5
#: Chunk of the candidate scan.
TOPK_CHUNK = CHUNK


def topk_indices(x: torch.Tensor, k: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted int64 indices of ``k`` elements of largest magnitude in 1-D ``x``.

    The RTop-K idea, made exact: a magnitude threshold is estimated from a
    random sample so that about ``TOPK_MARGIN * k`` elements pass it; one
    chunked pass keeps those candidates, and the k-th largest among them
    (a selection on ~1.5% of the data) picks exactly k. If fewer than k pass,
    the candidates cannot hold the top-k and it falls back to ``torch.topk``;
    so the result is always the true top-k (up to ties), only the time varies.
    """
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k == n:
        return torch.arange(n)
    if n <= TOPK_DIRECT_NUMEL or k > TOPK_DIRECT_DENSITY * n:
        return _direct_topk(x, k)
    m = TOPK_SAMPLE
    sample = x[torch.randint(0, n, (m,), generator=generator)].abs_()
    frac = min(1.0, TOPK_MARGIN * k / n + 4.0 * math.sqrt(k / n / m))
    j = max(1, m - int(math.ceil(frac * m)))  # kthvalue is 1-based, ascending
    thr = float(torch.kthvalue(sample, j).values)
    if not math.isfinite(thr):
        return _direct_topk(x, k)
    parts = []
    tmp = torch.empty(min(n, TOPK_CHUNK))
    mask = torch.empty(min(n, TOPK_CHUNK), dtype=torch.bool)
    for s, e in _chunks(n, TOPK_CHUNK):
        t, mk = tmp[: e - s], mask[: e - s]
        torch.abs(x[s:e], out=t)
        torch.gt(t, thr, out=mk)
        idx = mk.nonzero().view(-1)
        if s:
            idx += s
        parts.append(idx)
    cand = torch.cat(parts)
    c = cand.numel()
    if c < k:
        log.debug("top-k threshold too high (%d candidates for k=%d): full topk", c, k)
        return _direct_topk(x, k)
    if c == k:
        return cand
    mags = x[cand].abs_()
    # the k-th largest magnitude; keep all above it and the first ties at it, in order
    kth = torch.kthvalue(mags, c - k + 1).values
    keep = mags > kth
    need = k - int(keep.sum())
    if need:
        eq = mags == kth
        keep |= eq & (eq.cumsum(0) <= need)
    return cand[keep]


def _direct_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return idx.sort().values


class TopkCodec(Codec):
    """The ``density`` fraction of elements of largest magnitude, as values + int32 indices.

    Only meaningful with error feedback (what is not sent waits in the
    residual). Indices are sorted, so the receiver's scatter walks memory
    forward.
    """

    name = "topk"
    lossy = True
    sparse = True

    def __init__(self, density: float = 0.01, values: str = "fp32") -> None:
        super().__init__()
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not (0.0 < density <= 1.0):
            raise ConfigError(f"codec 'topk': density must be in (0, 1], got {density!r}")
        if values not in _TOPK_VALUES:
            raise ConfigError(f"codec 'topk': values must be one of {sorted(_TOPK_VALUES)}, got {values!r}")
        self.density = float(density)
        self.values = values
        self._vdt = _TOPK_VALUES[values]
        self._vsize = torch.empty((), dtype=self._vdt).element_size()

    def k_for(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, min(numel, math.ceil(self.density * numel)))

    def bytes_per_element(self) -> float:
        return self.density * (self._vsize + 4)

    def wire_bytes(self, numel: int) -> int:
        return self.k_for(numel) * (self._vsize + 4)

    def alloc_spec(self, numel: int) -> list[tuple[int, torch.dtype]]:
        k = self.k_for(numel)
        return [(k, self._vdt), (k, torch.int32)]

    def _generator(self) -> torch.Generator:
        g = getattr(self._local, "gen", None)
        if g is None:
            g = self._local.gen = torch.Generator().manual_seed(0x1D00)
        return g

    def _select(self, y: torch.Tensor, out: list[torch.Tensor] | None, num_summands: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        self._check_input(y)
        _check_summands(num_summands)
        n = y.numel()
        if out is None:
            out = self.alloc(n)
        else:
            self._check_out(out, n)
        idx = topk_indices(y, self.k_for(n), generator=self._generator())
        vals = y[idx]
        out[0].copy_(vals)
        out[1].copy_(idx)
        return out, idx

    def encode(self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1) -> Encoded:
        out, _ = self._select(x, out, num_summands)
        return Encoded({"k": out[1].numel(), "values": self.values}, list(out))

    def encode_feedback_(self, x, residual, out=None, *, num_summands: int = 1) -> Encoded:
        residual.add_(x)
        out, idx = self._select(residual, out, num_summands)
        # what was sent leaves the residual: exactly zero for fp32 values
        residual.index_add_(0, idx, out[0].to(torch.float32), alpha=-1.0)
        return Encoded({"k": out[1].numel(), "values": self.values}, list(out))

    def clear_sent_(self, t: torch.Tensor, enc: Encoded) -> None:
        t.index_fill_(0, enc.frames[1].to(torch.int64), 0.0)

    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        _check_numel(self.name, numel)
        _check_meta(self.name, meta, {"k": int, "values": str})
        k = meta["k"]
        if not 0 <= k <= numel:
            raise ProtocolError(f"codec 'topk': meta 'k' = {k} is outside [0, numel={numel}]")
        if meta["values"] not in _TOPK_VALUES:
            raise ProtocolError(f"codec 'topk': meta 'values' = {meta['values']!r} is not one of {sorted(_TOPK_VALUES)}")
        vsize = torch.empty((), dtype=_TOPK_VALUES[meta["values"]]).element_size()
        _check_frames(self.name, frames, [k * vsize, 4 * k])

    def decode_add_(self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0) -> None:
        k = int(meta["k"])
        if k == 0:
            return
        vals = _as(frames[0], _TOPK_VALUES[meta["values"]])
        idx = _as(frames[1], torch.int32)
        # the only check that needs the payload: indices must land inside acc
        lo, hi = torch.aminmax(idx)
        if int(lo) < 0 or int(hi) >= acc.numel():
            raise ProtocolError(f"codec 'topk': index out of range [0, {acc.numel()}): min {int(lo)}, max {int(hi)}")
        if vals.dtype != torch.float32:
            vals = vals.to(torch.float32)
        acc.index_add_(0, idx, vals, alpha=alpha)


_TOPK_VALUES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _amax(x: torch.Tensor) -> float:
    """Largest magnitude (NaN if any NaN), in one pass without a temporary."""
    if x.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(x)
    lo, hi = lo.item(), hi.item()
    if math.isnan(lo) or math.isnan(hi):
        return math.nan
    return max(-lo, hi)


# -- registry ----------------------------------------------------------------

_FACTORIES: dict[str, Callable[..., Codec]] = {}
_CACHE: dict[tuple, Codec] = {}
_LOCK = threading.Lock()


def register_codec(name: str, factory: Callable[..., Codec]) -> None:
    """Make ``get_codec(name, **params)`` build codecs with ``factory(**params)``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"codec name must be a non-empty str, got {name!r}")
    with _LOCK:
        _FACTORIES[name] = factory
        for key in [k for k in _CACHE if k[0] == name]:
            del _CACHE[key]


def get_codec(name: str, **params: Any) -> Codec:
    """The shared codec instance for ``(name, params)``.

    ``name`` may carry the codec's first parameter after a colon, so that a
    header's codec string alone names a parametrized codec: ``"topk:0.05"``
    is ``get_codec("topk", density=0.05)``'s twin, ``"int8:128"`` an int8
    codec with blocks of 128.
    """
    key = (name, tuple(sorted(params.items())))
    codec = _CACHE.get(key)
    if codec is not None:
        return codec
    if not isinstance(name, str):
        raise ConfigError(f"codec name must be a str, got {name!r}")
    base, colon, arg = name.partition(":")
    factory = _FACTORIES.get(name) or (_FACTORIES.get(base) if colon else None)
    if factory is None:
        raise ConfigError(f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}")
    args = (_parse_arg(arg),) if colon and name not in _FACTORIES else ()
    try:
        codec = factory(*args, **params)
    except TypeError as exc:
        raise ConfigError(f"codec {name!r}: bad parameters {params!r}: {exc}") from None
    with _LOCK:
        return _CACHE.setdefault(key, codec)


def _parse_arg(arg: str) -> int | float | str:
    for conv in (int, float):
        try:
            return conv(arg)
        except ValueError:
            pass
    return arg


def codec_names() -> list[str]:
    return sorted(_FACTORIES)


register_codec("none", NoneCodec)
register_codec("bf16", Bf16Codec)
register_codec("fp16", Fp16Codec)
register_codec("int8", Int8Codec)
register_codec("int4", Int4Codec)
register_codec("topk", TopkCodec)

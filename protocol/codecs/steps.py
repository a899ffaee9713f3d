"""``bf16_steps``: the weights' bf16 rounding, sent as steps on the bf16 grid, one byte each (pull only).

A worker that holds the bf16 rounding of a bucket's master weights (after a ``bf16`` reply, or the
last ``bf16_steps`` one) needs only how far each value moved on the bf16 grid to hold the next one.
Read as integers, bf16 bit patterns of one sign are in order and adjacent values differ by one, so
the step of element i is ``ord(new_i) - ord(old_i)`` (``ord(b) = b`` for a positive pattern,
``-(b & 0x7fff)`` for a negative one). A step in [-127, 127] is one int8 code; anything else (a larger
step, a new value that is a zero of the other sign, a non-finite one) is the code -128, an escape,
and the new bits follow in a second frame, in element order (``meta["escapes"]`` of them).

What a worker ends up with is, bit for bit, what a ``bf16`` reply gives (the same rounding to nearest
even), for about one byte a parameter instead of two. Unlike ``int8_delta`` the node keeps no shadow of
the workers' copy: the old bits are the rounding of the master weights just before the step
(:meth:`Bf16StepsCodec.snapshot`, one bucket at a time, into per-thread scratch), so a node holds its
optimizer's state and the buckets in flight, nothing per parameter besides.

How many escape: on the cluster task (AdamW, lr 1e-3) 6% of the elements in the first step, when
Adam moves every weight by about lr, 2% by step 5, under 1% from step 20 (and then 60-70% of the codes
are 0: most weights do not move by a whole bf16 step). :data:`ESCAPE_SHARE` is what the cost model
assumes.

Pull only: encoding needs the old bits (:meth:`encode_steps`), and decoding steps the weights held
(:meth:`decode_add_`, fp32 tensors holding bf16 values, or bf16 tensors). The fused kernels are in
``bf16steps.c``; the torch path gives the same bits for finite weights.
"""

from __future__ import annotations

import torch

from luwu.protocol import native
from luwu.protocol.codecs.base import (
    CHUNK,
    Codec,
    Encoded,
    _as,
    _check_frames,
    _check_meta,
    _check_numel,
    _chunks,
)
from luwu.protocol.errors import ConfigError, ProtocolError

#: The share of elements the cost model assumes escape (two more bytes each).
ESCAPE_SHARE = 0.01

ESCAPE = -128


def _ord(bits: torch.Tensor) -> torch.Tensor:
    """int32 bf16 patterns (0..65535) -> ordered integers."""
    return torch.where(bits >= 0x8000, -(bits & 0x7FFF), bits)


def _unord(o: torch.Tensor) -> torch.Tensor:
    return torch.where(o < 0, (-o) | 0x8000, o)


def _bits(w: torch.Tensor) -> torch.Tensor:
    """The bf16 patterns of ``w`` (fp32: rounded to nearest even; bf16: as is) as int32 0..65535."""
    b = w if w.dtype == torch.bfloat16 else w.to(torch.bfloat16)
    return b.view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 patterns 0..65535 -> a bf16 tensor."""
    return bits.to(torch.int16).view(
        torch.bfloat16
    )  # (the int32 -> int16 cast keeps the low 16 bits)


class Bf16StepsCodec(Codec):
    name = "bf16_steps"
    lossy = True
    pull_only = True

    def bytes_per_element(self) -> float:
        return 1.0 + 2.0 * ESCAPE_SHARE

    def wire_bytes(self, numel: int) -> int:
        """Typical payload bytes: the codes, and :data:`ESCAPE_SHARE` of the elements escaping."""
        return numel + 2 * round(ESCAPE_SHARE * numel)

    def alloc_spec(self, numel: int) -> list[tuple[int, torch.dtype]]:
        return [(numel, torch.int8)]  # (the escapes' frame is sized by each reply)

    def encode(self, x, out=None, *, num_summands: int = 1) -> Encoded:
        raise ConfigError(
            "bf16_steps is a pull codec: the node encodes the steps from the last weights sent (encode_steps)"
        )

    def snapshot(self, weights: torch.Tensor) -> torch.Tensor:
        """The bf16 patterns of ``weights`` (1-D fp32) now, in per-thread scratch: the old bits of the next
        :meth:`encode_steps` on this thread."""
        self._check_input(weights)
        old = self._scratch("old", weights.numel(), torch.int16)
        lib = native.kernels()
        if lib is not None and weights.device.type == "cpu":
            lib.luwu_bf16_round(weights.data_ptr(), old.data_ptr(), weights.numel())
        else:
            old.view(torch.bfloat16).copy_(weights)
        return old

    def encode_steps(
        self, weights: torch.Tensor, old: torch.Tensor, out: torch.Tensor | None = None
    ) -> Encoded:
        """The steps from ``old`` (int16 bf16 patterns, e.g. :meth:`snapshot`) to the bf16 rounding of
        ``weights`` (1-D fp32). ``out``: the codes' frame (int8, numel), else a new one; the escapes' frame
        is new, sized by the count."""
        self._check_input(weights)
        n = weights.numel()
        if old.numel() != n or old.dtype != torch.int16:
            raise ValueError(
                f"old must be int16 bf16 patterns of {n} elements, got {old.dtype} {tuple(old.shape)}"
            )
        codes = out if out is not None else torch.empty(n, dtype=torch.int8)
        if codes.numel() != n or codes.dtype != torch.int8:
            raise ValueError(
                f"out must be int8 of {n} elements, got {codes.dtype} {tuple(codes.shape)}"
            )
        lib = native.kernels()
        if lib is not None and all(
            t.device.type == "cpu" and t.is_contiguous() for t in (weights, old, codes)
        ):
            esc = self._scratch("esc", n, torch.int16)
            k = lib.luwu_bf16_steps_encode(
                weights.data_ptr(), old.data_ptr(), codes.data_ptr(), esc.data_ptr(), n
            )
            return Encoded({"escapes": k}, [codes, esc[:k].clone()])
        parts = []
        for s, e in _chunks(n):
            nb = _bits(weights[s:e])
            ob = old[s:e].to(torch.int32) & 0xFFFF
            d = _ord(nb) - _ord(ob)
            esc = (
                (d < -127)
                | (d > 127)
                | ((nb & 0x7F80) == 0x7F80)
                | (((nb & 0x7FFF) == 0) & (nb != ob))
            )
            codes[s:e].copy_(torch.where(esc, ESCAPE, d))
            parts.append(nb[esc].to(torch.int16))
        escapes = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int16)
        return Encoded({"escapes": escapes.numel()}, [codes, escapes])

    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        _check_numel(self.name, numel)
        _check_meta(self.name, meta, {"escapes": int})
        k = meta["escapes"]
        if not 0 <= k <= numel:
            raise ProtocolError(f"codec {self.name!r}: meta 'escapes' = {k} is not in [0, {numel}]")
        _check_frames(self.name, frames, [numel, 2 * k])

    def decode_(self, out, frames, meta, alpha: float = 1.0) -> None:
        raise ProtocolError(
            f"codec {self.name!r} sends steps: it needs the weights it steps from (a delta reply)"
        )

    def decode_add_(
        self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        """Step ``acc`` (fp32 holding bf16 values, or bf16) to the new bf16 weights. The count of escape
        codes is checked against ``meta`` before anything is written."""
        if alpha != 1.0:
            raise ValueError(f"codec {self.name!r}: steps are not scaled (alpha = {alpha})")
        if acc.dtype not in (torch.float32, torch.bfloat16) or acc.dim() != 1:
            raise ValueError(
                f"codec {self.name!r} steps 1-D fp32 or bf16 weights, got {acc.dtype} {tuple(acc.shape)}"
            )
        codes, esc = (
            _as(frames[0], torch.int8),
            _as(frames[1], torch.int16) if len(frames) > 1 else None,
        )
        n, k = acc.numel(), int(meta["escapes"])
        if codes.numel() != n or (esc.numel() if esc is not None else 0) != k:
            raise ProtocolError(
                f"codec {self.name!r}: {codes.numel()} codes and {0 if esc is None else esc.numel()} escapes for {n} weights ({k} announced)"
            )
        lib = native.kernels()
        if lib is not None and acc.device.type == "cpu" and acc.is_contiguous():
            got = lib.luwu_bf16_steps_apply(
                acc.data_ptr(),
                int(acc.dtype == torch.bfloat16),
                codes.data_ptr(),
                esc.data_ptr() if k else 0,
                n,
                k,
            )
            if got != k:
                raise ProtocolError(
                    f"codec {self.name!r}: the codes hold another number of escapes than the {k} announced"
                )
            return
        if int((codes == ESCAPE).sum()) != k:
            raise ProtocolError(
                f"codec {self.name!r}: the codes hold another number of escapes than the {k} announced"
            )
        j = 0
        for s, e in _chunks(n, CHUNK):
            c = codes[s:e].to(device=acc.device, dtype=torch.int32)
            ob = _bits(acc[s:e])
            nb = torch.where(c == 0, ob, _unord(_ord(ob) + c))
            hit = c == ESCAPE
            m = int(hit.sum())
            if m:
                nb[hit] = esc[j : j + m].to(device=acc.device, dtype=torch.int32) & 0xFFFF
                j += m
            acc[s:e].copy_(_from_bits(nb))

    def decode_add_segments_(
        self, targets: list[torch.Tensor], frames: list[torch.Tensor], meta: dict
    ) -> bool:
        """:meth:`decode_add_` of a bucket whose elements are ``targets`` one after another (its
        parameters' slices: 1-D, contiguous, in host memory, fp32 or bf16), each stepped in place: no
        staging buffer gathered from them and scattered back. The counts are checked before anything
        is written. False, with nothing written, where the kernels cannot take them (then
        :meth:`decode_add_` on a staging buffer)."""
        lib = native.kernels()
        if lib is None or not all(
            t.device.type == "cpu"
            and t.dim() == 1
            and t.is_contiguous()
            and t.dtype in (torch.float32, torch.bfloat16)
            for t in targets
        ):
            return False
        codes = _as(frames[0], torch.int8)
        esc = _as(frames[1], torch.int16) if len(frames) > 1 else None
        n, k = sum(t.numel() for t in targets), int(meta["escapes"])
        if codes.numel() != n or (esc.numel() if esc is not None else 0) != k:
            raise ProtocolError(
                f"codec {self.name!r}: {codes.numel()} codes and {0 if esc is None else esc.numel()} escapes for {n} weights ({k} announced)"
            )
        at, counts = codes.data_ptr(), []
        for t in targets:  # (one pass over the codes: each segment's share of the escapes)
            counts.append(lib.luwu_bf16_steps_count(at, t.numel()))
            at += t.numel()
        if sum(counts) != k:
            raise ProtocolError(
                f"codec {self.name!r}: the codes hold another number of escapes than the {k} announced"
            )
        at, j = codes.data_ptr(), 0
        for t, m in zip(targets, counts):
            half = int(t.dtype == torch.bfloat16)
            lib.luwu_bf16_steps_apply(
                t.data_ptr(), half, at, esc.data_ptr() + 2 * j if m else 0, t.numel(), m
            )
            at, j = at + t.numel(), j + m
        return True

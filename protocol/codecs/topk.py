"""Top-k sparsification: the largest-magnitude fraction of the elements, as values + indices."""

from __future__ import annotations

import logging
import math

import torch

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

log = logging.getLogger(__name__)

#: Below this many elements (or above this density) top-k goes straight to torch.topk.
TOPK_DIRECT_NUMEL = 1 << 16
TOPK_DIRECT_DENSITY = 0.2
#: Sample size for the threshold estimate, and the candidate margin over k.
TOPK_SAMPLE = 1 << 14
TOPK_MARGIN = 1.5
#: Chunk of the candidate scan.
TOPK_CHUNK = CHUNK


def topk_indices(
    x: torch.Tensor, k: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
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
        if (
            isinstance(density, bool)
            or not isinstance(density, (int, float))
            or not (0.0 < density <= 1.0)
        ):
            raise ConfigError(f"codec 'topk': density must be in (0, 1], got {density!r}")
        if values not in _TOPK_VALUES:
            raise ConfigError(
                f"codec 'topk': values must be one of {sorted(_TOPK_VALUES)}, got {values!r}"
            )
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

    def _select(
        self, y: torch.Tensor, out: list[torch.Tensor] | None, num_summands: int
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        out = self._prepare(y, out, num_summands)
        idx = topk_indices(y, self.k_for(y.numel()), generator=self._generator())
        vals = y[idx]
        out[0].copy_(vals)
        out[1].copy_(idx)
        return out, idx

    def encode(
        self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1
    ) -> Encoded:
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
            raise ProtocolError(
                f"codec 'topk': meta 'values' = {meta['values']!r} is not one of {sorted(_TOPK_VALUES)}"
            )
        vsize = torch.empty((), dtype=_TOPK_VALUES[meta["values"]]).element_size()
        _check_frames(self.name, frames, [k * vsize, 4 * k])

    def check_payload(self, numel: int, frames: list[torch.Tensor], meta: dict) -> None:
        """The indices must land inside the bucket."""
        if int(meta["k"]) == 0:
            return
        lo, hi = torch.aminmax(_as(frames[1], torch.int32))
        if int(lo) < 0 or int(hi) >= numel:
            raise ProtocolError(
                f"codec 'topk': index out of range [0, {numel}): min {int(lo)}, max {int(hi)}"
            )

    def decode_add_(
        self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        k = int(meta["k"])
        if k == 0:
            return
        self.check_payload(acc.numel(), frames, meta)
        vals = _as(frames[0], _TOPK_VALUES[meta["values"]])
        idx = _as(frames[1], torch.int32)
        if vals.dtype != torch.float32:
            vals = vals.to(torch.float32)
        acc.index_add_(0, idx, vals, alpha=alpha)


_TOPK_VALUES = {"fp32": torch.float32, "bf16": torch.bfloat16}

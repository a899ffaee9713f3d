"""The codec contract: :class:`Codec`, :class:`Encoded`, and the checks every codec shares.

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

import math
import threading
from typing import Any, NamedTuple

import torch

from luwu.protocol.errors import ConfigError, ProtocolError

#: Elements per chunk on the chunked paths (2 MiB of fp32 scratch per thread): large enough that
#: the per-op Python overhead, paid once per chunk, stops showing (benchmarks/bench_codecs.py).
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


def copy_finite_(dst: torch.Tensor, src: torch.Tensor) -> bool | None:
    """``dst.copy_(src)``, and whether ``src`` is all finite, found as it is copied (None: not known,
    when the kernels cannot take the tensors: then a later :func:`has_nonfinite` decides). A gradient
    copied into its bucket this way spares the push a second pass over the bucket."""
    from luwu.protocol import native  # (native imports nothing of the codecs)

    lib = native.kernels()
    if (
        lib is None
        or dst.dtype != torch.float32
        or src.dtype != torch.float32
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not (dst.is_contiguous() and src.is_contiguous())
        or dst.shape != src.shape
    ):
        dst.copy_(src)
        return None
    return not lib.luwu_copy_nonfinite(dst.data_ptr(), src.data_ptr(), src.numel())


def _as(frame: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a received (uint8) or locally encoded frame as ``dtype``."""
    if frame.dtype == dtype:
        return frame
    if frame.dtype != torch.uint8:
        frame = frame.view(torch.uint8)
    return frame.view(dtype)


def to_device(frame: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received frame (host memory) on ``device``, to be widened there. To a GPU it goes through
    page-locked memory and asynchronously on the current stream: a pageable copy is staged by the
    driver at a fraction of the DMA rate (about 2 GB/s against tens on an H200 host), and torch's
    pinned allocator keeps the block until its copy is done, so the frame may be dropped at once."""
    if device.type != "cuda":
        return frame.to(device)
    return frame.pin_memory().to(device, non_blocking=True)


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
            raise ProtocolError(
                f"codec {codec!r}: meta {key!r} must be {typ}, got {type(val).__name__}"
            )


def _check_frames(codec: str, frames: list[int], expected: list[int]) -> None:
    if len(frames) != len(expected):
        raise ProtocolError(
            f"codec {codec!r}: expected {len(expected)} payload frame(s), got {len(frames)}"
        )
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
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in floats
    ) and all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.int8, torch.uint8)
        for t in codes
    )


def _chunks(n: int, chunk: int = CHUNK):
    for s in range(0, n, chunk):
        yield s, min(s + chunk, n)


class Codec:
    """Base class: one instance per (name, params), shared, stateless but for scratch."""

    name: str = ""
    lossy: bool = True
    sparse: bool = False
    """Sends a subset of the elements (and :meth:`clear_sent_` can tell which)."""
    pull_only: bool = False
    """Carries weights back to the workers only (steps from what they hold): never a gradient."""

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
    def encode(
        self, x: torch.Tensor, out: list[torch.Tensor] | None = None, *, num_summands: int = 1
    ) -> Encoded:
        """Encode 1-D contiguous fp32 ``x`` (left unchanged), into ``out`` when given.

        ``num_summands``: how many such payloads the receiver adds up (fp16
        scales for it). The frames may alias ``out`` (or, for ``none`` without
        ``out``, ``x``): keep them unchanged until sent.
        """
        raise NotImplementedError

    def validate(self, numel: int, frames: list[int], meta: dict) -> None:
        """Check meta and the frames' byte lengths for ``numel`` elements; raise ProtocolError."""
        raise NotImplementedError

    def decode_add_(
        self, acc: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        """``acc += alpha * decoded``; frames are (possibly read-only) uint8 views, never written."""
        raise NotImplementedError

    def check_payload(self, numel: int, frames: list[torch.Tensor], meta: dict) -> None:
        """Checks that need the payload itself (a sparse codec's indices), run when a push is received,
        before a node holds it undecoded; none for dense codecs."""

    def decode_(
        self, out: torch.Tensor, frames: list[torch.Tensor], meta: dict, alpha: float = 1.0
    ) -> None:
        """``out = alpha * decoded`` (a node folds the 1/n of the average into its decode)."""
        out.zero_()
        self.decode_add_(out, frames, meta, alpha)

    def decode_pair_(
        self,
        out: torch.Tensor,
        first: tuple[list[torch.Tensor], dict],
        second: tuple[list[torch.Tensor], dict],
        alpha: float,
    ) -> None:
        """``out = alpha * (decoded first + decoded second)``: two pushes of this codec, (frames, meta) each.
        Dense codecs do it in one pass over ``out`` instead of a write and a read-modify-write."""
        self.decode_(out, *first, alpha)
        self.decode_add_(out, *second, alpha)

    # -- error feedback ----------------------------------------------------
    def encode_feedback_(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        out: list[torch.Tensor] | None = None,
        *,
        num_summands: int = 1,
    ) -> Encoded:
        """Encode ``x + residual`` and leave in ``residual`` what was not sent.

        The generic path makes three passes over memory; codecs override it
        with a fused chunked one where they can.
        """
        residual.add_(x)
        enc = self.encode(residual, out, num_summands=num_summands)
        self.decode_add_(residual, enc.frames, enc.meta, alpha=-1.0)
        return enc

    def takes_bf16_residual(self, x: torch.Tensor) -> bool:
        """Whether :meth:`encode_feedback_` takes a bf16 ``residual`` for this ``x`` in one fused pass
        (else the caller widens it to fp32 around the call)."""
        return False

    def takes_pieces(self) -> bool:
        """Whether ``encode_pieces_`` encodes (blockwise codecs, with the kernels): input in pieces,
        read where they are, not copied together first."""
        return False

    def clear_sent_(self, t: torch.Tensor, enc: Encoded) -> None:
        """Zero the elements of ``t`` that ``enc`` (this codec's own encode) carried: sparse codecs only."""
        raise ConfigError(
            f"codec {self.name!r} is dense: every element is sent, so none is cleared alone"
        )

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

    def _prepare(
        self, x: torch.Tensor, out: list[torch.Tensor] | None, num_summands: int
    ) -> list[torch.Tensor]:
        """Check an encode's arguments; ``out``, or new frames when it is None."""
        self._check_input(x)
        _check_summands(num_summands)
        if out is None:
            return self.alloc(x.numel())
        self._check_out(out, x.numel())
        return out

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 1 or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(
                f"codec {self.name!r} encodes 1-D contiguous fp32 tensors, got {x.dtype} {tuple(x.shape)}"
            )

    def _check_out(self, out: list[torch.Tensor], numel: int) -> None:
        want = self.alloc_spec(numel)
        if len(out) != len(want) or any(
            o.numel() != n or o.dtype != d for o, (n, d) in zip(out, want)
        ):
            raise ValueError(f"codec {self.name!r}: out buffers do not match alloc({numel})")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


def _amax(x: torch.Tensor) -> float:
    """Largest magnitude (NaN if any NaN), in one pass without a temporary."""
    if x.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(x)
    lo, hi = lo.item(), hi.item()
    if math.isnan(lo) or math.isnan(hi):
        return math.nan
    return max(-lo, hi)

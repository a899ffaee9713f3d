"""Error feedback: what a lossy codec did not send is added to the next message.

Two directions use it:

* push (worker -> node): :class:`ErrorFeedback` keeps one residual per
  bucket (fp32, or bf16 with ``compression.residual_dtype``); each step sends ``codec(grad + residual)`` and keeps
  ``(grad + residual) - decoded``. Compression error then only delays part of a
  gradient instead of losing it, which is what keeps int8 / int4 / top-k
  training on the uncompressed loss curve.
* pull (node -> workers): :class:`DeltaEncoder` sends int8 deltas of the
  weights against a *shadow* copy of what the workers hold. The node updates
  its shadow with the very decode the workers run, so shadow and worker copy
  stay bit-identical; ``weights - shadow`` is the error not yet sent and goes
  out with the next delta (error feedback by construction). A full fp32
  resync every ``resync_every`` steps bounds the damage of anything missed.
  Workers apply a reply with :func:`apply_pull_`.

**Momentum correction** (Lin et al. 2018, Deep Gradient Compression), for
sparse codecs (top-k): the worker folds each gradient into a velocity of its
own, ``u = beta * u + alpha * g`` with the optimizer's momentum
(:func:`worker_momentum`), accumulates ``u`` (not ``g``) in the residual,
sends the top-k of it and clears the velocity of what it sent (momentum factor
masking). The push then says so: its ``hyper`` carries
``worker_momentum = density``, and the node uses the sum as the momentum
term and drops its own (switch_nodes/optimizers.py): the momentum restarts
at the first compressed step, where the velocities start at zero. An
element held back for T steps then arrives with the momentum it would have
built in those T steps, instead of as a raw gradient sum that the node's
momentum spreads over the steps after it arrives.
"""

from __future__ import annotations

import logging
import threading
from typing import Hashable, NamedTuple

import torch

from luwu.protocol.codecs import Codec, Encoded, get_codec, has_nonfinite
from luwu.protocol.errors import ConfigError

log = logging.getLogger(__name__)


#: Push ``hyper`` key of a momentum-corrected bucket: the top-k density (a float in (0, 1]).
WORKER_MOMENTUM = "worker_momentum"


def worker_momentum(optimizer: str, hyper: dict) -> tuple[float, float]:
    """``(beta, alpha)`` of the velocity ``u = beta * u + alpha * g`` that matches the node's momentum:
    Adam's ``exp_avg`` (``betas[0]``, ``1 - betas[0]``) or SGD's buffer (``momentum``, ``1 - dampening``)."""
    if optimizer in ("adam", "adamw"):
        b1 = float(hyper["betas"][0])
        return b1, 1.0 - b1
    if optimizer == "sgd":
        return float(hyper["momentum"]), 1.0 - float(hyper["dampening"])
    raise ConfigError(f"momentum correction: optimizer {optimizer!r} has no momentum to correct")


class ErrorFeedback:
    """Residuals per key (e.g. bucket id), allocated once and reused; velocities too, with momentum correction.

    ``dtype``: the residuals' storage. fp32, or bf16 at half the memory (``compression.residual_dtype``):
    the int8 and int4 kernels read a bf16 residual and round it back in the same pass as the encode
    (:meth:`Codec.takes_bf16_residual`); for the other codecs, or without the kernels, it is widened
    into one fp32 scratch buffer shared by all keys and rounded back after. The bits are the same
    either way; what the rounding drops (2^-9 of the residual) is lost, not fed back."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"an error-feedback residual is float32 or bfloat16, not {dtype}")
        self.dtype = dtype
        self._res: dict[Hashable, torch.Tensor] = {}
        self._vel: dict[Hashable, torch.Tensor] = {}
        self._dirty: set[Hashable] = set()
        self._wide = torch.empty(0)  # bf16 residuals: the fp32 scratch they are widened into
        self._wide_lock = threading.Lock()  # (hooks of several autograd threads may encode at once)

    def residual(self, key: Hashable) -> torch.Tensor | None:
        return self._res.get(key)

    def _residual(self, key: Hashable, numel: int) -> torch.Tensor:
        r = self._res.get(key)
        if r is None or r.numel() != numel:
            if r is not None:
                log.warning(
                    "residual of %r resized from %d to %d elements: dropped", key, r.numel(), numel
                )
            r = self._res[key] = torch.zeros(numel, dtype=self.dtype)
        return r

    def _with_fp32(self, r: torch.Tensor, encode) -> Encoded:
        """``encode(r32)`` on the residual as fp32: ``r`` itself, or (bf16) widened into the scratch and
        rounded back into ``r`` after."""
        if r.dtype == torch.float32:
            return encode(r)
        with self._wide_lock:
            if self._wide.numel() < r.numel():
                self._wide = torch.empty(r.numel(), dtype=torch.float32)
            wide = self._wide[: r.numel()]
            wide.copy_(r)
            enc = encode(wide)
            r.copy_(wide)
            return enc

    def encode(
        self,
        key: Hashable,
        codec: Codec,
        x: torch.Tensor,
        out: list[torch.Tensor] | None = None,
        num_summands: int = 1,
        *,
        nonfinite: bool | None = None,
        momentum: tuple[float, float] | None = None,
    ) -> Encoded:
        """Encode ``x + residual[key]`` and keep what was not sent.

        ``momentum = (beta, alpha)``: momentum correction (sparse codecs
        only): encode ``velocity + residual`` with ``velocity = beta *
        velocity + alpha * x``, and clear the velocity of the elements sent.

        ``nonfinite``: whether ``x`` holds NaN/inf, if the caller already
        knows (else it is checked here, one cheap pass). A non-finite ``x`` is
        encoded as is and the residual is left untouched: that step is skipped
        by every node (found-inf), and a NaN residual would poison every later
        step.
        """
        if nonfinite is None:
            nonfinite = has_nonfinite(x)
        if nonfinite:
            return codec.encode(x, out, num_summands=num_summands)
        if not codec.lossy:
            if key not in self._dirty:
                return codec.encode(x, out, num_summands=num_summands)
            # flush the residual left by an earlier lossy codec
            r = self._res[key]
            if out is None:
                out = codec.alloc(x.numel())  # the frame must not alias r (or the scratch)
            enc = self._with_fp32(
                r, lambda r32: codec.encode(r32.add_(x), out, num_summands=num_summands)
            )
            r.zero_()
            self._dirty.discard(key)
            self._vel.pop(key, None)
            return enc
        r = self._residual(key, x.numel())
        self._dirty.add(key)
        if momentum is None:
            self._vel.pop(key, None)
            if r.dtype == torch.bfloat16 and codec.takes_bf16_residual(x):  # one fused pass
                return codec.encode_feedback_(x, r, out, num_summands=num_summands)
            return self._with_fp32(
                r, lambda r32: codec.encode_feedback_(x, r32, out, num_summands=num_summands)
            )
        if not codec.sparse:
            raise ConfigError(
                f"momentum correction needs a sparse codec (top-k), not {codec.name!r}"
            )
        u = self._vel.get(key)
        if u is None or u.numel() != x.numel():
            u = self._vel[key] = torch.zeros(x.numel(), dtype=torch.float32)
        beta, alpha = momentum
        u.mul_(beta).add_(x, alpha=alpha)
        enc = self._with_fp32(
            r, lambda r32: codec.encode_feedback_(u, r32, out, num_summands=num_summands)
        )
        codec.clear_sent_(
            u, enc
        )  # momentum factor masking: what was sent carries its momentum with it
        return enc

    def reset(self, key: Hashable | None = None) -> None:
        """Forget residuals (all, or one key): after a rollback, or a layout change."""
        if key is None:
            self._res.clear()
            self._vel.clear()
            self._dirty.clear()
        else:
            self._res.pop(key, None)
            self._vel.pop(key, None)
            self._dirty.discard(key)

    def velocity(self, key: Hashable) -> torch.Tensor | None:
        return self._vel.get(key)

    @property
    def nbytes(self) -> int:
        return (
            sum(t.numel() * t.element_size() for d in (self._res, self._vel) for t in d.values())
            + self._wide.numel() * 4
        )


class PullEncoded(NamedTuple):
    """A pull-direction payload: which codec, whether it is a delta, and the payload."""

    codec: str
    delta: bool
    """True: add to the worker's copy; False: replace it (full resync)."""
    encoded: Encoded


class DeltaEncoder:
    """Node side of the int8-delta pull direction (one shadow per key).

    Every worker that receives the same replies holds the same copy, so one
    shadow per bucket serves them all. A worker that missed a reply, or a
    worker that just joined, needs :meth:`force_resync`.
    """

    def __init__(
        self, codec: str = "int8", *, resync_every: int = 50, full_codec: str = "none", **params
    ) -> None:
        if isinstance(resync_every, bool) or not isinstance(resync_every, int) or resync_every < 1:
            raise ConfigError(f"resync_every must be an int >= 1, got {resync_every!r}")
        self.codec = get_codec(codec, **params)
        self.full = get_codec(full_codec)
        if self.full.lossy:
            raise ConfigError(
                f"full_codec must be lossless (a resync is exact), got {full_codec!r}"
            )
        self.resync_every = resync_every
        self._shadow: dict[Hashable, torch.Tensor] = {}
        self._out: dict[Hashable, list[torch.Tensor]] = {}
        self._last_full: dict[Hashable, int] = {}
        self._local = threading.local()

    def force_resync(self, key: Hashable | None = None) -> None:
        """Send full weights next time (one key, or all)."""
        if key is None:
            self._last_full.clear()
        else:
            self._last_full.pop(key, None)

    def shadow(self, key: Hashable) -> torch.Tensor | None:
        """What the workers hold for ``key`` (after the last encode)."""
        return self._shadow.get(key)

    def encode(
        self,
        key: Hashable,
        weights: torch.Tensor,
        step: int,
        *,
        out: list[torch.Tensor] | None = None,
        full_out: list[torch.Tensor] | None = None,
    ) -> PullEncoded:
        """The reply payload for ``weights`` at ``step``.

        ``out`` (from ``self.codec.alloc``) and ``full_out`` (from
        ``self.full.alloc``) are where delta and full frames go, e.g. buffers
        by step parity that the caller reuses once their send completed.
        Without them the frames are this encoder's own (a full frame is the
        shadow itself) and stay valid only until the next ``encode`` for the
        same key.
        """
        n = weights.numel()
        shadow = self._shadow.get(key)
        last = self._last_full.get(key)
        if shadow is None or shadow.numel() != n:
            shadow = self._shadow[key] = torch.empty(n, dtype=torch.float32)
            self._out.pop(key, None)
            last = None
        if (
            last is None
            or step - last >= self.resync_every
            or step < last
            or has_nonfinite(weights)
        ):
            shadow.copy_(weights)
            self._last_full[key] = step
            # without full_out the shadow is the frame: no second full-size buffer
            return PullEncoded(self.full.name, False, self.full.encode(shadow, full_out))
        delta = self._delta(n)
        torch.sub(weights, shadow, out=delta)
        if out is None:
            out = self._out.get(key)
            if out is None:
                out = self._out[key] = self.codec.alloc(n)
        enc = self.codec.encode(delta, out)
        # the exact decode the workers run: shadow stays bit-identical to their copy
        self.codec.decode_add_(shadow, enc.frames, enc.meta)
        return PullEncoded(self.codec.name, True, enc)

    def _delta(self, n: int) -> torch.Tensor:
        buf = getattr(self._local, "delta", None)
        if buf is None or buf.numel() < n:
            buf = self._local.delta = torch.empty(n, dtype=torch.float32)
        return buf[:n]

    def reset(self) -> None:
        self._shadow.clear()
        self._out.clear()
        self._last_full.clear()


def apply_pull_(
    weights: torch.Tensor, codec: str, delta: bool, frames: list[torch.Tensor], meta: dict
) -> None:
    """Worker side: update the persistent fp32 copy ``weights`` from a reply.

    Call ``get_codec(codec).validate(...)`` on the frame lengths first.
    """
    c = get_codec(codec)
    if delta:
        c.decode_add_(weights, frames, meta)
    else:
        c.decode_(weights, frames, meta)

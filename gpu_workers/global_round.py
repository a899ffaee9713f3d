"""The two-phase step: global-norm clipping and AMP's overflow decision, made alike on every worker.

With ``two_phase`` pushes the nodes sum a (step, bucket) and answer its squared norm (NORM) instead
of stepping. Each worker gathers every bucket's, computes the norm of the averaged gradient, decides
the skip (a non-finite gradient anywhere) and the coefficient (the GradScaler's inverse scale times
torch's clip coefficient), and sends it to the nodes (COMMIT), which step with it. Every worker sums
the same numbers in the same order, so they all send the same coefficient.
"""

from __future__ import annotations

import math
import time

import torch

from luwu.gpu_workers.channel import Reply
from luwu.protocol.messages import Op


def run(
    client,
    norms: list[Reply],
    node_buckets: list[list[int]],
    step: int,
    inv_scale: float,
    max_norm: float | None,
) -> tuple[bool, float, float]:
    """Gather the partial norms of ``step`` (``norms``: the futures of every bucket's NORM, in
    bucket order), decide skip / coefficient and COMMIT. Returns (skipped, grad norm of the
    unscaled averaged gradient, seconds waited for the norms)."""
    t0 = time.perf_counter()
    for _ in client.arrivals(norms, what="gradient norm"):
        pass
    msgs = [r.msg for r in norms]
    waited = time.perf_counter() - t0
    sq = math.fsum(m.header["sqnorm"] for m in msgs)
    nonfinite = any(m.header["nonfinite"] for m in msgs)
    norm = math.sqrt(sq) * inv_scale if not nonfinite else float("inf")
    coef = inv_scale
    if max_norm is not None and not nonfinite:
        # torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (norm + 1e-6), clamped to 1
        t = torch.tensor(max_norm, dtype=torch.float32) / (
            torch.tensor(norm, dtype=torch.float32) + 1e-6
        )
        coef = inv_scale * float(torch.clamp(t, max=1.0))
    for n, bids in enumerate(node_buckets):
        if bids:
            client.send(
                n,
                {
                    "op": Op.COMMIT,
                    "step": step,
                    "coef": float(coef),
                    "skip": nonfinite,
                    "buckets": bids,
                },
            )
    return nonfinite, norm, waited

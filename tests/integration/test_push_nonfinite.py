"""A non-finite gradient under int8 with error feedback, through the real worker and node: the copy into
the bucket finds the NaN (no second pass over the bucket), the push goes uncompressed, the step is
skipped (the two-phase round of clipping sees the non-finite norm), and the worker's residual is left
as it was (a NaN in it would poison every later step); the steps before and after train."""

import pytest
import torch

import luwu
from luwu.protocol.policy import CompressionConfig


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[5] = float("nan")
    return grad


@pytest.mark.timeout(60)
def test_a_nonfinite_gradient_goes_whole_and_leaves_the_residual(cluster1):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64) * 0.1)
    # one 64x64 matrix, "large" at this small_numel, in a bucket of its own: int8 with error feedback
    # from the first step, the weights back fp32
    cfg = CompressionConfig(
        large_codec="int8", warmup_steps=0, small_numel=1024, link_gbps=1.0, pull_codec="none"
    )
    opt = luwu.RemoteOptimizer(
        [w],
        "adamw",
        nodes=cluster1.addresses,
        lr=0.01,
        compression=cfg,
        bucket_bytes=64 * 64 * 4,
        max_grad_norm=100.0,  # (above the gradients' norm: clips nothing, skips a non-finite step)
    )
    g = torch.Generator().manual_seed(5)
    try:
        ef = opt.worker.encoder.feedback
        for t in range(5):
            x = torch.randn(32, 64, generator=g)
            opt.zero_grad()
            hook = w.register_hook(_poison) if t == 2 else None  # before the gradient hook pushes
            (x @ w.t()).tanh().pow(2).mean().backward()
            if hook is not None:
                hook.remove()
            residual = None if ef.residual(0) is None else ef.residual(0).clone()
            weights = w.detach().clone()
            opt.step()
            opt.synchronize()
            if t == 2:
                assert torch.equal(w.detach(), weights), "a NaN gradient was stepped on"
                assert torch.equal(ef.residual(0), residual), "the residual took the NaN step"
            else:
                assert not torch.equal(w.detach(), weights)
            assert torch.isfinite(w).all() and torch.isfinite(ef.residual(0).float()).all()
    finally:
        opt.close()

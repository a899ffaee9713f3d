"""CUDA workers: a model on a GPU trains through real nodes as it does on the CPU, and the prefetcher's
pinned side-stream copies deliver the loader's batches unchanged.

These run where ``torch.cuda.is_available()`` (a GPU machine); elsewhere they are skipped, and the CPU
suite covers the same code paths with CPU tensors.
"""

import pytest
import torch

from luwu import RemoteOptimizer
from luwu.gpu_workers.prefetch import Prefetcher

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)) for _ in range(3)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(64, 5)).cuda()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(n)]


def _train(model: torch.nn.Module, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_cuda_model_through_nodes_equals_local_adamw_on_cuda(cluster2, stream):
    data = _batches(6)
    ref = _model()
    want_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    model = _model()
    opt = RemoteOptimizer(model if stream else model.parameters(), nodes=cluster2.addresses, job=cluster2.job, lr=1e-3, compression=False, stream_weights=stream)
    try:
        losses = _train(model, opt, data)
        got = opt.model_state_dict() if stream else model.state_dict()
    finally:
        opt.close()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(got[name].to(w.device), w, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.timeout(60)
def test_prefetcher_copies_pinned_batches_to_cuda_on_a_side_stream():
    batches = [(torch.full((256, 256), float(i)), torch.arange(i, i + 4)) for i in range(12)]
    seen = []
    with Prefetcher(batches, device="cuda", depth=3) as pf:
        for x, y in pf:
            assert x.is_cuda and y.is_cuda
            # The consumer's stream reads the batch while the next copies run on the side stream.
            seen.append((x * 2).sum().item() / 2 / x.numel())
    assert seen == [float(i) for i in range(12)]

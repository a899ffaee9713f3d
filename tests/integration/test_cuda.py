"""CUDA workers: a model on a GPU trains through real nodes as it does on the CPU, and the prefetcher's
pinned side-stream copies deliver the loader's batches unchanged.

These run where ``torch.cuda.is_available()`` (a GPU machine); elsewhere they are skipped, and the CPU
suite covers the same code paths with CPU tensors.
"""

import contextlib

import pytest
import torch

from luwu import RemoteOptimizer
from luwu.gpu_workers.prefetch import Prefetcher

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64))
        for _ in range(3)
    ]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(64, 5)).cuda()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 64, generator=g), torch.randint(0, 5, (16,), generator=g))
        for _ in range(n)
    ]


def _train(model: torch.nn.Module, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _assert_same_weights(got: dict, ref: torch.nn.Module, rtol: float, atol: float) -> None:
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(
            got[name].to(w.device), w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_cuda_model_through_nodes_equals_local_adamw_on_cuda(cluster2, stream):
    data = _batches(6)
    ref = _model()
    want_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    model = _model()
    opt = RemoteOptimizer(
        model if stream else model.parameters(),
        nodes=cluster2.addresses,
        job=cluster2.job,
        lr=1e-3,
        compression=False,
        stream_weights=stream,
    )
    try:
        losses = _train(model, opt, data)
        got = opt.model_state_dict() if stream else model.state_dict()
    finally:
        opt.close()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    _assert_same_weights(got, ref, rtol=1e-5, atol=1e-6)


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


def _lockstep(
    ref, local, model, opt, batches, *, amp: bool = False, clip: float | None = None
) -> None:
    """Train ``ref`` with the local optimizer and ``model`` with LuWu on the same batches, each optionally
    under fp16 autocast with its own GradScaler (``amp``) and torch's global-norm clipping (``clip``)."""
    scalers = (
        [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in range(2)]
        if amp
        else [None, None]
    )
    for x, y in batches:
        for net, o, scaler, remote in (
            (ref, local, scalers[0], False),
            (model, opt, scalers[1], True),
        ):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = torch.nn.functional.cross_entropy(net(x.cuda()), y.cuda())
            (scaler.scale(loss) if amp else loss).backward()
            if clip is not None and not remote:
                if amp:
                    scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            if amp:
                scaler.step(o)
                scaler.update()
            else:
                o.step()
    if amp:
        assert scalers[0].get_scale() == scalers[1].get_scale()


@pytest.mark.timeout(180)
def test_cuda_amp_and_clipping_equal_local_torch(cluster2):
    """fp16 autocast with a GradScaler, and global-norm clipping by the nodes (``max_grad_norm``), on a CUDA
    model: the weights follow local torch (clip_grad_norm_ + AdamW) step for step."""
    data = _batches(6)
    ref, model = _model(), _model()
    local = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = RemoteOptimizer(
        model.parameters(),
        nodes=cluster2.addresses,
        job=cluster2.job,
        lr=1e-3,
        compression=False,
        amp=True,
        max_grad_norm=0.5,
    )
    try:
        _lockstep(ref, local, model, opt, data, amp=True, clip=0.5)
        got = model.state_dict()
    finally:
        opt.close()
    _assert_same_weights(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_cuda_model_on_default_compression_trains_like_local_adamw(cluster2, stream):
    """The defaults (bf16 / int8 codecs, gradients in buckets, per-layer waits) with a CUDA model: gradients
    stay on the GPU, the replies are written into CUDA parameters, and the loss follows local AdamW."""
    data = _batches(4) * 5  # seen five times: the loss falls
    ref, model = _model(), _model()
    local = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = RemoteOptimizer(
        model if stream else model.parameters(),
        nodes=cluster2.addresses,
        job=cluster2.job,
        lr=3e-3,
        stream_weights=stream,
    )
    try:
        want = _train(ref, local, data)
        got = _train(model, opt, data)
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        assert all(p.grad is None or p.grad.is_cuda for p in model.parameters())
    finally:
        opt.close()
    assert got[-1] < got[0] * 0.9
    assert got[-1] == pytest.approx(want[-1], rel=0.05)


@pytest.mark.timeout(180)
def test_cuda_bf16_model_trains_through_nodes(cluster2):
    """A bf16 model on the GPU (ZeRO-Offload's layout): bf16 gradients pushed from the device, fp32 masters on
    the nodes, the worker's weights their bf16 rounding after each step."""
    data = _batches(6)
    model = _model().to(torch.bfloat16)
    shadow = [p.detach().float().clone() for p in model.parameters()]
    local = torch.optim.AdamW(shadow, lr=1e-3)
    opt = RemoteOptimizer(
        model.parameters(), nodes=cluster2.addresses, job=cluster2.job, lr=1e-3, compression=False
    )
    try:
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(
                model(x.cuda().bfloat16()).float(), y.cuda()
            ).backward()
            for p, s in zip(model.parameters(), shadow):
                assert p.grad.dtype == torch.bfloat16 and p.grad.is_cuda
                s.grad = p.grad.float()
            opt.step()
            local.step()
        opt.synchronize()
        for p, s in zip(model.parameters(), shadow):
            assert p.dtype == torch.bfloat16 and p.is_cuda
            torch.testing.assert_close(p.detach().float(), s.bfloat16().float(), rtol=0, atol=1e-2)
    finally:
        opt.close()


@pytest.mark.timeout(180)
def test_cuda_no_sync_accumulation_equals_local(cluster2):
    """Gradient accumulation over micro-batches with ``no_sync()`` on a CUDA model equals local torch summing
    the same micro-batch gradients."""
    data = _batches(8)
    ref, model = _model(), _model()
    local = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = RemoteOptimizer(
        model.parameters(), nodes=cluster2.addresses, job=cluster2.job, lr=1e-3, compression=False
    )
    try:
        for i in range(0, len(data), 2):
            for net, o, remote in ((ref, local, False), (model, opt, True)):
                o.zero_grad()
                for j, (x, y) in enumerate(data[i : i + 2]):
                    ctx = opt.no_sync() if remote and j == 0 else contextlib.nullcontext()
                    with ctx:
                        torch.nn.functional.cross_entropy(net(x.cuda()), y.cuda()).backward()
                o.step()
        got = model.state_dict()
    finally:
        opt.close()
    _assert_same_weights(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
def test_decoding_into_a_cuda_tensor_gives_the_cpu_bits(name):
    """A reply decoded into a CUDA parameter crosses to the device as it travelled (int8 / int4 codes and their
    scales, bf16) and is widened there: the same bits as decoding on the CPU, for a tail block too."""
    from luwu.protocol.codecs import get_codec

    codec = get_codec(name)
    x = torch.randn(10_000 + 77, generator=torch.Generator().manual_seed(0))
    enc = codec.encode(x)
    frames = [f.clone() for f in enc.frames]
    want = torch.empty_like(x)
    codec.decode_(want, frames, enc.meta, alpha=0.5)
    got = torch.empty_like(x, device="cuda")
    codec.decode_(got, frames, enc.meta, alpha=0.5)
    assert torch.equal(got.cpu(), want)
    acc = torch.ones_like(x)
    codec.decode_add_(acc, frames, enc.meta)
    acc_cuda = torch.ones_like(x, device="cuda")
    codec.decode_add_(acc_cuda, frames, enc.meta)
    torch.testing.assert_close(acc_cuda.cpu(), acc, rtol=0, atol=1e-6)

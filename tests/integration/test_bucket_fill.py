"""How a bucket's gradient gathers (gpu_workers/bucket_fill.py), through real nodes. A resident
bucket copies, even under int8 with error feedback in a bf16 residual (the defaults once
compression starts): every ``.grad`` that fills a segment is the bucket's view, so autograd's tensor
was freed at the copy, and no push was encoded from held gradients. A streamed bucket's int8 push
(no error feedback, the codes in the bucket's borrowed buffer) is encoded from the gradients where
they are, and trains as copying them did: the same losses and final weights."""

from __future__ import annotations

import pytest
import torch

import luwu
from luwu.gpu_workers.encoding import GradientEncoder
from luwu.protocol.policy import CompressionConfig

STEPS = 5


def _patch(monkeypatch, hold: bool) -> list:
    """Copy into the buckets instead of holding (``hold`` False); the list of the encodes from held
    gradients, (step, bucket, streamed, codec name or None when it could not) each."""
    if not hold:
        monkeypatch.setattr(GradientEncoder, "takes_pieces", lambda self, b, step: False)
    encoded = []
    real = GradientEncoder.encode_pieces

    def counted(self, b, pieces, step, hyper, x):
        got = real(self, b, pieces, step, hyper, x)
        encoded.append((step, b.id, b.id in self.streamed, got and got[0]))
        return got

    monkeypatch.setattr(GradientEncoder, "encode_pieces", counted)
    return encoded


@pytest.mark.timeout(60)
def test_a_resident_bucket_copies_its_gradients_under_error_feedback(cluster1, monkeypatch):
    """After the bf16 warm-up and under int8 with error feedback alike, ``.grad`` is the bucket's
    view (autograd's tensor freed at the copy: holding it cost heap left resident), the pushes
    compress, and none was encoded from held gradients."""
    encoded = _patch(monkeypatch, True)
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 256, bias=False)  # 32768 parameters: 4 buckets
    cfg = CompressionConfig(
        large_codec="int8", warmup_steps=2, small_numel=16, link_gbps=1.0, pull_codec="none"
    )
    opt = luwu.RemoteOptimizer(
        lin, nodes=cluster1.addresses, lr=0.01, compression=cfg, bucket_bytes=32 << 10
    )
    try:
        flat = opt.worker.flat_grads[torch.float32]
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
        for step in range(4):
            opt.zero_grad()
            lin(x).square().mean().backward()
            ptr = lin.weight.grad.untyped_storage().data_ptr()
            assert ptr == flat.untyped_storage().data_ptr(), step
            assert torch.equal(flat[: lin.weight.numel()], lin.weight.grad.reshape(-1))
            opt.step()
            opt.synchronize()
        ef = opt.worker.encoder.feedback
        assert all(ef.residual(b.id) is not None for b in opt.worker.layout.buckets)  # int8 ran
    finally:
        opt.close()
    assert encoded == []


def _train_streaming(hold: bool, monkeypatch) -> tuple[list[float], dict, list]:
    from workers.stream import make_model

    encoded = _patch(monkeypatch, hold)
    model = make_model({"seed": 0, "blocks": 3, "width": 32})
    cfg = CompressionConfig(
        large_codec="int8", warmup_steps=0, small_numel=16, link_gbps=1.0, pull_codec="none"
    )
    losses = []
    with luwu.local_cluster(1) as cluster:
        opt = luwu.RemoteOptimizer(
            model,
            nodes=cluster.addresses,
            lr=0.01,
            compression=cfg,
            stream_weights=True,
            bucket_bytes=2048,
            rank=0,
            world_size=1,
        )
        try:
            g = torch.Generator().manual_seed(4)
            for _ in range(STEPS):
                opt.zero_grad()
                loss = model(torch.randn(8, 20, generator=g)).square().mean()
                loss.backward()
                losses.append(loss.item())
                opt.step()
            state = {k: v.clone() for k, v in opt.model_state_dict().items()}
        finally:
            opt.close()
    monkeypatch.undo()
    return losses, state, encoded


@pytest.mark.timeout(120)
def test_a_streamed_push_from_the_held_gradients_trains_as_the_copy(monkeypatch):
    (losses, state, encoded), (losses2, state2, encoded2) = (
        _train_streaming(True, monkeypatch),
        _train_streaming(False, monkeypatch),
    )
    assert "int8" in {name for _, _, streamed, name in encoded if streamed}, encoded
    assert encoded2 == []
    assert losses == losses2 and losses[0] != losses[-1]
    assert state.keys() == state2.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state)

"""A compressed push encoded straight from the gradients where they are (gpu_workers/bucket_fill.py):
through real nodes, int8 with error feedback in a bf16 residual (the defaults once compression
starts), buckets that pack several parameters and parameters split over buckets, with blocks that
span two parameters. Holding the gradients trains bit for bit as copying them into the buckets did:
the same weights, residuals and ``.grad`` values every step; every push was encoded from the held
gradients, and each parameter kept autograd's own ``.grad``. In streaming mode too (int8 without
error feedback, the codes in the bucket's borrowed buffer): the same losses and final weights."""

from __future__ import annotations

import pytest
import torch

import luwu
from luwu.gpu_workers.encoding import GradientEncoder
from luwu.protocol.policy import CompressionConfig

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    # matrices alone (a bias goes bf16, and its bucket with it): 37 * 53, 53 * 29 and 29 * 11
    # parameters, none a multiple of the int8 block (256)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 53, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(53, 29, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(29, 11, bias=False),
    )


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


def _train(hold: bool, monkeypatch) -> dict:
    encoded = _patch(monkeypatch, hold)
    model = _model()
    cfg = CompressionConfig(
        large_codec="int8", warmup_steps=0, small_numel=16, link_gbps=1.0, pull_codec="none"
    )
    grads, weights = [], []
    with luwu.local_cluster(2) as cluster:
        # 3000 B buckets: 750 parameters each, filled from the last layer's weight: buckets of two
        # weights, with blocks of int8 that span both, and the first weight over three buckets
        opt = luwu.RemoteOptimizer(
            model, nodes=cluster.addresses, lr=0.01, compression=cfg, bucket_bytes=3000
        )
        try:
            buckets = len(opt.worker.layout.buckets)
            x = torch.randn(16, 37, generator=torch.Generator().manual_seed(7))
            for step in range(STEPS):
                opt.zero_grad()
                model(x * (1 + step)).square().mean().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                if hold:  # autograd's tensor stays the gradient: the bucket was not written
                    flat = opt.worker.flat_grads[torch.float32].untyped_storage().data_ptr()
                    assert all(
                        p.grad.untyped_storage().data_ptr() != flat for p in model.parameters()
                    )
                opt.step()
                opt.synchronize()
                weights.append([p.detach().clone() for p in model.parameters()])
            ef = opt.worker.encoder.feedback
            residuals = [ef.residual(b.id) for b in opt.worker.layout.buckets[:5]]
        finally:
            opt.close()
    monkeypatch.undo()
    return dict(grads=grads, weights=weights, residuals=residuals, encoded=encoded, buckets=buckets)


@pytest.mark.timeout(120)
def test_holding_the_gradients_trains_bit_for_bit_as_copying_them(monkeypatch):
    held, copied = _train(True, monkeypatch), _train(False, monkeypatch)
    # 6 buckets, the last too small to pay for int8 (fp32): every other push from what it held
    assert held["buckets"] == 6
    assert len(held["encoded"]) == STEPS * 5
    assert all(name == "int8" for *_, name in held["encoded"])
    assert copied["encoded"] == []
    for name in ("grads", "weights"):
        for a, b in zip(held[name], copied[name], strict=True):
            assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), name
    assert all(
        torch.equal(u.view(torch.int16), v.view(torch.int16))
        for u, v in zip(held["residuals"], copied["residuals"], strict=True)
    )
    assert not torch.equal(held["weights"][0][0], held["weights"][-1][0])  # it trained


@pytest.mark.timeout(60)
def test_the_buffer_of_a_bucket_that_holds_is_given_back(cluster1):
    """After the bf16 warm-up (copied into the buckets, ``.grad`` their views), the first int8 push
    that holds gives its bucket's pages back (they read as zeros) and autograd's tensor is the
    gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 256, bias=False)  # 32768 parameters: 4 buckets of 8 pages each
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
            view = lin.weight.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert view is (step < 2)  # the warm-up copies; int8 holds
            written = int(flat.count_nonzero())  # given back at the first push that holds, but
            assert (written > 30_000) is (step < 2), (step, written)  # a partial page at each end
            opt.step()
            opt.synchronize()
    finally:
        opt.close()


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

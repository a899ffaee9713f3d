"""``torch.compile`` on LuWu's defaults: resident (per-layer waits on) and streaming.

A tiny transformer (2 ``nn.TransformerEncoderLayer`` blocks, d_model 32, an lm head tied to the
embedding and read by the model's own forward, a positional parameter held by the model itself; the
attention reads its ``out_proj`` weight without calling it) trains 5 steps on real nodes, fp32 both
ways, compiled and in eager mode: the compiled run ends on the eager run's weights (to compiled
kernels' rounding), the eager run on local ``torch.optim.AdamW``'s (to the nodes' kernels' ulps). A
stale weight would be off by about the learning rate. The per-layer waits' hooks are graph breaks:
after the first steps nothing compiles again, and every reply owed after ``step()`` is written by
the next forward."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from harness import assert_params_close, tanh_mlp

import luwu

VOCAB, D, T, STEPS, LR = 64, 32, 8, 5, 1e-2


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Parameter(torch.randn(T, D) * 0.02)
        layer = {
            "d_model": D,
            "nhead": 2,
            "dim_feedforward": 2 * D,
            "dropout": 0.0,
            "batch_first": True,
            "bias": False,
        }
        self.blocks = torch.nn.ModuleList(
            [torch.nn.TransformerEncoderLayer(**layer) for _ in range(2)]
        )
        self.norm = torch.nn.LayerNorm(D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        # the head, tied: the model reads its child's weight
        return F.linear(self.norm(x), self.emb.weight)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(step))


def _loss(model, step: int) -> torch.Tensor:
    idx = _batch(step)
    return F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _train_torch() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _close(got: dict, want: dict, **tol) -> None:
    assert_params_close([got[n] for n in want], list(want.values()), **tol)


def _train_luwu(compiled: bool, **kw) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """Final weights and, per step, the graphs compiled so far and the replies ``step()`` left owed
    (on fresh nodes: a job's nodes hold its state); checks that each forward wrote what the step
    before still owed."""
    torch._dynamo.reset()
    model = _model()
    run = torch.compile(model) if compiled else model
    with luwu.local_cluster(2) as cluster:
        opt = luwu.RemoteOptimizer(
            model, nodes=cluster.addresses, lr=LR, compression=False, bucket_bytes=8192, **kw
        )
        try:
            graphs, owed = [], []
            for step in range(STEPS):
                opt.zero_grad()
                loss = _loss(run, step)
                if opt.worker.defer is not None:
                    assert not opt.worker.defer.owed, f"step {step}: the forward left weights owed"
                loss.backward()
                opt.step()
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                owed.append(len(opt.worker.defer.owed) if opt.worker.defer is not None else 0)
            return opt.model_state_dict(), graphs, owed
        finally:
            opt.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["resident", "streaming"])
def test_compiled_training_equals_eager_and_torch(mode):
    kw = {"stream_weights": True} if mode == "streaming" else {}
    want = _train_torch()
    eager, _, _ = _train_luwu(False, **kw)
    # (the nodes' AdamW kernel rounds apart from torch's by an ulp here and there)
    _close(eager, want, rtol=1e-5, atol=1e-6)
    got, graphs, owed = _train_luwu(True, **kw)
    assert graphs[0] > 0, "the model was compiled"
    assert graphs[-1] == graphs[1], f"graphs compiled so far, per step: {graphs} (recompiling)"
    if mode == "resident":  # the waits stay on: the next forward's hooks wrote the replies
        assert any(owed), f"no reply was left to the forward ({owed})"
    _close(got, eager, rtol=1e-4, atol=1e-5)
    _close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_compiled_and_run_before_the_optimizer_waits_in_step(cluster1, caplog):
    """torch.compile does not see hooks added after its first run (here: a Sequential it traces
    whole): the per-layer waits notice that the model's hook did not run, wait in ``step()``
    instead and say so; the weights stay equal to torch's."""
    torch._dynamo.reset()
    model = tanh_mlp()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="eager")  # (hooks are dynamo's business, not the backend's)
    run(_features(0))
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster1.addresses, lr=LR, compression=False, bucket_bytes=1088
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=LR)
    try:
        with caplog.at_level(logging.WARNING, logger="luwu.gpu_workers.layer_waits"):
            for step in range(STEPS):
                for m, o in ((run, opt), (ref, lopt)):
                    o.zero_grad()
                    m(_features(step)).square().mean().backward()
                    o.step()
                assert not opt.worker.defer.owed, f"step {step}: replies owed, hooks not running"
        assert "forward pre-hook did not run" in caplog.text
        assert_params_close(list(model.parameters()), list(ref.parameters()), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()


def _features(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + step))

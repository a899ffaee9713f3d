"""Momentum correction (Deep Gradient Compression's) through the real worker and node: the distributed
step is the composition of its two documented halves, and bad configurations fail before any push."""

import pytest
import torch

import luwu
from luwu import ConfigError
from luwu.protocol.codecs import get_codec
from luwu.protocol.feedback import WORKER_MOMENTUM, ErrorFeedback
from luwu.protocol.policy import CompressionConfig
from luwu.switch_nodes.optimizers import ADAMW, apply_

STEPS, WARMUP, FREEZE, DENSITY, LR = 14, 4, 3, 0.05, 0.01


def config(**kw) -> CompressionConfig:
    # one 64x64 matrix, "large" at this small_numel, in a bucket of its own; the warm-up's gradients go
    # and the weights come back fp32, so the reference is exact
    base = dict(
        large_codec="topk",
        topk_density=DENSITY,
        warmup_steps=WARMUP,
        warmup_codec="none",
        momentum_correction=True,
        small_numel=1024,
        link_gbps=1.0,
        pull_codec="none",
    )
    return CompressionConfig(**(base | kw))


def batches():
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)) for _ in range(STEPS)
    ]


def loss_of(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x @ w.t()).tanh() - y).pow(2).mean()


def reference(w0: torch.Tensor) -> torch.Tensor:
    """The worker's half (ErrorFeedback with the Adam momentum, top-k) feeding the node's half (apply_
    with the frozen variance and WORKER_MOMENTUM), in this process."""
    w = w0.clone().reshape(-1)
    state = {"exp_avg": [torch.zeros_like(w)], "exp_avg_sq": [torch.zeros_like(w)]}
    steps = [torch.zeros(())]
    ef, codec = (
        ErrorFeedback(getattr(torch, config().residual_dtype)),
        get_codec(f"topk:{DENSITY}"),
    )  # (the worker's residual dtype)
    hyper = dict(ADAMW.defaults) | {"lr": LR, "variance_freeze_step": FREEZE}
    for t, (x, y) in enumerate(batches()):
        p = w.view(64, 64).clone().requires_grad_(True)
        loss_of(p, x, y).backward()
        g, h = p.grad.reshape(-1), hyper
        if t >= WARMUP:
            enc = ef.encode(0, codec, g, momentum=(0.9, 0.1))
            g = torch.zeros_like(w)
            codec.decode_add_(g, [f.view(torch.uint8) for f in enc.frames], enc.meta)
            h = hyper | {WORKER_MOMENTUM: DENSITY}
        apply_(ADAMW, [w], [g.clone()], state, steps, h)
    return w.view(64, 64)


@pytest.mark.timeout(60)
def test_the_distributed_step_is_worker_momentum_topk_then_the_frozen_node_update(cluster2):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64) * 0.1)
    want = reference(w.detach())
    groups = [{"params": [w], "variance_freeze_step": FREEZE}]
    opt = luwu.RemoteOptimizer(
        groups,
        "adamw",
        nodes=cluster2.addresses,
        lr=LR,
        compression=config(),
        bucket_bytes=64 * 64 * 4,
    )
    try:
        assert [b.numel for b in opt.layout.buckets] == [4096]
        for x, y in batches():
            opt.zero_grad()
            loss_of(w, x, y).backward()
            opt.step()
        assert opt.worker.encoder.feedback.velocity(0) is not None, (
            "the top-k steps did not go through momentum correction"
        )
        torch.testing.assert_close(w.detach(), want, rtol=1e-5, atol=1e-6)
    finally:
        opt.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "optimizer,group,kw,match",
    [
        ("adamw", {}, {}, "param group 0: momentum correction .* needs Adam's variance frozen"),
        (
            "adamw",
            {"variance_freeze_step": WARMUP + 1},
            {},
            "param group 0: variance_freeze_step = 5 is after compression.warmup_steps = 4",
        ),
        (
            "adam",
            {"variance_freeze_step": 2, "weight_decay": 0.1},
            {},
            "param group 0: .*adam's L2 weight_decay",
        ),
        (
            "sgd",
            {"momentum": 0.9, "weight_decay": 0.1},
            {},
            "param group 0: .*sgd without weight_decay or nesterov",
        ),
        (
            "adamw",
            {"variance_freeze_step": 2},
            {"mode": "async"},
            "param group 0: compression.momentum_correction needs mode='sync'",
        ),
    ],
)
def test_configurations_it_cannot_serve_fail_in_the_constructor(optimizer, group, kw, match):
    """Refused before any node is contacted (nothing listens at the address)."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ConfigError, match=match):
        luwu.RemoteOptimizer(
            [dict(group, params=[w])],
            optimizer,
            nodes=["tcp://127.0.0.1:9"],
            lr=0.01,
            compression=config(),
            **kw,
        )


def test_the_config_refuses_momentum_correction_without_a_topk_codec():
    with pytest.raises(ConfigError, match="neither large_codec nor a rule is top-k"):
        CompressionConfig(large_codec="int8", momentum_correction=True)
    with pytest.raises(ConfigError, match="momentum_correction must be a bool"):
        CompressionConfig(large_codec="topk", momentum_correction="yes")
    assert CompressionConfig(
        large_codec="int8", rules=[("fc*", "topk")], momentum_correction=True
    ).momentum_correction


@pytest.mark.timeout(60)
def test_add_param_group_checks_it_too(cluster1):
    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    opt = luwu.RemoteOptimizer(
        [{"params": [a], "variance_freeze_step": 2}],
        "adamw",
        nodes=cluster1.addresses,
        lr=0.01,
        compression=config(),
    )
    try:
        with pytest.raises(ConfigError, match="param group 1: momentum correction"):
            opt.add_param_group({"params": [b]})
        assert len(opt.param_groups) == 1
    finally:
        opt.close()

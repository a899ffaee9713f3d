"""A gradient hook that completes several buckets hands all their pushes to the worker's I/O thread
in one wake-up (``Worker.grad_ready`` inside ``client.wake.batched()``), and the pushes ``step()``
makes for what the hooks left (``finish``) in one more: one node, one worker, real processes, int8
pushes with error feedback (each encode gives the interpreter lock away, so an I/O thread woken per
push takes each push as it comes)."""

import pytest
import torch

from luwu.protocol.compression import CompressionConfig


@pytest.mark.timeout(180)
def test_a_hook_pushing_several_buckets_wakes_the_io_thread_once(cluster1):
    import luwu

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512, bias=False)  # 262144 weights: 16 buckets of 16384
    wakes: list[int] = []
    model.weight.register_post_accumulate_grad_hook(lambda p: wakes.append(opt.client.wake.writes))
    cfg = CompressionConfig(warmup_steps=0, rules=[("*", "int8")], link_gbps=1.0)
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=cfg,
        bucket_bytes=64 << 10,
        rank=0,
        world_size=1,
    )
    model.weight.register_post_accumulate_grad_hook(lambda p: wakes.append(opt.client.wake.writes))
    try:
        assert len(opt.worker.layout.buckets) == 16
        per_hook = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 512, generator=g)
            opt.zero_grad()
            wakes.clear()
            model(x).square().mean().backward()
            before, after = wakes  # around LuWu's hook, which pushes the 16 buckets
            per_hook.append(after - before)
            opt.step()
        assert per_hook == [1] * 4, per_hook
    finally:
        opt.close()

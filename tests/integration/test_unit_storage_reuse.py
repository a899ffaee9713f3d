"""A streaming worker reuses its units' storage from step to step (one node, one worker, real
processes): after the first step no unit's weights are allocated afresh, the blocks (of equal
shapes) run on the same memory in turn, and training still equals local torch AdamW."""

import pytest
import torch


@pytest.mark.timeout(180)
def test_units_run_on_recycled_storage_and_train_as_local_torch(cluster1):
    from workers.stream import make_model

    import luwu

    spec = {"seed": 0, "blocks": 3, "width": 16}
    ref, model = make_model(spec), make_model(spec)
    local = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        prefetch=1,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
    )
    try:
        blocks = [u for u in opt.streamer.units if u.buckets]
        assert len(blocks) == 3
        where: dict[int, set[int]] = {}  # block -> data_ptr of its first parameter while it runs
        for u in blocks:
            u.unit.module.register_forward_pre_hook(  # (after the streamer's: resident then)
                lambda m, a, u=u: where.setdefault(u.unit.index, set()).add(u.params[0].data_ptr())
            )
        fresh = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g)
            for net, o in ((ref, local), (model, opt)):
                o.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                o.step()
            fresh.append(opt.streamer.memory.fresh)
            assert opt.streamer.resident_bytes() == 0  # released storage holds no weights
        assert fresh[1:] == [fresh[0]] * 3, fresh  # after the first step: nothing allocated anew
        ptrs = set().union(*where.values())
        assert len(ptrs) <= 2, where  # three blocks on at most two storages (prefetch 1: cap 2)
        got = opt.model_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-6)
    finally:
        opt.close()

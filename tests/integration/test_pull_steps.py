"""The default pull codec ``bf16_steps`` on real nodes: a worker ends every step holding, bit for bit, the
bf16 rounding of the nodes' master weights, exactly what ``pull_codec = "bf16"`` gives it, for about half
the bytes; across a node's restart from its checkpoint (the rollback resends full weights) too."""

from __future__ import annotations

import pytest
import torch

import luwu
from luwu import optim_state
from luwu.protocol.compression import CompressionConfig

STEPS, WARMUP = 14, 4


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 8),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 64, generator=g), torch.randint(0, 8, (32,), generator=g)


def check_weights(opt, step: int) -> None:
    """Each bucket's weights on the worker are the nodes' masters rounded to bf16 (read from the shards),
    or the masters themselves where the cost rule sends a small bucket fp32."""
    flats = optim_state.fetch(opt.worker)
    for b in opt.layout.buckets:
        master = flats[b.id][0]
        want = (
            master
            if opt.worker.codecs.pull(b, step) == "none"
            else master.to(torch.bfloat16).float()
        )
        for s in b.segments:
            held = (
                opt.worker.params[s.param]
                .detach()
                .reshape(-1)[s.param_offset : s.param_offset + s.numel]
            )
            assert torch.equal(held, want[s.offset : s.offset + s.numel]), f"step {step}, {s.name}"


def train(pull: str, check: bool = False) -> tuple[list[torch.Tensor], list[float], list[int]]:
    """STEPS steps against fresh nodes, the policy told a 1 Gbit/s link (where the cost rule picks bf16 steps
    for every bucket, ``auto``'s choice too); (final weights, losses, payload bytes received per step)."""
    m = model()
    with luwu.local_cluster(2) as c:
        cfg = CompressionConfig(pull_codec=pull, warmup_steps=WARMUP, link_gbps=1.0)
        opt = luwu.RemoteOptimizer(
            m, nodes=c.addresses, lr=3e-3, compression=cfg, bucket_bytes=64 << 10, timeout_s=30
        )
        losses, got = [], []
        try:
            for s in range(STEPS):
                x, y = batch(s)
                before = opt.client.bytes_received
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                opt.synchronize()
                losses.append(loss.item())
                got.append(opt.client.bytes_received - before)
                if check:
                    check_weights(opt, s)
        finally:
            opt.close()
    return [p.detach().clone() for p in m.parameters()], losses, got


@pytest.mark.timeout(180)
def test_steps_give_the_workers_bf16s_very_bits_for_half_the_bytes():
    steps_w, steps_loss, steps_got = train("bf16_steps", check=True)
    bf16_w, bf16_loss, bf16_got = train("bf16")
    assert steps_loss == bf16_loss
    assert all(torch.equal(a, b) for a, b in zip(steps_w, bf16_w))
    assert all(g == bf16_got[0] for g in bf16_got)
    assert steps_got[0] == bf16_got[0], "a bucket's first reply is full bf16"
    assert all(g < 0.6 * bf16_got[0] for g in steps_got[1:]), (steps_got, bf16_got)


@pytest.mark.timeout(180)
def test_a_node_restarted_from_its_checkpoint_resends_full_weights(tmp_path):
    """The rollback resyncs: the worker holds the rounding of the restored masters, then steps on from there."""
    args = ["--node.checkpoint_dir", str(tmp_path / "ckpt"), "--node.checkpoint_every", "3"]
    m = model()
    with luwu.local_cluster(2, node_args=args) as c:
        opt = luwu.RemoteOptimizer(
            m,
            nodes=c.addresses,
            lr=3e-3,
            compression=CompressionConfig(warmup_steps=0, link_gbps=1.0),
            bucket_bytes=64 << 10,
            timeout_s=30,
        )
        assert all(opt.worker.codecs.pull(b, 0) == "bf16_steps" for b in opt.layout.buckets)
        try:
            s, restarted, rollbacks = 0, False, 0
            while s < 12:
                if s == 7 and not restarted:
                    c.kill(1)
                    c.restart(1)
                    restarted = True
                x, y = batch(s)
                try:
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(m(x), y).backward()
                    opt.step()
                    opt.synchronize()
                    s += 1
                except luwu.RollbackError:
                    rollbacks += 1
                    s = opt.recover()
                    assert s <= 7
                    continue
                check_weights(opt, s - 1)
            assert restarted and rollbacks >= 1
        finally:
            opt.close()


@pytest.mark.timeout(120)
def test_a_step_reply_from_weights_the_worker_does_not_hold_is_refused_and_writes_nothing():
    """A delta reply (bf16 steps) names the step it leads to; the worker writes it only onto the weights of the
    step before. Replayed when the worker already holds the next step's, it is refused with the node, bucket
    and step, the parameters untouched, and training goes on exact."""
    m = model()
    with luwu.local_cluster(2) as c:
        opt = luwu.RemoteOptimizer(
            m,
            nodes=c.addresses,
            lr=3e-3,
            compression=CompressionConfig(warmup_steps=0, link_gbps=1.0),
            bucket_bytes=64 << 10,
            timeout_s=30,
        )
        seen, write = {}, opt.worker.writer.write

        def keep(bid, msg):
            if msg.header.get("delta"):
                seen[bid] = msg
            write(bid, msg)

        opt.worker.writer.write = keep
        try:
            for s in range(4):
                x, y = batch(s)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                opt.synchronize()
            check_weights(opt, 3)
            assert seen, "bf16 steps replies after the first"
            bid, msg = next(iter(seen.items()))
            before = [p.detach().clone() for p in m.parameters()]
            with pytest.raises(
                luwu.StepMismatchError,
                match=f"bucket {bid}'s weights of step {msg.header['step']} as bf16_steps",
            ) as err:
                write(bid, msg)
            assert err.value.bucket == bid and err.value.step == msg.header["step"]
            assert all(torch.equal(a, b.detach()) for a, b in zip(before, m.parameters()))
            for s in range(4, 6):
                x, y = batch(s)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
                opt.synchronize()
                check_weights(opt, s)
        finally:
            opt.close()

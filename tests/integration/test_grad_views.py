"""Gradients as bucket views (``optimizer.grads_in_buckets``, resident mode): one copy of the gradients.

On a real node against local ``torch.optim.AdamW`` (fp32 both ways): after ``backward()`` each
parameter's ``.grad`` is its slice of the bucket buffer the push went from, with torch's values; training
equals local AdamW (to the node's fused-AdamW rounding) with ``zero_grad()`` either way and with ``no_sync()`` accumulation; a gradient changed
in place while its push is on its way is refused with its name (at ``step()`` or when the reply lands),
and a second backward outside ``no_sync()`` is refused instead of dropped.
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from harness import assert_params_close, tanh_mlp

import luwu
from luwu.config import load_config
from luwu.protocol.errors import ConfigError, StepMismatchError

LR = 0.05


def _loss(model, step: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + step))
    return model(x).square().mean()


def _pair(cluster, **kw):
    model = tanh_mlp(depth=3)
    ref = copy.deepcopy(model)
    # one bucket per layer (16 x 16 weight + bias = 1088 B)
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster.addresses, lr=LR, compression=False, bucket_bytes=1088, **kw
    )
    return model, opt, ref, torch.optim.AdamW(ref.parameters(), lr=LR)


def _is_view(opt, p: torch.Tensor) -> bool:
    """``p.grad`` is a slice of the worker's bucket buffers (one flat buffer)."""
    return (
        p.grad is not None
        and p.grad.untyped_storage().data_ptr()
        == opt.worker.flat_grads[p.dtype].untyped_storage().data_ptr()
    )


@pytest.mark.timeout(60)
def test_grads_are_bucket_views_with_torch_values_and_training_equals_local_adamw(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        for step in range(4):
            set_to_none = step % 2 == 0  # both ways of zero_grad()
            opt.zero_grad(set_to_none=set_to_none)
            lopt.zero_grad(set_to_none=set_to_none)
            _loss(model, step).backward()
            _loss(ref, step).backward()
            assert all(_is_view(opt, p) for p in model.parameters()), (
                "every .grad is its bucket's slice"
            )
            # step 0: the same weights, the same gradient to the bit; later the weights differ by the node's
            # fused AdamW's rounding (1e-8), so do the gradients
            grads = [p.grad.clone() for p in model.parameters()]
            for g, p, q in zip(grads, model.parameters(), ref.parameters()):
                assert p.grad.shape == p.shape and (
                    torch.equal(g, q.grad)
                    if step == 0
                    else torch.allclose(g, q.grad, rtol=1e-4, atol=1e-8)
                )
            opt.step()
            lopt.step()
            for g, p in zip(
                grads, model.parameters()
            ):  # .grad after step(): the gradient as pushed
                assert torch.equal(p.grad, g)
        opt.synchronize()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_parameter_split_over_buckets_is_one_slice(cluster1):
    """A 64 x 64 weight over 4 KiB buckets spans five buckets (and shares the first and the last): the
    buckets are placed in one buffer so that its gradient is one contiguous slice, and training is exact."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 16),
    )
    ref = copy.deepcopy(model)
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster1.addresses, lr=LR, compression=False, bucket_bytes=4096
    )
    lopt = torch.optim.AdamW(
        ref.parameters(), lr=LR, fused=True
    )  # (the node's: equal to the bit, not just to rounding)
    try:
        assert max(len(opt.worker.where[i]) for i in opt.worker.where) >= 4, (
            "the 64 x 64 weight spans buckets"
        )
        for step in range(3):
            for m, o in ((model, opt), (ref, lopt)):
                o.zero_grad()
                _loss(m, step).backward()
            assert all(_is_view(opt, p) for p in model.parameters())
            assert len(opt.worker.views.views) == len(list(model.parameters()))
            opt.step()
            lopt.step()
        opt.synchronize()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_off_keeps_autograds_tensor(cluster1):
    cfg = load_config(overrides={"optimizer.grads_in_buckets": False})
    model, opt, ref, lopt = _pair(cluster1, config=cfg)
    try:
        assert opt.worker.views is None
        _loss(model, 0).backward()
        assert not any(_is_view(opt, p) for p in model.parameters())
        opt.step()
        opt.synchronize()
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_no_sync_accumulation_equals_local_adamw(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        for step in range(3):
            for o in (opt, lopt):
                o.zero_grad()
            with opt.no_sync():
                _loss(model, 10 * step).backward()
            _loss(model, 10 * step + 1).backward()
            _loss(ref, 10 * step).backward()
            _loss(ref, 10 * step + 1).backward()
            opt.step()
            lopt.step()
        opt.synchronize()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_an_in_place_change_of_a_pushed_gradient_is_refused_with_its_name(cluster1):
    model, opt, _, _ = _pair(cluster1)
    try:
        _loss(model, 0).backward()
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1e-3
        )  # torch's clipping, after the pushes left
        with pytest.raises(
            ConfigError,
            match=r"step 0: the gradient of \['\d+\.(bias|weight)', '\d+\.(bias|weight)'.*\] changed after it was sent to the nodes.*opt\.clip_grad_norm_",
        ):
            opt.step()
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_change_after_step_while_the_reply_is_owed_is_refused_when_it_lands():
    with luwu.local_cluster(1) as c:
        model, opt, _, _ = _pair(c)
        try:
            _loss(model, 0).backward()
            opt.step()  # (the first step waits for the global round, in case clip_grad_norm_ comes: not this one)
            opt.zero_grad()
            _loss(model, 1).backward()
            os.kill(
                c.procs[0].pid, signal.SIGSTOP
            )  # the node holds its replies: the frames count as on their way
            try:
                opt.step()  # per-layer waits: returns with the replies owed
                next(model.parameters()).grad.mul_(
                    0.5
                )  # module.zero_grad(set_to_none=False) or a stray in-place op
            finally:
                os.kill(c.procs[0].pid, signal.SIGCONT)
            with pytest.raises(
                ConfigError,
                match=r"step 1, bucket \d+: the gradient of \['0\.weight'\] changed in place while its push was on its way",
            ):
                opt.synchronize()
        finally:
            opt.close()


@pytest.mark.timeout(60)
def test_zero_grad_in_place_after_step_waits_for_the_replies(cluster1):
    """``opt.zero_grad(set_to_none=False)`` right after ``step()`` zeroes no frame on its way: it waits for
    the replies first, and training equals local AdamW."""
    model, opt, ref, lopt = _pair(cluster1)
    try:
        for step in range(3):
            _loss(model, step).backward()
            _loss(ref, step).backward()
            opt.step()
            lopt.step()
            opt.zero_grad(set_to_none=False)
            lopt.zero_grad(set_to_none=False)
            assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_second_backward_outside_no_sync_is_refused_not_dropped(cluster1):
    model, opt, _, _ = _pair(cluster1)
    try:
        _loss(model, 0).backward()
        with pytest.raises(
            StepMismatchError,
            match=r"step 0: a second gradient of \d+\.(weight|bias) \(bucket \d+\) after its push.*no_sync",
        ):
            _loss(model, 1).backward()
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_parameter_with_two_gradients_in_one_backward_before_its_push_counts_once(cluster1):
    """A layer used outside and inside ``checkpoint(use_reentrant=True)`` gets two gradient hooks in one
    backward (the inner backward's, then the outer's). Its bucket (shared with a layer whose gradient comes
    later) waits for every segment once, and pushes the sum: training equals local AdamW."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(2)
    model = torch.nn.ModuleDict({"b": torch.nn.Linear(16, 16), "a": torch.nn.Linear(16, 16)})
    ref = copy.deepcopy(model)
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster1.addresses, lr=LR, compression=False, bucket_bytes=1 << 16
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)

    def loss(m, step):
        h = m["a"](m["b"](torch.randn(8, 16, generator=torch.Generator().manual_seed(step))))
        return checkpoint(lambda t: m["a"](t).tanh(), h, use_reentrant=True).square().mean()

    try:
        assert len(opt.layout.buckets) == 1
        for step in range(3):
            for m, o in ((model, opt), (ref, lopt)):
                o.zero_grad()
                loss(m, step).backward()
                o.step()
        opt.synchronize()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()

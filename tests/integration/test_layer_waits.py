"""Per-layer waits (``optimizer.layer_waits``, resident mode): ``step()`` returns with the replies on the
wire, each parameter waits for its new weights when it is next read, and the step stays exactly sync.

Checked on a real node against local ``torch.optim.AdamW`` (fp32 both ways, bit-exact): the next forward
writes each layer's weights as it reaches that layer, in forward order; every way of reading a parameter
outside a forward sees the new weights; metadata (``zero_grad()``) does not wait; buckets nothing read are
written at the next ``step()``; ``close()`` writes what the last step still owed.
"""

from __future__ import annotations

import copy
import io
import os
import signal
import time

import pytest
import torch
from harness import assert_params_close, tanh_mlp

import luwu
from luwu.gpu_workers.layer_waits import WRITTEN, OwedParameter
from luwu.protocol.messages import Op

LR = 0.05


def _batch(step: int, width: int = 16) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(100 + step))


def _step(model, opt, step: int) -> None:
    opt.zero_grad()
    model(_batch(step)).square().mean().backward()
    opt.step()


def _pair(cluster, **kw):
    """(model trained by LuWu, its optimizer, the same model trained by torch, torch's AdamW)."""
    model = tanh_mlp()
    ref = copy.deepcopy(model)
    # one bucket per layer (16 x 16 weight + bias = 1088 B): the layers' replies land one by one
    opt = luwu.RemoteOptimizer(model, nodes=cluster.addresses, lr=LR, compression=False, bucket_bytes=1088, **kw)
    return model, opt, ref, torch.optim.AdamW(ref.parameters(), lr=LR)


def _owed(model) -> list[bool]:
    return [type(p) is OwedParameter for p in model.parameters()]


@pytest.mark.timeout(60)
def test_the_next_forward_waits_layer_by_layer_in_forward_order(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        assert opt.worker.defer is not None, "per-layer waits are the default"
        _step(model, opt, 0)
        _step(ref, lopt, 0)
        assert all(_owed(model)), "step() returned with every layer's new weights still owed"
        opt.zero_grad()  # metadata only (p.grad): nothing waits
        assert all(_owed(model))
        seen = []
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        for k, lin in enumerate(linears):  # as each layer's forward starts: its weights owed, the earlier ones written
            lin.register_forward_pre_hook(lambda _m, _a, k=k: seen.append((type(linears[k].weight) is OwedParameter, [type(linears[j].weight) is OwedParameter for j in range(k)])))
        model(_batch(1)).square().mean().backward()
        assert seen == [(True, [False] * k) for k in range(len(linears))]
        assert not any(_owed(model))
        opt.step()
        _step(ref, lopt, 1)
        assert_params_close(list(model.parameters()), list(ref.parameters()))
        assert opt.last_report.update_wait_s >= 0.0
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_every_read_outside_a_forward_sees_the_new_weights(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    reads = {
        "detach": lambda m: [p.detach().clone() for p in m.parameters()],
        "data": lambda m: [p.data.clone() for p in m.parameters()],
        "state_dict": lambda m: [t.clone() for t in m.state_dict().values()],
        "deepcopy": lambda m: list(copy.deepcopy(m).parameters()),
        "torch.save": lambda m: list(torch.load(_saved(m), weights_only=False).parameters()),
        "tolist": lambda m: [torch.tensor(p.tolist()) for p in m.parameters()],
    }
    try:
        for step, (name, read) in enumerate(reads.items()):
            _step(model, opt, step)
            _step(ref, lopt, step)
            assert all(_owed(model))
            got = read(model)
            assert not any(_owed(model)), name
            assert not any(type(t) is OwedParameter for t in got), f"{name}: a copy kept the owing class"
            assert_params_close(got, list(ref.parameters()))
    finally:
        opt.close()


def _saved(m) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return buf


@pytest.mark.timeout(60)
def test_one_read_writes_only_its_own_buckets(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        _step(model, opt, 0)
        _step(ref, lopt, 0)
        assert_params_close([model[0].weight * 1], [ref[0].weight.detach()])  # one read of the first layer
        owed = _owed(model)
        assert owed[:2] == [False, False], "the first layer's weight and bias share its bucket"
        assert all(owed[2:]), "the other layers' replies are still on the wire"
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_unused_parameters_and_close_lose_no_update(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        for step in range(3):  # the last layers are used only at step 0: their replies wait for the next step()
            for m, o in ((model, opt), (ref, lopt)):
                o.zero_grad(set_to_none=True)
                h = m[:2](_batch(step))
                (m(_batch(step)) if step == 0 else h).square().mean().backward()
                o.step()
        opt.close()  # writes what the last step still owed
        assert not any(_owed(model))
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_replies_landing_while_owed_are_written_on_arrival():
    """The I/O thread writes an owed bucket's reply as it lands, so its frames are freed then, not held until
    the read: with every reply in, the parameters (still owed) hold the new weights, the filed replies are
    headers alone, and the read that follows only turns the parameters back into plain ones."""
    with luwu.local_cluster(1) as c:
        model, opt, ref, lopt = _pair(c)
        try:
            _step(ref, lopt, 0)
            os.kill(c.procs[0].pid, signal.SIGSTOP)  # every reply lands after step() filed it as owed
            try:
                _step(model, opt, 0)
                owed = list(opt.worker.defer.owed.values())
                assert len(owed) == 4 and all(_owed(model))
            finally:
                os.kill(c.procs[0].pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while not all(k in opt.client._inbox for k in owed):
                assert time.monotonic() < deadline, "the replies did not land"
                time.sleep(0.01)
            assert all(opt.client._inbox[k].header.get(WRITTEN) and opt.client._inbox[k].payload == [] for k in owed)
            assert all(_owed(model))
            with torch._C.DisableTorchFunctionSubclass():  # the raw values, without a read's wait
                raw = [p.detach().clone() for p in model.parameters()]
            assert_params_close(raw, list(ref.parameters()))
            model(_batch(1))
            assert not any(_owed(model)) and not opt.worker.defer.owed
        finally:
            opt.close()


@pytest.mark.timeout(60)
def test_replies_landing_before_step_are_written_in_step(cluster1, monkeypatch):
    """A reply that came before ``step()`` (replies not held, or released by ``step()`` before it owed them)
    is written by ``step()``: its frames are not kept until the next forward, a second copy of those weights.
    The buckets stay out of the forward-order record (no forward read them)."""
    monkeypatch.setenv("LUWU_OPTIMIZER__HOLD_REPLIES", "never")  # the node answers during backward
    model, opt, ref, lopt = _pair(cluster1)
    try:
        for step in range(2):
            opt.zero_grad()
            model(_batch(step)).square().mean().backward()
            keys = [(Op.UPDATE, b.node, step, b.id) for b in opt.worker.layout.buckets]
            deadline = time.monotonic() + 20
            while not all(k in opt.client._inbox for k in keys):  # every reply in before step()
                assert time.monotonic() < deadline, "the replies did not land"
                time.sleep(0.01)
            opt.step()
            _step(ref, lopt, step)
            assert not opt.worker.defer.owed and not any(_owed(model)), "step() wrote the replies that were here"
            assert not any(k in opt.client._inbox for k in keys), "no reply (nor its frames) is kept for the next forward"
            assert_params_close(list(model.parameters()), list(ref.parameters()))
        assert opt.worker.defer.order == {}
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_layer_waits_off_waits_in_step(cluster1):
    model, opt, ref, lopt = _pair(cluster1, layer_waits=False)
    try:
        assert opt.worker.defer is None and opt.config.optimizer.layer_waits is False
        _step(model, opt, 0)
        _step(ref, lopt, 0)
        assert not any(_owed(model))
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_bare_tensors_are_waited_for_in_step(cluster1):
    """A leaf tensor that is not an nn.Parameter cannot change class: its bucket is waited for in step()."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    ref = w.detach().clone().requires_grad_(True)
    opt = luwu.RemoteOptimizer([w], nodes=cluster1.addresses, lr=LR, compression=False)
    lopt = torch.optim.AdamW([ref], lr=LR)
    try:
        for t, o in ((w, opt), (ref, lopt)):
            o.zero_grad()
            (_batch(0) @ t).square().mean().backward()
            o.step()
        assert type(w) is torch.Tensor and not opt.worker.defer.owed
        assert_params_close([w.detach()], [ref.detach()])
    finally:
        opt.close()

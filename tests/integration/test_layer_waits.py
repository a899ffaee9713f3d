"""Per-layer waits (``optimizer.layer_waits``, resident mode): ``step()`` returns with the replies
on the wire, each module's forward pre-hook waits for its parameters' new weights, and the step
stays exactly sync.

Checked on a real node against local ``torch.optim.AdamW`` (fp32 both ways): the next forward writes
each layer's weights as it reaches that layer, in forward order; a parameter read by a module that
does not hold it is written by the model's pre-hook first; tied weights; the reads outside a forward
that settle by themselves (``state_dict``, ``load_state_dict``, the optimizer's methods) and
``synchronize()`` for the others; metadata (``zero_grad()``) does not wait; the buckets of modules
that did not run are written at the next forward's start; ``close()`` writes what the last step
still owed; without the model or its hook, ``step()`` waits."""

from __future__ import annotations

import copy
import io
import logging
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from harness import assert_params_close, tanh_mlp

import luwu
from luwu.gpu_workers.layer_waits import WRITTEN

LR = 0.05


def _batch(step: int, width: int = 16) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(100 + step))


def _step(model, opt, step: int) -> None:
    opt.zero_grad()
    model(_batch(step)).square().mean().backward()
    opt.step()


def _pair(cluster, model=None, **kw):
    """(model trained by LuWu, its optimizer, the same model trained by torch, torch's AdamW)."""
    model = tanh_mlp() if model is None else model
    ref = copy.deepcopy(model)
    # one bucket per layer (16 x 16 weight + bias = 1088 B): the layers' replies land one by one
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster.addresses, lr=LR, compression=False, bucket_bytes=1088, **kw
    )
    return model, opt, ref, torch.optim.AdamW(ref.parameters(), lr=LR)


def _owing_step(node, model, opt, step: int) -> None:
    """A step (not the first: that one's two-phase round waits for the node) whose replies are all
    still owed when ``step()`` returns: the node stops from the end of the forward (which took
    the last step's weights) until then."""
    opt.zero_grad()
    loss = model(_batch(step)).square().mean()
    assert not opt.worker.defer.owed, f"step {step}: the forward left replies owed"
    os.kill(node.pid, signal.SIGSTOP)
    try:
        loss.backward()
        opt.step()
    finally:
        os.kill(node.pid, signal.SIGCONT)


def _buckets(opt, p) -> set[int]:
    i = next(k for k, q in enumerate(opt.worker.params) if q is p)
    return {bid for bid, _ in opt.worker.where[i]}


def _owed(opt, model) -> list[bool]:
    """Per parameter of ``model``: whether a bucket of it still owes its new weights."""
    return [bool(_buckets(opt, p) & set(opt.worker.defer.owed)) for p in model.parameters()]


@pytest.mark.timeout(60)
def test_the_next_forward_waits_layer_by_layer_in_forward_order(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        assert opt.worker.defer is not None, "per-layer waits are the default"
        _step(model, opt, 0)  # (its forward shows which hooks cover which parameters)
        _owing_step(cluster1.procs[0], model, opt, 1)
        for step in range(2):
            _step(ref, lopt, step)
        assert all(_owed(opt, model)), "step() returned with every layer's new weights still owed"
        opt.zero_grad()  # metadata only (p.grad): nothing waits
        assert all(_owed(opt, model))
        seen = []
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        # as each layer's forward starts (after LuWu's hook): its weights written, later ones owed
        for lin in linears:
            lin.register_forward_pre_hook(
                lambda _m, _a: seen.append([any(_owed(opt, lin)) for lin in linears])
            )
        model(_batch(2)).square().mean().backward()
        n = len(linears)
        assert seen == [[False] * (k + 1) + [True] * (n - k - 1) for k in range(n)]
        assert not any(_owed(opt, model))
        opt.step()
        _step(ref, lopt, 2)
        opt.synchronize()  # (step 2's replies are owed: a raw read outside a forward waits first)
        assert_params_close(list(model.parameters()), list(ref.parameters()))
        assert opt.last_report.update_wait_s >= 0.0
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_owed_parameters_stay_plain_parameters(cluster1):
    """While a step's replies are owed, nothing changes the parameters' class (torch.compile guards
    on it, and a swapped class recompiles or breaks the graph): they stay plain ``nn.Parameter``
    objects, and ``synchronize()`` writes what they owe."""
    model, opt, ref, lopt = _pair(cluster1)
    try:
        _step(model, opt, 0)
        _owing_step(cluster1.procs[0], model, opt, 1)
        for step in range(2):
            _step(ref, lopt, step)
        assert all(_owed(opt, model)), "step() returned with every layer's new weights still owed"
        assert {type(p) for p in model.parameters()} == {torch.nn.Parameter}
        opt.synchronize()
        assert not any(_owed(opt, model))
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


def _saved(m) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return buf


@pytest.mark.timeout(60)
def test_reads_outside_a_forward_see_the_new_weights(cluster1):
    """Every read of the weights between ``step()`` and the next forward waits for them: the
    reads that settle by themselves (``state_dict``, the optimizer's methods), and raw reads of the
    parameters (``detach``, ``.data``, ``deepcopy``, ``torch.save``, an EMA through
    ``AveragedModel``), with no ``synchronize()``."""
    model, opt, ref, lopt = _pair(cluster1)

    def ema(m):
        avg = torch.optim.swa_utils.AveragedModel(
            tanh_mlp(), multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.0)
        )
        avg.n_averaged += 1  # (past the first call, which copies: the EMA's foreach path reads)
        avg.update_parameters(m)
        return list(avg.module.parameters())

    reads = {
        "state_dict": lambda m: [t.clone() for t in m.state_dict().values()],
        "a submodule's state_dict": lambda m: [
            t.clone() for i in range(0, len(m), 2) for t in m[i].state_dict().values()
        ],
        "model_state_dict": lambda m: list(opt.model_state_dict().values()),
        "optimizer state_dict": lambda m: (
            opt.state_dict(),
            [p.detach().clone() for p in m.parameters()],
        )[1],
        "synchronize, detach": lambda m: (
            opt.synchronize(),
            [p.detach().clone() for p in m.parameters()],
        )[1],
        "detach": lambda m: [p.detach().clone() for p in m.parameters()],
        ".data": lambda m: [p.data.clone() for p in m.parameters()],
        "deepcopy": lambda m: list(copy.deepcopy(m).parameters()),
        "torch.save": lambda m: list(torch.load(_saved(m), weights_only=False).parameters()),
        "AveragedModel (EMA)": ema,
    }
    try:
        _step(model, opt, 0)
        _step(ref, lopt, 0)
        for step, (name, read) in enumerate(reads.items(), start=1):
            _owing_step(cluster1.procs[0], model, opt, step)
            _step(ref, lopt, step)
            assert all(_owed(opt, model)), name
            got = read(model)
            assert not opt.worker.defer.owed, name
            # (8 steps: the nodes' AdamW and torch's drift apart by ulps)
            assert_params_close(got, list(ref.parameters()), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_with_block_around_step_pops_its_own_mode_and_reads_still_wait(cluster1):
    """The guard of owed reads is a torch function mode; a ``with`` entered before ``step()`` and
    left after it (``torch.device``, a user's mode) pops the top of the stack: it must pop its own
    mode, not the guard, so nothing of it stays behind and the reads after it still wait."""
    model, opt, ref, lopt = _pair(cluster1)
    try:
        _step(model, opt, 0)
        _step(ref, lopt, 0)
        with torch.device("cpu"):
            _owing_step(cluster1.procs[0], model, opt, 1)
        _step(ref, lopt, 1)
        assert all(_owed(opt, model))
        stack = [torch._C._get_function_stack_at(0)] if torch._C._len_torch_function_stack() else []
        assert len(stack) == 1 and not isinstance(stack[0], torch.utils._device.DeviceContext)
        got = [p.detach().clone() for p in model.parameters()]
        assert not opt.worker.defer.owed and not opt.worker.defer.reads.active
        assert_params_close(got, list(ref.parameters()), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_load_state_dict_is_not_overwritten_by_late_replies(cluster1):
    """``model.load_state_dict()`` between ``step()`` and the forward settles first: a reply landing
    after it would otherwise write the step's weights over the loaded ones."""
    model, opt, ref, _ = _pair(cluster1)
    try:
        _step(model, opt, 0)
        _owing_step(cluster1.procs[0], model, opt, 1)
        owed = list(opt.worker.defer.owed.values())
        assert len(owed) == 4
        # (from ref: model.state_dict() would settle)
        loaded = {k: torch.full_like(v, 0.5) for k, v in ref.state_dict().items()}
        model.load_state_dict(loaded)
        deadline = time.monotonic() + 20
        # replies still owed (they should not be): until they land
        while opt.worker.defer.owed and not all(r.done for r in owed):
            assert time.monotonic() < deadline, "the replies did not land"
            time.sleep(0.01)
        overwritten = [n for n, p in model.named_parameters() if not (p == 0.5).all()]
        assert not overwritten, f"a reply overwrote the loaded weights of {overwritten}"
        assert not opt.worker.defer.owed, "load_state_dict() left replies owed"
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_one_modules_forward_writes_only_its_own_buckets(cluster1):
    model, opt, ref, lopt = _pair(cluster1)
    try:
        _step(model, opt, 0)
        _owing_step(cluster1.procs[0], model, opt, 1)
        for step in range(2):
            _step(ref, lopt, step)
        # the first layer alone
        assert_params_close([model[0](_batch(2))], [ref[0](_batch(2)).detach()])
        owed = _owed(opt, model)
        assert owed[:2] == [False, False], "the first layer's weight and bias share its bucket"
        assert all(owed[2:]), "the other layers' replies are still owed"
    finally:
        opt.close()


class _Partial(torch.nn.Module):
    """An MLP whose last layers run only when ``full``."""

    def __init__(self):
        super().__init__()
        self.mlp, self.full = tanh_mlp(), True

    def forward(self, x):
        return self.mlp(x) if self.full else self.mlp[:2](x)


@pytest.mark.timeout(60)
def test_unused_parameters_and_close_lose_no_update(cluster1):
    model, opt, ref, lopt = _pair(cluster1, _Partial())
    try:
        # the last layers run only at step 0: the model's pre-hook writes their weights after
        for step in range(4):
            model.full = ref.full = step == 0
            if step < 3:
                _step(model, opt, step)
            else:
                _owing_step(cluster1.procs[0], model, opt, step)
            _step(ref, lopt, step)
        assert opt.worker.defer.owed, "the last step's replies are owed"
        opt.close()  # writes what the last step still owed
        assert not opt.worker.defer.owed
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


class _TiedLM(torch.nn.Module):
    """An embedding and a head holding the same weight (tied), the head run last."""

    def __init__(self, vocab: int = 24, d: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = (
            torch.nn.Embedding(vocab, d),
            torch.nn.Linear(d, d),
            torch.nn.Linear(d, vocab, bias=False),
        )
        self.head.weight = self.emb.weight

    def forward(self, x):
        idx = (x.abs() * 7).long().clamp(max=self.emb.num_embeddings - 1)
        return self.head(torch.tanh(self.mid(self.emb(idx).mean(1))))


class _ParentReads(torch.nn.Module):
    """The model reads ``proj``'s weights itself (``F.linear``) between two layers: ``proj`` never
    runs. ``before_read`` is called right before that read."""

    def __init__(self, d: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.proj, self.b = (
            torch.nn.Linear(d, d),
            torch.nn.Linear(d, d),
            torch.nn.Linear(d, d),
        )
        self.before_read = lambda: None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.before_read()
        return self.b(torch.tanh(F.linear(h, self.proj.weight, self.proj.bias)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tied", "parent_reads"])
def test_weights_read_outside_their_modules_forward_equal_torch(cluster1, kind):
    """A tied head (two modules hold one weight) and a model reading a child's weight without
    calling it: the model's pre-hook writes what no module's hook covered in the step before,
    before the model's forward runs."""
    model, opt, ref, lopt = _pair(cluster1, _TiedLM() if kind == "tied" else _ParentReads())
    owed_at_read = []
    if kind == "parent_reads":
        model.before_read = lambda: owed_at_read.append(
            bool(_buckets(opt, model.proj.weight) & set(opt.worker.defer.owed))
        )
    try:
        for step in range(5):
            _step(model, opt, step) if step == 0 else _owing_step(
                cluster1.procs[0], model, opt, step
            )
            _step(ref, lopt, step)
            assert step == 0 or opt.worker.defer.owed, (
                f"step {step}: no reply left to the next forward"
            )
        assert not any(owed_at_read), f"proj's weights were read while owed ({owed_at_read})"
        opt.synchronize()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_replies_landing_while_owed_are_written_on_arrival():
    """The I/O thread writes an owed bucket's reply as it lands, so its frames are freed then, not
    held until the forward: with every reply in, the parameters (still owed) hold the new
    weights, the filed replies are headers alone, and the forward that follows only takes them."""
    with luwu.local_cluster(1) as c:
        model, opt, ref, lopt = _pair(c)
        try:
            for step in range(2):
                _step(ref, lopt, step)
            _step(model, opt, 0)
            _owing_step(c.procs[0], model, opt, 1)  # every reply lands after step() owed it
            owed = list(opt.worker.defer.owed.values())
            assert len(owed) == 4 and all(_owed(opt, model))
            deadline = time.monotonic() + 20
            while not all(r.done for r in owed):
                assert time.monotonic() < deadline, "the replies did not land"
                time.sleep(0.01)
            assert all(r.msg.header.get(WRITTEN) and r.msg.payload == [] for r in owed)
            assert all(_owed(opt, model))
            assert_params_close(
                [p.detach().clone() for p in model.parameters()], list(ref.parameters())
            )
            model(_batch(2))
            assert not opt.worker.defer.owed
        finally:
            opt.close()


@pytest.mark.timeout(60)
def test_replies_landing_before_step_are_written_in_step(cluster1, monkeypatch):
    """A reply that came before ``step()`` (replies not held, or released by ``step()`` before it
    owed them) is written by ``step()``: its frames are not kept until the next forward, a second
    copy of those weights. The buckets stay out of the forward-order record (no forward read
    them)."""
    monkeypatch.setenv("LUWU_OPTIMIZER__HOLD_REPLIES", "never")  # the node answers during backward
    model, opt, ref, lopt = _pair(cluster1)
    try:
        _step(model, opt, 0)  # (the first step's two-phase round holds its replies until step())
        _step(ref, lopt, 0)
        opt.worker.defer.settle(read=False)  # (as if no forward read them: the record stays empty)
        for step in range(1, 3):
            opt.zero_grad()
            model(_batch(step)).square().mean().backward()
            channels = opt.worker.channels
            replies = [channels[b.id].reply(step, take=False) for b in opt.layout.buckets]
            deadline = time.monotonic() + 20
            while not all(r.done for r in replies):  # every reply in before step()
                assert time.monotonic() < deadline, "the replies did not land"
                time.sleep(0.01)
            opt.step()
            _step(ref, lopt, step)
            assert not opt.worker.defer.owed, "step() wrote the replies that were here"
            assert not any(r is channels[r.bucket].reply(step, take=False) for r in replies), (
                "no reply (nor its frames) is kept for the next forward"
            )
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
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_tensors_without_their_model_are_waited_for_in_step(cluster1):
    """Parameters given without their module (``model.parameters()``): nothing to hook, ``step()``
    waits."""
    model = tanh_mlp()
    ref = copy.deepcopy(model)
    opt = luwu.RemoteOptimizer(
        model.parameters(), nodes=cluster1.addresses, lr=LR, compression=False, bucket_bytes=1088
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=LR)
    try:
        assert opt.worker.defer is None
        for step in range(3):
            _step(model, opt, step)
            _step(ref, lopt, step)
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_a_forward_past_the_models_hook_waits_in_step(cluster1, caplog):
    """``model.forward(x)`` skips the model's own pre-hook: the waits cannot know which reads the
    forward makes, so that step's replies are waited for in ``step()``, with a warning."""
    model, opt, ref, lopt = _pair(cluster1)
    try:
        with caplog.at_level(logging.WARNING, logger="luwu.gpu_workers.layer_waits"):
            for step in range(3):
                opt.zero_grad()
                model.forward(_batch(step)).square().mean().backward()
                opt.step()
                _step(ref, lopt, step)
                assert not opt.worker.defer.owed, f"step {step}: replies left owed"
        assert "forward pre-hook did not run" in caplog.text
        assert_params_close(list(model.parameters()), list(ref.parameters()))
    finally:
        opt.close()

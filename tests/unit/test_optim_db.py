"""The node's optimizers against torch's own optimizer test database (``optim_db``).

For every optimizer a node runs, every CPU case of torch's ``optim_inputs_func`` runs through the
node's path (``BucketState.apply`` over flat buckets, each parameter's state in the bucket's flat
tensors, one parameter split across two buckets on purpose; Adafactor's parameters whole, with their
shaped state per segment) and through the torch optimizer, step by step; every parameter and every
state tensor must agree, to 1e-6 relative (the fused Adam and Adagrad
kernels and RAdam's foreach path round differently from torch's default per-tensor loop; the other
cases agree to the bit). torch's implementation switches (foreach, fused, capturable, differentiable)
are dropped: the node picks its kernel.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

from luwu.switch_nodes.optimizers import (
    IMPLEMENTATION_SWITCHES,
    KINDS,
    check_hyper,
    get_kind,
    torch_scalars,
)
from luwu.switch_nodes.store import BucketState, SegmentSpec, SegmentState

pytestmark = pytest.mark.timeout(120)

SHAPES = [(5, 4), (7,), (3, 2, 2)]
# bucket 0: parameter 0 whole and the first 3 elements of parameter 1; bucket 1: the rest of 1 and 2 whole
BUCKETS = [
    [SegmentSpec(0, 0, 0, 20), SegmentSpec(1, 0, 20, 3)],
    [SegmentSpec(1, 3, 0, 4), SegmentSpec(2, 0, 4, 12)],
]
# a kind that needs its parameters whole (Adafactor): bucket 0 holds parameters 0 and 1, bucket 1 parameter 2
WHOLE_BUCKETS = [
    [SegmentSpec(0, 0, 0, 20, SHAPES[0], True), SegmentSpec(1, 0, 20, 7, SHAPES[1], True)],
    [SegmentSpec(2, 0, 0, 12, SHAPES[2], True)],
]
STEPS = 6
WORKERS = 2  # the accumulator holds the sum of two pushes; the step divides by 2 (grad_scale)


def _cases() -> list:
    out = []
    for info in optim_db:
        name = info.optim_cls.__name__.lower()
        if name not in KINDS:
            continue
        for case in info.optim_inputs_func(device="cpu"):
            kwargs = {k: v for k, v in case.kwargs.items() if k not in IMPLEMENTATION_SWITCHES}
            out.append(
                pytest.param(info.optim_cls, kwargs, id=f"{info.optim_cls.__name__}-{case.desc}")
            )
    return out


CASES = _cases()
SUPPORTED_IN_DB = {
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
}


def _grads(seed: int = 3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) * (1.0 + 0.3 * t) for s in SHAPES] for t in range(STEPS)]


def _node_hyper(kind, kwargs: dict) -> dict:
    """What a worker sends: the group's keys, tensors as floats (RemoteOptimizer's ``_hyper_of``)."""
    h = dict(kind.defaults) | {
        k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()
    }
    check_hyper(kind, h)
    return h


def _node_buckets(kind, params: list[torch.Tensor]) -> list[BucketState]:
    out = []
    for bid, segs in enumerate(WHOLE_BUCKETS if kind.whole_params else BUCKETS):
        b = BucketState(bid, 0, sum(s.numel for s in segs), segs, kind)
        for s, v in zip(segs, b.pviews):
            v.copy_(params[s.param].reshape(-1).narrow(0, s.param_offset, s.numel))
        out.append(b)
    return out


def _node_step(buckets: list[BucketState], grads: list[torch.Tensor], hyper: dict, t: int) -> None:
    for b in buckets:
        acc = b.accumulator(t, 2)
        for s, v in zip(b.segments, b._views(b.buffer(acc))):
            v.copy_(grads[s.param].reshape(-1).narrow(0, s.param_offset, s.numel) * WORKERS)
        acc.hyper = hyper
        b.apply(acc, float(WORKERS))
        b.release(t)
        b.version += 1


def _gather(buckets: list[BucketState], read) -> list[torch.Tensor]:
    """Per parameter, the flat tensor ``read(bucket)`` holds, put together from the segments."""
    out = [torch.full((torch.Size(s).numel(),), float("nan")) for s in SHAPES]
    for b in buckets:
        flat = read(b)
        for s in b.segments:
            out[s.param].narrow(0, s.param_offset, s.numel).copy_(flat.narrow(0, s.offset, s.numel))
    return [t.view(s) for t, s in zip(out, SHAPES)]


def _shaped_state(buckets: list[BucketState], name: str) -> dict[int, torch.Tensor]:
    """Per parameter, its state ``name`` kept per segment (a kind with shaped state: parameters whole)."""
    assert all(isinstance(b.state, SegmentState) for b in buckets)
    return {s.param: t for b in buckets for s, t in zip(b.segments, b.state[name]) if t is not None}


def _segment_steps(buckets: list[BucketState]) -> dict[int, set[float]]:
    steps: dict[int, set[float]] = {}
    for b in buckets:
        for s, st in zip(b.segments, b.steps):
            steps.setdefault(s.param, set()).add(float(st))
    return steps


def test_the_database_covers_every_supported_optimizer():
    names = {p.values[0].__name__ for p in CASES}
    assert names == SUPPORTED_IN_DB
    print(f"optim_db: {len(CASES)} CPU cases of {len(names)} optimizers run on the nodes")
    assert len(CASES) == 68


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_node_matches_torch_on_optim_db_case(cls, kwargs):
    kind = get_kind(cls.__name__)
    torch.manual_seed(0)
    params = [torch.randn(s) for s in SHAPES]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = cls(ref, **kwargs)
    hyper = _node_hyper(kind, kwargs)
    buckets = _node_buckets(kind, params)
    for t, grads in enumerate(_grads()):
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        _node_step(buckets, grads, hyper, t)
        for i, (got, want) in enumerate(zip(_gather(buckets, lambda b: b.params), ref)):
            torch.testing.assert_close(
                got,
                want.detach(),
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, i=i, t=t: f"step {t}, parameter {i}: {m}",
            )
    steps = _segment_steps(buckets)
    for i, p in enumerate(ref):
        st = opt.state[p]
        flat_names = [k for k in st if k not in ("step", "mu_product")]
        assert sorted(flat_names) == sorted(
            n for n in kind.state_for(hyper) if n in kind.state_shapes(p.shape)
        ), "the node keeps the state torch keeps"
        if "step" in st:
            assert steps[i] == {float(st["step"])}
        for k, v in torch_scalars(kind, STEPS, hyper).items():
            torch.testing.assert_close(v, st[k].float(), rtol=0, atol=0)
        for k in flat_names:
            got = (
                _shaped_state(buckets, k)[i]
                if kind.whole_params
                else _gather(buckets, lambda b, k=k: b.state.read(k))[i]
            )
            torch.testing.assert_close(
                got,
                st[k],
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, i=i, k=k: f"parameter {i}, state {k}: {m}",
            )
    unused = {n for n in kind.state_names if n not in kind.state_for(hyper)}
    assert not unused & set(buckets[0].state.allocated()), (
        "state the update does not use is not allocated"
    )

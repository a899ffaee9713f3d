"""Streamed units' storage recycled within its cap (gpu_workers/unit_memory.py; no processes)."""

import torch

from luwu.gpu_workers.unit_memory import UnitMemory
from luwu.gpu_workers.units import free_storage


def _released(*shapes):
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape))
        free_storage(p)
        out.append(p)
    return out


def test_a_released_units_storage_serves_the_next_unit_of_its_size():
    """Two blocks of equal shapes in turn, over several steps: after the first allocation every
    unit's parameter gets the memory the other released, and nothing is allocated afresh."""
    a, b = _released((64, 64), (64, 64))
    mem = UnitMemory(cap_bytes=2 * a.nbytes)
    mem.alloc(a)
    first = a.data_ptr()
    storage_of_b = b.untyped_storage()
    for _ in range(3):  # forward a, forward b, backward b, backward a
        mem.release(a)
        mem.alloc(b)
        assert b.data_ptr() == first and a.untyped_storage().nbytes() == 0
        mem.release(b)
        mem.alloc(a)
        assert a.data_ptr() == first
    assert mem.fresh == 1
    # the parameter keeps its storage object (autograd's saved views hold it): only memory moves
    assert b.untyped_storage()._cdata == storage_of_b._cdata


def test_kept_and_lent_storage_stay_within_the_cap():
    a, b, c = _released((32, 32), (32, 32), (32, 32))
    size = a.nbytes
    mem = UnitMemory(cap_bytes=2 * size)
    for p in (a, b, c):  # three at once: past the cap, lent anyway
        mem.alloc(p)
    assert mem.lent_bytes == 3 * size and mem.fresh == 3
    for p in (a, b, c):
        mem.release(p)
        assert mem.lent_bytes + mem.kept_bytes <= 2 * size or mem.kept_bytes == 0
        assert p.untyped_storage().nbytes() == 0
    assert mem.kept_bytes == 2 * size  # (the first release freed its storage: over the cap)
    (d,) = _released((16, 16))  # another size: the kept storage makes room for it
    mem.alloc(d)
    assert mem.lent_bytes + mem.kept_bytes <= 2 * size
    mem.clear()
    assert mem.kept_bytes == 0


def test_released_and_reused_storage_keeps_autograd_exact():
    """A unit released after its forward gets another unit's memory back for its backward (the
    weights written again): gradients equal those of a module never released."""
    torch.manual_seed(0)
    lin, other, ref = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
    ref.load_state_dict(lin.state_dict())
    saved = {n: p.detach().clone() for n, p in lin.named_parameters()}
    mem = UnitMemory(cap_bytes=1 << 20)
    x = torch.randn(3, 6)
    out = lin(x)
    for p in lin.parameters():
        mem.release(p)
    for p in other.parameters():  # the other unit runs on the released memory meanwhile
        mem.release(p)
        mem.alloc(p)
        p.data.fill_(7.0)
        mem.release(p)
    for n, p in lin.named_parameters():
        mem.alloc(p)
        p.data.copy_(saved[n])
    out.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)

"""Streaming units, the per-unit layout, the buffer pool and released parameter storage (no processes)."""

import pytest
import torch

from luwu.gpu_workers.pool import BufferPool
from luwu.gpu_workers.streaming import patterns_of, pool_budget_bytes
from luwu.gpu_workers.units import alloc_storage, free_storage, select_units, unit_of_params
from luwu.protocol.errors import ConfigError
from luwu.protocol.layout import ParamSpec, build_layout
from luwu.protocol.memory import thp_mode, vm_flags


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc(x))


class Net(torch.nn.Module):
    def __init__(self, n=3, d=8):
        super().__init__()
        self.embed = torch.nn.Linear(4, d)
        self.small = torch.nn.Sequential(
            torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        )  # fewer parameters
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 2)


def test_default_units_are_the_blocks_of_the_largest_list():
    units = select_units(Net())
    assert [u.name for u in units] == ["layers.0", "layers.1", "layers.2"]
    assert [u.index for u in units] == [0, 1, 2]


def test_units_by_class_and_by_pattern_take_the_outermost_match():
    net = Net()
    assert [u.name for u in select_units(net, [Block])] == ["layers.0", "layers.1", "layers.2"]
    assert [u.name for u in select_units(net, ["layers.*"])] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]  # not layers.0.fc
    assert [u.name for u in select_units(net, "Block")] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]  # a class name
    assert [u.name for u in select_units(net, ["small", "head"])] == ["small", "head"]


def test_bad_unit_choices_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="no nn.ModuleList"):
        select_units(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="match no submodule"):
        select_units(Net(), ["nothing.*"])
    with pytest.raises(ConfigError, match="nn.Module"):
        select_units([torch.zeros(2)])


def test_a_parameter_shared_by_two_units_stays_with_the_root():
    net = Net()
    net.layers[1].fc.weight = net.layers[0].fc.weight  # tied
    of = unit_of_params(select_units(net))
    assert id(net.layers[0].fc.weight) not in of
    assert of[id(net.layers[0].fc.bias)] == 0 and of[id(net.layers[2].norm.weight)] == 2


def test_patterns_of_keeps_only_what_the_config_can_hold():
    assert patterns_of(None) is None and patterns_of("layers.*") == ["layers.*"]
    assert patterns_of(["a", "b"]) == ["a", "b"] and patterns_of([Block, "a"]) is None


def test_buckets_never_span_units_and_resident_layouts_keep_their_hash():
    shapes = [(8, 4), (8,), (8, 8), (8,), (8,), (8,), (8, 8), (8,), (8,), (8,), (2, 8), (2,)]
    plain = [ParamSpec(f"p{i}", s) for i, s in enumerate(shapes)]
    units = [-1, -1, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1]
    streamed = [ParamSpec(f"p{i}", s, unit=u) for i, (s, u) in enumerate(zip(shapes, units))]
    big = 1 << 20  # one bucket would hold everything of a class
    a, b = build_layout(plain, big, [1.0, 1.0]), build_layout(streamed, big, [1.0, 1.0])
    assert a.hash == build_layout([ParamSpec(p.name, p.shape) for p in plain], big, [1.0, 1.0]).hash
    assert a.hash != b.hash
    for bucket in b.buckets:
        assert len({units[s.param] for s in bucket.segments}) == 1
    by_unit = b.unit_buckets()
    assert sorted(by_unit) == [0, 1]
    assert sorted(s.param for bid in by_unit[0] for s in b.buckets[bid].segments) == [2, 3, 4, 5]
    assert pool_budget_bytes(b, 2) == 4 * 4 * (64 + 8 * 3)


def test_pool_reuses_buffers_and_reclaims_over_budget():
    pool = BufferPool(budget_bytes=3 * 40)
    first = pool.take(10)
    pool.give(first)
    assert pool.take(10) is first  # given back: lent again, nothing allocated
    lent = [first, pool.take(10), pool.take(10)]
    calls = []

    def reclaim():
        calls.append(1)
        if lent:
            pool.give(lent.pop())
            return True
        return False

    freed = lent[-1]
    again = pool.take(
        10, reclaim
    )  # over the budget: one reclaim gives a buffer back, which is lent again
    assert calls == [1] and again is freed
    assert pool.lent_bytes == 3 * 40 and pool.peak_bytes == 3 * 40


def test_released_parameters_keep_working_with_autograd():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    ref = torch.nn.Linear(6, 6)
    ref.load_state_dict(lin.state_dict())
    saved = {n: p.detach().clone() for n, p in lin.named_parameters()}
    x = torch.randn(3, 6)
    out = lin(x)
    for p in lin.parameters():  # released after forward, as a streaming worker does
        free_storage(p)
        assert p.untyped_storage().nbytes() == 0
    for n, p in lin.named_parameters():  # fetched again before backward
        alloc_storage(p)
        p.data.copy_(saved[n])
    out.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_unit_over_the_budget_is_refused_naming_it_and_its_size():
    from luwu.gpu_workers.streaming import check_budget

    net = Net(n=2, d=8)
    units = select_units(net)
    of = unit_of_params(units)
    specs = [
        ParamSpec(n, tuple(p.shape), unit=of.get(id(p), -1)) for n, p in net.named_parameters()
    ]
    layout = build_layout(specs, 1 << 20, [1.0])
    per_unit = 8 * 8 + 8 + 8 + 8  # fc weight and bias, norm weight and bias
    check_budget(layout, units, 8 * per_unit)  # fits exactly
    check_budget(layout, units, 0)  # no limit
    with pytest.raises(
        ConfigError, match=r"unit 'layers.0' \(Block\) has 88 parameters.*stream_budget_bytes"
    ):
        check_budget(layout, units, 8 * per_unit - 1)


@pytest.mark.skipif(
    thp_mode() in (None, "never"),
    reason="no transparent huge pages in this kernel",
)
def test_a_large_unit_storage_comes_back_under_huge_page_advice():
    """The storage a streamed parameter gets back before its unit runs is advised for 2 MiB pages (its first
    write faults 512x fewer pages)."""
    big = torch.empty(4 << 20)  # 16 MiB
    free_storage(big)
    alloc_storage(big)
    assert "hg" in vm_flags(big.data_ptr() + (8 << 20))
    big.fill_(1.0)  # (and it is ordinary memory)
    assert float(big.sum()) == big.numel()

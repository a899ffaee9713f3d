"""A node sums a (step, bucket)'s pushes as a pairwise tree over the ranks: the same bits whatever
order the pushes arrive in, equal to the tree written top-down, with few partial sums at once."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from luwu.protocol.codecs import get_codec
from luwu.switch_nodes.summation import RankTree, Summed, aligned_blocks

pytestmark = pytest.mark.timeout(120)

NUMEL = 4099


def _pushes(codec_name: str, n: int, seed: int = 0) -> list[tuple]:
    codec = get_codec(codec_name)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(NUMEL, generator=g) * torch.rand(NUMEL, generator=g).exp() * 3
        enc = codec.encode(x.clone(), codec.alloc(NUMEL))
        out.append(
            (codec, [f.contiguous().view(torch.uint8).clone() for f in enc.frames], enc.meta)
        )
    return out


class Buffers:
    """take/give with a count of the partial sums alive at once."""

    def __init__(self):
        self.live = self.peak = 0

    def take(self) -> torch.Tensor:
        self.live += 1
        self.peak = max(self.peak, self.live)
        return torch.full((NUMEL,), float("nan"))

    def give(self, buf: torch.Tensor) -> None:
        self.live -= 1


def _tree_sum(pushes: list[tuple], order: list[int], alpha: float) -> tuple[torch.Tensor, int]:
    bufs = Buffers()
    ranks = tuple(range(10, 10 + len(pushes)))  # (ranks need not start at 0)
    tree = RankTree(ranks, alpha)
    for pos in order:
        assert not tree.complete
        tree.add(ranks[pos], pushes[pos], bufs.take, bufs.give)
    assert tree.complete
    out = tree.result(bufs.take, bufs.give)
    assert bufs.live == 1
    return out, bufs.peak


def _top_down(pushes: list[tuple], alpha: float) -> torch.Tensor:
    """The same tree, written recursively: the count split into aligned power-of-two blocks from the
    left, each the sum of its halves (a pair in one decode, a single push alone), blocks added left
    to right."""

    def block(lo: int, size: int) -> torch.Tensor:
        out = torch.empty(NUMEL)
        if size == 1:
            c, f, m = pushes[lo]
            c.decode_(out, f, m, alpha)
        elif size == 2:
            (c, f0, m0), (_, f1, m1) = pushes[lo], pushes[lo + 1]
            c.decode_pair_(out, (f0, m0), (f1, m1), alpha)
        else:
            out = block(lo, size // 2) + block(lo + size // 2, size // 2)
        return out

    total, lo, n = None, 0, len(pushes)
    for k in reversed(range(n.bit_length())):
        if n >> k & 1:
            b = block(lo, 1 << k)
            total = b if total is None else total + b
            lo += 1 << k
    return total


def _arrival_sum(pushes: list[tuple], order: list[int], alpha: float) -> torch.Tensor:
    """What a node summed before: the first two pushes to arrive in one pass, the others added as they came."""
    out = torch.empty(NUMEL)
    (c, f0, m0), (_, f1, m1) = pushes[order[0]], pushes[order[1]]
    c.decode_pair_(out, (f0, m0), (f1, m1), alpha)
    for pos in order[2:]:
        c, f, m = pushes[pos]
        c.decode_add_(out, f, m, alpha)
    return out


@pytest.mark.parametrize("codec_name", ["none", "int8", "bf16"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16])
def test_every_arrival_order_gives_the_bits_of_the_tree(codec_name, n):
    pushes, alpha = _pushes(codec_name, n, seed=n), 1.0 / n
    want = _top_down(pushes, alpha)
    orders = list(itertools.permutations(range(n))) if n <= 4 else []
    rng = random.Random(n)
    orders += [rng.sample(range(n), n) for _ in range(24)] + [list(range(n))[::-1]]
    for order in orders:
        got, peak = _tree_sum(pushes, order, alpha)
        assert torch.equal(got, want), f"arrival order {order}"
        assert peak <= max(1, n.bit_length()), (order, peak)  # a binary counter's blocks, + one
    exact = torch.stack([_top_down([p], 1.0) for p in pushes]).double().sum(0) / n
    torch.testing.assert_close(want.double(), exact, rtol=1e-5, atol=1e-6)


def test_summed_as_they_arrive_the_bits_depend_on_the_order():
    """Why the tree: five pushes added in arrival order differ in the last bits between orders."""
    pushes, alpha = _pushes("none", 5, seed=5), 0.2
    sums = {
        _arrival_sum(pushes, order, alpha).numpy().tobytes()
        for order in itertools.permutations(range(5))
    }
    assert len(sums) > 1
    assert (
        len(
            {
                _tree_sum(pushes, list(order), alpha)[0].numpy().tobytes()
                for order in itertools.permutations(range(5))
            }
        )
        == 1
    )


def test_two_pushes_keep_the_one_pass_sum():
    """With two workers the tree is the one decode of both that a node always made (either order)."""
    pushes = _pushes("bf16", 2, seed=2)
    for order in ([0, 1], [1, 0]):
        got, peak = _tree_sum(pushes, order, 0.5)
        assert torch.equal(got, _arrival_sum(pushes, order, 0.5)) and peak == 1


def test_a_step_that_goes_on_without_some_ranks_sums_those_that_came():
    """Elastic mode drops a rank mid-step: the pushes that came are summed (the waiting ones in rank
    order), and an abandoned step gives its partial sums back."""
    pushes = _pushes("none", 4, seed=4)
    bufs, ranks = Buffers(), (0, 1, 2, 3)
    tree = RankTree(ranks, 0.25)
    for pos in (1, 2, 3):  # rank 0 never pushes: nothing can be folded
        tree.add(ranks[pos], pushes[pos], bufs.take, bufs.give)
    assert bufs.live == 0 and not tree.complete
    out = tree.result(bufs.take, bufs.give)
    want = sum(_top_down([p], 1.0) for p in pushes[1:]) / 4
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    tree = RankTree(ranks, 0.25)
    for pos in (0, 1):
        tree.add(ranks[pos], pushes[pos], bufs.take, bufs.give)
    assert bufs.live == 2  # (the first result, and this pair)
    tree.release(bufs.give)
    assert bufs.live == 1


def test_a_group_is_cut_into_the_trees_aligned_blocks():
    ranks = tuple(range(8))
    assert aligned_blocks(ranks, (0, 1, 2, 3)) == [(0, 1, 2, 3)]
    assert aligned_blocks(ranks, (2, 3, 4, 5, 6)) == [(2, 3), (4, 5), (6,)]
    assert aligned_blocks(ranks, (3, 4, 5, 6, 7)) == [(3,), (4, 5, 6, 7)]
    assert aligned_blocks(tuple(range(6)), (4, 5)) == [(4, 5)]
    with pytest.raises(ValueError, match="contiguous"):
        aligned_blocks(ranks, (1, 3))


@pytest.mark.parametrize("codec_name", ["none", "int8"])
@pytest.mark.parametrize("n,groups", [(4, [2, 2]), (8, [4, 4]), (7, [3, 4]), (5, [5]), (6, [4, 2])])
def test_aggregators_sums_folded_in_give_the_flat_trees_bits(codec_name, n, groups):
    """Each group's blocks summed apart (as an aggregator does, times the node's 1/n) and sent as fp32:
    the node's tree with those blocks folded in, in any order, has the flat tree's bits."""
    pushes, alpha, none = _pushes(codec_name, n, seed=n), 1.0 / n, get_codec("none")
    want, _ = _tree_sum(pushes, list(range(n)), alpha)
    ranks = tuple(range(10, 10 + n))
    items, first = [], 0
    for size in groups:
        for block in aligned_blocks(ranks, ranks[first : first + size]):
            pos = [ranks.index(r) for r in block]
            if len(block) == 1:
                items.append((block, pushes[pos[0]]))
                continue
            sub = RankTree(block, alpha)
            for r, p in zip(block, pos):
                sub.add(r, pushes[p], Buffers().take, lambda b: None)
            total = sub.result(Buffers().take, lambda b: None)
            frames = [total.view(torch.uint8)]
            items.append((block, (Summed(none, 1.0, len(block)), frames, {})))
        first += size
    for order in (items, items[::-1]):
        bufs, tree = Buffers(), RankTree(ranks, alpha)
        for block, push in order:
            if len(block) == 1:
                tree.add(block[0], push, bufs.take, bufs.give)
            else:
                assert tree.fits(block)
                tree.add_block(block, push, bufs.take, bufs.give)
        assert tree.complete
        assert tree.result(bufs.take, bufs.give).equal(want)


def test_a_block_that_is_no_subtree_does_not_fit():
    tree = RankTree(tuple(range(8)), 0.125)
    assert tree.fits((0, 1)) and tree.fits((4, 5, 6, 7))
    assert not tree.fits((1, 2)), "not aligned"
    assert not tree.fits((0, 1, 2)), "not a power of two"
    assert not tree.fits((8, 9)), "not the tree's ranks"

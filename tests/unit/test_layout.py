"""Layout properties: every element owned exactly once, balanced, deterministic, groups apart."""

from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.protocol.layout import ParamSpec, build_layout

shapes = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple), min_size=1, max_size=25)


def specs_of(shape_list, groups=1):
    return [ParamSpec(f"p{i}", s, i % groups) for i, s in enumerate(shape_list)]


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(16, 4096), st.integers(1, 5), st.integers(1, 3))
def test_every_element_owned_exactly_once(shape_list, bucket_bytes, num_nodes, groups):
    specs = specs_of(shape_list, groups)
    layout = build_layout(specs, bucket_bytes, [1.0] * num_nodes)
    covered = {i: [] for i in range(len(specs))}
    for b in layout.buckets:
        assert b.numel <= bucket_bytes // 4
        assert len({specs[s.param].group for s in b.segments}) == 1 == len({b.group})
        off = 0
        for s in b.segments:
            assert s.offset == off
            off += s.numel
            covered[s.param].append((s.param_offset, s.numel))
        assert off == b.numel
    for i, spans in covered.items():
        pos = 0
        for start, n in sorted(spans):
            assert start == pos
            pos += n
        assert pos == specs[i].numel


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(64, 2048), st.integers(1, 5))
def test_balanced_within_one_bucket(shape_list, bucket_bytes, num_nodes):
    layout = build_layout(specs_of(shape_list), bucket_bytes, [1.0] * num_nodes)
    loads = layout.node_bytes()
    biggest = max(b.nbytes for b in layout.buckets)
    assert max(loads) - min(loads) <= biggest


def test_capacity_weights_the_layout():
    specs = [ParamSpec(f"p{i}", (256,)) for i in range(60)]
    layout = build_layout(specs, 1024, [2.0, 1.0])
    a, b = layout.node_bytes()
    assert abs(a / b - 2.0) < 0.1


def test_deterministic_and_hash_changes_with_model():
    specs = specs_of([(10, 10), (10,), (3, 4, 5)])
    a = build_layout(specs, 256, [1.0, 1.0])
    b = build_layout(list(specs), 256, [1.0, 1.0])
    assert a == b and a.hash == b.hash
    c = build_layout(specs_of([(10, 10), (11,), (3, 4, 5)]), 256, [1.0, 1.0])
    assert c.hash != a.hash
    assert build_layout(specs, 512, [1.0, 1.0]).hash != a.hash


def test_reverse_order_and_large_tensor_spans_buckets():
    specs = [ParamSpec("first", (10,)), ParamSpec("big", (1000,))]
    layout = build_layout(specs, 400, [1.0])
    assert layout.buckets[0].segments[0].name == "big"  # backward produces the last parameter first
    assert sum(1 for b in layout.buckets if any(s.name == "big" for s in b.segments)) == 10


def test_added_group_only_appends_buckets():
    base = specs_of([(10, 10), (10,)])
    more = base + [ParamSpec("extra", (50,), 1)]
    a, b = build_layout(base, 256, [1.0, 1.0]), build_layout(more, 256, [1.0, 1.0])
    assert [x.spec() for x in b.buckets[: len(a.buckets)]] == [x.spec() for x in a.buckets]
    assert [x.node for x in b.buckets[: len(a.buckets)]] == [x.node for x in a.buckets]

"""Layout properties: every element owned exactly once, balanced, deterministic, groups apart."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luwu.protocol.layout import SMALL_NUMEL, ParamSpec, build_layout, is_dense_class

shapes = st.lists(
    st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple), min_size=1, max_size=25
)


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
    assert [x.to_wire() for x in b.buckets[: len(a.buckets)]] == [x.to_wire() for x in a.buckets]
    assert [x.node for x in b.buckets[: len(a.buckets)]] == [x.node for x in a.buckets]


big_or_small = st.lists(
    st.one_of(
        st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
        st.sampled_from([(300, 300), (512, 256), (70000,), (4, 128, 128), (256, 255)]),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=150, deadline=None)
@given(big_or_small, st.integers(1024, 1 << 20), st.integers(1, 3), st.integers(1, 2))
def test_small_and_1d_parameters_never_share_a_bucket_with_large_matrices(
    shape_list, bucket_bytes, num_nodes, groups
):
    """So the policy's one codec per bucket can give every large matrix int8 and every small / 1-D tensor
    bf16; and a group's buckets come in the order backward completes them (streaming pushes)."""
    specs = specs_of(shape_list, groups)
    layout = build_layout(specs, bucket_bytes, [1.0] * num_nodes)
    last_done: dict[int, int] = {}
    for b in layout.buckets:
        classes = {is_dense_class(s.shape) for s in b.segments}
        assert len(classes) == 1, [(s.name, s.shape) for s in b.segments]
        # a bucket is complete when the first-registered parameter it holds has its gradient
        done = min(s.param for s in b.segments)
        assert done <= last_done.get(b.group, len(specs)), (
            "bucket numbered before one that completes earlier"
        )
        last_done[b.group] = done
        # within a class, parameters come in reverse registration order
        params = [s.param for s in b.segments]
        assert params == sorted(params, reverse=True)
    assert [b.group for b in layout.buckets] == sorted(b.group for b in layout.buckets)


def test_dense_class_line():
    assert is_dense_class((65535,)) and is_dense_class((70000,)) and is_dense_class(())
    assert (
        is_dense_class((255, 257))
        and not is_dense_class((256, 256))
        and not is_dense_class((16, 64, 64))
    )
    assert SMALL_NUMEL == 65536


def test_a_transformer_block_splits_into_matrices_and_the_rest():
    specs = [
        ParamSpec("emb", (100, 64)),
        ParamSpec("qkv.weight", (768, 256)),
        ParamSpec("qkv.bias", (768,)),
        ParamSpec("out.weight", (256, 256)),
        ParamSpec("out.bias", (256,)),
        ParamSpec("norm.weight", (256,)),
    ]
    layout = build_layout(specs, 4 << 20, [1.0, 1.0])
    assert [[s.name for s in b.segments] for b in layout.buckets] == [
        ["out.weight", "qkv.weight"],
        ["norm.weight", "out.bias", "qkv.bias", "emb"],
    ]
    assert [b.node for b in layout.buckets] == [0, 1]


def test_hash_pins_the_layout_rule():
    """The hash names the bucketing rule too: a worker bucketing another way (an older release that mixed
    small and large parameters) is refused at HELLO instead of pushing into the wrong segments."""
    layout = build_layout(specs_of([(300, 300), (300,), (10, 10)], 2), 1 << 20, [1.0, 1.0])
    assert layout.hash == "b634169fb284f388", (
        layout.hash
    )  # mixed buckets (before): "6624e127ad02af01"


def test_delayed_parameters_get_buckets_of_their_own():
    """Partial delayed update: a bucket is delayed whole or not at all, whichever class its parameters are."""
    names = [
        ("emb", (100, 64)),
        ("l0.weight", (256, 256)),
        ("l0.bias", (256,)),
        ("l1.weight", (256, 256)),
        ("l1.bias", (256,)),
    ]
    plain = [ParamSpec(n, s) for n, s in names]
    marked = [ParamSpec(n, s, 0, n.startswith(("emb", "l0."))) for n, s in names]
    base, layout = (
        build_layout(plain, 4 << 20, [1.0, 1.0]),
        build_layout(marked, 4 << 20, [1.0, 1.0]),
    )
    assert [[s.name for s in b.segments] for b in base.buckets] == [
        ["l1.weight", "l0.weight"],
        ["l1.bias", "l0.bias", "emb"],
    ]
    assert [[s.name for s in b.segments] for b in layout.buckets] == [
        ["l1.bias"],
        ["l1.weight"],
        ["l0.weight"],
        ["l0.bias", "emb"],
    ]
    assert layout.delayed_buckets() == {2, 3} and base.delayed_buckets() == frozenset()
    assert layout.hash != base.hash, (
        "workers delaying different parameters bucket differently: refused at HELLO"
    )
    assert base.hash == build_layout(plain, 4 << 20, [1.0, 1.0]).hash


def test_a_bucket_goes_through_the_wire_unchanged():
    from luwu.protocol.layout import Bucket

    layout = build_layout(
        [ParamSpec("w", (300, 300)), ParamSpec("b", (300,)), ParamSpec("v", (10, 10), group=1)],
        64 << 10,
        [1.0, 2.0],
    )
    for b in layout.buckets:
        back = Bucket.from_wire(b.to_wire(), node=b.node)
        assert back.to_wire() == b.to_wire() and (back.id, back.node, back.group, back.numel) == (
            b.id,
            b.node,
            b.group,
            b.numel,
        )
        assert [(s.param, s.param_offset, s.offset, s.numel) for s in back.segments] == [
            (s.param, s.param_offset, s.offset, s.numel) for s in b.segments
        ]


@pytest.mark.parametrize(
    "spec",
    [
        None,
        {0: 0},
        [0, 0, 4],
        [0, 0, 4, [[0, 0, 0]]],
        [0, 0, 4, [[0, 0, 0, 3]]],  # covers 3 of 4
        [0, 0, 4, [[0, 0, 1, 4]]],  # not starting at 0
        [0, 0, 4, []],
        [-1, 0, 4, [[0, 0, 0, 4]]],
        [0, 0, 4, [[0, 0, 0, 2], [1, 0, 0, 2]]],  # overlapping
        [0, 0, 4, [[0, 0, 0, 4.0]]],
        [0, 0, True, [[0, 0, 0, 4]]],
    ],
)
def test_a_malformed_bucket_spec_is_a_protocol_error(spec):
    from luwu.protocol.errors import ProtocolError
    from luwu.protocol.layout import Bucket

    with pytest.raises(ProtocolError):
        Bucket.from_wire(spec)


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(16, 4096), st.integers(1, 4))
def test_whole_parameters_are_never_split(shape_list, bucket_bytes, num_nodes):
    """Adafactor's parameters (``whole``): each in exactly one bucket, even one larger than bucket_bytes;
    a bucket over bucket_bytes holds that one parameter only; every element is still owned once."""
    specs = [ParamSpec(f"p{i}", s, whole=True) for i, s in enumerate(shape_list)]
    layout = build_layout(specs, bucket_bytes, [1.0] * num_nodes)
    cap = bucket_bytes // 4
    where: dict[int, list[int]] = {}
    for b in layout.buckets:
        for s in b.segments:
            assert (
                s.whole
                and s.param_offset == 0
                and s.numel == specs[s.param].numel
                and s.shape == specs[s.param].shape
            )
            where.setdefault(s.param, []).append(b.id)
        assert b.numel <= cap or len(b.segments) == 1
    assert sorted(where) == list(range(len(specs))) and all(len(v) == 1 for v in where.values())


def test_an_adafactor_matrix_larger_than_a_bucket_stays_whole_and_its_shape_travels():
    from luwu.protocol.layout import Bucket

    plain = [ParamSpec("w", (300, 300)), ParamSpec("b", (300,)), ParamSpec("v", (10, 10))]
    whole = [ParamSpec(p.name, p.shape, whole=True) for p in plain]
    base, layout = (
        build_layout(plain, 64 << 10, [1.0, 1.0]),
        build_layout(whole, 64 << 10, [1.0, 1.0]),
    )
    assert len([b for b in base.buckets if b.segments[0].name == "w"]) == 6, "split when it may be"
    (w,) = [b for b in layout.buckets if b.segments[0].name == "w"]
    assert w.numel == 90000 > (64 << 10) // 4 and len(w.segments) == 1
    assert layout.hash != base.hash and base.hash == build_layout(plain, 64 << 10, [1.0, 1.0]).hash
    assert w.to_wire()[3] == [[0, 0, 0, 90000, [300, 300]]]
    for b in layout.buckets:
        back = Bucket.from_wire(b.to_wire(), node=b.node)
        assert back.to_wire() == b.to_wire()
        assert [(s.param, s.shape, s.whole) for s in back.segments] == [
            (s.param, s.shape, True) for s in b.segments
        ]


@pytest.mark.parametrize(
    "spec",
    [
        [0, 0, 4, [[0, 0, 0, 4, [2, 3]]]],  # shape of 6 elements
        [0, 0, 4, [[0, 1, 0, 4, [4]]]],  # a whole parameter from its first element only
        [0, 0, 4, [[0, 0, 0, 4, 4]]],
        [0, 0, 4, [[0, 0, 0, 4, [2.0, 2]]]],
        [0, 0, 4, [[0, 0, 0, 4, [-2, -2]]]],
    ],
)
def test_a_malformed_whole_segment_is_a_protocol_error(spec):
    from luwu.protocol.errors import ProtocolError
    from luwu.protocol.layout import Bucket

    with pytest.raises(ProtocolError):
        Bucket.from_wire(spec)

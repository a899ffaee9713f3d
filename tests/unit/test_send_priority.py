"""P3 priority in the worker's send queue: among pushes queued one after another the lowest priority (the
bucket the next forward needs first) goes out first; a message without a priority keeps its place. To a
node that bounds its pushes in flight (WELCOME's ``in_order``) pushes go in the order they were made."""

from __future__ import annotations

import collections

from luwu.gpu_workers.send_order import SendOrder


def _drain(entries):
    q = collections.deque((p, name) for p, name in entries)
    out = []
    while q:
        at = SendOrder.next_out(q)
        out.append(q[at][1])
        del q[at]
    return out


def test_pushes_go_out_lowest_priority_first():
    assert _drain([(5, "last layer"), (3, "middle"), (0, "first layer"), (3, "middle 2")]) == [
        "first layer",
        "middle",
        "middle 2",
        "last layer",
    ]


def test_a_message_without_priority_is_never_overtaken_nor_overtakes():
    # the PULL was queued after the pushes of 4 and 2, before the push of 0: it waits for both, and the
    # push of 0 waits for it
    got = _drain([(4, "push 4"), (2, "push 2"), (None, "pull"), (0, "push 0"), (1, "push 1")])
    assert got == ["push 2", "push 4", "pull", "push 0", "push 1"]
    assert _drain([(None, "hello"), (None, "init"), (1, "push")]) == ["hello", "init", "push"]


def test_a_node_with_a_push_budget_gets_the_pushes_in_the_order_they_were_made():
    order = SendOrder(2)
    order.in_order[1] = True  # node 1's WELCOME said in_order; node 0's did not
    made = [(5, "last layer"), (3, "middle"), (0, "first layer")]
    to_0 = [(order.priority(0, p), name) for p, name in made]
    to_1 = [(order.priority(1, p), name) for p, name in made]
    to_1.append((order.priority(1, -1), "release"))  # a release still overtakes them
    to_1.append((order.priority(1, None), "pull"))
    assert _drain(to_0) == ["first layer", "middle", "last layer"]
    assert _drain(to_1) == ["release", "last layer", "middle", "first layer", "pull"]

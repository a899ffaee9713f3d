"""An aggregator's shared fetches (switch_nodes/tier/fetches.py): the group's PULLs of one bucket in
flight at once go up once, and the answer reaches each rank that waited on it."""

import pytest

from luwu.switch_nodes.tier.fetches import Fetches

pytestmark = pytest.mark.timeout(30)


def test_pulls_of_a_bucket_in_flight_at_once_go_up_once():
    f = Fetches()
    assert f.ask(0, 5, "int8", rank=1), "the first goes up"
    assert not f.ask(0, 5, "int8", rank=2) and not f.ask(0, 5, "int8", rank=3)
    assert not f.ask(0, 5, "int8", rank=2), "(asked again while waiting: counted once)"
    assert f.ask(0, 5, "int8", rank=1), "the first's own retry goes up again"
    assert f.ask(1, 5, "int8", rank=2), "another node's bucket"
    assert f.ask(0, 5, "none", rank=2), "another codec"
    assert not f.ask(0, 5, "int8_delta", rank=3), "answered whole in fp32 too: shared"
    assert f.answered(0, 5, rank=2, codec="none") == [3], "rank 2's fp32 PULL, rank 3 waited on it"
    assert f.answered(0, 5, rank=1, codec="int8") == [2, 3]
    assert f.answered(0, 5, rank=1, codec="int8") == [], "answered once"
    assert f.ask(0, 5, "int8", rank=3), "after the answer a PULL goes up again"


def test_a_rank_with_a_pull_in_flight_in_one_codec_does_not_share_another():
    f = Fetches()
    assert f.ask(0, 5, "int8", rank=1)
    assert f.ask(0, 5, "none", rank=1), "its own second PULL goes up, unshared"
    assert not f.ask(0, 5, "int8", rank=2)
    assert f.answered(0, 5, rank=1, codec="none") == [], "the fp32 answer is not theirs"
    assert f.answered(0, 5, rank=1, codec="int8") == [2], "the int8 answer releases the waiters"
    assert f.in_flight == 0
    assert f.ask(0, 6, "bogus", rank=1) and f.ask(0, 6, "bogus", rank=2), "for the node to refuse"
    assert f.in_flight == 0


def test_an_error_answering_the_pull_reaches_its_waiters():
    f = Fetches()
    assert f.ask(0, 5, "int8", rank=1) and not f.ask(0, 5, "int8", rank=2)
    assert f.answered(0, 5, rank=1, codec=None) == [2]

"""A batch of sends wakes the worker's I/O thread once, as the batch ends (gpu_workers/wake.py): the
client and a scripted node on loopback (a real ROUTER socket), no node process."""

import time

import pytest
from support import scripted_node

from luwu.protocol.messages import Op

JOB = "wake-test"


def _settle(client) -> None:
    """Until the I/O thread took the last wake-up: a send may go out on a poll timeout before its
    wake-up is written, and that wake-up, still undrained, would stand for the next one (one on its
    way is enough), which the counts below would miss."""
    deadline = time.monotonic() + 10
    while client.wake._woken and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_sends_inside_a_batch_wake_the_io_thread_once_and_all_arrive():
    with scripted_node.scripted(JOB) as (node, ident, client, (ch0, ch1)):
        _settle(client)
        before = client.wake.writes
        with client.wake.batched():
            for seq in range(6):
                client.send(0, {"op": Op.HEARTBEAT, "seq": seq})
                with client.wake.batched():  # (nested: still the outer batch's)
                    client.send(0, {"op": Op.HEARTBEAT, "seq": 100 + seq})
            assert client.wake.writes == before  # nothing woken while the batch runs
        assert client.wake.writes == before + 1
        got = [node.recv_multipart() for _ in range(12)]  # every message goes out
        assert len(got) == 12
        _settle(client)
        client.send(0, {"op": Op.HEARTBEAT})  # outside a batch: woken at once
        assert node.recv_multipart()
        assert client.wake.writes == before + 2

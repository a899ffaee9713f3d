"""A wait inside a batch of sends (gpu_workers/wake.py, ``Wake.batched``) first wakes the worker's I/O
thread for the sends before it: the client and a scripted node on loopback (a real ROUTER socket),
no node process."""

import threading

import pytest
from support import scripted_node

JOB = "wake-wait-test"


@pytest.mark.timeout(30)
def test_a_wait_inside_a_batch_first_wakes_the_io_thread_for_the_batch():
    """A PULL sent inside a batch and waited for in the same batch goes out before the wait (one
    wake-up written then), not when the batch ends (it would never end) or the I/O thread's poll
    happens to time out."""
    with scripted_node.scripted(JOB) as (node, ident, client, (ch0, ch1)):
        answered = threading.Event()

        def serve():
            frames = node.recv_multipart()  # the PULL
            assert frames[1:] and answered.is_set() is False
            node.send_multipart([ident, *scripted_node.update(JOB, -1, 0, 2.0)])
            answered.set()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        before = client.wake.writes
        with client.wake.batched():
            reply = ch0.pull("none")
            assert client.wake.writes == before  # queued, the batch holds the wake-up
            got = list(client.arrivals([reply], timeout_s=10, what="weights"))
            assert client.wake.writes == before + 1  # written by the wait, inside the batch
        server.join(10)
        assert answered.is_set() and len(got) == 1
        assert client.wake.writes == before + 1  # nothing left to wake for at the batch's end

"""The node's sending thread (switch_nodes/sender.py): a peer's queued messages with a priority go lowest
first (a step's replies in the next forward's order); a message without one, and one already on its way,
keep their place."""

import socket
import time

import pytest

from luwu.switch_nodes.sender import Sender, Sent


@pytest.mark.timeout(30)
def test_queued_messages_with_a_priority_go_lowest_first_and_others_keep_their_place():
    a, b = socket.socketpair()
    a.setblocking(False)  # as the event loop leaves a peer's socket
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s = Sender()
    try:
        s.add(b"k", a.fileno())
        head = b"H" * (1 << 20)  # fills the socket: what follows queues in the sender
        s.put(b"k", [head], priority=9)
        time.sleep(0.2)  # the head is on its way (partly in the kernel): it stays first
        done = Sent()
        for body, prio in ((b"<3>", 3), (b"<1>", 1), (b"<X>", None), (b"<2>", 2), (b"<0>", 0)):
            s.put(b"k", [body], done if body == b"<0>" else None, priority=prio)
        b.settimeout(10)
        got = b""
        while len(got) < len(head) + 15:
            got += b.recv(1 << 20)
        assert got[: len(head)] == head
        assert got[len(head) :] == b"<1><3><X><0><2>"
        done.wait(5)
    finally:
        s.close()
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_what_a_peer_leaves_unsent_and_for_how_long_is_known_until_it_reads():
    """A peer that does not read: its queued messages' costs count until each is sent whole, and the time
    its queue has not moved grows; once it reads, both are back to 0."""
    a, b = socket.socketpair()
    a.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s = Sender()
    try:
        s.add(b"k", a.fileno())
        s.put(b"k", [b"H" * (1 << 20)], cost=100)  # more than the socket takes
        s.put(b"k", [b"<pong>"], cost=7)
        time.sleep(0.5)
        assert s.unsent(b"k") == 107 and s.stalled_s(b"k") >= 0.3
        b.settimeout(10)
        got = 0
        while got < (1 << 20) + 6:
            got += len(b.recv(1 << 20))
        deadline = time.monotonic() + 5
        while s.unsent(b"k") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.unsent(b"k") == 0 and s.stalled_s(b"k") == 0.0
    finally:
        s.close()
        a.close()
        b.close()

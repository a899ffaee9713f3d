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

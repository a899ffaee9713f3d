"""A ZMTP peer by hand, for tests and studies that attack a node: a libzmq client cannot leave a multipart
message unfinished, send commands of its own, or stop reading its socket."""

from __future__ import annotations

import select
import socket
import struct
import time

from luwu.protocol import messages as wire
from luwu.switch_nodes.zmtp_frames import command, frame_head, property_list, ready

MiB = 1 << 20
PING = command(b"PING", b"\x00\x64" + b"c" * 16)
"""A ZMTP heartbeat (TTL 10 s, a 16-byte context): its PONG is 23 bytes."""


def frame(body: bytes, more: bool = False) -> bytes:
    return frame_head(len(body), more) + body


class RawPeer:
    """A TCP connection that did the ZMTP 3 handshake as a DEALER and sends whatever it is told."""

    def __init__(
        self, addr: str, timeout_s: float = 10.0, rcvbuf: int = 0, secret: str | None = None
    ):
        """``secret``: the join secret shown in READY; None: this process's local clusters' (a holder of the
        job's secret who may then misbehave), '' none (a stranger)."""
        if secret is None:
            from harness import job_secret

            secret = job_secret()
        host, port = addr.split("://", 1)[1].rsplit(":", 1)
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout_s)
        self.sock.connect((host, int(port)))
        greeting = (
            b"\xff" + b"\x00" * 7 + b"\x01\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
        )
        self.sock.sendall(greeting)
        got = self.recv_exact(64)
        assert got[:1] == b"\xff" and got[10] == 3 and got[12:16] == b"NULL", got
        props = {
            b"Socket-Type": b"DEALER",
            **({wire.JOIN_PROPERTY.encode(): secret.encode()} if secret else {}),
        }
        self.sock.sendall(command(b"READY", property_list(props)) if secret else ready(b"DEALER"))
        flags, size = self.recv_exact(2)
        assert flags == 4 and self.recv_exact(size).startswith(b"\x05READY")

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise ConnectionError("closed")
            out += got
        return out

    def send_message(self, frames: list[bytes]) -> None:
        self.sock.sendall(b"".join(frame(f, i < len(frames) - 1) for i, f in enumerate(frames)))

    def recv_message(self) -> list[bytes]:
        frames = []
        while True:
            flags = self.recv_exact(1)[0]
            n = struct.unpack(">Q", self.recv_exact(8))[0] if flags & 2 else self.recv_exact(1)[0]
            frames.append(self.recv_exact(n))
            if not flags & 1:
                return frames

    def closed_by_node(self, within_s: float) -> bool:
        """True once the node ended the connection (EOF or reset) within ``within_s``; what it still
        sends meanwhile is read and dropped."""
        deadline = time.monotonic() + within_s
        self.sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except TimeoutError:
                continue
            except OSError:
                return True
        return False

    def cut_by_node(self, within_s: float) -> bool:
        """True once the node ended the connection (reset or end of writing) within ``within_s``, reading
        nothing meanwhile (a peer that does not read stays one)."""
        poll = select.poll()
        poll.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if poll.poll(200):
                return True
        return False

    def try_send(self, data: bytes) -> None:
        """Send as much as the node takes (it may close the connection halfway)."""
        try:
            self.sock.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()

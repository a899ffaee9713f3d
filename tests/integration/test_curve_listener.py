"""The node's ZMTP listener speaks CURVE (switch_nodes/curve.py): libzmq workers with CURVE keys talk to
it unchanged, only authorized keys get past the handshake, and an *authenticated* peer is held to the
same per-message and per-peer bounds as any other (node.peer_bytes, node.max_message_frames,
node.max_message_bytes), checked on each encrypted frame's size before its buffer exists.

Attackers speak CurveZMQ by hand (:class:`CurvePeer`, PyNaCl): a libzmq client cannot leave a multipart
message unfinished. The first tests run the listener in this process; the last runs a real node with
a key set from `luwu keys` while a worker trains, and compares the run with local AdamW.
"""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import threading
import time
import tomllib

import numpy as np
import pytest
import torch
import zmq
from harness import proc_status
from integration.test_peer_bounds import MiB, RawPeer, answered_then_closed, served  # noqa: F401  (served: the fixture)
from nacl import bindings as nacl

import luwu
from luwu.gpu_workers.config import TransportConfig
from luwu.switch_nodes.curve import CurveKeys
from luwu.switch_nodes.zmtp_frames import command, frame_head, property_list


class CurvePeer(RawPeer):
    """A TCP connection that did the CurveZMQ handshake as a DEALER with the given client keys (z85), and
    sends whatever MESSAGE frames it is told (reading, closing: as :class:`RawPeer`)."""

    def __init__(
        self,
        addr: str,
        server_public: str,
        public: str,
        secret: str,
        timeout_s: float = 10.0,
        padding: bytes = bytes(72),
        rcvbuf: int = 0,
    ):
        host, port = addr.split("://", 1)[1].rsplit(":", 1)
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout_s)
        self.sock.connect((host, int(port)))
        S = zmq.utils.z85.decode(server_public.encode())
        C, c = zmq.utils.z85.decode(public.encode()), zmq.utils.z85.decode(secret.encode())
        self.sock.sendall(
            b"\xff" + b"\x00" * 7 + b"\x01\x7f\x03\x01" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32
        )
        got = self.recv_exact(64)
        assert got[12:17] == b"CURVE", got
        short_pub, short_sec = nacl.crypto_box_keypair()
        self.nonce = 1
        n = self._nonce()
        self.sock.sendall(
            command(
                b"HELLO",
                b"\x01\x00"
                + padding
                + short_pub
                + n
                + nacl.crypto_box(bytes(64), b"CurveZMQHELLO---" + n, S, short_sec),
            )
        )
        name, body = self.recv_command()
        assert name == b"WELCOME", (name, body)
        plain = nacl.crypto_box_open(body[16:], b"WELCOME-" + body[:16], S, short_sec)
        server_short, cookie = plain[:32], plain[32:]
        vouch_nonce = nacl.randombytes(16)
        vouch = nacl.crypto_box(short_pub + S, b"VOUCH---" + vouch_nonce, server_short, c)
        n = self._nonce()
        meta = property_list({b"Socket-Type": b"DEALER"})
        self.sock.sendall(
            command(
                b"INITIATE",
                cookie
                + n
                + nacl.crypto_box(
                    C + vouch_nonce + vouch + meta, b"CurveZMQINITIATE" + n, server_short, short_sec
                ),
            )
        )
        self.key = nacl.crypto_box_beforenm(server_short, short_sec)
        name, body = self.recv_command()
        if name == b"ERROR":
            raise PermissionError(body[1:].decode())
        assert name == b"READY", name
        nacl.crypto_box_open_afternm(body[8:], b"CurveZMQREADY---" + body[:8], self.key)

    def _nonce(self) -> bytes:
        self.nonce += 1
        return struct.pack(">Q", self.nonce - 1)

    def recv_frame(self) -> tuple[int, bytes]:
        flags = self.recv_exact(1)[0]
        n = struct.unpack(">Q", self.recv_exact(8))[0] if flags & 2 else self.recv_exact(1)[0]
        return flags, self.recv_exact(n)

    def recv_command(self) -> tuple[bytes, bytes]:
        flags, data = self.recv_frame()
        assert flags & 4, flags
        return data[1 : 1 + data[0]], data[1 + data[0] :]

    def message_frame(
        self, data: bytes, more: bool = False, nonce: bytes | None = None, is_command: bool = False
    ) -> bytes:
        """One MESSAGE carrying ``data`` (its ZMTP frame, header included; ``is_command``: a command such as PING)."""
        n = nonce or self._nonce()
        body = (
            b"\x07MESSAGE"
            + n
            + nacl.crypto_box_afternm(
                bytes([(1 if more else 0) | (2 if is_command else 0)]) + data,
                b"CurveZMQMESSAGEC" + n,
                self.key,
            )
        )
        return frame_head(len(body), False) + body

    def send_message(self, frames: list[bytes]) -> None:
        self.sock.sendall(
            b"".join(self.message_frame(f, i < len(frames) - 1) for i, f in enumerate(frames))
        )

    def recv_message(self) -> list[bytes]:
        frames = []
        while True:
            _, body = self.recv_frame()
            assert body[:8] == b"\x07MESSAGE", body[:8]
            plain = nacl.crypto_box_open_afternm(
                body[16:], b"CurveZMQMESSAGES" + body[8:16], self.key
            )
            frames.append(plain[1:])
            if not plain[0] & 1:
                return frames


@pytest.fixture
def keys():
    """The node's key pair and two clients' (z85 strings): the first authorized, the second not."""
    pairs = [tuple(k.decode() for k in zmq.curve_keypair()) for _ in range(3)]
    return {
        "server": pairs[0],
        "client": pairs[1],
        "stranger": pairs[2],
        "keys": CurveKeys(*pairs[0], [pairs[1][0]]),
    }


def curve_dealer(addr: str, server_public: str, pair: tuple[str, str]) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (
        server_public.encode(),
        pair[0].encode(),
        pair[1].encode(),
    )
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(addr)
    return s


@pytest.mark.timeout(60)
def test_a_libzmq_curve_dealer_speaks_with_the_listener(served, keys):
    """libzmq's CURVE, as workers speak it: multipart messages with empty, small, staged and in-place
    frames both ways, each frame what was sent; a large frame is opened in place and 64-byte aligned;
    the connection's key is known (tied to ranks by the node); heartbeats (encrypted PING) answered."""
    srv = served(curve=keys["keys"], budget=lambda ident: 16 * MiB)
    s = curve_dealer(srv.address, keys["server"][0], keys["client"])
    s.setsockopt(zmq.HEARTBEAT_IVL, 50)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big = bytes(range(256)) * (3 * MiB // 256)
        sent = [b"head", b"", b"x" * 300, b"y" * (16 * 1024 - 20), big, b"tail"]
        s.send_multipart(sent)
        ident, got, _ = srv.take()
        assert [bytes(f) for f in got] == sent
        assert np.frombuffer(got[4], dtype=np.uint8).ctypes.data % 64 == 0
        assert srv.on_loop(srv.listener.peer_key, ident) == keys["client"][0]
        tracker = srv.on_loop(srv.listener.send, ident, [b"answer", b"", memoryview(big)], True)
        assert s.recv_multipart() == [b"answer", b"", big]
        tracker.wait(5)
        time.sleep(1.0)  # ~20 heartbeats: unanswered, libzmq would drop the connection after 300 ms
        assert not mon.poll(0), "libzmq dropped the connection: PING not answered"
        for i in range(50):  # nonces keep growing both ways
            s.send_multipart([b"again %d" % i])
            ident, got, _ = srv.take()
            srv.on_loop(srv.listener.send, ident, [bytes(got[0])])
            assert s.recv_multipart() == [b"again %d" % i]
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "attack, why",
    [
        ("unfinished", "more than this peer may hold"),
        ("too_large", "a message payload of"),
        ("empty_frames", "more than 8 frames"),
        ("replay", "nonce does not grow"),
        ("forged", "does not open"),
        ("tiny", "a CURVE frame of 5 bytes"),
    ],
)
def test_an_authenticated_peer_past_a_limit_is_disconnected_named_once_and_answered_first(
    served, keys, caplog, attack, why
):
    """A peer that holds an authorized key is bounded as any other: an unfinished message of 1 MiB frames
    past its 3 MiB, a 1 TiB frame announced, 3000 empty frames, a replayed or forged frame, each refused
    on the frame's header (or its box) before it is kept; its earlier message is served and answered
    first, and the log names it once. The listener never holds more than the budget for it."""
    srv = served(curve=keys["keys"], budget=lambda ident: 3 * MiB, max_message_bytes=8 * MiB)
    peer = CurvePeer(srv.address, keys["server"][0], *keys["client"])
    caplog.set_level(logging.WARNING, logger="luwu.switch_nodes.zmtp")
    try:
        peer.send_message([b"first"])
        ident, got, _ = srv.take()
        assert [bytes(f) for f in got] == [b"first"]
        if attack == "unfinished":
            data = peer.message_frame(b"h", True) + b"".join(
                peer.message_frame(bytes(MiB), True) for _ in range(6)
            )
        elif attack == "too_large":
            data = peer.message_frame(b"h", True) + frame_head(1 << 40, False) + bytes(1000)
        elif attack == "empty_frames":
            data = b"".join(peer.message_frame(b"", True) for _ in range(3000))
        elif attack == "replay":
            n = struct.pack(">Q", peer.nonce - 1)  # the nonce of "first"
            data = peer.message_frame(b"again", nonce=n)
        elif attack == "forged":
            frame = bytearray(peer.message_frame(b"x" * 100))
            frame[-1] ^= 1
            data = bytes(frame)
        else:
            data = frame_head(5, False) + b"\x07MESSA"[:5]
        peer.sock.settimeout(10)
        sender = threading.Thread(target=peer.try_send, args=(data,), daemon=True)
        sender.start()
        held = []
        for _ in range(20):
            held.append(srv.on_loop(srv.listener.held, ident))
            time.sleep(0.02)
        assert max(held) <= 3 * MiB, held
        answered_then_closed(srv, peer, ident, caplog, why)
        sender.join(10)
    finally:
        peer.close()


@pytest.mark.timeout(60)
def test_the_handshake_lets_only_authorized_keys_in(served, keys, caplog):
    """A key the node does not list is answered ERROR 400 after INITIATE and closed; a client that does not
    know the node's key (its HELLO does not open), a HELLO whose padding is not zeros, a NULL peer, and a
    libzmq DEALER with an unlisted key are closed at the handshake. Nothing of theirs reaches the node; the authorized key still gets in."""
    srv = served(curve=keys["keys"])
    caplog.set_level(logging.WARNING, logger="luwu.switch_nodes.zmtp")
    with pytest.raises(PermissionError, match="400"):
        CurvePeer(srv.address, keys["server"][0], *keys["stranger"])
    with pytest.raises(ConnectionError):
        CurvePeer(
            srv.address, keys["stranger"][0], *keys["client"]
        )  # HELLO boxed to another server key
    null = socket.create_connection(srv.address.split("//")[1].rsplit(":", 1))
    null.sendall(
        b"\xff" + b"\x00" * 7 + b"\x01\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    )
    null.settimeout(5)
    got = b""
    while chunk := null.recv(1024):
        got += chunk
    assert len(got) == 64  # our greeting, then the end
    null.close()
    s = curve_dealer(srv.address, keys["server"][0], keys["stranger"])
    s.send_multipart([b"let me in"])
    assert not s.poll(500)
    s.close(0)
    with pytest.raises(TimeoutError):
        srv.take(timeout_s=0.5)  # nothing reached the node
    with pytest.raises(ConnectionError):
        CurvePeer(
            srv.address, keys["server"][0], *keys["client"], padding=b"\x01" + bytes(71)
        )  # rfc 26: the padding is zeros
    lines = " ".join(r.getMessage() for r in caplog.records)
    assert f"a CURVE key that is not authorized: {keys['stranger'][0]}" in lines
    assert (
        "a HELLO (wrong server key?) that does not open" in lines
        and "security mechanism 'NULL'" in lines
    )
    assert "a HELLO whose padding is not zeros" in lines
    ok = curve_dealer(srv.address, keys["server"][0], keys["client"])
    ok.send_multipart([b"hi"])
    assert [bytes(f) for f in srv.take()[1]] == [b"hi"]
    ok.close(0)


@pytest.mark.timeout(180)
def test_an_authorized_flood_against_a_curve_node_holds_nothing_and_changes_nothing(
    tmp_path, capfd
):
    """A real node with `luwu keys` (CURVE, the node's own listener: the default) while a worker trains:
    peers holding an authorized key (luwu status's: a monitor key, which may not say HELLO) send
    unfinished messages of 2 MiB frames without end, and 3000 empty frames. Each is cut off before its
    message holds more than a monitor key may hold (node.stranger_bytes, 256 KiB; a worker's key would
    hold node.peer_bytes, here 9 MiB) or 64 frames, and named once; node RSS stays within 24 MiB of what
    it was; the training equals local AdamW."""
    out = subprocess.run(
        [sys.executable, "-m", "luwu", "keys", "--out", str(tmp_path / "keys"), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    node = tomllib.loads((tmp_path / "keys" / "node.toml").read_text())["node"]
    worker = tomllib.loads((tmp_path / "keys" / "worker0.toml").read_text())["transport"]
    monitor = tomllib.loads((tmp_path / "keys" / "monitor.toml").read_text())["transport"]
    args = [
        "--config",
        str(tmp_path / "keys" / "node.toml"),
        "--node.max_message_bytes",
        str(8 * MiB),
    ]
    torch.manual_seed(0)
    model, local = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    local.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(local.parameters(), lr=0.01)
    data = [torch.randn(16, 64) for _ in range(40)]
    with luwu.local_cluster(1, node_args=args) as cluster:
        pid = cluster.procs[0].pid
        opt = luwu.RemoteOptimizer(
            model,
            nodes=cluster.addresses,
            lr=0.01,
            compression=False,
            transport=TransportConfig(timeout_s=30, **worker),
        )
        try:
            before = proc_status(pid)["VmRSS"]
            peers = [
                CurvePeer(
                    cluster.addresses[0],
                    node["curve_public_key"],
                    monitor["curve_public_key"],
                    monitor["curve_secret_key"],
                )
                for _ in range(4)
            ]
            floods = []
            for i, p in enumerate(peers):
                if i % 2 == 0:
                    frames = p.message_frame(b"\x80", True) + b"".join(
                        p.message_frame(bytes(2 * MiB), True) for _ in range(50)
                    )
                else:
                    frames = b"".join(p.message_frame(b"", True) for _ in range(3000))
                floods.append(threading.Thread(target=p.try_send, args=(frames,), daemon=True))
                floods[-1].start()
            for x in data:
                for m, o in ((model, opt), (local, ref)):
                    o.zero_grad()
                    (m(x) ** 2).mean().backward()
                    o.step()
            opt.synchronize()
            for p in peers:
                assert p.closed_by_node(10)
            grown = proc_status(pid)["VmRSS"] - before
            assert grown < 24 * MiB, f"node RSS grew by {grown / MiB:.1f} MiB"
            for p in peers:
                p.close()
        finally:
            opt.close()
    for a, b in zip(model.parameters(), local.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    named = [line for line in capfd.readouterr().err.splitlines() if "disconnecting" in line]
    assert len(named) == 4 and all(
        f"(CURVE key {monitor['curve_public_key']})" in line for line in named
    ), named
    assert (
        sum("more than this peer may hold (262144)" in line for line in named) == 2
        and sum("more than 64 frames" in line for line in named) == 2
    ), named

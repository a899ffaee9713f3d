"""CurveZMQ (https://rfc.zeromq.org/spec/26/), the server's half, as the node's ZMTP listener speaks it.

Workers keep their libzmq DEALER sockets with CURVE keys; the node does the handshake and the per-frame
encryption itself, so that its own framing (:mod:`.zmtp`) bounds what an authenticated peer may hold
per message, as it does without CURVE. The handshake proves, in this order:

- HELLO (200 bytes, its 72 bytes of padding zeros): the client knows the node's public key (a box to
  it opens);
- WELCOME: the node's short-term key and a cookie, boxed to the client's short-term key;
- INITIATE: the cookie comes back, and a vouch boxed by the client's long-term key binds that key to
  this connection; the key must be one of ``node.curve_authorized_keys``, ``node.curve_monitor_keys`` or
  ``node.curve_aggregator_keys``;
- READY: metadata, boxed with the connection's key.

After it every ZMTP frame is a MESSAGE: ``"\\x07MESSAGE"``, an 8-octet nonce that grows by one per
frame, and a box (16 octets of MAC, then the frame's flags and its bytes). The crypto is libsodium's
XSalsa20-Poly1305 through PyNaCl: the handshake with its public functions, the frames with its cffi
library in place (no copy of a frame beyond the one into the sealed buffer), the GIL released while a
frame is sealed or opened.
"""

from __future__ import annotations

import struct

import numpy as np
import zmq.utils.z85
from nacl import bindings as nacl
from nacl._sodium import ffi, lib
from nacl.exceptions import CryptoError

from luwu.switch_nodes.zmtp_frames import Refused, command, frame_head

__all__ = ["OVERHEAD", "CurveError", "CurveKeys", "CurveSession"]

OVERHEAD = 33
"""What a MESSAGE frame carries beyond the frame itself: its name, nonce, MAC and the inner flags."""
HELLO_BYTES = 200
MAX_INITIATE = 1024  # a client's INITIATE with its metadata (libzmq's: ~300 bytes)
_MESSAGE = b"\x07MESSAGE"
_INNER_MORE, _INNER_COMMAND = 0x01, 0x02


class CurveError(Refused):
    """A CURVE handshake or frame failed (the message says why); a key the node does not list is answered
    with ERROR 400, as libzmq's ZAP refusal is."""

    def __init__(self, why: str, unauthorized: bool = False) -> None:
        super().__init__(why, command(b"ERROR", b"\x03400") if unauthorized else None)


class CurveKeys:
    """The node's long-term key pair and the client keys it lets in (z85 strings, as configured): the
    workers', the monitors' and the switch tier's aggregators' (what each may do is the node's to say,
    not the handshake's: :mod:`.peer_roles`)."""

    def __init__(
        self,
        public: str,
        secret: str,
        authorized: list[str],
        monitors: list[str] = (),
        aggregators: list[str] = (),
    ) -> None:
        self.public = zmq.utils.z85.decode(public.encode())
        self.secret = zmq.utils.z85.decode(secret.encode())
        clients = [*authorized, *monitors, *aggregators]
        self.authorized = {zmq.utils.z85.decode(k.encode()): k for k in clients}


def _open(box: bytes, nonce: bytes, pk: bytes, sk: bytes, what: str) -> bytes:
    try:
        return nacl.crypto_box_open(box, nonce, pk, sk)
    except CryptoError:
        raise CurveError(f"a {what} that does not open") from None


def _short_nonce(data: bytes) -> int:
    return int.from_bytes(data, "big")


class CurveSession:
    """One connection's CURVE state. The handshake runs on the event loop; afterwards :meth:`open` runs
    there (frames received) and :meth:`seal` on the sending thread (frames sent), each with its own
    nonce counter."""

    def __init__(self, keys: CurveKeys) -> None:
        self.keys = keys
        self.short_public, self.short_secret = nacl.crypto_box_keypair()
        self.client_short = b""
        self.cookie_key = b""
        self.key = b""  # the connection's precomputed box key (after INITIATE)
        self.client_key = ""  # the client's long-term public key, z85
        self.peer_nonce = 0  # the last nonce the client used: each must be larger
        self.nonce = 1  # the next one we use

    # ---------------------------------------------------------------- handshake
    def welcome(self, hello: bytes) -> bytes:
        """HELLO's body (command name included) -> WELCOME's (after its name)."""
        if len(hello) != HELLO_BYTES or not hello.startswith(b"\x05HELLO"):
            raise CurveError(f"a CURVE HELLO of {len(hello)} bytes (expected {HELLO_BYTES})")
        if hello[6:8] != b"\x01\x00":
            raise CurveError(f"CURVE version {hello[6]}.{hello[7]} (this node speaks 1.0)")
        if hello[8:80] != bytes(72):
            raise CurveError(
                "a HELLO whose padding is not zeros (rfc 26: its anti-amplification padding must be)"
            )
        self.client_short, short = hello[80:112], hello[112:120]
        if _open(
            hello[120:200],
            b"CurveZMQHELLO---" + short,
            self.client_short,
            self.keys.secret,
            "HELLO (wrong server key?)",
        ) != bytes(64):
            raise CurveError("a HELLO whose signature box is not zeros")
        self.peer_nonce = _short_nonce(short)
        self.cookie_key = nacl.randombytes(32)
        cookie_nonce = nacl.randombytes(16)
        cookie = cookie_nonce + nacl.crypto_secretbox(
            self.client_short + self.short_secret, b"COOKIE--" + cookie_nonce, self.cookie_key
        )
        welcome_nonce = nacl.randombytes(16)
        box = nacl.crypto_box(
            self.short_public + cookie,
            b"WELCOME-" + welcome_nonce,
            self.client_short,
            self.keys.secret,
        )
        return welcome_nonce + box

    def initiate(self, body: bytes) -> bytes:
        """INITIATE's body -> its metadata (ZMTP properties). Raises :class:`CurveError` unless the client
        proved it holds an authorized key."""
        if len(body) < 257 or not body.startswith(b"\x08INITIATE"):
            raise CurveError(f"a CURVE INITIATE of {len(body)} bytes")
        try:
            cookie = nacl.crypto_secretbox_open(
                body[25:105], b"COOKIE--" + body[9:25], self.cookie_key
            )
        except CryptoError:
            raise CurveError("an INITIATE with a cookie this node did not give") from None
        if cookie != self.client_short + self.short_secret:
            raise CurveError("an INITIATE with another connection's cookie")
        short = body[105:113]
        if _short_nonce(short) <= self.peer_nonce:
            raise CurveError("an INITIATE whose nonce does not grow")
        self.peer_nonce = _short_nonce(short)
        plain = _open(
            body[113:],
            b"CurveZMQINITIATE" + short,
            self.client_short,
            self.short_secret,
            "INITIATE",
        )
        client, vouch_nonce, vouch = plain[:32], plain[32:48], plain[48:128]
        if (
            _open(vouch, b"VOUCH---" + vouch_nonce, client, self.short_secret, "vouch")
            != self.client_short + self.keys.public
        ):
            raise CurveError("a vouch for another connection or node")
        if client not in self.keys.authorized:
            raise CurveError(
                f"a CURVE key that is not authorized: {zmq.utils.z85.encode(client).decode()}",
                unauthorized=True,
            )
        self.client_key = self.keys.authorized[client]
        self.key = nacl.crypto_box_beforenm(self.client_short, self.short_secret)
        return plain[128:]

    def ready(self, metadata: bytes) -> bytes:
        """READY's body (after its name), carrying ``metadata`` (ZMTP properties)."""
        short = self._next_nonce()
        return short + nacl.crypto_box_afternm(metadata, b"CurveZMQREADY---" + short, self.key)

    def _next_nonce(self) -> bytes:
        n, self.nonce = self.nonce, self.nonce + 1
        return struct.pack(">Q", n)

    # ---------------------------------------------------------------- frames
    def check(self, frame: memoryview) -> None:
        """A MESSAGE's name and nonce (its first 16 bytes), before its box is opened."""
        if frame[:8] != _MESSAGE:
            raise CurveError("a frame that is not a CURVE MESSAGE")
        n = _short_nonce(bytes(frame[8:16]))
        if n <= self.peer_nonce:
            raise CurveError("a MESSAGE whose nonce does not grow (a replay?)")
        self.peer_nonce = n

    def open(self, frame: memoryview, out: memoryview) -> tuple[bool, bool]:
        """Open a received MESSAGE ``frame`` (all of it) into ``out``: its flags byte, then the frame's
        bytes (``len(frame) - 32`` in all; ``out`` may be ``frame[32:]``: opened in place). Returns
        (more, command)."""
        self.check(frame)
        c = ffi.from_buffer(frame)
        m = ffi.from_buffer(out, require_writable=True)
        if (
            lib.crypto_box_open_easy_afternm(
                m, c + 16, len(frame) - 16, b"CurveZMQMESSAGEC" + bytes(frame[8:16]), self.key
            )
            != 0
        ):
            raise CurveError("a MESSAGE that does not open (corrupted or forged)")
        flags = out[0]
        return bool(flags & _INNER_MORE), bool(flags & _INNER_COMMAND)

    def seal(self, frames: list, command: bool = False) -> list:
        """A message's frames -> the ZMTP frames that carry them as MESSAGEs (on the sending thread)."""
        out = []
        last = len(frames) - 1
        for i, f in enumerate(frames):
            data = np.frombuffer(f, dtype=np.uint8) if len(f) else np.empty(0, np.uint8)
            n = data.nbytes
            head = frame_head(n + OVERHEAD, False)  # the frame's own flags travel inside the box
            h = len(head)
            buf = np.empty(h + n + OVERHEAD, dtype=np.uint8)
            short = self._next_nonce()
            buf[:h] = np.frombuffer(head, np.uint8)
            buf[h : h + 8] = np.frombuffer(_MESSAGE, np.uint8)
            buf[h + 8 : h + 16] = np.frombuffer(short, np.uint8)
            buf[h + 32] = (_INNER_MORE if i < last else 0) | (_INNER_COMMAND if command else 0)
            buf[h + 33 :] = data
            p = ffi.from_buffer(buf, require_writable=True)
            lib.crypto_box_easy_afternm(
                p + h + 16, p + h + 32, n + 1, b"CurveZMQMESSAGES" + short, self.key
            )
            out.append(buf)
        return out

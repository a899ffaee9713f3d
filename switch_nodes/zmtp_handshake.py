"""A connection's ZMTP handshake, up to READY, as the node's listener (:mod:`.zmtp`) runs it: the greeting,
then the security mechanism's commands. NULL: the peer's READY (with the job's secret, if the node has
one). CURVE (:mod:`.curve`): HELLO, WELCOME, INITIATE, READY; only a key the node authorizes gets through.
Nothing of the job is allocated or answered before it is through."""

from __future__ import annotations

import hmac
import logging
import struct
import time

from luwu.protocol.messages import JOIN_PROPERTY
from luwu.switch_nodes.curve import MAX_INITIATE, CurveKeys, CurveSession
from luwu.switch_nodes.zmtp_frames import (
    COMMAND,
    GREETING_BYTES,
    LONG,
    Refused,
    command,
    greeting,
    properties,
    property_list,
    ready,
)

__all__ = ["BUFFER_BYTES", "Handshake", "StrangerLog", "command_at"]

log = logging.getLogger("luwu.switch_nodes.zmtp")  # the listener's lines

BUFFER_BYTES = 2048  # the greeting and the handshake's commands: they fit whole
_JOIN = JOIN_PROPERTY.lower().encode()


def command_at(buf: bytearray, at: int, fill: int) -> tuple[bytes | None, int]:
    """The handshake command frame at ``buf[at:fill]``: (its body, bytes it takes), (None, 0) while
    incomplete. Raises :class:`Refused` on anything else."""
    got = fill - at
    if got < 2:
        return None, 0
    flags = buf[at]
    if flags & ~(COMMAND | LONG) or not flags & COMMAND:
        raise Refused("expected a handshake command after the greeting")
    head = 9 if flags & LONG else 2
    if got < head:
        return None, 0
    size = struct.unpack_from(">Q", buf, at + 1)[0] if flags & LONG else buf[at + 1]
    if size > BUFFER_BYTES - GREETING_BYTES - head:
        raise Refused(f"a handshake command of {size} bytes")
    if got < head + size:
        return None, 0
    return bytes(buf[at + head : at + head + size]), head + size


class Handshake:
    """One connection's greeting and mechanism, up to READY (see the module's doc)."""

    def __init__(self, curve_keys: CurveKeys | None, join_secret: bytes) -> None:
        self.curve = CurveSession(curve_keys) if curve_keys is not None else None
        self.mechanism = b"CURVE" if self.curve is not None else b"NULL"
        self.join_secret = join_secret
        self.state = "hello" if self.curve is not None else "ready"

    def greeting(self) -> bytes:
        return greeting(self.mechanism)

    def check_start(self, start: bytes) -> None:
        """The first bytes of a greeting still on its way: a peer that is not ZMTP is refused at once."""
        if len(start) >= 1 and start[0] != 0xFF or len(start) >= 10 and start[9] & 1 == 0:
            raise Refused("not a ZMTP peer")

    def on_greeting(self, g: bytes) -> None:
        self.check_start(g)
        if g[10] < 3:
            raise Refused(f"not a ZMTP 3 peer (version {g[10]}.{g[11]})")
        mech = bytes(g[12:32]).rstrip(b"\x00")
        if mech != self.mechanism:
            keys = "CURVE keys configured" if self.curve is not None else "no CURVE keys configured"
            raise Refused(
                f"security mechanism {mech.decode('ascii', 'replace')!r}: this node speaks {self.mechanism.decode()} ({keys})"
            )

    def on_command(self, body: bytes) -> tuple[bytes, bool]:
        """A handshake command's body -> (the command frame to answer with, whether the handshake is through)."""
        if self.state == "hello":
            if not body.startswith(b"\x05HELLO"):
                raise Refused("expected a CURVE HELLO after the greeting")
            self.state = "initiate"
            return command(b"WELCOME", self.curve.welcome(body)), False
        if self.state == "initiate":
            if not body.startswith(b"\x08INITIATE") or len(body) > MAX_INITIATE:
                raise Refused(
                    f"expected a CURVE INITIATE of at most {MAX_INITIATE} bytes after WELCOME"
                )
            props = self._properties(self.curve.initiate(body))
            self._check_type(props)
            self.state = "done"
            return command(
                b"READY", self.curve.ready(property_list({b"Socket-Type": b"ROUTER"}))
            ), True
        if not body.startswith(b"\x05READY"):
            raise Refused("expected READY after the greeting")
        props = self._properties(body[6:])
        self._check_type(props)
        if self.join_secret and not hmac.compare_digest(props.get(_JOIN, b""), self.join_secret):
            raise Refused("no join secret" if _JOIN not in props else "a wrong join secret")
        self.state = "done"
        return ready(b"ROUTER"), True

    @staticmethod
    def _properties(data: bytes) -> dict[bytes, bytes]:
        try:
            return properties(data)
        except ValueError:
            raise Refused("a torn property list in the handshake") from None

    @staticmethod
    def _check_type(props: dict[bytes, bytes]) -> None:
        kind = props.get(b"socket-type", b"")
        if kind != b"DEALER":
            raise Refused(
                f"socket type {kind.decode('ascii', 'replace')!r}: a node serves DEALER sockets"
            )


class StrangerLog:
    """How many strangers' disconnections were logged this minute: a stranger opening connection after
    connection must not write the node's log for it."""

    LINES = 20

    def __init__(self) -> None:
        self.since, self.lines, self.quiet = time.monotonic(), 0, 0

    def may(self) -> bool:
        now = time.monotonic()
        if now - self.since >= 60:
            if self.quiet:
                log.warning(
                    "... and %d more peers that did not say HELLO disconnected in the last %.0f s",
                    self.quiet,
                    now - self.since,
                )
            self.since, self.lines, self.quiet = now, 0, 0
        self.lines += 1
        if self.lines > self.LINES:
            self.quiet += 1
            return False
        return True

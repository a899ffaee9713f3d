"""ZMTP 3.1 framing (https://rfc.zeromq.org/spec/37/): the greeting, command frames, READY's
properties and frame headers, as the node's listener (:mod:`.zmtp`) reads and writes them."""

from __future__ import annotations

import struct

__all__ = [
    "Refused",
    "COMMAND",
    "GREETING_BYTES",
    "LONG",
    "MORE",
    "command",
    "frame_head",
    "greeting",
    "properties",
    "property_list",
    "ready",
]


class Refused(Exception):
    """A peer broke a limit or the protocol: it is disconnected (the message says why). ``answer``: a
    command frame to send it first (an ERROR)."""

    def __init__(self, why: str, answer: bytes | None = None) -> None:
        super().__init__(why)
        self.answer = answer


MORE, LONG, COMMAND = 0x01, 0x02, 0x04
"""Frame flag bits: more frames follow, an 8-octet size, a command."""
GREETING_BYTES = 64


def frame_head(n: int, more: bool) -> bytes:
    """The flags and size in front of a message frame of ``n`` bytes."""
    flag = MORE if more else 0
    return bytes([flag, n]) if n < 256 else bytes([flag | LONG]) + struct.pack(">Q", n)


def greeting(mechanism: bytes = b"NULL") -> bytes:
    """Signature, version 3.1, the security mechanism, as-server, filler (rfc 37, section "The Greeting")."""
    return (
        b"\xff"
        + b"\x00" * 7
        + b"\x01\x7f"
        + b"\x03\x01"
        + mechanism.ljust(20, b"\x00")
        + b"\x01"
        + b"\x00" * 31
    )


def command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return (
        bytes([COMMAND, len(data)])
        if len(data) < 256
        else bytes([COMMAND | LONG]) + struct.pack(">Q", len(data))
    ) + data


def ready(socket_type: bytes) -> bytes:
    """The READY command of a socket of ``socket_type`` (NULL mechanism: its only property)."""
    return command(b"READY", property_list({b"Socket-Type": socket_type}))


def property_list(props: dict[bytes, bytes]) -> bytes:
    """ZMTP metadata: name-size, name, value-size (4 octets), value, for each property."""
    return b"".join(bytes([len(k)]) + k + struct.pack(">I", len(v)) + v for k, v in props.items())


def properties(data: bytes) -> dict[bytes, bytes]:
    """READY's metadata: name-size, name, value-size (4 octets), value; ValueError on a torn list."""
    props, at = {}, 0
    while at < len(data):
        n = data[at]
        name = data[at + 1 : at + 1 + n]
        if len(name) != n or at + 5 + n > len(data):
            raise ValueError("torn property")
        (v,) = struct.unpack_from(">I", data, at + 1 + n)
        value = data[at + 5 + n : at + 5 + n + v]
        if len(value) != v:
            raise ValueError("torn property")
        props[name.lower()] = value
        at += 5 + n + v
    return props

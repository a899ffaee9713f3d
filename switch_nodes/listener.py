"""How a node meets its peers: a listening socket that yields whole messages and sends replies.

Two listeners keep one contract (:class:`Listener`): the node's own ZMTP listener
(:mod:`.zmtp`, the default, NULL or CURVE: per-peer and per-message bounds before allocation) and
libzmq's ROUTER (:class:`LibzmqListener`, ``node.listener = libzmq``: kept to compare, and for
inproc:// addresses). Workers speak ZMTP through libzmq DEALER sockets to either.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

import zmq
import zmq.asyncio

from luwu.protocol import messages as wire

__all__ = ["AddressInUse", "Listener", "LibzmqListener", "SendQueueFull", "listening_socket"]

log = logging.getLogger(__name__)


class AddressInUse(OSError):
    """The node's address is taken by another socket (an old node?)."""


class SendQueueFull(Exception):
    """A peer's send queue is full (it does not read): the message was not sent."""


class Listener:
    """A bound socket. ``address`` is what workers connect to."""

    address: str
    #: what the message :meth:`recv` gave last counts in flight (:class:`.inflight.Ticket`; None: nothing)
    ticket = None

    async def start(self) -> None:
        """Begin accepting (on the node's event loop)."""

    async def recv(self) -> tuple[bytes, list, bool]:
        """The next whole message: the connection's routing id, its frames (header first) and whether its
        payload was dropped unread (a peer that did not say HELLO sent more than node.stranger_bytes: only
        the header is there, to be answered as any stranger's). Calling it again says the previous message
        was served (what its peer held is given back)."""
        raise NotImplementedError

    def send(self, ident: bytes, frames: list, track: bool = False, priority=None):
        """Send without blocking (frames are sent zero-copy: untouched until the tracker is done); the
        tracker (``wait(timeout)`` raises ``zmq.NotDone``) when ``track``. Raises :class:`SendQueueFull`.
        ``priority``: among queued messages with one, not yet on their way, the lowest goes first (the
        zmtp listener; libzmq's sends in order)."""
        raise NotImplementedError

    def peer_key(self, ident: bytes) -> str | None:
        """The CURVE public key (z85) ``ident`` authenticated with (None without CURVE)."""
        return None

    def connected(self, ident: bytes) -> bool:
        """Whether ``ident``'s connection is still open (libzmq's ROUTER does not say: True)."""
        return True

    def close(self) -> None:
        raise NotImplementedError


def listening_socket(bind: str) -> tuple[socket.socket, str]:
    """A non-blocking listening socket on ``bind`` (tcp://HOST:PORT, port 0 any, ``*`` every interface;
    ipc://PATH, a stale socket file replaced as libzmq does) and the address it got."""
    scheme, rest = bind.split("://", 1)
    if scheme == "ipc":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(rest) and stat.S_ISSOCK(os.stat(rest).st_mode):
            os.unlink(rest)
        where, address = rest, bind
    else:
        host, port = rest.rsplit(":", 1)
        host = "0.0.0.0" if host == "*" else host.strip("[]")
        family, _, _, _, where = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(where)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(errno.EADDRINUSE, f"{bind} is in use") from None
        raise
    if scheme != "ipc":
        got = sock.getsockname()
        address = (
            f"tcp://[{got[0]}]:{got[1]}"
            if sock.family == socket.AF_INET6
            else f"tcp://{got[0]}:{got[1]}"
        )
    sock.listen(1024)
    sock.setblocking(False)
    return sock, address


class _KeyList:
    """CURVE credentials provider: only the listed worker public keys get in."""

    def __init__(self, allowed: set[bytes]):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        import zmq.utils.z85

        return zmq.utils.z85.encode(key) in self.allowed or key in self.allowed


class LibzmqListener(Listener):
    """libzmq's ROUTER. Bounds one frame (``MAXMSGSIZE``) and whole messages (``RCVHWM``), not an
    unfinished multipart message (with CURVE, only authenticated workers can send one)."""

    def __init__(
        self,
        bind: str,
        *,
        max_message_bytes: int,
        hwm: int,
        curve: tuple[str, str, list[str]] | None = None,
    ) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + wire.MAX_HEADER_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._auth = None
        self._keys: dict[bytes, str] = {}
        if curve is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            public, secret, authorized = curve
            self._auth = AsyncioAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback(
                domain="*", credentials_provider=_KeyList({k.encode() for k in authorized})
            )
            sock.curve_server = True
            sock.curve_secretkey = secret.encode()
            sock.curve_publickey = public.encode()
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(errno.EADDRINUSE, f"{bind} is in use") from None
            raise
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[bytes, list, bool]:
        frames = await self._sock.recv_multipart(copy=False)
        ident, body = frames[0].bytes, frames[1:]
        if self._auth is not None and body:  # the CURVE key the connection authenticated with (z85)
            self._keys[ident] = body[0].get("User-Id")
        return ident, body, False

    def peer_key(self, ident: bytes) -> str | None:
        return self._keys.get(ident)

    def send(self, ident: bytes, frames: list, track: bool = False, priority=None):
        try:
            fut = self._sock.send_multipart(
                [ident, *frames], copy=False, track=track, flags=zmq.NOBLOCK
            )
        except zmq.Again:
            raise SendQueueFull(ident) from None
        # zmq.asyncio settles a NOBLOCK send at once; its result is the MessageTracker
        return fut.result() if fut.done() else None

    def close(self) -> None:
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()

"""Whether a worker reaches its nodes, and the errors that say why not.

ZeroMQ retries a connection silently until a deadline, so the worker watches each socket's
connection events until its first handshake succeeds: a node address that refused every
connection for :data:`REFUSED_WINDOW_S` has nothing listening there, and a node that cut
:data:`SHUT_OUT_AFTER` handshakes, letting none through, asks for a join secret or CURVE keys this
worker does not show. Both are named at once instead of after the deadline; a wait past its
deadline names the node, and past start-up the step and bucket still missing.
"""

from __future__ import annotations

import socket
import time

import zmq

from luwu.gpu_workers.config import TransportConfig
from luwu.protocol.errors import NodeTimeoutError

#: Start-up: a node address that refused every connection this long is named as not listening (a
#: node that is just starting has this long to bind).
REFUSED_WINDOW_S = 1.0

#: Handshakes a node may cut, with none let through, before the worker says it lacks the node's
#: secret or keys.
SHUT_OUT_AFTER = 3
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: The connection events watched until a handshake succeeds.
WATCHED = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | (HANDSHAKE_FAILED)
)


def check_resolves(addr: str) -> None:
    """Refuse a tcp:// address whose host does not resolve: ZeroMQ would retry it silently forever."""
    scheme, _, rest = addr.partition("://")
    if scheme != "tcp":
        return
    host = rest.rpartition(":")[0].strip("[]")
    if host in ("*", ""):
        return
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise NodeTimeoutError(
            f"node address {addr}: host {host!r} does not resolve ({e}): check cluster.nodes (or "
            "LUWU_NODES) and DNS",
            node=addr,
        ) from None


class Reach:
    """What the connection events of each node's socket said (the client's lock guards it)."""

    def __init__(self, nodes: list[str], rank: int, cfg: TransportConfig):
        self.nodes, self.rank, self.cfg = nodes, rank, cfg
        self.reached = [False] * len(nodes)  # a connection was made (TCP/IPC), since the start
        self.refused_since: list[float | None] = [None] * len(nodes)  # first refusal, never reached
        self.shut_out = [0] * len(nodes)  # handshakes the node cut, none succeeding yet
        self.joined = [False] * len(nodes)  # a handshake succeeded

    def forget(self, node: int) -> None:
        """``node``'s socket was connected anew (a fallback from its aggregator): nothing said yet."""
        self.reached[node], self.refused_since[node] = False, None
        self.shut_out[node], self.joined[node] = 0, False

    def note(self, node: int, event: int) -> None:
        """A connection event of ``node``'s socket."""
        if event == zmq.EVENT_CONNECTED:
            self.reached[node] = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.joined[node] = True
        elif event & HANDSHAKE_FAILED:
            self.shut_out[node] += 1
        elif (
            event == zmq.EVENT_CONNECT_RETRIED
            and self.refused_since[node] is None
            and not self.reached[node]
        ):
            self.refused_since[node] = time.monotonic()

    def raise_refused(self, nodes: list[int]) -> None:
        """Raise for a node of ``nodes`` known not to let this worker in (see the module
        docstring)."""
        for n in nodes:
            if self.shut_out[n] >= SHUT_OUT_AFTER:
                raise self._shut_out_error(n)
        if all(self.reached):
            return
        now = time.monotonic()
        for n in nodes:
            since = self.refused_since[n]
            if since is not None and not self.reached[n] and now - since >= REFUSED_WINDOW_S:
                raise NodeTimeoutError(
                    f"worker {self.rank}: node {n} at {self.nodes[n]} refused every connection "
                    f"for {now - since:.1f} s: no node listens there. Start it (luwu up, luwu "
                    "node) or fix cluster.nodes (or LUWU_NODES)",
                    node=self.nodes[n],
                    worker=self.rank,
                )

    def _shut_out_error(self, n: int) -> NodeTimeoutError:
        cfg = self.cfg
        shown = (
            "CURVE keys"
            if cfg.curve_server_key
            else "a join secret"
            if cfg.join_secret
            else "neither a join secret nor CURVE keys"
        )
        refused = " the node does not accept" if shown[0] != "n" else ""
        return NodeTimeoutError(
            f"worker {self.rank}: node {n} at {self.nodes[n]} closed {self.shut_out[n]} "
            "connections at the ZeroMQ handshake: it asks for a join secret or CURVE keys, and "
            f"this worker shows {shown}{refused}. Give the worker the cluster's: --config <run "
            "dir>/keys/join.toml (written by luwu up and luwu node) or "
            "LUWU_TRANSPORT__JOIN_SECRET (local_cluster sets it for its own process), or with "
            "CURVE its keys/worker<rank>.toml (a node at node.max_connections cuts handshakes "
            "too: its log says so)",
            node=self.nodes[n],
            worker=self.rank,
        )

    def timeout(
        self, missing: list[tuple], what: str, timeout_s: float, total: int, welcome: bool = False
    ) -> NodeTimeoutError:
        """The error for a wait past its deadline; ``missing``: (node, step, bucket) of each reply
        still missing. Names the node, and (past start-up) which step and bucket; ``welcome``: the
        missing replies are WELCOMEs (a hint says what to check)."""
        node, step, bucket = missing[0]
        nodes = [self.nodes[n] for n in sorted({m[0] for m in missing})]
        where = f" for step {step}, bucket {bucket}" if step is not None and bucket >= 0 else ""
        hint = ""
        if welcome:
            hint = (
                ": is a node listening there? Start it (luwu up, luwu node) or fix "
                "cluster.nodes; raise transport.connect_timeout_s for slow starts"
            )
        return NodeTimeoutError(
            f"worker {self.rank}: no {what} from node {node} at {self.nodes[node]}{where} within "
            f"{timeout_s:.1f} s ({len(missing)} of {total} replies missing, from nodes "
            f"{nodes}){hint}",
            node=self.nodes[node],
            worker=self.rank,
            step=step,
            bucket=bucket,
        )

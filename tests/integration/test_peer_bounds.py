"""What one peer may hold in a node, and the time one message may take, are bounded (node.peer_bytes,
node.stranger_bytes, node.max_message_frames, node.max_connections; the node's own ZMTP listener).

Attackers speak ZMTP by hand over raw TCP (a libzmq client cannot leave a multipart message
unfinished); workers and monitors use libzmq DEALER sockets. The first tests run the listener in this
process (a real socket, a uvloop event loop on a thread) to look inside it; the last run real node
processes while a real job trains, and compare the job with local AdamW.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import uvloop
import zmq
import zmq.utils.monitor
from harness import assert_params_close, member_socket, proc_status, run_training
from integration.test_hostile_input import (
    JOB,
    job_layout,
    pack,
    stats,
    templates,
    wait_for_workers,
)
from raw_zmtp import MiB, RawPeer, frame  # noqa: F401  (RawPeer, frame: for the other attack tests too)
from workers.train import reference

import luwu
from luwu.protocol import messages as wire
from luwu.protocol.messages import Op
from luwu.switch_nodes.zmtp import ZmtpListener
from luwu.switch_nodes.zmtp_frames import frame_head

# -- the listener in this process ---------------------------------------------------------------------


class Served:
    """A ZmtpListener on a uvloop event loop in a thread; ``take()`` serves one message."""

    def __init__(self, **kw):
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        args = {
            "max_message_bytes": 4 * MiB,
            "max_frames": 8,
            "budget": lambda ident: 6 * MiB,
            "who": lambda ident: "peer",
            "max_connections": 16,
            "sndhwm": 100,
            **kw,
        }
        self.listener = self.call(self._make(args))
        self.address = self.listener.address

    async def _make(self, args) -> ZmtpListener:
        lis = ZmtpListener("tcp://127.0.0.1:0", **args)
        await lis.start()
        return lis

    def call(self, coro, timeout_s: float = 10.0):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()  # or it would take the next message
            raise

    def take(self, timeout_s: float = 10.0) -> tuple[bytes, list, bool]:
        async def one():
            return await self.listener.recv()

        return self.call(one(), timeout_s)

    def serve_on(self) -> None:
        """Serve every message from now on, unseen (as the node's receive loop does: the last one taken
        counts as served once the next is asked for)."""

        async def forever():
            while True:
                await self.listener.recv()

        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(forever()))

    def on_loop(self, fn, *args):
        async def run():
            return fn(*args)

        return self.call(run())

    def close(self) -> None:
        self.on_loop(self.listener.close)

        async def cancel():
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        self.call(cancel())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def served():
    made: list[Served] = []

    def make(**kw) -> Served:
        made.append(Served(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def dealer(addr: str) -> zmq.Socket:
    s = member_socket(zmq.Context.instance().socket(zmq.DEALER))
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(addr)
    return s


@pytest.mark.timeout(60)
def test_a_libzmq_dealer_speaks_with_the_listener(served):
    """The listener is ZMTP as libzmq speaks it: multipart messages with empty, small, staged and
    in-place frames both ways, answers by routing id, send trackers done once the bytes left,
    heartbeats (PING) answered so libzmq keeps the connection."""
    srv = served()
    s = dealer(srv.address)
    s.setsockopt(zmq.HEARTBEAT_IVL, 50)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big = bytes(range(256)) * (3 * MiB // 256)
        sent = [b"head", b"", b"x" * 300, big, b"tail"]
        s.send_multipart(sent)
        ident, got, _ = srv.take()
        assert [bytes(f) for f in got] == sent
        tracker = srv.on_loop(srv.listener.send, ident, [b"answer", memoryview(big)], True)
        assert s.recv_multipart() == [b"answer", big]
        tracker.wait(5)
        time.sleep(1.0)  # ~20 heartbeats: unanswered, libzmq would drop the connection after 300 ms
        assert not mon.poll(0), "libzmq dropped the connection: PING not answered"
        s.send_multipart([b"again"])
        assert [bytes(f) for f in srv.take()[1]] == [b"again"]
        edge = [
            b"h",
            b"y" * (16 * 1024 + 10),
        ]  # just over the staging size: it arrives whole in staging
        s.send_multipart(edge)
        assert [bytes(f) for f in srv.take()[1]] == edge
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


@pytest.mark.timeout(60)
def test_what_a_peer_holds_is_bounded_and_it_is_read_on_once_served(served):
    """A peer sending faster than its messages are served holds at most its budget in the listener
    (the node stops reading it; TCP pushes back), and nothing is lost: every message arrives, in order,
    once served."""
    budget = 6 * MiB
    srv = served(budget=lambda ident: budget)
    peer = RawPeer(srv.address)
    msgs = [[b"h%d" % i, bytes([i]) * MiB] for i in range(40)]  # 40 MiB, far past the budget
    sender = threading.Thread(target=lambda: [peer.send_message(m) for m in msgs], daemon=True)
    sender.start()
    try:
        time.sleep(1.0)
        ident = next(iter(srv.on_loop(lambda: list(srv.listener.peers))))
        held = srv.on_loop(srv.listener.held, ident)
        assert 0 < held <= budget, held
        assert sender.is_alive(), "the whole 40 MiB was taken in: the sender should be held back"
        for i, m in enumerate(msgs):
            _, got, _ = srv.take()
            assert [bytes(f) for f in got] == m, i
            assert srv.on_loop(srv.listener.held, ident) <= budget
        sender.join(10)
        assert not sender.is_alive()
    finally:
        peer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "attack, why",
    [
        ("unfinished", "more than this peer may hold"),
        ("too_large", "a message payload of 1099511627776 bytes"),
        ("header", "header frame"),
        ("empty_frames", "more than 8 frames"),
        ("flags", "not ZMTP 3"),
    ],
)
def test_a_peer_past_a_limit_is_disconnected_named_once_and_answered_first(
    served, caplog, attack, why
):
    """Each limit is checked on a frame's header, before its buffer exists: the peer's earlier complete
    message is served and answered, then the connection ends, and the log names the peer once."""
    srv = served(budget=lambda ident: 3 * MiB, max_message_bytes=8 * MiB)
    peer = RawPeer(srv.address)
    caplog.set_level(logging.WARNING, logger="luwu.switch_nodes.zmtp")
    try:
        peer.send_message([b"first"])
        attacks = {
            "unfinished": frame(b"h", True)
            + frame_head(MiB, True)
            + bytes(MiB)
            + frame_head(MiB, True)
            + bytes(MiB)
            + frame_head(MiB, True)
            + bytes(1000),
            "too_large": frame(b"h", True) + frame_head(1 << 40, False) + bytes(1000),
            "header": frame_head(wire.MAX_HEADER_BYTES + 1, False) + bytes(1000),
            "empty_frames": b"\x01\x00" * 3_000_000,  # 6 MB of empty frames, all MORE
            "flags": b"\x80\x00",
        }
        peer.try_send(attacks[attack])
        ident, got, _ = srv.take()
        assert [bytes(f) for f in got] == [b"first"]
        answered_then_closed(srv, peer, ident, caplog, why)
    finally:
        peer.close()


def answered_then_closed(srv: Served, peer: RawPeer, ident: bytes, caplog, why: str) -> None:
    """The peer's earlier message is answered, then the node ends the connection and names it once (``why``)."""
    srv.on_loop(srv.listener.send, ident, [b"answer"])
    srv.serve_on()
    peer.sock.settimeout(10)
    assert peer.recv_message() == [b"answer"]
    assert peer.closed_by_node(5)
    peer.close()  # the node half-closed; libzmq closes on that EOF, as we do here
    deadline = time.monotonic() + 5
    while srv.on_loop(lambda: len(srv.listener.peers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.on_loop(lambda: len(srv.listener.peers)) == 0
    lines = [r.getMessage() for r in caplog.records if "disconnecting" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0] and "peer (127.0.0.1:" in lines[0], lines


@pytest.mark.timeout(60)
def test_a_strangers_payload_past_its_budget_is_dropped_unread_and_its_header_kept(served):
    """A peer that did not say HELLO (here: every peer) sends a payload past its budget: the frames are
    read and dropped, not allocated, and the header reaches the node marked (so a worker reconnected
    after a node restart is still told to roll back); the connection stays, and what follows is read."""
    srv = served(member=lambda ident: False, budget=lambda ident: 256 * 1024)
    peer = RawPeer(srv.address)
    try:
        peer.send_message([b"header", bytes(3 * MiB), b"tail"])
        peer.send_message([b"next", b"small"])
        ident, got, dropped = srv.take()
        assert [bytes(f) for f in got] == [b"header"] and dropped
        assert srv.on_loop(srv.listener.held, ident) <= 256 * 1024
        _, got, dropped = srv.take()
        assert [bytes(f) for f in got] == [b"next", b"small"] and not dropped
        peer.try_send(
            frame(b"h", True) + b"\x01\x00" * 100
        )  # frame counts hold for dropped frames too
        srv.serve_on()
        assert peer.closed_by_node(5)
    finally:
        peer.close()


@pytest.mark.timeout(60)
def test_a_peer_that_does_not_read_gets_at_most_sndhwm_replies_queued(served):
    """Replies to a peer that does not read wait in the sending thread up to ``sndhwm`` messages; past
    it the listener refuses them (the node drops them and logs the peer once), and a reader is served."""
    from luwu.switch_nodes.listener import SendQueueFull

    srv = served(sndhwm=50)
    deaf = RawPeer(srv.address, rcvbuf=4096)
    try:
        deaf.send_message([b"hi"])
        ident, _, _ = srv.take()
        big = memoryview(bytes(MiB))

        def flood() -> int:
            for i in range(1000):
                try:
                    srv.listener.send(ident, [b"r", big])
                except SendQueueFull:
                    return i
            return -1

        refused_at = srv.on_loop(flood)
        assert 50 <= refused_at < 1000, (
            refused_at
        )  # the kernel took a few MiB, the queue 50 messages
        reader = dealer(srv.address)
        reader.send_multipart([b"ping"])
        rid, _, _ = srv.take()
        srv.on_loop(srv.listener.send, rid, [b"pong"])
        assert reader.recv_multipart() == [b"pong"]
        reader.close(0)
    finally:
        deaf.close()


@pytest.mark.timeout(60)
def test_silent_connections_and_connections_past_the_limit_are_closed(served):
    """A connection that never finishes the handshake is closed after handshake_s; past
    max_connections a new one is closed at once, and there is room again once they are gone."""
    srv = served(max_connections=3, handshake_s=0.5)
    quiet = [socket.create_connection(srv.address.split("//")[1].rsplit(":", 1)) for _ in range(3)]
    try:
        extra = socket.create_connection(srv.address.split("//")[1].rsplit(":", 1))
        extra.settimeout(5)
        assert extra.recv(100) in (b"",), "the 4th connection is closed at once"
        for q in quiet:  # the greeting, then nothing: closed after handshake_s
            q.settimeout(5)
            got = q.recv(100)
            while got:
                got = q.recv(100)
            q.close()
        time.sleep(0.2)
        peer = RawPeer(srv.address)  # room again
        peer.close()
    finally:
        for q in quiet:
            q.close()


# -- real nodes, a real job ---------------------------------------------------------------------------

SPEC = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01},
    "steps": 40,
    "batch": 8,
    "bucket_bytes": 1024,
    "timeout_s": 60.0,
}


def rss(pid: int) -> int:
    return proc_status(pid)["VmRSS"]


@pytest.mark.timeout(240)
def test_floods_against_a_training_node_hold_nothing_and_change_nothing(tmp_path, capfd):
    """While a 2-worker job trains, from 20 connections: unfinished multipart messages (a 100 MiB frame
    announced, 4 MiB of it sent: read and dropped, the connection kept), 3M empty frames in one message
    (6 MB), 10 MiB header frames, a stranger's HELLO naming 3e7 ranks, and peers asking STATS 20000
    times without reading a reply. The empty-frame and header flooders are cut off and named in the
    node's log once, each deaf peer too (its unsent replies passed node.stranger_reply_bytes), node RSS
    stays within 16 MiB of what it was, a monitor's STATS is answered all along (within 5 s: on this 2-core
    box the two workers and the flooders share the node's cores; a starved loop would not answer at all),
    and the job equals local AdamW."""
    with luwu.local_cluster(1, job=JOB) as cluster:
        pid = cluster.procs[0].pid
        out: dict = {}

        def train():
            try:
                out["results"] = run_training(
                    SPEC, cluster.addresses, tmp_path, world_size=2, timeout_s=180
                )
            except BaseException as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"

        th = threading.Thread(target=train, daemon=True)
        th.start()
        wait_for_workers(cluster.addresses, 2, 120, alive=th.is_alive)
        before = rss(pid)
        layout = job_layout(SPEC, 1)
        hello, _ = templates(layout, 0)[Op.HELLO]
        peers, slowest = [], 0.0
        for i in range(20):
            kind = ("unfinished", "empty", "header", "hello", "deaf")[i % 5]
            p = RawPeer(cluster.addresses[0], rcvbuf=4096 if kind == "deaf" else 0)
            if (
                kind == "deaf"
            ):  # asks and asks, never reads: cut off once its unsent replies pass node.stranger_reply_bytes
                ask_stats = b"".join(
                    frame(f)
                    for f in wire.encode({"op": Op.STATS, "job": JOB, "step": 0, "worker": 0})
                )
                threading.Thread(target=p.try_send, args=(ask_stats * 20000,), daemon=True).start()
            elif kind == "unfinished":
                p.try_send(
                    frame(pack(dict(hello), [])[0], True)
                    + frame_head(100 * MiB, True)
                    + bytes(4 * MiB)
                )
            elif kind == "empty":
                p.try_send(b"\x01\x00" * 3_000_000)
            elif kind == "header":
                p.try_send(frame_head(10 * MiB, False) + bytes(MiB))
            else:
                p.send_message(pack({**hello, "world_size": 30_000_000}, []))
                reply = wire.decode(p.recv_message(), job=JOB).header
                assert reply["op"] == Op.ERROR and "max_world_size" in reply["message"], reply
            t0 = time.monotonic()
            stats(cluster.addresses[0])
            slowest = max(slowest, time.monotonic() - t0)
            peers.append((kind, p))
        try:
            for kind, p in peers:
                if kind in ("empty", "header"):
                    assert p.closed_by_node(10), f"{kind}: still connected"
                elif kind == "deaf":
                    assert p.cut_by_node(20), (
                        "a peer that does not read its replies is still connected"
                    )
            grown = rss(pid) - before
            assert grown < 16 * MiB, f"node RSS grew by {grown / MiB:.1f} MiB"
            assert slowest < 5.0, f"a STATS took {slowest:.2f} s during the floods"
        finally:
            for _, p in peers:
                p.close()
        th.join(200)
        assert "error" not in out, out.get("error")
        want, _ = reference(dict(SPEC, world_size=2))
        for r in out["results"]:
            assert_params_close(r["params"], want)
        assert rss(pid) - before < 16 * MiB
    err = capfd.readouterr().err.splitlines()
    named = [line for line in err if "disconnecting a peer that did not say HELLO" in line]
    assert len(named) == 12, named
    deaf = [line for line in named if "bytes of replies left unread" in line]
    assert len(deaf) == 4, deaf  # once each, however many replies it asked for


@pytest.mark.timeout(120)
def test_a_worker_rank_is_held_to_its_budget(tmp_path, capfd):
    """A connection that said HELLO as a rank may send messages of up to node.max_message_bytes (here 4
    MiB; it holds at most node.peer_bytes, 5 MiB, while they wait): an unfinished message past it is
    refused before its third 2 MiB frame is allocated, and the node names the rank."""
    with luwu.local_cluster(
        1, job=JOB, node_args=["--node.max_message_bytes", str(4 * MiB)]
    ) as cluster:
        pid = cluster.procs[0].pid
        layout = job_layout(SPEC, 1)
        hello, _ = templates(layout, 0)[Op.HELLO]
        p = RawPeer(cluster.addresses[0])
        try:
            p.send_message(pack({**hello, "world_size": 1, "worker": 0}, []))
            assert wire.decode(p.recv_message(), job=JOB).header["op"] == Op.WELCOME
            before = rss(pid)
            head = pack({"op": Op.STATS, "job": JOB, "step": 0, "worker": 0}, [])[0]
            p.try_send(
                frame(head, True)
                + (frame_head(2 * MiB, True) + bytes(2 * MiB)) * 2
                + frame_head(2 * MiB, True)
                + bytes(MiB)
            )
            assert p.closed_by_node(10)
            assert rss(pid) - before < 8 * MiB
            assert (
                stats(cluster.addresses[0])["workers"] == 1
            )  # the node is fine; the rank waits for a new HELLO
        finally:
            p.close()
    named = [line for line in capfd.readouterr().err.splitlines() if "disconnecting" in line]
    assert (
        len(named) == 1
        and "disconnecting worker rank 0" in named[0]
        and "a message payload of 6291456 bytes or more (at most 4194304)" in named[0]
    ), named


SECRET = "s3cr3t-join-0123456789abcdef01234"  # at least 32 characters (node.join_secret)


def closed_at_handshake(addr: str, secret: str | None) -> bool:
    """A libzmq DEALER (showing ``secret`` if given) asks STATS: True if the node closed the connection
    without a word."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        s.setsockopt(zmq.METADATA, wire.join_metadata(secret))
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        s.connect(addr)
        s.send_multipart(wire.encode({"op": Op.STATS, "job": JOB, "step": 0, "worker": 0}))
        disconnected = bool(mon.poll(5000))
        assert not s.poll(200), "the node answered a peer without the join secret"
        return disconnected
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


@pytest.mark.timeout(60)
def test_the_listener_closes_a_peer_without_the_join_secret_before_its_first_frame(served):
    srv = served(join_secret="abc")
    assert closed_at_handshake(srv.address, None)
    assert closed_at_handshake(srv.address, "abd")
    with pytest.raises(TimeoutError):
        srv.take(timeout_s=0.5)  # nothing reached the node
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.METADATA, wire.join_metadata("abc"))
    s.connect(srv.address)
    try:
        s.send_multipart([b"hi"])
        assert [bytes(f) for f in srv.take()[1]] == [b"hi"]
    finally:
        s.close(0)


@pytest.mark.timeout(180)
def test_a_node_with_a_join_secret_gives_a_stranger_nothing(tmp_path, monkeypatch, capfd):
    """node.join_secret (here from LUWU_NODE__JOIN_SECRET, never argv): a peer that does not show it in
    the handshake gets no reply, no job state and no allocation, and the node's log says so at most 20
    times a minute (libzmq reconnects a refused socket every 100 ms); workers and
    `luwu status` that show it (transport.join_secret) train and query as usual, and the job equals
    local AdamW."""
    from harness import TRAIN, start_workers, wait_all

    from luwu.ops.monitor import query_many

    monkeypatch.setenv("LUWU_NODE__JOIN_SECRET", SECRET)
    with luwu.local_cluster(1, job=JOB) as cluster:
        addr = cluster.addresses[0]
        assert SECRET not in " ".join(
            open(f"/proc/{cluster.procs[0].pid}/cmdline").read().split("\0")
        )
        assert closed_at_handshake(addr, None) and closed_at_handshake(addr, "wrong")
        with pytest.raises(ConnectionError):
            RawPeer(addr, secret="")  # no READY back: the handshake is where it ends
        (st,) = query_many([addr], JOB, 5, join_secret=SECRET)
        assert st.up and st.detail["workers"] == 0, st
        (st,) = query_many([addr], JOB, 2)
        assert not st.up
        spec = dict(SPEC, nodes=[addr], world_size=2, out=str(tmp_path / "joined"))
        path_env = {"LUWU_TRANSPORT__JOIN_SECRET": SECRET}
        wait_all(start_workers(TRAIN, spec, 2, tmp_path, env=path_env), 150)
    want, _ = reference(dict(SPEC, world_size=2))
    import torch

    for r in range(2):
        assert_params_close(torch.load(f"{spec['out']}.rank{r}")["params"], want)
    named = [
        line
        for line in capfd.readouterr().err.splitlines()
        if "join secret" in line and "disconnecting" in line
    ]
    # libzmq reconnects a refused socket every 100 ms: at most 20 lines a minute say so, whatever the count
    assert 3 <= len(named) <= 20 and any("a wrong join secret" in line for line in named), named


@pytest.mark.timeout(180)
def test_a_big_push_on_a_new_connection_after_a_node_restart_is_told_to_roll_back(tmp_path):
    """A worker whose node restarted from its checkpoint reconnects as a stranger (libzmq reconnects
    by itself) and sends its 1 MiB pushes: past node.stranger_bytes, the payload is dropped unread,
    but the header is answered as before the listener existed: RollbackError naming the step, so
    recover() can run; and the connection stays."""
    ckpt = ["--node.checkpoint_dir", str(tmp_path / "ck"), "--node.checkpoint_every", "5"]
    spec = dict(SPEC, steps=10)
    with luwu.local_cluster(1, job=JOB, node_args=ckpt) as cluster:
        run_training(spec, cluster.addresses, tmp_path, world_size=2, timeout_s=120)
        addr = cluster.restart(0)
        layout = job_layout(spec, 1)
        push, _ = templates(layout, 0)[Op.PUSH]
        p = RawPeer(addr)
        try:
            for _ in range(2):
                p.send_message(pack({**push, "step": 10}, [bytes(MiB)]))
                err = wire.decode(p.recv_message(), job=JOB).header
                assert (
                    err["op"] == Op.ERROR
                    and err["code"] == "rollback"
                    and f"roll back to step {err['step']}" in err["message"]
                ), err
        finally:
            p.close()

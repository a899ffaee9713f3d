"""What peers make a node hold beyond their own messages: the replies they leave unread, what all of them
hold together, and what each CURVE key may hold; and that a node starts from one bad checkpoint file.

Each test runs a real node process and, where the attack happens while a job trains, a real 2-worker
job beside it that must end equal to local AdamW; node memory is bounded with the figure asserted.
Attackers speak ZMTP (NULL or CURVE) by hand (:class:`RawPeer`, :class:`CurvePeer`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tomllib

import pytest
import torch
import zmq
from checkpoint_files import assert_resumes_like_adamw, rewrite_manifest, train_steps
from harness import TRAIN, assert_params_close, job_secret, member_socket, run_training, wait_all
from integration.test_curve_listener import CurvePeer
from integration.test_hostile_input import JOB, job_layout, pack, templates
from integration.test_peer_bounds import SECRET, SPEC, rss, served  # noqa: F401  (served: the fixture)
from raw_zmtp import PING, MiB, RawPeer, frame
from workers.train import DEFAULTS, make_model, reference

import luwu
from luwu.gpu_workers.config import TransportConfig
from luwu.protocol import messages as wire
from luwu.protocol.layout import ParamSpec, build_layout
from luwu.protocol.messages import Op
from luwu.switch_nodes.zmtp_frames import frame_head


def node_log(capfd) -> list[str]:
    return capfd.readouterr().err.splitlines()


def ask(
    addr: str, header: dict, secret: str | None = None, curve: tuple[str, str, str] | None = None
) -> wire.Message:
    """One request from a fresh libzmq DEALER (showing ``secret``, None: this process's local clusters'
    (:func:`harness.job_secret`); or CURVE keys), one reply within 10 s."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    secret = job_secret() if secret is None else secret
    if secret:
        s.setsockopt(zmq.METADATA, wire.join_metadata(secret))
    if curve is not None:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (k.encode() for k in curve)
    s.connect(addr)
    try:
        s.send_multipart(wire.encode({"job": JOB, "step": 0, "worker": 0, **header}))
        return wire.decode(s.recv_multipart(), job=JOB)
    finally:
        s.close(0)


def wait_workers(addr: str, n: int, alive, **kw) -> None:
    deadline = time.monotonic() + 60
    while ask(addr, {"op": Op.STATS}, **kw).header["detail"]["workers"] < n:
        assert alive() and time.monotonic() < deadline, "the job's workers did not connect"
        time.sleep(0.05)


def train_beside(
    spec: dict, addrs: list[str], tmp_path, envs: list[dict] | None = None
) -> tuple[threading.Thread, dict]:
    """A real 2-worker job (tests/workers/train.py) in the background; ``envs``: each rank's own variables."""
    out: dict = {}

    def run():
        try:
            if envs is None:
                out["results"] = run_training(spec, addrs, tmp_path, world_size=2, timeout_s=100)
                return
            full = dict(spec, nodes=addrs, world_size=2, out=str(tmp_path / "ranked"))
            path = tmp_path / "ranked.json"
            path.write_text(json.dumps(full))
            procs = [
                subprocess.Popen(
                    [sys.executable, str(TRAIN), str(path)],
                    env=dict(
                        os.environ,
                        RANK=str(r),
                        WORLD_SIZE="2",
                        LOCAL_RANK=str(r),
                        PYTHONUNBUFFERED="1",
                        **envs[r],
                    ),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for r in range(2)
            ]
            wait_all(procs, 100)
            out["results"] = [torch.load(f"{full['out']}.rank{r}") for r in range(2)]
        except BaseException as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def assert_equal_to_torch(th: threading.Thread, out: dict, spec: dict) -> None:
    th.join(110)
    assert "error" not in out, out.get("error")
    want, _ = reference(dict(spec, world_size=2))
    for r in out["results"]:
        assert_params_close(r["params"], want)


def flood(peer: RawPeer, data: bytes) -> threading.Thread:
    th = threading.Thread(target=peer.try_send, args=(data,), daemon=True)
    th.start()
    return th


# -- replies left unread ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_peers_that_ask_and_never_read_are_cut_off(tmp_path, monkeypatch, capfd):
    """Two holders of the join secret that never say HELLO send 16 MiB of ZMTP PINGs each and never read the
    PONGs; two others ask STATS 20000 times and never read. Each is disconnected once its unsent replies
    pass node.stranger_reply_bytes (128 KiB), named in the log once with its address; node RSS stays
    within 24 MiB of what it was, and the 2-worker job beside them equals local AdamW."""
    monkeypatch.setenv("LUWU_NODE__JOIN_SECRET", SECRET)
    monkeypatch.setenv("LUWU_TRANSPORT__JOIN_SECRET", SECRET)  # (the workers)
    spec = dict(SPEC, steps=20)
    with luwu.local_cluster(1, job=JOB) as cluster:
        addr, pid = cluster.addresses[0], cluster.procs[0].pid
        th, out = train_beside(spec, cluster.addresses, tmp_path)
        wait_workers(addr, 2, th.is_alive, secret=SECRET)
        before = rss(pid)
        stats = b"".join(
            frame(f) for f in wire.encode({"op": Op.STATS, "job": JOB, "step": 0, "worker": 0})
        )
        peers = [RawPeer(addr, rcvbuf=4096, secret=SECRET) for _ in range(4)]
        floods = [
            flood(p, PING * (16 * MiB // len(PING)) if i < 2 else stats * 20000)
            for i, p in enumerate(peers)
        ]
        try:
            for p in peers:
                assert p.cut_by_node(30), "a peer that does not read is still connected"
            for f in floods:
                f.join(10)
            grown = rss(pid) - before
            assert grown < 24 * MiB, f"node RSS grew by {grown / MiB:.1f} MiB"
            assert ask(addr, {"op": Op.STATS}, secret=SECRET).header["op"] == Op.STATS
        finally:
            for p in peers:
                p.close()
        assert_equal_to_torch(th, out, spec)
    unread = [line for line in node_log(capfd) if "bytes of replies left unread" in line]
    assert len(unread) == 4 and all(
        "a peer that did not say HELLO (127.0.0.1:" in line for line in unread
    ), unread
    assert len({line.split("(127.0.0.1:")[1].split(")")[0] for line in unread}) == 4, (
        unread
    )  # each address once


# -- what all connections hold together ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_messages_past_the_total_wait_and_each_completes_in_turn(served):
    """Four peers send 1.5 MiB messages at once against a node-wide total of 2 MiB: reads wait for room,
    nothing is served while every message is unfinished, so one at a time reads on past the total until
    whole: every message arrives intact, and the listener never holds more than the total and one
    message."""
    srv = served(budget=lambda ident: 4 * MiB, total_bytes=2 * MiB)
    peers = [RawPeer(srv.address) for _ in range(4)]
    msgs = [[b"h%d" % i, bytes([i]) * (3 * MiB // 2)] for i in range(4)]
    senders = [
        threading.Thread(target=p.send_message, args=(m,), daemon=True) for p, m in zip(peers, msgs)
    ]
    try:
        for t in senders:
            t.start()
        time.sleep(1.0)
        got = []
        for _ in msgs:
            assert srv.on_loop(lambda: srv.listener.total.held) <= 2 * MiB + 3 * MiB // 2 + MiB // 8
            got.append([bytes(f) for f in srv.take()[1]])
        assert sorted(got) == sorted(msgs)
    finally:
        for p in peers:
            p.close()


@pytest.mark.timeout(60)
def test_an_idle_holder_is_disconnected_when_others_need_room(served, caplog):
    """Three peers each leave a 700-720 KiB message unfinished (the total is 2 MiB) and go quiet; a fourth then
    sends a whole message: the idle holders are disconnected, largest first, until it fits, and its
    message arrives; the log says why."""
    import logging

    caplog.set_level(logging.WARNING, logger="luwu.switch_nodes.zmtp")
    srv = served(budget=lambda ident: 4 * MiB, total_bytes=2 * MiB)
    holders = [RawPeer(srv.address) for _ in range(3)]
    try:
        for i, h in enumerate(holders):
            h.try_send(
                frame(b"h", True) + frame_head((700 + 10 * i) * 1024, True) + bytes(600 * 1024)
            )
        time.sleep(1.5)  # idle past IDLE_S
        worker = RawPeer(srv.address)
        worker.send_message([b"push", bytes(MiB)])
        assert [bytes(f) for f in srv.take()[1]] == [b"push", bytes(MiB)]
        assert holders[2].closed_by_node(5), "the largest idle holder is still connected"
        worker.close()
    finally:
        for h in holders:
            h.close()
    assert any(
        "sent nothing for" in r.getMessage()
        and "node.peers_total_bytes = 2097152" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.timeout(120)
def test_all_connections_together_hold_at_most_peers_total_bytes(tmp_path, capfd):
    """300 strangers each leave a message of 240 KiB unfinished (each within node.stranger_bytes: 70 MiB in
    all) while a 2-worker job trains, with node.peers_total_bytes = 16 MiB. Past it the largest holder
    is disconnected whenever a read must wait and nothing is being served (said in the log once): node
    RSS stays within 32 MiB of what it was, STATS is answered, and the job equals local AdamW."""
    args = ["--node.peers_total_bytes", str(16 * MiB), "--node.max_message_bytes", str(4 * MiB)]
    spec = dict(SPEC, steps=20)
    with luwu.local_cluster(1, job=JOB, node_args=args) as cluster:
        addr, pid = cluster.addresses[0], cluster.procs[0].pid
        th, out = train_beside(spec, cluster.addresses, tmp_path)
        wait_workers(addr, 2, th.is_alive)
        before = rss(pid)
        head = pack({"op": Op.STATS, "job": JOB, "step": 0, "worker": 0}, [])[0]
        unfinished = frame(head, True) + frame_head(240 * 1024, True) + bytes(240 * 1024)
        peers = []
        try:
            for _ in range(300):
                p = RawPeer(addr)
                p.try_send(unfinished)
                peers.append(p)
            time.sleep(1.0)
            grown = rss(pid) - before
            assert grown < 32 * MiB, f"node RSS grew by {grown / MiB:.1f} MiB"
            assert ask(addr, {"op": Op.STATS}).header["op"] == Op.STATS
            assert_equal_to_torch(th, out, spec)
            assert rss(pid) - before < 32 * MiB
        finally:
            for p in peers:
                p.close()
    said = [line for line in node_log(capfd) if "node.peers_total_bytes" in line]
    assert sum("said once" in line for line in said) == 1 and any(
        "the most while all connections together hold" in line for line in said
    ), said[:3]


# -- CURVE keys: roles, one connection per worker key ---------------------------------------------------


def make_keys(tmp_path, workers: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "luwu",
            "keys",
            "--out",
            str(tmp_path / "keys"),
            "--workers",
            str(workers),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    read = lambda name, section: tomllib.loads((tmp_path / "keys" / name).read_text())[section]  # noqa: E731
    return {
        "node": read("node.toml", "node"),
        "workers": [read(f"worker{r}.toml", "transport") for r in range(workers)],
        "monitor": read("monitor.toml", "transport"),
    }


def key_env(keys: dict) -> dict:
    return {f"LUWU_TRANSPORT__{k.upper()}": v for k, v in keys.items()}


@pytest.mark.timeout(150)
def test_curve_keys_hold_what_their_role_allows(tmp_path, capfd):
    """`luwu keys --workers 3`, node.max_message_bytes 8 MiB (node.peer_bytes 9 MiB). Before the job: worker
    key 2 on 12 connections, each leaving 6 MiB unfinished: each new connection replaces the one before
    (named once), so the node holds one at a time (12 at once would be 72 MiB). Then, while a 2-worker job
    trains with keys 0 and 1: the monitor key says HELLO (refused, named once), holds unfinished messages
    on 4 connections (cut at node.stranger_bytes) and PINGs without reading on 2 (cut at
    node.stranger_reply_bytes). Node RSS stays within 24 MiB of what it was; the job equals local AdamW."""
    keys = make_keys(tmp_path, 3)
    server, monitor, spare = keys["node"]["curve_public_key"], keys["monitor"], keys["workers"][2]
    args = [
        "--config",
        str(tmp_path / "keys" / "node.toml"),
        "--node.max_message_bytes",
        str(8 * MiB),
    ]
    spec = dict(SPEC, steps=20)
    with luwu.local_cluster(1, job=JOB, node_args=args) as cluster:
        addr, pid = cluster.addresses[0], cluster.procs[0].pid
        before = rss(pid)
        spares = []
        for _ in range(12):
            p = CurvePeer(addr, server, spare["curve_public_key"], spare["curve_secret_key"])
            p.try_send(
                p.message_frame(b"\x80", True)
                + b"".join(p.message_frame(bytes(2 * MiB), True) for _ in range(3))
            )
            spares.append(p)
        assert all(p.closed_by_node(10) for p in spares[:-1])
        grown = rss(pid) - before
        assert grown < 24 * MiB, (
            f"node RSS grew by {grown / MiB:.1f} MiB with one worker key on 12 connections"
        )
        th, out = train_beside(
            spec, cluster.addresses, tmp_path, envs=[key_env(keys["workers"][r]) for r in range(2)]
        )
        mon = (server, monitor["curve_public_key"], monitor["curve_secret_key"])
        peers = [
            CurvePeer(addr, *mon, rcvbuf=4096 if i >= 4 else 0) for i in range(6)
        ]  # (made while the workers start)
        floods = [
            p.message_frame(b"\x80", True)
            + b"".join(p.message_frame(bytes(MiB), True) for _ in range(8))
            for p in peers[:4]
        ]
        floods += [
            b"".join(p.message_frame(PING[2:], is_command=True) for _ in range(6 * MiB // 66))
            for p in peers[4:]
        ]  # 66 bytes a PING
        wait_workers(addr, 2, th.is_alive, curve=mon)
        hello, _ = templates(job_layout(spec, 1), 0)[Op.HELLO]
        for _ in range(2):
            err = ask(addr, {**hello, "worker": 0}, curve=mon).header
            assert err["op"] == Op.ERROR and "a monitor key" in err["message"], err
        for p, data in zip(peers, floods):
            flood(p, data)
        try:
            assert all(p.closed_by_node(30) for p in peers[:4]) and all(
                p.cut_by_node(30) for p in peers[4:]
            )
            grown = rss(pid) - before
            assert grown < 24 * MiB, f"node RSS grew by {grown / MiB:.1f} MiB"
        finally:
            for p in [*spares, *peers]:
                p.close()
        assert_equal_to_torch(th, out, spec)
    err = node_log(capfd)
    replaced = [line for line in err if "replaces its connection" in line]
    assert len(replaced) == 1 and spare["curve_public_key"] in replaced[0], replaced
    refused = [line for line in err if "refusing HELLO from the monitor key" in line]
    assert len(refused) == 1 and monitor["curve_public_key"] in refused[0], refused
    cut = [
        line
        for line in err
        if f"CURVE key {monitor['curve_public_key']}" in line and "disconnecting" in line
    ]
    assert (
        sum("more than this peer may hold (262144)" in line for line in cut) == 4
        and sum("replies left unread" in line for line in cut) == 2
    ), cut


@pytest.mark.timeout(120)
def test_a_worker_key_reconnecting_replaces_its_hung_connection(tmp_path, capfd):
    """Rank 0's key said HELLO on a connection that then hangs (open, silent: a host that froze). A new
    process with the same key connects: its connection replaces the hung one (which the node closes),
    it says HELLO as rank 0 at once (the rank goes on with the new connection instead of waiting
    node.worker_timeout_s for the old one) and trains; the weights equal local AdamW."""
    keys = make_keys(tmp_path, 1)
    server, worker = keys["node"]["curve_public_key"], keys["workers"][0]
    spec = DEFAULTS | dict(SPEC, bucket_bytes=4096)
    model, local = make_model(spec), make_model(spec)
    ref = torch.optim.AdamW(local.parameters(), lr=0.01)
    data = [torch.randn(8, 20) for _ in range(20)]
    with luwu.local_cluster(
        1, job=JOB, node_args=["--config", str(tmp_path / "keys" / "node.toml")]
    ) as cluster:
        addr = cluster.addresses[0]
        hello, _ = templates(job_layout(spec, 1), 0)[
            Op.HELLO
        ]  # the job's own layout, as rank 0 of 1
        hung = CurvePeer(addr, server, worker["curve_public_key"], worker["curve_secret_key"])
        hung.send_message(pack({**hello, "world_size": 1}, []))
        assert wire.decode(hung.recv_message(), job=JOB).header["op"] == Op.WELCOME
        transport = TransportConfig(
            timeout_s=30, connect_timeout_s=20, bucket_bytes=spec["bucket_bytes"], **worker
        )
        opt = luwu.RemoteOptimizer(
            model,
            "adamw",
            nodes=cluster.addresses,
            job=JOB,
            lr=0.01,
            compression=False,
            transport=transport,
        )
        try:
            assert hung.closed_by_node(10), "the hung connection was not replaced"
            for x in data:
                for m, o in ((model, opt), (local, ref)):
                    o.zero_grad()
                    (m(x) ** 2).mean().backward()
                    o.step()
            opt.synchronize()
        finally:
            opt.close()
            hung.close()
    for a, b in zip(model.parameters(), local.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    replaced = [line for line in node_log(capfd) if "replaces its connection" in line]
    assert len(replaced) == 1 and worker["curve_public_key"] in replaced[0], replaced


# -- a worker that does not take its replies -------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_worker_whose_library_reads_for_it_but_that_never_takes_its_replies_is_named(cluster1):
    """Rank 1 is a libzmq DEALER (RCVHWM 4, as LuWu's own client) that pushes every step and never takes a
    reply: its library reads a few, then its replies (bf16 weights, not sent zero-copy: no send tracker
    waits on them) stay unsent in the node. Within 15 s of that (worker_timeout_s / 4) the node names it:
    rank 0's next reply is WorkerLostError naming rank 1, long before worker_timeout_s (60 s); the node's
    RSS grows by less than 64 MiB meanwhile."""
    addr, pid = cluster1.addresses[0], cluster1.procs[0].pid
    layout = build_layout([ParamSpec("w", (512, 512), 0)], 4 << 20, [1.0])
    (b,) = layout.buckets_of(0)
    ctx = zmq.Context.instance()
    socks = []
    for w in range(2):
        s = member_socket(ctx.socket(zmq.DEALER))
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 4)
        if w == 1:
            s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(addr)
        socks.append(s)
    try:
        for w, s in enumerate(socks):
            hello = {
                "op": Op.HELLO,
                "job": JOB,
                "step": 0,
                "worker": w,
                "world_size": 2,
                "layout": layout.hash,
                "node_index": 0,
                "buckets": [b.to_wire()],
                "optimizer": "adamw",
                "mode": "sync",
                "param_names": {0: "w"},
            }
            s.send_multipart(pack(hello, []))
        assert wire.decode(socks[0].recv_multipart(), job=JOB).header["op"] == Op.WELCOME
        socks[0].send_multipart(
            pack(
                {
                    "op": Op.INIT,
                    "job": JOB,
                    "step": 0,
                    "worker": 0,
                    "bucket": b.id,
                    "codec": "none",
                    "cmeta": {},
                },
                [bytes(4 * b.numel)],
            )
        )
        # the seed is in before rank 1 pushes (its push would otherwise race rank 0's INIT: refused, as a
        # real worker never sends it, and the step would wait for rank 1 until worker_timeout_s)
        pull = {"op": Op.PULL, "job": JOB, "step": 0, "worker": 0, "bucket": b.id, "codec": "none"}
        socks[0].send_multipart(pack(pull, []))
        assert wire.decode(socks[0].recv_multipart(), job=JOB).header["op"] == Op.UPDATE
        # rank 0 waits for its reply while the node holds the step for rank 1: naming rank 1 takes 15 s
        # after its replies stuck (plus the watch's tick, longer on a loaded box), far less than the 60 s
        # worker_timeout_s that a node without the watch would take
        socks[0].setsockopt(zmq.RCVTIMEO, 40_000)
        before, t0, reply = rss(pid), time.monotonic(), None
        for step in range(400):
            for w, s in enumerate(socks):
                h = {
                    "op": Op.PUSH,
                    "job": JOB,
                    "step": step,
                    "worker": w,
                    "bucket": b.id,
                    "codec": "none",
                    "cmeta": {},
                    "hyper": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
                    "nograd": [],
                    "two_phase": False,
                    "pull": "bf16",
                }
                s.send_multipart(pack(h, [bytes(4 * b.numel)]))
            try:
                reply = wire.decode(socks[0].recv_multipart(), job=JOB).header
            except zmq.Again:
                pytest.fail(
                    f"step {step}: rank 0 got no reply in 40 s, {time.monotonic() - t0:.0f} s in"
                )
            if reply["op"] == Op.ERROR or time.monotonic() - t0 > 50:
                break
            time.sleep(0.25)
        took = time.monotonic() - t0
        assert reply["op"] == Op.ERROR and "worker 1 stopped reading" in reply["message"], (
            f"after {took:.0f} s: {reply}"
        )
        assert took < 50, took
        assert rss(pid) - before < 64 * MiB, (rss(pid) - before) / MiB
    finally:
        for s in socks:
            s.close(0)


# -- start-up never dies of one checkpoint file ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_node_starts_from_the_newest_checkpoint_that_restores(tmp_path):
    """A job checkpoints at steps 5, 10 and 15. The step-15 folder's manifest becomes JSON nested 100,000
    deep (RecursionError when read) and the step-10 one's names a world size of 10**12, both with a valid
    checksum: the restarted node skips both, says so, and restores step 5; a worker resuming from it
    gets the weights of local AdamW after 5 steps, and after 10 more steps still equals it."""
    ckpt = tmp_path / "ck"
    args = ["--node.checkpoint_dir", str(ckpt), "--node.checkpoint_every", "5", "--node.index", "0"]
    torch.manual_seed(0)
    data = [torch.randn(8, 16) for _ in range(15)]
    init = torch.nn.Linear(16, 8).state_dict()

    def model() -> torch.nn.Module:
        m = torch.nn.Linear(16, 8)
        m.load_state_dict(init)
        return m

    with luwu.local_cluster(1, job=JOB, node_args=args) as cluster:
        first = model()
        opt = luwu.RemoteOptimizer(
            first,
            "adamw",
            nodes=cluster.addresses,
            job=JOB,
            lr=0.01,
            compression=False,
            timeout_s=30,
        )
        try:
            train_steps(first, opt, data)
        finally:
            opt.close()
        cluster.stop()
        files = sorted(ckpt.glob("node0-step*.dcp"))
        assert [f.name[-8:-4] for f in files] == ["0005", "0010", "0015"], files
        rewrite_manifest(files[2], lambda h: b"[" * 100_000 + b"]" * 100_000)
        rewrite_manifest(files[1], lambda h: json.dumps({**h, "world_size": 10**12}).encode())
        addr = cluster.restart(0)
        st = ask(addr, {"op": Op.STATS}).header["detail"]
        assert st["step"] == 5 and st["checkpoint_step"] == 5, st
        assert_resumes_like_adamw(addr, JOB, model, data, 5)

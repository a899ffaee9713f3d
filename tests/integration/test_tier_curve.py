"""The switch tier with CURVE: aggregators with keys of their own role, real processes on loopback.

``luwu keys --cluster`` makes one pair per group: its aggregator serves its workers with it (only the
group's worker keys get in, each bound to its rank) and shows it to the nodes, which let that key
relay the group's ranks and nothing else. Training through such aggregators has the bits of the flat
run (compression off), the first of them SIGKILLed mid-run (its workers fall back to the nodes with
the nodes' key); a worker key of another group, a worker key saying HELLO marked ``relay``, an
aggregator's key relaying a rank outside its group or speaking as a plain worker are refused, each
naming the key and the rank, and the nodes go on serving the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
import zmq
from harness import TRAIN, run_training, wait_all
from support.cli import luwu
from support.worker_output import read_until_step

import luwu as lw
from luwu.cluster import _await_ready, _spawn
from luwu.gpu_workers.config import TransportConfig
from luwu.protocol import messages as wire
from luwu.protocol.messages import Op

SPEC = {"optimizer": "adamw", "hyper": {"lr": 0.01}, "steps": 10, "batch": 4, "bucket_bytes": 2048}
SPEC["step_sleep"] = 0.05  # (the first aggregator is killed mid-run: its workers fall back)
GROUPS = ("0-1", "2-3")
CLUSTER = """[cluster]
world_size = 4

[[groups]]
ranks = "0-1"
aggregator = "tcp://127.0.0.1:0"

[[groups]]
ranks = "2-3"
aggregator = "tcp://127.0.0.1:0"
"""


def _keys(tmp: Path) -> Path:
    (tmp / "cluster.toml").write_text(CLUSTER)
    out = tmp / "keys"
    r = luwu("keys", "--out", str(out), "--workers", "4", "--cluster", str(tmp / "cluster.toml"))
    assert r.returncode == 0, r.stderr
    return out


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _start_aggregators(keys: Path, nodes: list[str], procs: list) -> list[str]:
    """``luwu aggregator --config keys/aggregator<i>.toml`` for each group (appended to ``procs``)."""
    spawned = []
    for i, ranks in enumerate(GROUPS):
        args = ["--config", str(keys / f"aggregator{i}.toml"), "--ranks", ranks]
        args += ["--cluster.nodes", ",".join(nodes), "--node.bind", "tcp://127.0.0.1:0"]
        proc, lines = _spawn(args, "aggregator")
        procs.append(proc)
        spawned.append((proc, lines, args))
    return [_await_ready(*sp, 60, None)[1] for sp in spawned]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _train_through(
    keys: Path, aggregators: list[str], nodes: list[str], tmp: Path, kill: subprocess.Popen
) -> list[dict]:
    """The 4 ranks of SPEC, rank r with its own keys/worker<r>.toml and its group's aggregator;
    ``kill`` (the first aggregator) SIGKILLed once rank 0 reached step 3: its workers fall back to
    the nodes, showing them the nodes' key."""
    out = tmp / f"result-{time.monotonic_ns()}"
    spec = dict(SPEC, nodes=nodes, world_size=4, out=str(out))
    spec["aggregators"] = {str(r): aggregators[r // 2] for r in range(4)}
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    procs = []
    for rank in range(4):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_TRANSPORT__")}
        own = _toml(keys / f"worker{rank}.toml")["transport"]
        env.update({f"LUWU_TRANSPORT__{k.upper()}": v for k, v in own.items() if "curve" in k})
        group = _toml(keys / f"worker{rank}.toml")["groups"][rank // 2]
        assert group["ranks"] == GROUPS[rank // 2]
        env["LUWU_CLUSTER__AGGREGATOR_KEY"] = group["aggregator_key"]
        env.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TRAIN), str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    seen: list[str] = []
    read_until_step(procs[0], 3, seen)
    kill.kill()
    outs = wait_all(procs, 180)
    assert "goes on directly" in outs[1], outs[1][-2000:]
    return [torch.load(f"{out}.rank{r}") for r in range(4)]


def _raw(
    address: str, server: str, pair: tuple[str, str], frames: list, timeout_ms: int = 20000
) -> dict:
    """``frames`` sent over CURVE with ``pair`` to ``address`` (server key ``server``); the answer
    (zmq.Again: none within ``timeout_ms``)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.curve_serverkey, s.curve_publickey = server.encode(), pair[0].encode()
    s.curve_secretkey = pair[1].encode()
    s.connect(address)
    try:
        s.send_multipart(frames)
        return wire.decode(s.recv_multipart(), job="luwu").header
    finally:
        s.close(0)


def _raw_hello(node: str, server: str, pair: tuple[str, str], rank: int, relay: bool) -> dict:
    """A HELLO as ``rank`` of 4 (marked ``relay`` or not) over CURVE with ``pair``; its answer."""
    header = {
        "op": Op.HELLO, "job": "luwu", "step": 0, "worker": rank, "world_size": 4,
        "layout": "0" * 16, "node_index": 0, "buckets": [], "optimizer": "adamw",
        "mode": "sync", "param_names": {},
    }  # fmt: skip
    if relay:
        header["relay"] = True
    return _raw(node, server, pair, wire.encode(header))


def _refusals(keys: Path, node: str) -> None:
    """A worker key relaying, an aggregator key past its group or as a plain worker: each refused
    by the node, naming the key and the rank."""
    server = _toml(keys / "node.toml")["node"]["curve_public_key"]
    w0 = _toml(keys / "worker0.toml")["transport"]
    worker = (w0["curve_public_key"], w0["curve_secret_key"])
    a0 = _toml(keys / "aggregator0.toml")["transport"]
    agg = (a0["curve_public_key"], a0["curve_secret_key"])
    cases = [
        (worker, 0, True, f"HELLO marked relay for worker rank 0 with the CURVE key {worker[0]}, "
         "which is no aggregator's"),
        (agg, 2, True, f"HELLO relaying worker rank 2 with the CURVE key {agg[0]} of the aggregator "
         "of ranks 0-1 (node.curve_aggregator_keys): rank 2 is outside its group"),
        (agg, 0, False, f"HELLO as plain worker rank 0 with the CURVE key {agg[0]} of the aggregator "
         "of ranks 0-1"),
    ]  # fmt: skip
    for pair, rank, relay, text in cases:
        got = _raw_hello(node, server, pair, rank, relay)
        assert got["op"] == Op.ERROR and text in got["message"], (rank, relay, got)


@pytest.mark.timeout(420)
def test_training_through_curve_aggregators_equals_the_flat_run_and_strangers_are_refused(tmp_path):
    with lw.local_cluster(2) as flat:
        want = run_training(SPEC, flat.addresses, tmp_path, world_size=4)
    keys = _keys(tmp_path)
    node_toml = _toml(keys / "node.toml")["node"]
    assert [e.partition("=")[0] for e in node_toml["curve_aggregator_keys"]] == list(GROUPS)
    procs: list[subprocess.Popen] = []
    with lw.local_cluster(2, node_args=["--config", str(keys / "node.toml")]) as tier:
        try:
            aggs = _start_aggregators(keys, tier.addresses, procs)
            _refusals(keys, tier.addresses[0])
            _stranger_at_aggregator(keys, aggs[0])
            _budget_at_aggregator(keys, aggs[0])
            got = _train_through(keys, aggs, tier.addresses, tmp_path, kill=procs[0])
        finally:
            _stop(procs)
    for rank in range(4):
        for i, (a, b) in enumerate(zip(got[rank]["params"], want[rank]["params"])):
            assert a.equal(b), f"rank {rank} parameter {i}: not the bits of the flat run"


def _budget_at_aggregator(keys: Path, aggregator: str) -> None:
    """The node's per-peer bounds at the aggregator's hop too: a group's worker key that has not said
    HELLO pushes 1 MiB, past node.stranger_bytes (256 KiB): disconnected before the payload is read
    (its log names the peer), nothing answered; the aggregator serves on (the training after it)."""
    server = _toml(keys / "aggregator0.toml")["node"]["curve_public_key"]
    w0 = _toml(keys / "worker0.toml")["transport"]
    push = {
        "op": Op.PUSH, "job": "luwu", "step": 0, "worker": 0, "bucket": 0, "codec": "none",
        "cmeta": {}, "hyper": {}, "nograd": [], "two_phase": False, "pull": "",
    }  # fmt: skip
    frames = wire.encode(push, [torch.zeros(1 << 18)])  # 1 MiB
    with pytest.raises(zmq.Again):
        _raw(aggregator, server, (w0["curve_public_key"], w0["curve_secret_key"]), frames, 3000)


def _stranger_at_aggregator(keys: Path, aggregator: str) -> None:
    """Rank 2's key (group 2-3) at the aggregator of ranks 0-1: closed at the CURVE handshake (only
    the group's worker keys get in); rank 1's key claiming rank 0 there: refused naming both ranks."""
    a0 = _toml(keys / "aggregator0.toml")["node"]["curve_public_key"]
    for rank, claim, error, text in (
        (2, 2, lw.NodeTimeoutError, "WELCOME|closed"),
        (1, 0, lw.ProtocolError, "HELLO as worker rank 0 with the CURVE key"),
    ):
        own = _toml(keys / f"worker{rank}.toml")["transport"]
        tc = TransportConfig(
            timeout_s=10,
            connect_timeout_s=5,
            curve_server_key=a0,
            curve_public_key=own["curve_public_key"],
            curve_secret_key=own["curve_secret_key"],
        )
        with pytest.raises(error, match=text):
            lw.RemoteOptimizer(
                torch.nn.Linear(4, 2),
                nodes=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
                aggregator=aggregator,
                rank=claim,
                world_size=4,
                lr=0.1,
                transport=tc,
            )

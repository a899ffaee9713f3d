"""Out-of-core nodes (node.state_dir, node.state_memory_bytes), real processes: 2 workers train against
a node whose state is at least 4x its memory budget, and the weights equal an in-RAM node's run bit for
bit (compression off), resident and streaming; the state files hold every bucket's last step. The files
are the checkpoint: a node SIGKILLed at a random step, or stopped and killed while its write-backs are
in flight, restarts from them and the run ends bit for bit as the failure-free one; checkpoint_every, a
CHECKPOINT request and SIGTERM commit them; files that do not match their job.json are refused.
AdamW's files hold 12 B a parameter (amsgrad's maximum left out until a step turns it on: see
test_ooc_optimizers.py), and a streaming
worker's weight fetches read the weights alone from them."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from harness import (
    ROOT,
    TRAIN,
    kill_node_after_step,
    run_training,
    start_workers,
    tanh_mlp,
    wait_all,
)
from support.worker_output import read_until_step

import luwu
from luwu.protocol.errors import ConfigError
from luwu.protocol.messages import Op
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.ooc import IOEngine, StateFile, StateLayout
from luwu.switch_nodes.ooc.shard import STEP_SHIFT

STREAM = ROOT / "workers" / "stream.py"
SLOT = 4 * 4096  # an AdamW bucket of at most 1024 elements: params, 2 moments, steps, 4 KiB each
BUDGET = 2 * SLOT


def _stream(spec: dict, nodes: list[str], tmp) -> list[dict]:
    spec = dict(spec, nodes=nodes, world_size=2, out=str(tmp / f"result-{time.monotonic_ns()}"))
    wait_all(start_workers(STREAM, spec, 2, tmp), 150)
    return [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]


def _train(spec: dict, streaming: bool, tmp, node_args: list[str] | None = None) -> list:
    with luwu.local_cluster(1, node_args=node_args) as c:
        if streaming:
            return [r["params"] for r in _stream(spec, c.addresses, tmp)]
        return [r["params"] for r in run_training(spec, c.addresses, tmp)]


def _flat(params) -> list[torch.Tensor]:
    return list(params.values()) if isinstance(params, dict) else list(params)


def _committed_steps(folder) -> tuple[dict[int, int], int]:
    """The step each bucket's state files hold (committed), and the bytes of one slot of every bucket."""
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    engine = IOEngine()
    state = StateFile.open(folder, layout, engine)
    try:
        steps = {bid: c.version >> STEP_SHIFT for bid, c in state.committed.items()}
    finally:
        state.close()
        engine.close()
    return steps, sum(b.slot_bytes for b in layout.buckets)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streaming"])
def test_node_with_a_quarter_of_its_state_in_ram_trains_as_the_in_ram_node(streaming, tmp_path):
    steps = 6
    spec = {"steps": steps, "bucket_bytes": 1024 if not streaming else 2048, "hyper": {"lr": 0.01}}
    if streaming:
        spec["hyper"] = {"lr": 0.01, "weight_decay": 0.05}
    want = _train(spec, streaming, tmp_path)
    state_dir = tmp_path / "state"
    args = ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(BUDGET)]
    got = _train(spec, streaming, tmp_path, args)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(_flat(got[rank]), _flat(want[rank]))):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")
    committed, state_bytes = _committed_steps(state_dir / "luwu-node0")
    assert state_bytes >= 4 * BUDGET, (state_bytes, BUDGET)  # the state was 4x the budget at least
    assert committed and set(committed.values()) == {steps}, committed


@pytest.mark.timeout(200)
def test_state_that_fits_the_budget_stays_in_ram_and_writes_no_files(tmp_path):
    spec = {"steps": 4, "bucket_bytes": 1024}
    want = _train(spec, False, tmp_path)
    state_dir = tmp_path / "state"
    args = ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(64 << 20)]
    got = _train(spec, False, tmp_path, args)
    for a, b in zip(_flat(got[0]), _flat(want[0])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not (state_dir / "luwu-node0" / "header.json").exists()


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"state_memory_bytes": -1}, "node.state_memory_bytes must be >= 0"),
        ({"state_memory_bytes": 1 << 20}, "needs node.state_dir"),
        ({"state_dir": "/tmp/s", "checkpoint_dir": "/tmp/c"}, "do not combine"),
    ],
)
def test_state_settings_are_validated(kw, says):
    with pytest.raises(ConfigError, match=says):
        NodeConfig(**kw)


def test_state_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        NodeConfig(state_dir=str(f))
    assert NodeConfig(state_dir=str(tmp_path / "new"), state_memory_bytes=1 << 30).state_dir


# ----------------------------------------------------------------------------- restart from the files
CRASH = {
    "optimizer": "adamw",
    "hyper": {"lr": 0.01},
    "steps": 30,
    "bucket_bytes": 1024,
    "resilient": True,
    "step_sleep": 0.03,
    "timeout_s": 20.0,
}


def _ooc_args(state_dir, *extra: str) -> list[str]:
    return ["--node.state_dir", str(state_dir), "--node.state_memory_bytes", str(BUDGET), *extra]


def _failure_free(tmp, spec: dict) -> list:
    """Each rank's final parameters of ``spec`` trained against an in-RAM node, without failures."""
    with luwu.local_cluster(1) as c:
        return [r["params"] for r in run_training(dict(spec, resilient=False), c.addresses, tmp)]


def _assert_bitwise(got: list, want: list) -> None:
    for rank in range(2):
        for i, (a, b) in enumerate(zip(_flat(got[rank]), _flat(want[rank]))):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"param {i}: {m}")


def _files_after_kill(folder) -> tuple[int, int]:
    """After a kill: (buckets whose committed step is past the lowest one, i.e. to be rewound; slots
    whose journal record names data that is no longer there, i.e. a write-back caught uncommitted)."""
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    engine = IOEngine()
    state = StateFile.open(folder, layout, engine)
    try:
        floor = state.floor()
        ahead = sum(c.version >> STEP_SHIFT > floor for c in state.committed.values() if c)
        torn = sum(not state.intact(r) for recs in state.records.values() for r in recs.values())
    finally:
        state.close()
        engine.close()
    return ahead, torn


def _recoveries(spec: dict) -> list[dict]:
    results = [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]
    assert all(r["recoveries"] >= 1 for r in results), results[0]["recoveries"]
    return results


@pytest.mark.timeout(400)
def test_sigkill_ooc_node_at_random_step_restart_from_its_files_final_params_equal(tmp_path):
    """A node with a quarter of its state in RAM is SIGKILLed at a random step and restarted on the same
    state_dir: it restarts from its state files (no checkpoint_dir), the workers roll back to the step
    every bucket holds, and the final weights equal the failure-free run bit for bit."""
    kill_at = random.Random(os.environ.get("LUWU_TEST_SEED", time.time_ns())).randint(6, 22)
    print(f"killing the node after step {kill_at}")
    want = _failure_free(tmp_path, CRASH)
    state_dir = tmp_path / "state"
    with luwu.local_cluster(1, node_args=_ooc_args(state_dir)) as cluster:
        spec = dict(CRASH, nodes=cluster.addresses, world_size=2, out=str(tmp_path / "res"))
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        seen = kill_node_after_step(cluster, procs[0], kill_at, node=0)
        wait_all(procs, 240)
        assert cluster.procs[0].poll() is None, "".join(seen[-20:])
    got = [r["params"] for r in _recoveries(spec)]
    _assert_bitwise(got, want)
    committed, state_bytes = _committed_steps(state_dir / "luwu-node0")
    assert state_bytes >= 4 * BUDGET and set(committed.values()) == {CRASH["steps"]}, committed


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


def _stop_while_writing(proc, url: str, timeout_s: float = 30) -> None:
    """SIGSTOP the node the moment its state bytes written move between two reads of its metrics (a
    write-back in flight, its commit at most a group-commit interval behind), then SIGKILL it."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        now = _metric(url, "luwu_node_state_bytes_written_total")
        if last is not None and now > last:
            proc.send_signal(signal.SIGSTOP)
            break
        last = now
    else:
        raise AssertionError(f"the node wrote no state for {timeout_s} s")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.timeout(500)
def test_sigkill_during_write_back_recovers_exactly_once(tmp_path):
    """The node is stopped while its write-backs are in flight (its metrics show state bytes being written)
    and SIGKILLed, again after each restart, until a kill has left a slot whose data an uncommitted
    write-back overwrote (at most 5 kills): every restart puts the buckets at one step from the files, the
    workers roll back to it, and the final weights equal the failure-free run bit for bit."""
    rng = random.Random(os.environ.get("LUWU_TEST_SEED", time.time_ns()))
    spec = dict(CRASH, steps=40, step_sleep=0.02)
    want = _failure_free(tmp_path, spec)
    state_dir, port = tmp_path / "state", _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    args = _ooc_args(state_dir, "--metrics.port", str(port))
    spec["out"] = str(tmp_path / "res")
    seen, kills, caught, rewound = [], 0, 0, 0
    with luwu.local_cluster(1, node_args=args) as cluster:
        spec["nodes"], spec["world_size"] = cluster.addresses, 2
        procs = start_workers(TRAIN, spec, 2, tmp_path)
        target = 0
        while kills < 2 or (not caught and kills < 5):
            target += rng.randint(3, 6)
            read_until_step(procs[0], target, seen)
            _stop_while_writing(cluster.procs[0], url)
            kills += 1
            ahead, torn = _files_after_kill(state_dir / "luwu-node0")
            caught, rewound = caught + (torn > 0), rewound + (ahead > 0)
            cluster.restart(0)
        outs = wait_all(procs, 300)
    print(f"kills: {kills}, caught mid write-back: {caught}, buckets left ahead: {rewound}")
    assert caught, f"none of {kills} kills landed between a write-back and its commit"
    results = [torch.load(f"{spec['out']}.rank{r}") for r in range(2)]
    assert all(r["recoveries"] >= 1 for r in results), "".join(seen[-30:]) + outs[0][-2000:]
    _assert_bitwise([r["params"] for r in results], want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_once(opt, model, seed: int) -> None:
    opt.zero_grad()
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()


@pytest.mark.timeout(150)
def test_checkpoint_request_and_sigterm_commit_the_files_and_a_restart_resumes(tmp_path):
    """With state_dir (no checkpoint_dir) checkpoint_every and a CHECKPOINT request commit the state files
    (the request was refused: no checkpoint_dir), SIGTERM commits them too, and the restarted node resumes
    from them: the worker rolls back to the step it reached and holds the same weights."""
    folder, port = tmp_path / "state" / "luwu-node0", _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    args = _ooc_args(
        tmp_path / "state", "--node.checkpoint_every", "2", "--metrics.port", str(port)
    )
    with luwu.local_cluster(1, node_args=args) as cluster:
        model = tanh_mlp()  # 4 buckets of one layer each with 1088-byte buckets: twice the budget
        opt = luwu.RemoteOptimizer(
            model,
            nodes=cluster.addresses,
            lr=0.05,
            compression=False,
            bucket_bytes=1088,
            rank=0,
            world_size=1,
            timeout_s=10,
        )
        try:
            for s in range(3):
                _step_once(opt, model, s)
            opt.synchronize()
            assert _metric(url, "luwu_node_checkpoint_step") == 2  # checkpoint_every = 2 committed
            opt.worker.client.send(0, {"op": Op.CHECKPOINT})
            opt.worker.client.wait([(Op.CHECKPOINT, 0, None, -1)], what="checkpoint")
            assert _metric(url, "luwu_node_checkpoint_step") == 3
            assert set(_committed_steps(folder)[0].values()) == {3}
            _step_once(opt, model, 3)
            opt.synchronize()
            before = [p.detach().clone() for p in model.parameters()]
            cluster.procs[0].terminate()  # SIGTERM: the node commits its files, then exits
            assert cluster.procs[0].wait(30) == 0
            assert set(_committed_steps(folder)[0].values()) == {4}
            cluster.restart(0)
            with pytest.raises(luwu.RollbackError) as err:
                _step_once(opt, model, 4)
                opt.synchronize()
            assert err.value.step == 4
            assert opt.recover() == 4
            for a, b in zip(model.parameters(), before):
                torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
            _step_once(opt, model, 4)  # and it trains on from there
            opt.synchronize()
        finally:
            opt.close()


@pytest.mark.timeout(200)
def test_state_files_that_do_not_match_the_job_they_restart_are_refused(tmp_path):
    """A restart on state files whose header.json is another layout's (here: another run's, of another
    bucket_bytes) than the job.json beside them is refused at start, naming both layouts."""
    spec = {"steps": 2, "bucket_bytes": 1024}
    _train(spec, False, tmp_path, _ooc_args(tmp_path / "a"))
    _train(dict(spec, bucket_bytes=2048), False, tmp_path, _ooc_args(tmp_path / "b"))
    ours, theirs = tmp_path / "a" / "luwu-node0", tmp_path / "b" / "luwu-node0"
    want = json.loads((ours / "header.json").read_text())["layout_hash"]
    other = json.loads((theirs / "header.json").read_text())["layout_hash"]
    shutil.copy(theirs / "header.json", ours / "header.json")
    node = [sys.executable, "-m", "luwu", "node", "--node.bind", "tcp://127.0.0.1:0"]
    done = subprocess.run(
        [*node, "--node.index", "0", *_ooc_args(tmp_path / "a")],
        env=dict(os.environ, LUWU_TRANSPORT__JOIN_SECRET="s" * 32),
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "do not match its job.json" in said, said
    assert want[:12] in said and other[:12] in said, said


@pytest.mark.timeout(300)
def test_adamw_state_files_hold_12_bytes_a_param(tmp_path):
    """AdamW's files hold the weights and its two moments, not amsgrad's maximum it never uses: a slot is
    params + exp_avg + exp_avg_sq (4 B a parameter each, 4096-aligned) + the step counters."""
    _train({"steps": 2, "bucket_bytes": 1024}, False, tmp_path, _ooc_args(tmp_path / "a"))
    folder = tmp_path / "a" / "luwu-node0"
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    params = 0
    for b in layout.buckets:
        names = [t.name for t in b.tensors]
        assert names == ["params", "exp_avg", "exp_avg_sq", "steps"], names
        numel, nsegs = b.tensors[0].numel, b.tensors[-1].numel
        params += numel
        want = 3 * (-(-4 * numel // 4096) * 4096) + -(-4 * nsegs // 4096) * 4096
        assert b.slot_bytes == want, (b.id, b.slot_bytes, want)
    slots = sum(b.slot_bytes for b in layout.buckets)
    steps = sum(-(-4 * b.tensors[-1].numel // 4096) * 4096 for b in layout.buckets)
    assert (folder / "slots.bin").stat().st_size >= 2 * slots == layout.data_bytes
    assert slots - steps <= 12 * params + 3 * 4096 * len(layout.buckets), (slots, params)


@pytest.mark.timeout(300)
def test_streaming_weight_fetches_read_only_the_weights(tmp_path):
    """A streaming worker fetches each unit's weights before its forward and again before its backward:
    such a reply reads the bucket's fp32 weights alone from the state files (4 B a parameter, 4096-
    aligned), not its whole slot. So the node reads at most the state once a step plus the weights once
    a fetch (counted as the fp32 bytes the node sent, which counts a fetch of every worker), and the run
    still equals the in-RAM node's bit for bit."""
    steps = 4
    spec = {"steps": steps, "bucket_bytes": 2048, "hyper": {"lr": 0.01, "weight_decay": 0.05}}
    want = _train(spec, True, tmp_path)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    args = _ooc_args(tmp_path / "state", "--metrics.port", str(port))
    with luwu.local_cluster(1, node_args=args) as c:
        got = [r["params"] for r in _stream(spec, c.addresses, tmp_path)]
        read = _metric(url, "luwu_node_state_bytes_read_total")
        sent = sum(
            float(ln.split()[-1])
            for ln in urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
            if ln.startswith("luwu_node_raw_bytes_sent_total{")
        )
    _assert_bitwise(got, want)
    folder = tmp_path / "state" / "luwu-node0"
    layout = StateLayout.from_json(json.loads((folder / "header.json").read_text()))
    state = sum(b.slot_bytes for b in layout.buckets)
    params = sum(b.tensors[0].numel for b in layout.buckets)
    weights = sum(-(-4 * b.tensors[0].numel // 4096) * 4096 for b in layout.buckets)
    fetches = sent / (4 * params)  # whole-model sends, every worker's counted
    # the state once a step, once more (the first read of each slot checks it whole), the weights a fetch
    bound = (steps + 2) * state + fetches * weights
    print(f"read {read:.0f} B, state {state} B, weights {weights} B, {fetches:.1f} fetches")
    assert fetches >= 2 * steps, (sent, params)  # the workers did fetch before forward and backward
    assert 0 < read <= bound, (read, bound, state, weights, fetches)

"""A worker that dies or stalls behind an aggregator: the same strict and elastic policies as without
one, naming the missing rank, not the aggregator's group.

Four workers behind one aggregator (its block is ranks 0-3, summed as one subtree of the node's
tree). Rank 2 stops: the aggregator sends the nodes what ranks 0, 1 and 3 pushed once the block
waited a quarter of the nodes' ``worker_timeout_s`` (a sum of 0-1 and rank 3's push as it came), so
the nodes see which rank is missing. Strict mode fails the step for the others naming rank 2;
elastic mode drops rank 2, trains on, and takes it back after ``recover()``."""

import signal

import pytest
import torch
from harness import TRAIN, start_workers, wait_all
from integration.test_worker_faults import SPEC, end_workers, read_until

import luwu

WORLD = 4
STALLED = 2


def _spec(cluster, tmp_path, **kw) -> dict:
    aggregators = {str(r): cluster.aggregator_for(r) for r in range(WORLD)}
    out = str(tmp_path / "res")
    return dict(SPEC, nodes=cluster.addresses, world_size=WORLD, out=out, aggregators=aggregators)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_strict_mode_names_the_missing_rank_behind_an_aggregator(sig, tmp_path):
    args = ["--node.worker_policy", "strict", "--node.worker_timeout_s", "2"]
    with luwu.local_cluster(2, node_args=args, aggregators=1, world_size=WORLD) as cluster:
        procs = start_workers(TRAIN, _spec(cluster, tmp_path), WORLD, tmp_path)
        try:
            read_until(procs[STALLED], "STEP 5")
            procs[STALLED].send_signal(sig)
            for rank in (0, 1, 3):
                out, _ = procs[rank].communicate(timeout=90)
                assert procs[rank].returncode != 0, out[-2000:]
                assert "WorkerLostError" in out and f"workers [{STALLED}]" in out, out[-2000:]
        finally:
            end_workers(procs)


@pytest.mark.timeout(240)
def test_elastic_mode_drops_a_stalled_rank_behind_an_aggregator_and_takes_it_back(tmp_path):
    args = ["--node.worker_policy", "elastic", "--node.worker_timeout_s", "2"]
    with luwu.local_cluster(2, node_args=args, aggregators=1, world_size=WORLD) as cluster:
        spec = dict(_spec(cluster, tmp_path), resilient=True, steps=80, step_sleep=0.1)
        procs = start_workers(TRAIN, spec, WORLD, tmp_path)
        read_until(procs[STALLED], "STEP 5")
        procs[STALLED].send_signal(signal.SIGSTOP)
        for rank in (0, 1, 3):
            read_until(procs[rank], "STEP 15")  # the others train on without it
        procs[STALLED].send_signal(signal.SIGCONT)
        outs = wait_all(procs, 200)
    stalled = outs[STALLED]
    assert "RECOVERED" in stalled and "WorkerLostError" in stalled, stalled[-2000:]
    assert f"worker {STALLED} dropped" in stalled, stalled[-2000:]
    resumed = int(stalled.split("RECOVERED ")[1].split()[0])
    assert resumed <= 70, (
        f"rank {STALLED} resumed at step {resumed}: it should train on with the rest"
    )
    results = [torch.load(f"{spec['out']}.rank{r}") for r in range(WORLD)]
    for rank in range(1, WORLD):
        for x, y in zip(results[0]["params"], results[rank]["params"]):
            assert torch.equal(x, y), f"rank {rank} ends with other weights than rank 0"

"""An out-of-core node inside a memory cgroup trains as an in-RAM node does, and the limit binds.

The short version of ``benchmarks/bench_ooc_node.py`` (a node process in a fresh memory cgroup from
its first byte, two streaming workers, compression off): a state of ~50 MB, node.state_memory_bytes a
quarter of it, 3 steps. The limit is the in-RAM node's peak in its cgroup less half the state: the
in-RAM node cannot live under it (checked: it is killed), the out-of-core node must, and its weights
equal the in-RAM node's bit for bit. (Not the issue's baseline + state / 4: at this size the few MiB
the node holds besides node.state_memory_bytes, named in the second test, are a large share of a
13 MB budget; at 269M parameters bench_ooc_node trains under that limit.) The second test bounds
what the node holds above its idle self by node.state_memory_bytes and that small allowance. Needs
root and a cgroup memory controller; skipped without.
"""

from pathlib import Path

import pytest

from benchmarks.bench_memory import memory_cgroup
from benchmarks.bench_ooc_node import MIB, compare, model_numel, run_case, state_bytes

WIDTH, DEPTH, STEPS = 256, 8, 3
FREE = 16 << 30  # a limit that never binds on the machines this runs on


def _cgroup_or_skip() -> None:
    with memory_cgroup(FREE) as (procs, why):
        if procs is None:
            pytest.skip(why)


@pytest.mark.timeout(400)
def test_out_of_core_node_under_a_limit_the_in_ram_node_cannot_live_under(tmp_path: Path):
    _cgroup_or_skip()
    state = state_bytes(model_numel(WIDTH, DEPTH))
    spec = {
        "width": WIDTH,
        "depth": DEPTH,
        "steps": STEPS,
        "batch": 8,
        "world_size": 2,
        "bucket_bytes": 1 * MIB,
        "timeout_s": 60,
    }
    ref = run_case("in RAM", dict(spec, out=str(tmp_path / "ref.pt")), [], FREE, tmp_path, 200)
    assert ref["trained"], ref
    limit = int(ref["cgroup_peak_mib"] * MIB) - state // 2
    ooc_args = ["--node.state_dir", str(tmp_path / "state")]
    ooc_args += ["--node.state_memory_bytes", str(state // 4)]
    cap = run_case(
        "state_dir", dict(spec, out=str(tmp_path / "ooc.pt")), ooc_args, limit, tmp_path, 200
    )
    assert cap["trained"] and cap["oom_kills"] == 0, (
        f"the out-of-core node did not train under {limit / MIB:.0f} MiB "
        f"(in-RAM peak {ref['cgroup_peak_mib']} MiB, state {state / MIB:.0f} MiB): {cap}"
    )
    assert cap["state_read_mib"] > 0 and cap["state_written_mib"] > 0, cap  # it went to disk
    assert compare(tmp_path / "ref.pt", tmp_path / "ooc.pt") == 0.0
    # the limit binds: the in-RAM node under it is killed
    one_step = dict(spec, steps=1, out=str(tmp_path / "x.pt"))
    nodir = run_case("no state_dir", one_step, [], limit, tmp_path, 200)
    assert not nodir["trained"] and nodir["oom_kills"] >= 1, nodir


# node.state_memory_bytes bounds the node: what it holds besides its idle self (cgroup peak less the
# idle node's) is the window and the pushes in flight, both within the budget, plus a small fixed part
# named here: the pushes' overdraft (with nothing in flight one bucket's pushes go in whatever the
# budget), the connections' staging buffers, the threads' stacks and one bucket's optimizer temporaries.
# Measured here: 3-5 MiB over the budget with the bound, 66-73 MiB over without it.
ALLOWANCE = 16 * MIB


@pytest.mark.timeout(150)
def test_out_of_core_node_memory_stays_within_state_memory_bytes(tmp_path: Path):
    """Seeds, pushes and replies count against node.state_memory_bytes, and what the node frees goes
    back. Unbounded, the seeds rank 0 sends while the node opens its state files piled up unread (to
    node.peer_bytes at most), and the heaps kept their peaks: each alone put the node ~0.7x the budget
    above it here."""
    _cgroup_or_skip()
    width, depth = 1024, 4  # 34M parameters: 385 MiB of state, 4 MiB buckets
    state = state_bytes(model_numel(width, depth))
    budget = state // 4
    spec = {
        "width": width,
        "depth": depth,
        "steps": 2,
        "batch": 8,
        "world_size": 2,
        "bucket_bytes": 4 * MIB,
        "timeout_s": 60,
    }
    idle = run_case("idle", dict(spec, steps=0), [], FREE, tmp_path, 60)
    ooc_args = ["--node.state_dir", str(tmp_path / "state")]
    ooc_args += ["--node.state_memory_bytes", str(budget)]
    cap = run_case(
        "state_dir", dict(spec, out=str(tmp_path / "o.pt")), ooc_args, FREE, tmp_path, 90
    )
    assert cap["trained"], cap
    assert cap["state_read_mib"] > 0 and cap["state_written_mib"] > 0, cap  # it went to disk
    over = (cap["cgroup_peak_mib"] - idle["cgroup_peak_mib"]) * MIB
    print(f"above the idle node: {over / MIB:.1f} MiB, budget {budget / MIB:.1f} MiB")
    assert over <= budget + ALLOWANCE, (
        f"the node held {over / MIB:.1f} MiB above its idle self ({idle['cgroup_peak_mib']} MiB), "
        f"more than node.state_memory_bytes {budget / MIB:.1f} MiB + {ALLOWANCE / MIB:.0f} MiB "
        f"(state {state / MIB:.0f} MiB; pushes in flight peaked at {cap['inflight_peak_mib']} MiB of "
        f"{cap['inflight_limit_mib']} MiB, window {cap['state_buffer_mib']} MiB)"
    )

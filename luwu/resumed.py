"""A worker that resumes a job (``resume=True``) while the nodes hold its buckets at different steps
is refused, with what to do.

A worker killed between its pushes of one step leaves some buckets stepped and the others waiting for
it: in strict mode a bucket's step is applied once every rank's push of it is in, and this rank's
pushes of some buckets got there. Resumed at the lowest step, the worker would compute that step's
gradient on weights of which a part is one step newer (the run silently no longer the one without
the failure), and its first step's global round (asked in case it clips) would wait for the norms of
buckets already stepped, which no node can give: an in-RAM node keeps one version of its buckets.
Nodes restarted from their checkpoints hold one step again.
"""

from __future__ import annotations

from luwu.protocol.errors import StepMismatchError


def mixed_steps(welcomes: list[dict], rank: int, job: str) -> str | None:
    """Why a worker cannot resume from nodes whose buckets are at different steps (their WELCOMEs'
    ``versions``), or None when every bucket is at the same step."""
    at = {(n, int(b)): v for n, w in enumerate(welcomes) for b, v in w["versions"].items()}
    if not at or min(at.values()) == max(at.values()):
        return None
    low = min(at.values())
    ahead: dict[int, list[int]] = {}
    for (n, b), v in sorted(at.items()):
        if v > low:
            ahead.setdefault(n, []).append(b)
    where = "; ".join(
        f"node {n}: bucket{'s' if len(bs) > 1 else ''} {', '.join(map(str, bs[:8]))}"
        + (f" and {len(bs) - 8} more" if len(bs) > 8 else "")
        for n, bs in ahead.items()
    )
    return (
        f"worker {rank} cannot resume job {job!r}: the nodes hold step {low}, but step {low} was "
        f"already applied to some buckets ({where}), with this rank's pushes from before it "
        f"restarted. Resumed, its step-{low} gradients of the other buckets would be computed on "
        "weights partly one step newer, and its first step would wait for norms that no node "
        "keeps. Restart the nodes from their checkpoints (node.checkpoint_dir: they restore one "
        "step) and resume again, or start the job fresh"
    )


def refuse_mixed_steps(welcomes: list[dict], rank: int, job: str) -> None:
    """Raise :func:`mixed_steps`' refusal, if any."""
    why = mixed_steps(welcomes, rank, job)
    if why is not None:
        raise StepMismatchError(why)

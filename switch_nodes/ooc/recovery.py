"""What an out-of-core node needs besides its state files to restart from them: the job's description.

The slots and the journal hold every bucket's tensors and versions (:mod:`.state_file`); ``job.json``,
beside them in the same folder, holds the rest of what an in-RAM node's checkpoint holds: the job's
layout hash (as the workers said it in HELLO), world size, optimizer kind, parameter names and every
bucket's spec, in the order the buckets step. It is written (temporary file, fsync, rename, fsync of the
folder) before the state files are created and again at every commit, so a folder with a
``header.json`` has one, and a restart needs nothing else. A bucket that never committed is
uninitialized (its seed had not landed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from luwu.protocol.errors import (
    ConfigError,
    CorruptCheckpointError,
    LayoutMismatchError,
    ProtocolError,
)
from luwu.protocol.layout import Bucket
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.ooc.io import IOEngine
from luwu.switch_nodes.ooc.layout import StateLayout
from luwu.switch_nodes.ooc.state_file import HEADER_FILE, StateFile
from luwu.switch_nodes.optimizers import OptimizerKind, get_kind
from luwu.switch_nodes.store import BucketState, SegmentState

META_FILE = "job.json"


def folder_of(ctx: NodeContext) -> Path:
    """The node's state folder: ``<state_dir>/<job>-node<index>``."""
    return Path(ctx.cfg.state_dir) / f"{ctx.job}-node{ctx.index}"


def has_state(folder: Path) -> bool:
    return (folder / HEADER_FILE).exists()


def layout_of(
    ctx: NodeContext,
    order: list[BucketState],
    kind: OptimizerKind | None,
    names: tuple[str, ...] | None = None,
) -> StateLayout:
    """The state files' layout of ``order``'s buckets holding state ``names`` (default: what the files
    of optimizer ``kind`` hold at first, :func:`file_state`)."""
    if names is None:
        names = file_state(kind) if kind else ()
    sized = kind is not None and kind.whole_params
    return StateLayout.for_shard(
        ctx.job,
        [
            (b.id, b.numel, len(b.segments), SegmentState.sizes(kind, b.segments) if sized else {})
            for b in order
        ],
        names,
    )


def file_state(kind: OptimizerKind) -> tuple[str, ...]:
    """The state names the files hold for ``kind``: every name but the optional state of a boolean
    switch that is off by default (Adam's ``max_exp_avg_sq``, ``amsgrad``; RMSprop's ``grad_avg``,
    ``centered``). The files are laid out at the first seed, before any push said the job's
    hyperparameters, so a variant off by default costs no disk and no read; state of a numeric
    hyperparameter (SGD's ``momentum``) is held, since jobs usually set it. The first step that needs a
    name left out lays the files out again to hold it (:mod:`.relay`); a later one is refused
    (:func:`missing_state`)."""
    rare = {n for n, key in kind.optional_state if isinstance(kind.defaults.get(key), bool)}
    return tuple(n for n in kind.state_names if n not in rare)


def missing_state(
    ctx: NodeContext,
    b: BucketState,
    step: int,
    hyper: dict | None,
    held: tuple[str, ...] | None = None,
) -> None:
    """Refuse (ConfigError) step ``step`` of bucket ``b`` when its hyperparameters need state the files
    do not hold (``held``, default :func:`file_state`; a switch such as ``amsgrad`` turned on after the
    first step): never a step on state that is not there."""
    held = file_state(b.kind) if held is None else held
    for name in b.kind.state_for(hyper or {}):
        if name not in held:
            key = dict(b.kind.optional_state).get(name, name)
            raise ConfigError(
                f"node {ctx.index}: bucket {b.id} step {step}: {key}={(hyper or {}).get(key)!r} needs "
                f"optimizer state {name!r}, which this out-of-core node's state files do not hold "
                f"(they hold {', '.join(held) or 'none'}: {b.kind.name}'s state with {key} off); "
                f"{key} turned on after the first step is not supported with node.state_dir (the files "
                f"are laid out for it at the first step that names it): set {key} from the first step, "
                "or leave node.state_dir empty (an in-RAM node) for it"
            )


def write_meta(
    folder: Path, ctx: NodeContext, order: list[BucketState], names: tuple[str, ...] | None = None
) -> None:
    """``job.json`` of the job as it is now, atomically and durably; ``names``: the optimizer state
    the files hold (None: :func:`file_state`'s)."""
    meta = ctx.job_description(order[0].kind if order else None)
    meta["buckets"] = [b.to_wire() for b in order]
    if names is not None:
        meta["state_names"] = list(names)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (META_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / META_FILE)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_meta(folder: Path, ctx: NodeContext) -> tuple[dict, OptimizerKind, list[Bucket]]:
    """``job.json`` checked against this node: (the table, the optimizer kind, the bucket specs in step
    order). Refused (ConfigError) when it is missing, unreadable, or of another job or node."""
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
        kind = get_kind(meta["optimizer"])
        specs = [Bucket.from_wire(w) for w in meta["buckets"]]
        world = meta["world_size"]
    except (OSError, ValueError, KeyError, TypeError, ConfigError, ProtocolError) as exc:
        raise ConfigError(
            f"node {ctx.index}: {folder} holds state files but its {META_FILE} cannot be read "
            f"({type(exc).__name__}: {exc}); restore the folder from a copy, or remove it (or point "
            "node.state_dir elsewhere) to start the job afresh"
        ) from None
    if meta["job"] != ctx.job or meta["node"] != ctx.index:
        raise ConfigError(
            f"node {ctx.index}: {path} describes node {meta['node']} of job {meta['job']!r}, not node "
            f"{ctx.index} of job {ctx.job!r}: point node.state_dir at this job's folder or an empty one"
        )
    if type(world) is not int or not 1 <= world <= ctx.cfg.max_world_size:
        raise ConfigError(f"node {ctx.index}: {path} names world size {world}, not a job's")
    return meta, kind, specs


def held_of(meta: dict, kind: OptimizerKind) -> tuple[str, ...]:
    """The optimizer state the files of ``job.json`` ``meta`` hold (written by a re-lay), else
    :func:`file_state`'s; names the kind does not have are refused (ConfigError)."""
    names = meta.get("state_names")
    if names is None:
        return file_state(kind)
    if not isinstance(names, list) or not set(names) <= set(kind.state_names):
        raise ConfigError(
            f"{META_FILE} names optimizer state {names!r}, not {kind.name}'s {kind.state_names}: "
            "restore the folder from a copy, or remove it to start the job afresh"
        )
    return tuple(n for n in kind.state_names if n in names)


def open_files(folder: Path, ctx: NodeContext, layout: StateLayout, engine: IOEngine) -> StateFile:
    """The state files of an earlier run, whose ``header.json`` must describe ``layout`` (the one
    ``job.json`` describes): a mismatch is refused (ConfigError) naming both."""
    try:
        return StateFile.open(folder, layout, engine)
    except (LayoutMismatchError, CorruptCheckpointError) as exc:
        raise ConfigError(
            f"node {ctx.index}: the state files in {folder} do not match its {META_FILE} (job "
            f"{layout.job!r}, layout {layout.hash[:12]}, {len(layout.buckets)} buckets): {exc}"
        ) from exc

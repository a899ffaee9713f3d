"""Asking the nodes of a cluster how they are doing: STATS, rates, and the table of them.

Each node answers a STATS message on its ZeroMQ address (the one workers use),
so this works wherever the workers can reach the nodes, metrics endpoint or
not. All nodes are asked at once with one deadline: a node that does not
answer in time is shown DOWN with its address, and a cluster of dead nodes
costs one timeout, not one per node. ``luwu status`` prints the table once,
``luwu top`` refreshes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from luwu.ops.rundir import read_state
from luwu.protocol.errors import NodeTimeoutError, ProtocolError, error_for_code
from luwu.protocol.messages import join_metadata
from luwu.units import human_bytes, human_seconds

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0


@dataclass(slots=True)
class NodeStatus:
    """One node's answer to STATS (or the lack of one)."""

    address: str
    up: bool
    detail: dict = field(default_factory=dict)
    """The STATS reply's ``detail`` (node, step, workers, bytes_in, bytes_out, uptime_s, ...)."""
    error: str = ""
    """Why the node is not UP: no answer within the deadline, or the refusal it sent."""
    at: float = 0.0
    """time.monotonic() when the answer arrived (for rates between two samples)."""


def _stats_request(job: str) -> list:
    from luwu.protocol import messages  # imported here: `luwu --help` needs no wire code

    return messages.encode({"op": messages.Op.STATS, "job": job, "step": 0, "worker": 0})


def _parse_reply(address: str, frames: list) -> dict:
    from luwu.protocol import messages

    msg = messages.decode(frames)
    if msg.op == messages.Op.ERROR:
        raise error_for_code(msg.header["code"], msg.header["message"], node=address)
    if msg.op != messages.Op.STATS or not isinstance(msg.header.get("detail"), dict):
        raise ProtocolError(f"node {address} answered STATS with {msg.op.name} and no detail")
    return msg.header["detail"]


def query_many(
    addresses: list[str],
    job: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    context=None,
    curve: tuple[str, str, str] | None = None,
    join_secret: str = "",
) -> list[NodeStatus]:
    """Ask every node at once; one deadline for all. Never raises for a node's fault.

    ``curve`` = (nodes' public key, our public key, our secret key) for nodes with CURVE on
    (``luwu up`` makes a monitor key pair the nodes accept: keys/monitor.toml); ``join_secret`` for
    nodes that ask for one (node.join_secret)."""
    import zmq

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = context or zmq.Context.instance()
    out = [NodeStatus(a, up=False, error=f"no answer within {timeout_s:g} s") for a in addresses]
    socks: dict[zmq.Socket, int] = {}
    poller = zmq.Poller()
    try:
        for i, address in enumerate(addresses):
            # A fresh socket per query: a late reply to an earlier query can never be read as this one's.
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 0)
            socks[s] = i
            if curve is not None:
                s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (
                    k.encode() for k in curve
                )
            if join_secret:
                s.setsockopt(zmq.METADATA, join_metadata(join_secret))
            try:
                s.connect(address)
                s.send_multipart(_stats_request(job), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                out[i].error = f"cannot send to {address}: {exc}"
                continue
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        pending = len(poller.sockets)
        while pending:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                break
            for s, _ in poller.poll(left_ms):
                i = socks[s]
                poller.unregister(s)
                pending -= 1
                frames = s.recv_multipart(flags=zmq.NOBLOCK)
                try:
                    out[i] = NodeStatus(
                        addresses[i],
                        up=True,
                        detail=_parse_reply(addresses[i], frames),
                        at=time.monotonic(),
                    )
                except Exception as exc:  # a node's bad answer is shown, never raised
                    out[i].error = f"{type(exc).__name__}: {exc}"
    finally:
        for s in socks:
            s.close(0)
    return out


def query_stats(
    address: str,
    job: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    curve: tuple[str, str, str] | None = None,
    join_secret: str = "",
) -> dict:
    """The STATS ``detail`` of one node; raises NodeTimeoutError naming the address if it does not answer."""
    (st,) = query_many([address], job, timeout_s, curve=curve, join_secret=join_secret)
    if not st.up:
        if st.error.startswith("no answer"):
            raise NodeTimeoutError(
                f"node {address} did not answer STATS within {timeout_s:g} s (is it up? is job {job!r} right?)"
            )
        raise ProtocolError(f"node {address}: {st.error}")
    return st.detail


# ----------------------------------------------------------------- rates and formatting


def rates(cur: NodeStatus, prev: NodeStatus | None) -> tuple[dict[str, float], str]:
    """Bytes/s in and out, pushes/s, updates/s: between two samples of the same node life, else
    averaged over its uptime. Returns (rates, 'window' or 'avg')."""
    keys = ("bytes_in", "bytes_out", "pushes", "updates")
    d = cur.detail
    if prev is not None and prev.up and cur.up and cur.at > prev.at:
        p = prev.detail
        restarted = d.get("uptime_s", 0.0) < p.get("uptime_s", 0.0) or any(
            d.get(k, 0.0) < p.get(k, 0.0) for k in keys
        )
        if not restarted:
            dt = cur.at - prev.at
            return {k: (d.get(k, 0.0) - p.get(k, 0.0)) / dt for k in keys}, "window"
    up = max(float(d.get("uptime_s", 0.0)), 1e-9)
    return {k: float(d.get(k, 0.0)) / up for k in keys}, "avg"


def checkpoint_text(detail: dict) -> str:
    if "checkpoint_step" not in detail:
        return "-"
    step = detail["checkpoint_step"]
    if step is None or step < 0:
        return "none"
    age = detail.get("checkpoint_age_s")
    return f"step {step}" + (f", {human_seconds(age)} ago" if isinstance(age, (int, float)) else "")


def idle_reason(detail: dict) -> str:
    """Why an answering node holds no bucket yet ('' when it holds some): a node gets its share of
    the model from the first worker's HELLO, so a fresh cluster is idle until training starts."""
    if detail.get("buckets"):
        return ""
    if not detail.get("workers"):
        return "idle: no worker has said HELLO yet (it gets its buckets when training starts)"
    return "idle: holds no bucket of this model (more nodes than buckets: use fewer nodes or smaller transport.bucket_bytes)"


def row(cur: NodeStatus, prev: NodeStatus | None = None, *, restarts: int | None = None) -> dict:
    """One node as plain values (what --json prints, and what the table shows)."""
    d = cur.detail
    out = {"address": cur.address, "up": cur.up, "error": cur.error or None, "restarts": restarts}
    if cur.up:
        r, how = rates(cur, prev)
        out.update(
            node=d.get("node"),
            step=d.get("step"),
            workers=d.get("workers"),
            world_size=d.get("world_size"),
            mode=d.get("mode"),
            buckets=d.get("buckets"),
            params=d.get("params"),
            idle=idle_reason(d) or None,
            uptime_s=d.get("uptime_s"),
            bytes_in_per_s=r["bytes_in"],
            bytes_out_per_s=r["bytes_out"],
            pushes_per_s=r["pushes"],
            updates_per_s=r["updates"],
            rate_over="since start" if how == "avg" else "between samples",
            checkpoint_step=d.get("checkpoint_step"),
            checkpoint_age_s=d.get("checkpoint_age_s"),
        )
    return out


_COLUMNS = (
    "#",
    "address",
    "state",
    "step",
    "workers",
    "in/s",
    "out/s",
    "upd/s",
    "uptime",
    "restarts",
    "checkpoint",
)
_NARROW_COLUMNS = _COLUMNS[:7] + ("uptime",)
"""Below WIDE_COLUMNS characters the table keeps these, and each node's restarts, updates/s and
checkpoint go on a line of their own under it."""
WIDE_COLUMNS = 120


def _cells(i: int, st: NodeStatus, r: dict | None, restarts: int | None) -> dict[str, str]:
    count = "-" if restarts is None else str(restarts)
    if r is None:
        return {
            "#": str(i),
            "address": st.address,
            "state": "[bold red]DOWN[/]",
            "restarts": count,
            **dict.fromkeys(_COLUMNS[3:9], "-"),
            "checkpoint": "-",
        }
    number = r["node"] if isinstance(r["node"], int) and r["node"] >= 0 else i
    return {
        "#": str(number),
        "address": st.address,
        "state": "[bold green]UP[/]",
        "step": str(r["step"]),
        "workers": f"{r['workers']}/{r['world_size'] or '?'}",
        "in/s": human_bytes(r["bytes_in_per_s"]),
        "out/s": human_bytes(r["bytes_out_per_s"]),
        "upd/s": f"{r['updates_per_s']:.1f}",
        "uptime": human_seconds(float(r["uptime_s"] or 0.0)),
        "restarts": count,
        "checkpoint": checkpoint_text(st.detail),
    }


def render_table(
    statuses: list[NodeStatus],
    prev: dict[str, NodeStatus] | None = None,
    *,
    title: str = "",
    restarts: dict[str, int] | None = None,
    width: int = WIDE_COLUMNS,
):
    """A rich Table of the nodes for a console ``width`` characters wide (80 is enough).

    Under it: totals, each node's details when the table is narrow, and why a node is
    DOWN or idle (up, holding no bucket yet), by node number. ``restarts`` maps an
    address to how often its supervisor restarted it (``luwu up``'s state.json);
    without it the count shows as '-'.
    """
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    prev, restarts = prev or {}, restarts or {}
    columns = _COLUMNS if width >= WIDE_COLUMNS else _NARROW_COLUMNS
    table = Table(
        title=title or None,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
    )
    for name in columns:
        left = name in ("address", "state", "checkpoint")
        table.add_column(
            name, justify="left" if left else "right", no_wrap=name != "address", overflow="fold"
        )
    total_in = total_out = 0.0
    details, notes = [], []
    for i, st in enumerate(statuses):
        r = row(st, prev.get(st.address), restarts=restarts.get(st.address)) if st.up else None
        cells = _cells(i, st, r, restarts.get(st.address))
        table.add_row(*(cells[name] for name in columns))
        if r is None:
            notes.append(f"[red]node {i}: {escape(st.error)}[/]")
            continue
        total_in += r["bytes_in_per_s"]
        total_out += r["bytes_out_per_s"]
        if columns is _NARROW_COLUMNS:
            restarted = "" if r["restarts"] is None else f"restarts {r['restarts']}, "
            details.append(
                f"node {cells['#']}: {restarted}{cells['upd/s']} updates/s, checkpoint {cells['checkpoint']}"
            )
        if r["idle"]:
            notes.append(f"[yellow]node {cells['#']}: {escape(r['idle'])}[/]")
    num_up = sum(st.up for st in statuses)
    style = "green" if num_up == len(statuses) else "bold red"
    table.caption = "\n".join(
        [
            f"[{style}]{num_up}/{len(statuses)} nodes up[/]   in {human_bytes(total_in)}/s   out {human_bytes(total_out)}/s",
            *details,
            *notes,
        ]
    )
    table.caption_justify = "left"
    return table


def restart_counts(run_dir) -> dict[str, int]:
    """Address -> restarts, from the supervisor's state.json of ``run_dir`` ({} without one)."""
    state = read_state(run_dir) or {}
    return {
        n["address"]: int(n.get("restarts", 0)) for n in state.get("nodes", []) if n.get("address")
    }

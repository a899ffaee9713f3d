"""``luwu status`` and ``luwu top``: ask every node of a cluster how it is doing.

Each node answers a STATS message on its ZeroMQ address (the one workers use),
so this works wherever the workers can reach the nodes, metrics endpoint or
not. All nodes are asked at once with one deadline: a node that does not
answer in time is shown DOWN with its address, and a cluster of dead nodes
costs one timeout, not one per node.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import zmq

from rich.markup import escape

from luwu.protocol.errors import ConfigError, NodeTimeoutError, ProtocolError, error_for_code

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
    from luwu.protocol import messages  # imported here: it brings in torch, which `luwu --help` does not need

    return messages.encode({"op": messages.Op.STATS, "job": job, "step": 0, "worker": 0})


def _parse_reply(address: str, frames: list) -> dict:
    from luwu.protocol import messages

    msg = messages.decode(frames)
    if msg.op == messages.Op.ERROR:
        raise error_for_code(msg.header["code"], msg.header["message"], node=address)
    if msg.op != messages.Op.STATS or not isinstance(msg.header.get("detail"), dict):
        raise ProtocolError(f"node {address} answered STATS with {msg.op.name} and no detail")
    return msg.header["detail"]


def query_many(addresses: list[str], job: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, context: zmq.Context | None = None) -> list[NodeStatus]:
    """Ask every node at once; one deadline for all. Never raises for a node's fault."""
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
                    out[i] = NodeStatus(addresses[i], up=True, detail=_parse_reply(addresses[i], frames), at=time.monotonic())
                except Exception as exc:  # a node's bad answer is shown, never raised
                    out[i].error = f"{type(exc).__name__}: {exc}"
    finally:
        for s in socks:
            s.close(0)
    return out


def query_stats(address: str, job: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """The STATS ``detail`` of one node; raises NodeTimeoutError naming the address if it does not answer."""
    (st,) = query_many([address], job, timeout_s)
    if not st.up:
        if st.error.startswith("no answer"):
            raise NodeTimeoutError(f"node {address} did not answer STATS within {timeout_s:g} s (is it up? is job {job!r} right?)")
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
        restarted = d.get("uptime_s", 0.0) < p.get("uptime_s", 0.0) or any(d.get(k, 0.0) < p.get(k, 0.0) for k in keys)
        if not restarted:
            dt = cur.at - prev.at
            return {k: (d.get(k, 0.0) - p.get(k, 0.0)) / dt for k in keys}, "window"
    up = max(float(d.get("uptime_s", 0.0)), 1e-9)
    return {k: float(d.get(k, 0.0)) / up for k in keys}, "avg"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s // 60:.0f}m{s % 60:02.0f}s"
    if s < 86400:
        return f"{s // 3600:.0f}h{s % 3600 // 60:02.0f}m"
    return f"{s // 86400:.0f}d{s % 86400 // 3600:02.0f}h"


def checkpoint_text(detail: dict) -> str:
    if "checkpoint_step" not in detail:
        return "-"
    step = detail["checkpoint_step"]
    if step is None or step < 0:
        return "none"
    age = detail.get("checkpoint_age_s")
    return f"step {step}" + (f", {human_seconds(age)} ago" if isinstance(age, (int, float)) else "")


def row(cur: NodeStatus, prev: NodeStatus | None = None) -> dict:
    """One node as plain values (what --json prints, and what the table shows)."""
    d = cur.detail
    out = {"address": cur.address, "up": cur.up, "error": cur.error or None}
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


def render_table(statuses: list[NodeStatus], prev: dict[str, NodeStatus] | None = None, *, title: str = ""):
    """A rich Table of the nodes; the reasons a node is DOWN are listed under it."""
    from rich import box
    from rich.table import Table

    prev = prev or {}
    table = Table(title=title or None, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("node", "address", "state", "step", "workers", "in/s", "out/s", "updates/s", "uptime", "checkpoint"):
        table.add_column(name, justify="left" if name in ("address", "state", "checkpoint") else "right", no_wrap=True)
    total_in = total_out = 0.0
    notes = []
    for i, st in enumerate(statuses):
        if not st.up:
            table.add_row(str(i), st.address, "[bold red]DOWN[/]", *["-"] * 7)
            notes.append(f"[red]{st.address}: {escape(st.error)}[/]")
            continue
        r = row(st, prev.get(st.address))
        total_in += r["bytes_in_per_s"]
        total_out += r["bytes_out_per_s"]
        table.add_row(
            str(r["node"] if isinstance(r["node"], int) and r["node"] >= 0 else i),
            st.address,
            "[bold green]UP[/]",
            str(r["step"]),
            f"{r['workers']}/{r['world_size'] or '?'}",
            human_bytes(r["bytes_in_per_s"]),
            human_bytes(r["bytes_out_per_s"]),
            f"{r['updates_per_s']:.1f}",
            human_seconds(float(r["uptime_s"] or 0.0)),
            checkpoint_text(st.detail),
        )
    num_up = sum(st.up for st in statuses)
    style = "green" if num_up == len(statuses) else "bold red"
    table.caption = "\n".join([f"[{style}]{num_up}/{len(statuses)} nodes up[/]   total in {human_bytes(total_in)}/s   out {human_bytes(total_out)}/s", *notes])
    table.caption_justify = "left"
    return table


def _console():
    """stdout; wide enough for the table when it is a pipe or a file (rich assumes 80 columns there)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


# ----------------------------------------------------------------- which cluster


def resolve_cluster(args, rest: list[str]) -> tuple[list[str], str, str]:
    """(node addresses, job, where they came from) from --config / --run-dir / env / flags.

    Without a cluster file, ``luwu up``'s default run dir is looked at, so that
    ``luwu up --nodes 2`` followed by a bare ``luwu status`` just works.
    """
    from luwu.config import load_config

    path = args.config
    if path is None and args.run_dir:
        path = os.path.join(args.run_dir, "cluster.toml")
        if not os.path.exists(path):
            raise ConfigError(f"run dir {args.run_dir!r} has no cluster.toml: is the cluster up (luwu up --run-dir {args.run_dir})?")
    cfg = load_config(path, argv=rest)
    if not cfg.cluster.nodes and path is None:
        from luwu.launcher import default_run_dir

        guess = os.path.join(default_run_dir(cfg.cluster.job), "cluster.toml")
        if os.path.exists(guess):
            path = guess
            cfg = load_config(path, argv=rest)
    if not cfg.cluster.nodes:
        raise ConfigError("no nodes to ask: pass --config CLUSTER_FILE (luwu up writes <run dir>/cluster.toml), --run-dir DIR, or --cluster.nodes=tcp://host:port,...")
    return list(cfg.cluster.nodes), cfg.cluster.job, path or "environment/flags"


# ----------------------------------------------------------------- commands


def cmd_status(args, rest: list[str]) -> int:
    addresses, job, source = resolve_cluster(args, rest)
    if args.sample < 0:
        raise ConfigError(f"--sample must be >= 0 seconds, got {args.sample}")
    statuses = query_many(addresses, job, args.timeout)
    prev = None
    if args.sample > 0:
        prev = {st.address: st for st in statuses}
        time.sleep(args.sample)
        statuses = query_many(addresses, job, args.timeout)
    if args.json:
        print(json.dumps([row(st, (prev or {}).get(st.address)) for st in statuses], indent=2))
    else:
        how = f"rates over the last {args.sample:g} s" if args.sample > 0 else "rates averaged since each node started (--sample S for a window)"
        _console().print(render_table(statuses, prev, title=f"LuWu job [bold]{job}[/] ({source}); {how}"))
    return 0 if all(st.up for st in statuses) else 1


def cmd_top(args, rest: list[str]) -> int:
    from rich.live import Live

    addresses, job, source = resolve_cluster(args, rest)
    if not args.interval > 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {args.interval}")
    if args.iterations < 0:
        raise ConfigError(f"--iterations must be >= 0 (0 = until Ctrl-C), got {args.iterations}")
    timeout_s = args.timeout if args.timeout is not None else max(0.2, min(DEFAULT_TIMEOUT_S, args.interval))
    console = _console()
    prev: dict[str, NodeStatus] = {}
    n = 0

    def frame():
        nonlocal prev
        statuses = query_many(addresses, job, timeout_s)
        table = render_table(statuses, prev, title=f"luwu top - job [bold]{job}[/] ({source}) - {time.strftime('%H:%M:%S')} - every {args.interval:g} s, Ctrl-C quits")
        prev = {st.address: st for st in statuses if st.up}
        return table

    try:
        if console.is_terminal:
            with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
                n = 1
                while not args.iterations or n < args.iterations:
                    time.sleep(args.interval)
                    live.update(frame(), refresh=True)
                    n += 1
        else:  # batch mode, like `top -b`: one table per refresh, for logs and pipes
            while not args.iterations or n < args.iterations:
                if n:
                    time.sleep(args.interval)
                console.print(frame())
                sys.stdout.flush()
                n += 1
    except KeyboardInterrupt:
        pass
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML cluster file listing the nodes ([cluster] nodes, job); `luwu up` writes one in its run dir")
    p.add_argument("--run-dir", metavar="DIR", help="read DIR/cluster.toml (what `luwu up --run-dir DIR` wrote)")


def add_arguments(subparsers) -> None:
    """Register ``status`` and ``top`` on the ``luwu`` command's subparsers."""
    s = subparsers.add_parser(
        "status",
        help="ask every node of a cluster file: up or not, step, workers, bytes/s, last checkpoint",
        description=(
            "Ask every node of a cluster (STATS over its ZeroMQ address, all at once with one deadline) and print one row "
            "per node: address, UP/DOWN, step, connected workers, bytes/s in and out, uptime, last checkpoint. "
            "A node that does not answer within --timeout is DOWN. Exit code 0 when every node is up, 1 otherwise. "
            "Without --config, the cluster file that `luwu up` wrote for the job is used. "
            "Extra --section.field=value flags override the file (e.g. --cluster.job=myjob)."
        ),
        allow_abbrev=False,
    )
    _add_common(s)
    s.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help=f"seconds to wait for the nodes' answers (default {DEFAULT_TIMEOUT_S:g})")
    s.add_argument("--sample", type=float, default=0.0, metavar="S", help="ask twice, S seconds apart, and show rates over that window (default: averages since each node started)")
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    s.set_defaults(func=cmd_status)

    t = subparsers.add_parser(
        "top",
        help="live view of the cluster that refreshes, like htop",
        description=(
            "A table of every node that refreshes every --interval seconds, with bytes/s and updates/s computed between "
            "refreshes. Ctrl-C quits. When stdout is not a terminal it prints one table per refresh (like `top -b`). "
            "Extra --section.field=value flags override the cluster file."
        ),
        allow_abbrev=False,
    )
    _add_common(t)
    t.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (default 1)")
    t.add_argument("--iterations", type=int, default=0, metavar="N", help="stop after N refreshes (default 0: until Ctrl-C)")
    t.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds to wait for answers per refresh (default: min(interval, 2))")
    t.set_defaults(func=cmd_top)


def main(argv: list[str] | None = None) -> int:
    """``python -m luwu.status status|top ...``: the same as ``luwu status|top``."""
    from luwu.cli import main as cli_main

    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())

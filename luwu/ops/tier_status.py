"""The switch tier in ``luwu status``: each aggregator of a cluster file's groups, alive or not.

An aggregator answers nothing but a worker's HELLO, so it is not asked for STATS: it is alive when
its address takes a TCP connection within the deadline (all are tried at once, closed at once,
before any byte is sent). When the cluster file is a ``luwu up`` run dir's, the supervisor's
state adds each one's pid, state and restarts.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from luwu.ops.rundir import read_state


def _connects(address: str, timeout_s: float) -> str:
    """'' when ``tcp://HOST:PORT`` takes a connection within ``timeout_s``, else why not."""
    host, _, port = address.partition("://")[2].rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return ""
    except (OSError, ValueError) as exc:
        return f"no connection within {timeout_s:g} s: {exc}"


def probe_aggregators(groups: list[dict], run_dir: Path | None, timeout_s: float) -> list[dict]:
    """One row per group: ``role`` ``aggregator``, ``index``, ``ranks``, ``address``, ``up``,
    ``error``, and from the run dir's state (when there is one) ``pid``, ``state``, ``restarts``."""
    known = {}
    if run_dir is not None:
        for a in (read_state(run_dir) or {}).get("aggregators", []):
            known[a.get("ranks")] = a
    if not groups:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(groups))) as pool:
        errors = list(pool.map(lambda g: _connects(g["aggregator"], timeout_s), groups))
    rows = []
    for i, (g, error) in enumerate(zip(groups, errors)):
        st = known.get(g["ranks"], {})
        rows.append(
            {
                "role": "aggregator",
                "index": i,
                "ranks": g["ranks"],
                "address": g["aggregator"],
                "up": not error,
                "error": error,
                "pid": st.get("pid"),
                "state": st.get("state", ""),
                "restarts": st.get("restarts"),
                "at": time.time(),
            }
        )
    return rows


def render_tier(rows: list[dict]):
    """A rich Table of the aggregators (``luwu status`` prints it under the nodes')."""
    from rich import box
    from rich.table import Table

    table = Table(
        title="switch tier (aggregators)",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
    )
    for name in ("#", "address", "ranks", "state", "pid", "restarts"):
        table.add_column(name, no_wrap=True)
    for r in rows:
        state = "[green]UP[/]" if r["up"] else "[bold red]DOWN[/]"
        table.add_row(
            f"a{r['index']}",
            r["address"],
            r["ranks"],
            state,
            str(r["pid"]) if r["pid"] else "-",
            "-" if r["restarts"] is None else str(r["restarts"]),
        )
    return table

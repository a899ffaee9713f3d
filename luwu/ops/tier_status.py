"""The switch tier in ``luwu status`` and ``luwu top``: each aggregator of a cluster file's groups,
alive or not, and what it moves.

An aggregator answers nothing but a worker's HELLO, so it is not asked for STATS: it is alive when
its address takes a TCP connection within the deadline (all are tried at once, closed at once,
before any byte is sent). Its numbers (bytes from the workers and to the nodes, pushes summed, the
wait for a block's last push) come from its own ``/metrics`` (:mod:`luwu.ops.tier_metrics`), read
in the same deadline. When the cluster file is a ``luwu up`` run dir's, the supervisor's state adds
each one's pid, state and restarts, and its /metrics address when the file names none.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from luwu.ops.rundir import read_state
from luwu.ops.tier_metrics import TierSample, metrics_row, metrics_url, scrape_many


def _connects(address: str, timeout_s: float) -> str:
    """'' when ``tcp://HOST:PORT`` takes a connection within ``timeout_s``, else why not."""
    host, _, port = address.partition("://")[2].rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return ""
    except (OSError, ValueError) as exc:
        return f"no connection within {timeout_s:g} s: {exc}"


def _metrics_address(group: dict, known: dict) -> str:
    """Where the group's aggregator serves /metrics: its ``metrics`` key, else the run dir's state."""
    from luwu.ops.cluster_file import reachable

    if group.get("metrics"):
        return metrics_url(group["metrics"])
    url = known.get("metrics_url") or ""
    return metrics_url(reachable(url)) if url else ""


def probe_aggregators(
    groups: list[dict],
    run_dir: Path | None,
    timeout_s: float,
    prev: dict[str, TierSample] | None = None,
) -> tuple[list[dict], dict[str, TierSample]]:
    """One row per group: ``role`` ``aggregator``, ``index``, ``ranks``, ``address``, ``up``,
    ``error``, from the run dir's state (when there is one) ``pid``, ``state``, ``restarts``, and
    :func:`~luwu.ops.tier_metrics.metrics_row` (rates against ``prev``, the samples of an earlier
    call). The TCP probes and the /metrics reads run at once, in one ``timeout_s``. Returns (rows,
    this call's samples by address, for the next call's ``prev``)."""
    known = {}
    if run_dir is not None:
        for a in (read_state(run_dir) or {}).get("aggregators", []):
            known[a.get("ranks")] = a
    if not groups:
        return [], {}
    urls = [_metrics_address(g, known.get(g["ranks"], {})) for g in groups]
    with ThreadPoolExecutor(max_workers=min(16, len(groups)) + 1) as pool:
        scraped = pool.submit(scrape_many, urls, timeout_s)
        errors = list(pool.map(lambda g: _connects(g["aggregator"], timeout_s), groups))
        samples = scraped.result()
    prev = prev or {}
    rows = []
    for i, (g, error, sample) in enumerate(zip(groups, errors, samples)):
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
                **metrics_row(sample, prev.get(g["aggregator"])),
            }
        )
    return rows, {g["aggregator"]: s for g, s in zip(groups, samples) if s.up}


def _wait_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


_COLUMNS = (
    "#",
    "address",
    "ranks",
    "state",
    "pid",
    "restarts",
    "conns",
    "from workers/s",
    "to nodes/s",
    "from nodes/s",
    "to workers/s",
    "summed/s",
    "sums/s",
    "fanned/s",
    "last-push wait",
    "errors",
)
_NARROW = ("#", "address", "ranks", "state", "conns", "from workers/s", "to nodes/s", "summed/s")
"""Below WIDE characters the table keeps these; the rest of each row goes on a line under it."""
WIDE = 160


def _cells(r: dict) -> dict[str, str]:
    from luwu.units import human_bytes

    cells = {
        "#": f"a{r['index']}",
        "address": r["address"],
        "ranks": r["ranks"],
        "state": "[green]UP[/]" if r["up"] else "[bold red]DOWN[/]",
        "pid": str(r["pid"]) if r["pid"] else "-",
        "restarts": "-" if r["restarts"] is None else str(r["restarts"]),
        **dict.fromkeys(_COLUMNS[6:], "-"),
    }
    if r.get("metrics_up"):
        cells.update(
            {
                "conns": str(r["worker_connections"]),
                "from workers/s": human_bytes(r["bytes_from_workers_per_s"]),
                "to nodes/s": human_bytes(r["bytes_to_nodes_per_s"]),
                "from nodes/s": human_bytes(r["bytes_from_nodes_per_s"]),
                "to workers/s": human_bytes(r["bytes_to_workers_per_s"]),
                "summed/s": f"{r['pushes_summed_per_s']:.1f}",
                "sums/s": f"{r['sums_sent_per_s']:.1f}",
                "fanned/s": f"{r['replies_fanned_out_per_s']:.1f}",
                "last-push wait": _wait_text(r["group_wait_mean_s"]),
                "errors": str(r["errors"]),
            }
        )
    return cells


def _caption(rows: list[dict], details: list[str]) -> str:
    from rich.markup import escape

    from luwu.units import human_bytes

    up = sum(r["up"] for r in rows)
    read = [r for r in rows if r.get("metrics_up")]
    style = "green" if up == len(rows) and len(read) == len(rows) else "bold red"
    wk = sum(r["bytes_from_workers_per_s"] for r in read)
    nodes = sum(r["bytes_to_nodes_per_s"] for r in read)
    saved = f" ({wk / nodes:.2f}x less)" if nodes > 0 else ""
    lines = [
        f"[{style}]{up}/{len(rows)} aggregators up, {len(read)}/{len(rows)} metrics read[/]   "
        f"from workers {human_bytes(wk)}/s   to nodes {human_bytes(nodes)}/s{saved}",
        *details,
    ]
    for r in rows:
        if not r["up"]:
            lines.append(f"[red]aggregator a{r['index']} ({r['address']}): {escape(r['error'])}[/]")
        if not r.get("metrics_up"):
            where = r.get("metrics") or "no /metrics address"
            lines.append(
                f"[yellow]aggregator a{r['index']} ({escape(where)}): "
                f"{escape(r['metrics_error'])}[/]"
            )
    return "\n".join(lines)


def render_tier(rows: list[dict], *, width: int = WIDE, title: str = ""):
    """A rich Table of the aggregators for a console ``width`` characters wide (``luwu status`` and
    ``luwu top`` print it under the nodes'): state, and from each one's /metrics its worker
    connections (``conns``: one per worker and node), bytes
    per second from its workers, to the nodes and back, pushes summed, sums sent and replies fanned
    out per second, the mean wait for a block's last push, errors. Under it the totals, and why an
    aggregator is DOWN or its metrics unread."""
    from rich import box
    from rich.table import Table

    columns = _COLUMNS if width >= WIDE else _NARROW
    table = Table(
        title=title or "switch tier (aggregators)",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
    )
    for name in columns:
        left = name in ("#", "address", "ranks", "state")
        table.add_column(name, justify="left" if left else "right", no_wrap=name != "address")
    details = []
    for r in rows:
        cells = _cells(r)
        table.add_row(*(cells[name] for name in columns))
        if columns is _NARROW and r.get("metrics_up"):
            rest = ", ".join(f"{k} {cells[k]}" for k in _COLUMNS if k not in _NARROW)
            details.append(f"a{r['index']}: {rest}")
    table.caption = _caption(rows, details)
    table.caption_justify = "left"
    return table

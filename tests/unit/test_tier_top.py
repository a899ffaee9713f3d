"""The switch tier in ``luwu top`` / ``luwu status``: an aggregator's /metrics read, its rates, the
table, and the groups' ``metrics`` key. Real HTTP endpoints and sockets in this process (the
aggregator's own metrics and server), no daemons."""

from __future__ import annotations

import socket
import time

import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from luwu.groups import bind_line, checked_groups, group_entries, groups_toml
from luwu.groups import main as groups_main
from luwu.ops.rundir import write_state
from luwu.ops.tier_metrics import metrics_row, rates, scrape_many
from luwu.ops.tier_status import probe_aggregators, render_tier
from luwu.protocol.errors import ConfigError
from luwu.protocol.metrics import serve_metrics
from luwu.switch_nodes.tier.metrics import AggregatorMetrics


@pytest.fixture
def aggregator_metrics():
    m = AggregatorMetrics(CollectorRegistry())
    server, port = serve_metrics(m.registry, "127.0.0.1", 0)
    try:
        yield m, f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


def _traffic(m: AggregatorMetrics, sums: int) -> None:
    """What a group of two sends through in ``sums`` (step, bucket)s of 1000 bytes a push."""
    for _ in range(sums):
        m.bytes_in.labels("push", "workers").inc(2000)
        m.summed.inc(2)
        m.bytes_out.labels("push", "nodes").inc(1000)
        m.sums.inc()
        m.bytes_in.labels("update", "nodes").inc(500)
        m.bytes_out.labels("update", "workers").inc(1000)
        m.fanned.inc()
        m.group_wait.observe(0.004)


def _silent() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_aggregators_metrics_are_read_and_its_rates_taken_between_samples(aggregator_metrics):
    m, url = aggregator_metrics
    _traffic(m, 3)
    m.workers.set(4)
    (first,) = scrape_many([url], 2.0)
    assert first.up and first.url == url + "/metrics", first.error
    v = first.values
    assert (v["bytes_from_workers"], v["bytes_to_nodes"]) == (6000, 3000)
    assert (v["bytes_from_nodes"], v["bytes_to_workers"]) == (1500, 3000)
    assert (v["pushes_summed"], v["sums_sent"], v["replies_fanned_out"]) == (6, 3, 3)
    assert v["wait_count"] == 3 and v["workers"] == 4 and abs(v["started"] - time.time()) < 60
    r, how = rates(first, None)
    assert how == "since start" and r["pushes_summed"] > 0 and r["wait_s"] == pytest.approx(0.004)

    _traffic(m, 2)
    m.group_wait.observe(0.020)  # the mean over the window: (2 x 4 ms + 20 ms) / 3
    m.errors.labels("bad_frame").inc()
    time.sleep(0.05)
    (second,) = scrape_many([url], 2.0)
    r, how = rates(second, first)
    span = second.at - first.at
    assert how == "between samples"
    assert r["bytes_from_workers"] == pytest.approx(4000 / span)
    assert r["sums_sent"] == pytest.approx(2 / span) and r["pushes_summed"] == pytest.approx(
        4 / span
    )
    assert r["wait_s"] == pytest.approx(0.028 / 3) and r["errors"] == 1
    row = metrics_row(second, first)
    assert row["metrics_up"] and row["worker_connections"] == 4 and row["errors"] == 1
    assert row["totals"]["sums_sent"] == 5 and row["rate_over"] == "between samples"
    # no block finished between two samples: no wait to show
    (third,) = scrape_many([url], 2.0)
    assert rates(third, second)[0]["wait_s"] is None


def test_a_restarted_aggregator_is_not_taken_for_negative_rates(aggregator_metrics):
    m, url = aggregator_metrics
    _traffic(m, 5)
    (before,) = scrape_many([url], 2.0)
    fresh = AggregatorMetrics(CollectorRegistry())  # a new life: its counters start again
    _traffic(fresh, 1)
    server, port = serve_metrics(fresh.registry, "127.0.0.1", 0)
    try:
        (after,) = scrape_many([f"http://127.0.0.1:{port}"], 2.0)
    finally:
        server.shutdown()
    r, how = rates(after, before)
    assert how == "since start" and r["sums_sent"] > 0


def test_metrics_that_do_not_answer_are_shown_within_the_timeout():
    silent = _silent()
    try:
        urls = [
            f"http://127.0.0.1:{silent.getsockname()[1]}",
            f"http://127.0.0.1:{_free_port()}",
            "",
        ]
        began = time.monotonic()
        hung, refused, unknown = scrape_many(urls, 0.5)
        took = time.monotonic() - began
    finally:
        silent.close()
    assert took < 2.0, took
    assert not hung.up and "metrics:" in hung.error and "timed out" in hung.error.lower()
    assert not refused.up and "refused" in refused.error.lower(), refused.error
    assert not unknown.up and "no address" in unknown.error
    assert metrics_row(hung) == {
        "metrics": hung.url,
        "metrics_up": False,
        "metrics_error": hung.error,
    }


def test_a_page_that_is_not_an_aggregators_metrics_is_refused():
    other = CollectorRegistry()
    server, port = serve_metrics(other, "127.0.0.1", 0)
    try:
        (s,) = scrape_many([f"http://127.0.0.1:{port}"], 2.0)
    finally:
        server.shutdown()
    assert not s.up and "no luwu_aggregator_" in s.error


def test_status_rows_read_the_groups_metrics_or_the_run_dirs_state(aggregator_metrics, tmp_path):
    m, url = aggregator_metrics
    _traffic(m, 2)
    listener = _silent()  # the aggregator's own address: it takes a connection
    addr = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    gone = f"tcp://127.0.0.1:{_free_port()}"
    write_state(tmp_path, {"aggregators": [{"ranks": "2-3", "metrics_url": url, "pid": 7}]})
    (tmp_path / "plan.json").write_text("{}")
    groups = [
        {"ranks": "0-1", "aggregator": addr, "metrics": url},
        {"ranks": "2-3", "aggregator": gone},  # its /metrics: from state.json
        {"ranks": "4-5", "aggregator": gone},  # nowhere
    ]
    try:
        rows, samples = probe_aggregators(groups, tmp_path, 1.0)
    finally:
        listener.close()
    assert [r["up"] for r in rows] == [True, False, False]
    assert [r["metrics_up"] for r in rows] == [True, True, False]
    assert rows[1]["pid"] == 7 and rows[0]["totals"]["sums_sent"] == 2
    assert set(samples) == {addr, gone}
    wide, narrow = Console(width=200, record=True), Console(width=100, record=True)
    wide.print(render_tier(rows, width=200))
    narrow.print(render_tier(rows, width=100))
    text = wide.export_text()
    assert "1/3 aggregators up, 2/3 metrics read" in text and "last-push wait" in text
    assert "4.0 ms" in text and "(2.00x less)" in text
    assert "aggregator a2 (no /metrics address): metrics: no address" in text
    small = narrow.export_text()
    assert "last-push wait" not in small.splitlines()[2] and "a0: pid -, restarts -" in small
    assert all(len(line) <= 100 for line in small.splitlines())


def test_a_group_may_name_its_aggregators_metrics():
    groups = checked_groups(
        group_entries("0-3=tcp://h:7100=http://h:9500,4-7=tcp://g:7100", "env"), 8
    )
    assert groups == [
        {"ranks": "0-3", "aggregator": "tcp://h:7100", "metrics": "http://h:9500"},
        {"ranks": "4-7", "aggregator": "tcp://g:7100"},
    ]
    assert 'metrics = "http://h:9500" }' in groups_toml(groups)
    assert checked_groups(
        [{"ranks": "0", "aggregator": "tcp://h:1", "metrics": "http://h:2/metrics"}]
    )
    for bad in ("tcp://h:9500", "http://h", "h:9500", 9500):
        with pytest.raises(ConfigError, match="metrics must be"):
            checked_groups([{"ranks": "0-3", "aggregator": "tcp://h:7100", "metrics": bad}])
    with pytest.raises(ConfigError, match=r"may have \['metrics'"):
        checked_groups([{"ranks": "0-3", "aggregator": "tcp://h:7100", "port": 1}])
    assert bind_line(groups[0]) == "tcp://h:7100 h 9500"
    assert bind_line(groups[1]) == "tcp://g:7100 127.0.0.1 -1"


def test_the_systemd_lookup_prints_a_groups_bind_addresses(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    path.write_text(
        '[cluster]\nnodes = ["tcp://10.0.0.1:5555"]\n\n[[groups]]\nranks = "0-3"\n'
        'aggregator = "tcp://10.0.0.21:7100"\nmetrics = "http://10.0.0.21:9500"\n'
    )
    assert groups_main(["--ranks", "0-3", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["tcp://10.0.0.21:7100", "10.0.0.21", "9500"]
    assert groups_main(["--ranks", "4-7", str(path)]) == 3
    assert groups_main(["--ranks"]) == 2
    assert groups_main([str(path), "10.0.0.21"]) == 0
    assert capsys.readouterr().out.split() == ["0-3", "7100"]

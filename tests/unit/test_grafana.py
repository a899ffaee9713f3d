"""The Grafana dashboard against the code: every query is scoped to one job and the chosen instances,
every metric it names is one the metric factories really make, and every node and worker metric
that README.md or docs/ name has a panel.

The metric names come from the factories themselves (``NodeMetrics``, ``WorkerMetrics``, the prefetch
metrics, all built on ``MetricsFactory``) in fresh registries, never from a list kept by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "luwu-dashboard.json"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""What users read: a metric named there should be on the dashboard."""
#: the label a LuWu job puts on its targets (file_sd targets written by `luwu up` and train_example.py)
JOB_LABEL = "luwu_job"
#: the series one metric family exposes, by type (what a PromQL query can name)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
#: a metric name in PromQL, with its label selector when it has one
METRIC_RE = re.compile(r"\b(luwu_[a-z0-9_]+)(\{[^}]*\})?")


def exposed_series() -> set[str]:
    """Every series name LuWu's metric factories make, read from ``registry.collect()``."""
    from luwu.gpu_workers.metrics import PrefetchMetrics, WorkerMetrics
    from luwu.switch_nodes.metrics import NodeMetrics

    registries = [
        NodeMetrics(CollectorRegistry()).registry,
        WorkerMetrics(CollectorRegistry()).registry,
    ]
    prefetch = CollectorRegistry()
    PrefetchMetrics(prefetch)
    registries.append(prefetch)
    out = set()
    for registry in registries:
        for family in registry.collect():
            out.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return out


def node_and_worker_families() -> dict[str, set[str]]:
    """Each metric family ``NodeMetrics`` and ``WorkerMetrics`` make -> the series names it exposes."""
    from luwu.gpu_workers.metrics import WorkerMetrics
    from luwu.switch_nodes.metrics import NodeMetrics

    out = {}
    for registry in (
        NodeMetrics(CollectorRegistry()).registry,
        WorkerMetrics(CollectorRegistry()).registry,
    ):
        for family in registry.collect():
            out[family.name] = {family.name + suffix for suffix in SUFFIXES[family.type]}
    return out


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []

    def walk(items: list[dict]) -> None:
        for p in items:
            out.append(p)
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


def variables(dash: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def test_the_collected_names_cover_every_factory_and_suffix():
    names = exposed_series()
    for prefix in ("luwu_node_", "luwu_worker_", "luwu_prefetch_"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert "luwu_worker_steps_total" in names and "luwu_node_optimizer_step_seconds_bucket" in names
    assert (
        "luwu_node_optimizer_step_seconds" not in names
    )  # a histogram is only queried through its series


def test_job_and_instance_variables_exist():
    found = variables(load())
    for name, label in (("job", JOB_LABEL), ("instance", "instance")):
        assert name in found, f"the dashboard has no ${name} variable"
        var = found[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == "${datasource}", name
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert query.startswith("label_values(") and query.rstrip().endswith(f", {label})"), (
            name,
            query,
        )
    assert "$job" in str(found["instance"]["query"]), "the instance list must follow the chosen job"
    # one job at a time: "All" would sum two jobs again
    assert not found["job"].get("includeAll") and not found["job"].get("multi")


def test_every_query_filters_by_job_and_instance():
    unscoped = []
    for title, expr in queries(load()):
        for name, selector in METRIC_RE.findall(expr):
            selector = selector or ""
            if f'{JOB_LABEL}=~"$job"' not in selector or 'instance=~"$instance"' not in selector:
                unscoped.append(f"panel {title!r}: {name}{selector}")
    assert not unscoped, "queries not filtered by $job and $instance:\n" + "\n".join(unscoped)


def test_every_metric_a_query_uses_exists():
    exposed = exposed_series()
    used = {(name, title) for title, expr in queries(load()) for name, _ in METRIC_RE.findall(expr)}
    assert len({name for name, _ in used}) >= 20
    unknown = sorted(f"{name} (panel {title!r})" for name, title in used if name not in exposed)
    assert not unknown, "the dashboard queries metrics no factory makes:\n" + "\n".join(unknown)


def test_every_node_and_worker_metric_the_docs_name_has_a_panel():
    """A metric the README or docs/ point users at (by its family name or one of its series) is on
    the dashboard."""
    named = {name for doc in DOCS for name in re.findall(r"\bluwu_[a-z0-9_]+", doc.read_text())}
    families = node_and_worker_families()
    advertised = {name for name, series in families.items() if name in named or series & named}
    assert advertised, (
        f"README.md and docs/ name none of the node and worker metrics: {sorted(named)}"
    )
    used = {name for _, expr in queries(load()) for name, _ in METRIC_RE.findall(expr)}
    missing = sorted(name for name in advertised if not families[name] & used)
    assert not missing, (
        "metrics README.md or docs/ name that no dashboard panel shows:\n" + "\n".join(missing)
    )


@pytest.mark.parametrize(
    "expr, ok",
    [
        ('rate(luwu_worker_steps_total{luwu_job=~"$job", instance=~"$instance"}[5m])', True),
        ("rate(luwu_worker_steps_total[5m])", False),
        ('luwu_node_step{instance=~"$instance"}', False),
    ],
)
def test_the_scope_check_tells_scoped_from_unscoped(expr, ok):
    found = [(n, s) for n, s in METRIC_RE.findall(expr)]
    assert all(f'{JOB_LABEL}=~"$job"' in s and 'instance=~"$instance"' in s for _, s in found) is ok

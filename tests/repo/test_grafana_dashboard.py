"""The Grafana dashboard the chart ships (helm/tokenmesh/files/grafana-dashboard.json).

It parses, its data source is a variable, every panel's PromQL names only the
metrics docs/observability.md "## Metrics" lists (with labels they carry), and every
expression is valid PromQL for Prometheus itself: promtool has no checker of a
single expression, so each one is loaded as a recording rule and checked with
``promtool check rules``. The chart's ConfigMap of it: tests/repo/test_chart.py.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "tokenmesh" / "files" / "grafana-dashboard.json"
METRICS_DOC = ROOT / "docs" / "observability.md"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's interval variables, as Prometheus would see them after Grafana's substitution.
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
}

# What the dashboard must show (issue 14): metric -> the quantiles asked of it (none: not a histogram).
REQUIRED = {
    "tokenmesh_router_time_to_first_token_seconds_bucket": {0.5, 0.9, 0.99},
    "tokenmesh_router_inter_token_latency_seconds_bucket": {0.5, 0.99},
    "tokenmesh_router_queue_wait_seconds_bucket": {0.99},
    "tokenmesh_router_generation_tokens_total": set(),
    "tokenmesh_router_requests_total": set(),
    "tokenmesh_router_interruptions_total": set(),
    "tokenmesh_router_migrations_total": set(),
    "tokenmesh_prober_worker_weight": set(),
    "tokenmesh_router_queued": set(),
    "tokenmesh_router_in_flight": set(),
    "tokenmesh_router_concurrency_limit": set(),
}


@functools.cache
def readme_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """docs/observability.md "## Metrics" table: metric name -> (type, labels)."""
    section = METRICS_DOC.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`tokenmesh_"):
            continue
        labels = frozenset(label.strip() for label in cells[2].split(",") if label.strip())
        for name in re.findall(r"`([a-z_:][a-z0-9_:]*)`", cells[0]):
            found[name] = (cells[1], labels)
    assert len(found) > 30, f"the metrics table of docs/observability.md did not parse: {sorted(found)}"
    return found


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    return [p for panel in node.get("panels", []) for p in (panel, *panels(panel))]


def targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(panel, target) for panel in panels(dashboard()) for target in panel.get("targets", [])]


def target_id(panel: dict[str, Any], target: dict[str, Any]) -> str:
    return f"panel {panel['id']} ({panel['title']}) {target['refId']}"


def series_metric(name: str) -> str:
    """The documented name of a series: a histogram's _bucket/_sum/_count are its own."""
    known = readme_metrics()
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and known.get(base, ("",))[0] == "histogram":
            return base
    return name


def parse(expr: str) -> tuple[list[str], set[str], set[str]]:
    """The metric names of a PromQL expression, the labels it matches on, and those it groups by."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    matched = {
        label
        for braces in re.findall(r"\{([^}]*)\}", text)
        for label in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", braces)
    }
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    grouped = {
        label.strip()
        for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text)
        for label in clause.split(",")
        if label.strip()
    }
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = [
        m.group(0)
        for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", text)
        if m.group(0).lower() not in PROMQL_KEYWORDS and not re.match(r"\s*\(", text[m.end() :])
    ]
    return names, matched, grouped


def test_parse_finds_metrics_and_labels() -> None:
    # The helper the checks below rely on, on an expression with every construct it strips.
    names, matched, grouped = parse(
        'histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{model=~"x|y", '
        'tenant!="b c"}[5m]))) > 1e3 and on (model) b offset 1m'
    )
    assert (names, matched, grouped) == (["a_bucket", "b"], {"model", "tenant"}, {"le", "model"})


def test_dashboard_parses_and_is_a_current_grafana_dashboard() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    assert board["uid"] == "tokenmesh" and board["title"] == "tokenmesh"
    assert board.get("id") is None, "an id would clash with the Grafana it is loaded into"
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    cells: set[tuple[int, int]] = set()
    for panel in panels(board):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area


def test_the_data_source_is_a_variable_and_the_model_one_reads_the_routers() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(tokenmesh_router_requests_total, model)"
    assert "model" in readme_metrics()["tokenmesh_router_requests_total"][1]
    # "All" is a regex that also matches the empty model of requests refused before one was chosen.
    assert model["includeAll"] is True and model["allValue"] == ".*"
    for panel in panels(dashboard()):
        if panel["type"] != "row":
            assert panel["datasource"] == DATASOURCE, panel["title"]
    for panel, target in targets():
        assert target["datasource"] == DATASOURCE, target_id(panel, target)


def test_every_expression_names_only_readme_metrics_with_their_labels() -> None:
    known = readme_metrics()
    assert targets()
    for panel, target in targets():
        where = target_id(panel, target)
        names, matched, grouped = parse(target["expr"])
        assert names, f"{where}: no metric in {target['expr']}"
        metrics = [series_metric(name) for name in names]
        unknown = [name for name, metric in zip(names, metrics, strict=True) if metric not in known]
        assert not unknown, f'{where}: not in docs/observability.md "## Metrics": {unknown}'
        labels = {label for metric in metrics for label in known[metric][1]}
        labels |= {"le"} if any(name.endswith("_bucket") for name in names) else set()
        assert matched | grouped <= labels, f"{where}: labels {sorted((matched | grouped) - labels)} not on {metrics}"
        # A legend names only labels the result keeps.
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert legend <= grouped, f"{where}: legend {sorted(legend - grouped)} not grouped by"
        # rate() and increase() only of counters and histogram series.
        for name in re.findall(r"\b(?:rate|increase)\(\s*([A-Za-z_:][\w:]*)", target["expr"]):
            kind = known[series_metric(name)][0]
            assert kind == "counter" or (kind == "histogram" and name.endswith(HISTOGRAM_SERIES)), (where, name)


def test_the_dashboard_shows_what_issue_14_asks() -> None:
    shown: dict[str, set[float]] = {}
    for _, target in targets():
        names, _, _ = parse(target["expr"])
        quantile = re.match(r"\s*histogram_quantile\(\s*([0-9.]+)", target["expr"])
        for name in names:
            shown.setdefault(name, set()).update({float(quantile.group(1))} if quantile else set())
    missing = {
        name: quantiles - shown.get(name, set())
        for name, quantiles in REQUIRED.items()
        if name not in shown or quantiles - shown[name]
    }
    assert not missing, f"not on the dashboard (metric: quantiles): {missing}"


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool not found: `make test-deps` installs Debian's prometheus")
    return found


def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    rules = []
    for panel, target in targets():
        expr = target["expr"]
        for variable, value in GRAFANA_INTERVALS.items():
            expr = expr.replace(variable, value)
        # Grafana's other variables ($model) may stand only inside label values (strings).
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        assert "$" not in outside, f"{target_id(panel, target)}: a variable outside a string: {expr}"
        rules.append({"record": f"tokenmesh_dashboard:panel{panel['id']}_{target['refId']}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "tokenmesh-dashboard", "rules": rules}]}, sort_keys=False))
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout, done.stdout


def test_promtool_refuses_a_broken_expression(tmp_path: Path) -> None:
    # What makes the check above worth having.
    path = tmp_path / "broken.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "broken",
                        "rules": [{"record": "broken:x", "expr": "sum by (le (rate(tokenmesh_router_queued[5m]))"}],
                    }
                ]
            }
        )
    )
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0, done.stdout

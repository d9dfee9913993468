"""deploy/grafana: the dashboard of a run queries only metrics that some role exports, and its provisioning fits it.

The exported names and the PromQL parser are ``support/promql.py``'s.

``query_problems`` parses each PromQL ``expr`` (strings, label matchers, grouping clauses, ranges, numbers and
Grafana variables set aside) and names what does not fit: a metric no role exports, a function PromQL lacks, a
label no target or family has, a selector without ``run_id="$run_id"``, a ``primerl_metric`` selector whose
``name`` is not a step-metric key of ``proto/telemetry.py``. Tests plant each kind of mistake to show it is caught.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.promql import (
    LABELS,
    exported_names,
    family_kinds,
    metric_names,
    parse_query,
    prometheus_names,
    query_problems,
    runtime_kinds,
    source_kinds,
    vllm_kinds,
)

from primerl.proto import telemetry

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "primerl-run.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "primerl.yml"
README = GRAFANA / "README.md"

RUN_ID_QUERY = "label_values(primerl_broker_committed_step, run_id)"

# -- the dashboard -------------------------------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside it


def dashboard_problems(dashboard: dict, exported: frozenset[str]) -> list[str]:
    """Every panel with a datasource and queries, each query as ``query_problems`` wants it, the legends' labels
    known, and the run_id variable's metric exported."""
    problems = []
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        where = f"panel {panel.get('title')!r}"
        if panel.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{where}: its datasource is not the ${{datasource}} variable")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no query")
        for target in targets:
            expr = target.get("expr", "")
            if not expr.strip():
                problems.append(f"{where}: an empty query")
            problems += [f"{where}: {problem}  [{expr}]" for problem in query_problems(expr, exported)]
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            problems += [f"{where}: legend label {label!r} unknown" for label in sorted(legend_labels - LABELS)]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\(\s*(\w+)\s*,\s*(\w+)\s*\)", variable["definition"])
            if found is None or found[1] not in exported or found[2] not in LABELS:
                problems.append(f"variable {variable['name']}: {variable['definition']!r} names no exported metric")
    return problems


def variables(dashboard: dict) -> dict[str, dict]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def test_the_dashboard_queries_only_metrics_the_roles_export():
    dashboard = load_dashboard()
    assert dashboard_problems(dashboard, exported_names()) == []
    exprs = [target["expr"] for panel in all_panels(dashboard) for target in panel.get("targets", [])]
    queried = {name for expr in exprs for name in metric_names(expr)}
    # the panels the dashboard exists for
    for name in (
        "primerl_broker_committed_step",
        "primerl_metric",
        "primerl_trainer_loss",
        "primerl_inference_policy_version",
        "primerl_broker_latest_policy_version",
        "primerl_broker_rollout_batches_queued",
        "primerl_inference_update_pause_ms_bucket",
        "primerl_orchestrator_rollout_errors_total",
        "primerl_broker_workers_lost",
        "primerl_disk_free_bytes",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
    ):
        assert name in queried, name


def test_the_dashboard_shape():
    dashboard = load_dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["refresh"] == "10s"
    assert dashboard["uid"] == "primerl-run"
    found = variables(dashboard)
    assert found["datasource"]["type"] == "datasource" and found["datasource"]["query"] == "prometheus"
    assert found["run_id"]["definition"] == RUN_ID_QUERY
    assert found["run_id"]["query"]["query"] == RUN_ID_QUERY
    assert found["run_id"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    panels = list(all_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: dict[tuple[int, int], str] = {}  # the grid is 24 columns wide
    for panel in panels:
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        for x in range(position["x"], position["x"] + position["w"]):
            for y in range(position["y"], position["y"] + position["h"]):
                assert cells.setdefault((x, y), panel["title"]) == panel["title"], f"{panel['title']} overlaps"
        ref_ids = [target["refId"] for target in panel.get("targets", [])]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_provisioning_matches_the_dashboard():
    dashboard = load_dashboard()
    (datasource,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://localhost:9090"
    assert datasource["uid"] == variables(dashboard)["datasource"]["current"]["value"]
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    readme = README.read_text()
    assert f"{provider['options']['path']}/" in readme, "the README copies the JSON where the provider reads"
    assert DASHBOARD.name in readme


def promtool_check(exprs: list[str], directory: Path) -> subprocess.CompletedProcess:
    """``promtool check rules`` over the expressions as recording rules: Prometheus's own parser reads them."""
    rules = [{"record": f"dashboard:expr_{index}", "expr": expr} for index, expr in enumerate(exprs)]
    path = directory / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_every_query_parses_in_promtool(tmp_path):
    exprs = [
        target["expr"].replace("$run_id", "run-1")
        for panel in all_panels(load_dashboard())
        for target in panel.get("targets", [])
    ]
    checked = promtool_check(exprs, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert promtool_check(['sum by (worker (up{run_id="run-1"})'], tmp_path).returncode != 0


# -- the checks can fail -------------------------------------------------------------------------------------------


def test_the_metric_names_of_a_query():
    assert metric_names(
        'sum by (worker) (rate(vllm:generation_tokens_total{run_id="$run_id", role="inference"}[$__rate_interval]))'
    ) == {"vllm:generation_tokens_total"}
    assert metric_names(
        'max by (run_id) (a{x="b{c}"}) - on (run_id) group_right b offset 1h30m / ignoring(le) c[5m:1m] * 2.5e3'
    ) == {"a", "b", "c"}
    assert metric_names('histogram_quantile(0.9, sum(rate(h_bucket{name="train/reward"}[5m])) without (x, y))') == {
        "h_bucket"
    }
    assert metric_names("count(up == 0) > bool 0x1f and on() vector(1)") == {"up"}
    query = parse_query('sum without (phase) (m{purpose!~"a|b"}) by (host)')
    assert query.label_names == {"phase", "purpose", "host"}
    assert query.functions == {"sum"}


EXPORTED = frozenset({"primerl_broker_committed_step", "primerl_metric", "primerl_x_total", "primerl_h_bucket", "up"})


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ('primerl_no_such_metric{run_id="$run_id"}', "primerl_no_such_metric: no role exports it"),
        ('rate(primerl_x{run_id="$run_id"}[5m])', "primerl_x: no role exports it"),  # a counter without _total
        ('primerl_h{run_id="$run_id"}', "primerl_h: no role exports it"),  # a histogram without a suffix
        ("primerl_broker_committed_step", 'primerl_broker_committed_step: no run_id="$run_id" matcher'),
        ('rates(primerl_x_total{run_id="$run_id"}[5m])', "rates(): not a PromQL function"),
        ('sum by (wrker) (up{run_id="$run_id"})', "label 'wrker': no target or family has it"),
        ('up{run_id="$run_id", role="trainr"}', "up: role 'trainr' is none of"),
        ('{__name__="up", run_id="$run_id"}', "a selector without a metric name"),
        (
            'primerl_metric{run_id="$run_id", name="train/no_such_key"}',
            "primerl_metric: 'train/no_such_key' is no step-metric key",
        ),
        (
            'primerl_metric{run_id="$run_id", name=~"train/reward|train/rewards"}',
            "primerl_metric: 'train/rewards' is no step-metric key",
        ),
        ('primerl_metric{run_id="$run_id"}', "primerl_metric: one name="),
    ],
)
def test_a_planted_mistake_is_caught(expr, problem):
    problems = query_problems(expr, EXPORTED)
    assert any(p.startswith(problem) for p in problems), problems


def test_a_made_up_name_in_the_dashboard_is_caught():
    dashboard = load_dashboard()
    planted = copy.deepcopy(dashboard)
    panel = next(p for p in all_panels(planted) if p["type"] != "row")
    panel["targets"][0]["expr"] = 'rate(primerl_no_such_metric_total{run_id="$run_id"}[5m])'
    del next(p for p in all_panels(planted) if p["type"] == "timeseries" and p is not panel)["datasource"]
    problems = dashboard_problems(planted, exported_names())
    assert any("primerl_no_such_metric_total: no role exports it" in p for p in problems), problems
    assert any("is not the ${datasource} variable" in p for p in problems), problems
    assert len(problems) == 2, problems


# -- the names and kinds the check rests on ------------------------------------------------------------------------


def test_family_kinds_are_read_from_the_code():
    kinds, conflicts = source_kinds()
    assert conflicts == ()
    # the patterns the scan reads: exporter.gauge/counter, Counter/Histogram, *MetricFamily, _Family(_COUNTER, ..)
    assert kinds[telemetry.ORCHESTRATOR_INFLIGHT_ROLLOUTS] == "gauge"
    assert kinds[telemetry.TRAINER_LOSS_TOKENS] == "counter"
    assert kinds[telemetry.INFERENCE_UPDATE_PAUSE_MS] == "histogram"
    assert kinds[telemetry.BROKER_WORKERS] == "gauge"
    assert kinds[telemetry.BROKER_ROLLOUT_MESSAGES_REFUSED] == "counter"
    assert kinds[telemetry.BROKER_WEIGHT_BYTES_PUSHED] == "counter"
    assert kinds[telemetry.BROKER_COMMITTED_STEP] == "gauge"


def test_the_scan_agrees_with_the_families_really_built():
    scanned, _ = source_kinds()
    built = {name: kind for name, kind in runtime_kinds().items() if name in scanned}
    assert {"primerl_step", "primerl_metric", telemetry.INFERENCE_UPDATE_PAUSE_MS} <= built.keys()
    assert {name: scanned[name] for name in built} == built
    assert family_kinds()[1] == ()


def test_every_telemetry_name_has_a_kind():
    kinds, _ = family_kinds()
    assert sorted(prometheus_names() - kinds.keys()) == []


def test_process_and_vllm_families_are_found():
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= exported_names()
    kinds = vllm_kinds()
    assert kinds["vllm:num_requests_running"] == "gauge"
    assert kinds["vllm:generation_tokens"] == "counter"
    assert kinds["vllm:time_to_first_token_seconds"] == "histogram"

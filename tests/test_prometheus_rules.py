"""deploy/prometheus with Debian's ``promtool``: the scrape config and the rules are valid, the unit tests of the
alerts pass (each alert fires on its recorded series and stays quiet on a healthy run), each of those tests fails
when its alert is broken, and every query names only metrics some role exports (``support/promql.py``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.promql import exported_names, query_problems

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((DEPLOY / "rules").glob("*.yml"))
ALERT_TESTS = DEPLOY / "tests" / "primerl-alerts.test.yml"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool: apt-get install prometheus (.ci/run installs it when run as root)"
)


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def rules() -> list[dict]:
    return [
        rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]
    ]


def alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


@needs_promtool
def test_the_scrape_config_is_valid(tmp_path):
    shutil.copytree(DEPLOY, tmp_path / "prometheus")
    (tmp_path / "prometheus" / "run-token").write_text("a-token")
    checked = promtool("check", "config", "prometheus.yml", cwd=tmp_path / "prometheus")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


@needs_promtool
def test_the_rules_are_valid():
    checked = promtool("check", "rules", *map(str, RULE_FILES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_promtool
def test_each_alert_fires_on_its_series_and_no_alert_fires_on_a_healthy_run():
    tested = promtool("test", "rules", str(ALERT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_firing_case_a_healthy_case_and_says_what_to_do():
    spec = yaml.safe_load(ALERT_TESTS.read_text())
    firing = {case["alertname"] for test in spec["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    [healthy] = [test for test in spec["tests"] if test["name"].startswith("a healthy run")]
    quiet = {case["alertname"] for case in healthy["alert_rule_test"] if case["exp_alerts"] == []}
    assert firing == alerts().keys() == quiet
    for name, rule in alerts().items():
        assert {"summary", "description", "action"} <= rule["annotations"].keys(), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name


@needs_promtool
@pytest.mark.parametrize("alert", sorted(alerts()))
def test_the_unit_tests_fail_when_an_alert_is_broken(alert, tmp_path):
    """An alert whose expression can never hold (``vector(1) < 0``) fails its own firing case."""
    shutil.copytree(DEPLOY / "rules", tmp_path / "rules")
    (tmp_path / "tests").mkdir()
    shutil.copy(ALERT_TESTS, tmp_path / "tests")
    path = tmp_path / "rules" / "primerl-alerts.yml"
    spec = yaml.safe_load(path.read_text())
    for group in spec["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = "vector(1) < 0"
    path.write_text(yaml.safe_dump(spec))
    tested = promtool("test", "rules", str(tmp_path / "tests" / ALERT_TESTS.name), cwd=tmp_path)
    assert tested.returncode != 0
    assert f"alertname: {alert}," in tested.stdout + tested.stderr


def test_every_query_names_only_exported_metrics_or_recorded_series():
    recorded = frozenset(rule["record"] for rule in rules() if "record" in rule)
    known = exported_names() | recorded
    problems = {}
    for rule in rules():
        found = query_problems(rule["expr"], known, run_matcher=None)
        if found:
            problems[rule.get("alert") or rule.get("record")] = found
    assert problems == {}
    assert all(re.fullmatch(r"primerl:[a-z_]+(:[a-z0-9_]+)?", name) for name in recorded), recorded


def test_a_made_up_metric_in_a_rule_is_caught():
    assert query_problems("increase(primerl_no_such_total[5m]) > 0", exported_names(), run_matcher=None) == [
        "primerl_no_such_total: no role exports it"
    ]

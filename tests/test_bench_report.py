"""The bench's report helpers (bench/report.py) and the run timelines it reads (bench/primerl_runs.py)."""

from __future__ import annotations

import json
import math

import pytest
from support.bench import load_bench_module

from primerl.proto import telemetry

report = load_bench_module("report")
primerl_runs = load_bench_module("primerl_runs")


def test_stats_cell_and_verdicts():
    stats = report.Stats()
    assert stats.cell() == "—" and math.isnan(stats.median)
    for value in (3.0, 1.0, 2.0):
        stats.add(value)
    assert (stats.min, stats.median, stats.max) == (1.0, 2.0, 3.0)
    assert stats.cell() == "2.00 (1.00–3.00, n=3)"
    with pytest.raises(ValueError):
        stats.add(float("nan"))
    assert report.verdict(2.9, "<=", 3.0) == "met" and report.verdict(3.1, "<=", 3.0) == "missed"
    assert report.verdict(0.7, ">=", 0.7) == "met" and report.verdict(None, ">=", 0.7) == "not measured"
    assert report.target_line("x", 3.5, "<=", 3.0).startswith("- **missed** x: 3.50 (target <= 3.00)")
    with pytest.raises(ValueError):
        report.verdict(1.0, "<", 2.0)


def test_markdown_table_escapes_and_checks_width():
    text = report.markdown_table(["a", "b"], [["1", "x|y"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x\\|y |"]
    with pytest.raises(ValueError):
        report.markdown_table(["a", "b"], [["1"]])


def test_section_written_atomically(tmp_path):
    section = report.Section("t", argv=["bench/x.py", "--flag"])
    section.line("hello")
    section.write(tmp_path / "s.md")
    text = (tmp_path / "s.md").read_text()
    assert text.startswith("### t\n") and "bench/x.py --flag" in text and "hello" in text and "load" in text


def test_primerl_timeline_from_metrics(tmp_path):
    rows = [
        {"step": 0, "role": "orchestrator", "time": 110.0, telemetry.TRAIN_REWARD: 0.3},
        {
            "step": 1,
            "role": "trainer",
            "time": 112.0,
            telemetry.PERF_STEP_TIME_S: 1.5,
            telemetry.TRAIN_KL_DIVERGENCE: 0.0,
        },
        {"step": 1, "role": "orchestrator", "time": 112.5, telemetry.TRAIN_REWARD: 0.4},
        {"step": 2, "role": "trainer", "time": 114.0, telemetry.PERF_STEP_TIME_S: 1.0},
        {"step": 3, "role": "trainer", "time": 118.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"half": ')
    timeline = primerl_runs.read_primerl_timeline(tmp_path, launch=100.0, end=120.0)
    assert timeline.startup_to_rollouts_s == 10.0 and timeline.startup_to_first_step_s == 12.0
    assert timeline.step_intervals_s == [2.0, 4.0] and timeline.steady_wall_per_step_s == 3.0
    assert timeline.samples_per_s(64) == pytest.approx(64 / 3.0)
    assert timeline.step_rewards == [0.3, 0.4] and timeline.extra["step_time_s"] == [1.5, 1.0]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(primerl_runs.BenchRunError, match="no trainer rows"):
        primerl_runs.read_primerl_timeline(tmp_path, launch=100.0, end=120.0)

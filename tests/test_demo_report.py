"""scripts/demo_report.py --runs: the demo's held-out figures over several runs, with mean and min-max."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "demo_report.py"


def _run_dir(root: Path, name: str, sft: float, rl: float) -> Path:
    for stage, reward in (("sft", sft), ("rl", rl)):
        directory = root / name / "eval" / stage
        directory.mkdir(parents=True)
        (directory / "summary.json").write_text(json.dumps({"reward_mean": reward}))
    return root / name


def test_runs_give_one_row_each_then_mean_and_min_max(tmp_path):
    runs = [_run_dir(tmp_path, "a", 0.5, 0.75), _run_dir(tmp_path, "b", 0.5, 0.7), _run_dir(tmp_path, "c", 0.5, 0.8)]
    result = subprocess.run([sys.executable, str(SCRIPT), "--runs", *map(str, runs)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[1:] == ["0.500", "0.750", "+0.250"]
    assert lines[4].split() == ["mean", "0.500", "0.750", "+0.250"]
    assert lines[5].split() == ["min-max", "0.500-0.500", "0.700-0.800", "0.200-0.300"]
    assert "SFT held-out identical in every run: yes" in result.stdout
    assert "RL held-out identical in every run: no" in result.stdout


def test_a_run_without_its_evals_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert result.returncode != 0 and "cannot read" in result.stderr

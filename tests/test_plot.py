"""`primerl plot`: reading metrics.jsonl into series, which figures are drawn, the PNGs, and the errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from primerl.cli.plot import main
from primerl.proto import telemetry
from primerl.runtime.run_metrics import MetricsFileError, read_metrics_file, read_run_rows
from primerl.supervisor.run_plots import plan_plots, reward_panel, tokens_per_s_panel
from primerl.supervisor.run_series import eval_reward_names, extract_series, moving_average

BIN = Path(sys.executable).parent
NUM_STEPS = 12
# (height, width) in pixels: figsize x dpi 100, one 320-pixel row per panel.
EXPECTED_SHAPES = {
    "reward": (320, 800),
    "loss": (640, 800),
    "lag": (320, 800),
    "throughput": (640, 800),
    "summary": (750, 1200),
}


def orchestrator_row(step: int) -> dict:
    return {
        "step": step,
        "role": "orchestrator",
        "time": 1000.0 + step,
        telemetry.TRAIN_REWARD: 0.1 * step,
        telemetry.ROLLOUT_REWARD_STD: 0.05,
        telemetry.ROLLOUT_MEAN_LENGTH: 20.0,
        telemetry.ROLLOUT_TOKENS_PER_S: 400.0 + step,
        telemetry.ROLLOUT_GENERATION_TIME: 2.0,
        telemetry.ASYNC_OFF_POLICY_LAG_MEAN: 0.5,
        telemetry.ASYNC_OFF_POLICY_LAG_MAX: 1.0,
    }


def trainer_row(step: int) -> dict:
    return {
        "step": step,
        "role": "trainer",
        "time": 1000.5 + step,
        telemetry.TRAIN_LOSS: 1.0 / step,
        telemetry.TRAIN_LEARNING_RATE: 1e-5,
        telemetry.TRAIN_KL_DIVERGENCE: 0.01 * step,
        "train/entropy": 2.0,
        "train/grad_norm": 0.3,
        telemetry.PERF_STEP_TIME_S: 2.0,
        telemetry.PERF_WAIT_FOR_DATA_S: 0.1,
        telemetry.TRAIN_NUM_LOSS_TOKENS: 1000.0 * step,
    }


def write_metrics(run_dir: Path, rows: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


def full_run_rows() -> list[dict]:
    """Both roles interleaved (trainer step N lands after orchestrator step N+1, as in an async run), evals every
    4 steps for two environments."""
    rows = [orchestrator_row(1)]
    for step in range(1, NUM_STEPS + 1):
        if step < NUM_STEPS:
            rows.append(orchestrator_row(step + 1))
        rows.append(trainer_row(step))
        if step % 4 == 0:
            rows.append(
                {
                    "step": step,
                    "role": "orchestrator",
                    "time": 2000.0 + step,
                    "eval/reverse-text/reward": 0.2 * step,
                    "eval/org/math/reward": 0.1,
                }
            )
    return rows


TRUNCATED_TAIL = '{"step": 13, "role": "trainer", "train/lo'


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_metrics(tmp_path / "run", full_run_rows(), tail=TRUNCATED_TAIL)
    return tmp_path / "run"


# ---- reading and series --------------------------------------------------------------------------------------


def test_series_have_the_steps_and_values_of_each_role(run_dir):
    metrics = read_metrics_file(run_dir / "metrics.jsonl")
    assert "line" in metrics.dropped_last_line and "incomplete" in metrics.dropped_last_line
    series = extract_series(metrics.rows)
    steps = np.arange(1, NUM_STEPS + 1)
    assert series[telemetry.TRAIN_REWARD].steps.tolist() == steps.tolist()
    np.testing.assert_allclose(series[telemetry.TRAIN_REWARD].values, 0.1 * steps)
    assert series[telemetry.TRAIN_LOSS].steps.tolist() == steps.tolist()  # the half-written step 13 is not there
    np.testing.assert_allclose(series[telemetry.TRAIN_LOSS].values, 1.0 / steps)
    assert eval_reward_names(series) == {"org/math": "eval/org/math/reward", "reverse-text": "eval/reverse-text/reward"}
    assert series["eval/reverse-text/reward"].steps.tolist() == [4, 8, 12]
    np.testing.assert_allclose(series["eval/reverse-text/reward"].values, [0.8, 1.6, 2.4])
    assert "time" not in series and "role" not in series and "step" not in series

    curves = reward_panel(series).curves
    assert [(c.label, c.markers_only) for c in curves] == [
        ("train reward", False),
        ("eval org/math", True),
        ("eval reverse-text", True),
    ]
    # an older run (no percentiles, no min/max): mean ± std, unclipped
    assert curves[0].band.label == "± std"
    np.testing.assert_allclose(curves[0].band.low.values, 0.1 * steps - 0.05)
    np.testing.assert_allclose(curves[0].band.high.values, 0.1 * steps + 0.05)


def test_reward_band_is_the_rollout_percentiles_when_logged():
    rows = [
        {
            **orchestrator_row(step),
            telemetry.TRAIN_REWARD: 0.05,
            telemetry.ROLLOUT_REWARD_STD: 0.2,
            telemetry.ROLLOUT_REWARD_P10: 0.0,
            telemetry.ROLLOUT_REWARD_P90: 0.25,
        }
        for step in (1, 2)
    ]
    band = reward_panel(extract_series(rows)).curves[0].band
    assert band.label == "10th-90th percentile of rollouts"
    np.testing.assert_allclose(band.low.values, [0.0, 0.0])
    np.testing.assert_allclose(band.high.values, [0.25, 0.25])


def test_std_band_never_leaves_the_rewards_min_max():
    """Mean 0.05 ± std 0.2 would go down to -0.15 with rewards in [0, 1]: the band stops at the step's min."""
    rows = [
        {
            **orchestrator_row(1),
            telemetry.TRAIN_REWARD: 0.05,
            telemetry.ROLLOUT_REWARD_STD: 0.2,
            telemetry.ROLLOUT_REWARD_MIN: 0.0,
            telemetry.ROLLOUT_REWARD_MAX: 0.2,
        },
        {**orchestrator_row(2), telemetry.TRAIN_REWARD: 0.9, telemetry.ROLLOUT_REWARD_STD: 0.2},
    ]  # no min/max: unclipped
    band = reward_panel(extract_series(rows)).curves[0].band
    assert band.label == "± std, within min-max"
    np.testing.assert_allclose(band.low.values, [0.0, 0.7])
    np.testing.assert_allclose(band.high.values, [0.2, 1.1])


def test_trainer_tokens_per_s_is_loss_tokens_over_step_time(run_dir):
    series = extract_series(read_metrics_file(run_dir / "metrics.jsonl").rows)
    curves = {curve.label: curve.series for curve in tokens_per_s_panel(series).curves}
    np.testing.assert_allclose(curves["trainer loss tokens/s"].values, 500.0 * np.arange(1, NUM_STEPS + 1))
    np.testing.assert_allclose(curves["rollout tokens/s"].values, 400.0 + np.arange(1, NUM_STEPS + 1))


def test_a_repeated_step_keeps_the_row_written_last_and_non_numbers_are_skipped():
    rows = [
        {"step": 2, "role": "trainer", telemetry.TRAIN_LOSS: 5.0},
        {"step": 1, "role": "trainer", telemetry.TRAIN_LOSS: 3.0},
        {
            "step": 2,
            "role": "trainer",
            telemetry.TRAIN_LOSS: 4.0,
            "note": "resumed",
            "flag": True,
            "train/entropy": None,
        },
    ]
    series = extract_series(rows)
    assert series[telemetry.TRAIN_LOSS].steps.tolist() == [1, 2]
    assert series[telemetry.TRAIN_LOSS].values.tolist() == [3.0, 4.0]
    assert set(series) == {telemetry.TRAIN_LOSS}


def test_moving_average_is_a_trailing_mean_that_skips_nans():
    np.testing.assert_allclose(moving_average(np.array([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(moving_average(np.array([1.0, np.nan, 3.0]), 3), [1.0, 1.0, 2.0])
    np.testing.assert_allclose(moving_average(np.array([2.0, 4.0]), 10), [2.0, 3.0])


def test_a_bad_line_before_the_last_names_its_line_number(tmp_path):
    half_line = '{"step": 2, "role": "tra\n'
    path = write_metrics(tmp_path, [trainer_row(1)], tail=half_line + json.dumps(trainer_row(3)) + "\n")
    with pytest.raises(MetricsFileError, match=r"line 2 is malformed: not valid JSON"):
        read_metrics_file(path)
    path.write_text(json.dumps(trainer_row(1)) + '\n{"role": "trainer"}\n' + json.dumps(trainer_row(2)) + "\n")
    with pytest.raises(MetricsFileError, match=r'line 2 is malformed: "step" must be an integer'):
        read_metrics_file(path)


def test_what_a_run_left_skips_bad_lines_anywhere_and_reads_each_file_once(tmp_path):
    """The launcher's closing summary, the chaos checks and the benches read whatever a run left."""
    path = write_metrics(
        tmp_path, [trainer_row(1)], tail='{"step": 2, "role": "tra\n' + json.dumps(trainer_row(3)) + '\n{"st'
    )
    metrics = read_metrics_file(path, skip_bad_lines=True)
    assert [row["step"] for row in metrics.rows] == [1, 3]
    assert metrics.num_skipped_lines == 1 and "line 4" in metrics.dropped_last_line
    rows = read_run_rows(tmp_path, tmp_path / ".", tmp_path / "missing")  # one file, a missing dir skipped
    assert [row["step"] for row in rows] == [1, 3]


# ---- the command ---------------------------------------------------------------------------------------------


def assert_png(path: Path, height_width: tuple[int, int]) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    image = imread(path)
    assert image.shape == (*height_width, 4), f"{path.name}: {image.shape}"
    assert image[..., :3].std() > 0.01, f"{path.name} is blank"


def test_plot_writes_the_five_pngs_and_prints_their_paths(run_dir, capsys):
    assert main([str(run_dir)]) == 0
    out, err = capsys.readouterr()
    expected = [run_dir / "plots" / f"{name}.png" for name in EXPECTED_SHAPES]
    assert out.split() == [str(path) for path in expected]
    for name, shape in EXPECTED_SHAPES.items():
        assert_png(run_dir / "plots" / f"{name}.png", shape)
    assert f"line {len(full_run_rows()) + 1} (the last) is incomplete" in err and "skipped" not in err
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(f"{n}.png" for n in EXPECTED_SHAPES)


def test_installed_console_command_plots_with_output_and_smoothing(run_dir, tmp_path):
    output = tmp_path / "elsewhere" / "plots"
    result = subprocess.run(
        [str(BIN / "primerl"), "plot", str(run_dir), "--output", str(output), "--smooth", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(output / f"{name}.png") for name in EXPECTED_SHAPES]
    for name, shape in EXPECTED_SHAPES.items():
        assert_png(output / f"{name}.png", shape)
    assert not (run_dir / "plots").exists()


def test_missing_data_skips_only_the_figures_that_need_it(tmp_path, capsys):
    trainer_only = [trainer_row(step) for step in range(1, 6)]
    for row in trainer_only:
        del row[telemetry.TRAIN_KL_DIVERGENCE]
    write_metrics(tmp_path, trainer_only)
    plan = plan_plots(extract_series(trainer_only))
    assert list(plan.figures) == ["loss", "throughput"]
    assert [panel.title for panel in plan.figures["loss"]] == ["Loss"]  # no KL panel without KL

    assert main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(tmp_path / "plots" / f"{name}.png") for name in ("loss", "throughput", "summary")]
    assert "reward.png skipped" in err and "lag.png skipped" in err
    assert "loss.png skipped" not in err and "throughput.png skipped" not in err
    assert_png(tmp_path / "plots" / "loss.png", (320, 800))
    assert not (tmp_path / "plots" / "reward.png").exists() and not (tmp_path / "plots" / "lag.png").exists()


def test_help_describes_the_files(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "RUN_DIR" in out and "--smooth" in out and "--output" in out
    assert all(f"{name}.png" in out for name in EXPECTED_SHAPES)


# ---- errors: exit 2, one clear line, no traceback ------------------------------------------------------------


def run_failing(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("primerl plot: error: "), err
    assert err.count("error:") == 1 and "Traceback" not in err
    return err


def test_missing_run_dir(tmp_path, capsys):
    err = run_failing([str(tmp_path / "nope")], capsys)
    assert f"run directory {tmp_path / 'nope'} does not exist" in err


def test_missing_metrics_file_says_who_writes_it(tmp_path, capsys):
    err = run_failing([str(tmp_path)], capsys)
    assert f"no metrics.jsonl in {tmp_path}" in err
    assert "trainer, orchestrator and sft daemons" in err and "has not reached step 1" in err


def test_malformed_line_in_the_middle_is_an_error_with_its_number(tmp_path, capsys):
    rows = [orchestrator_row(1), trainer_row(1)]
    write_metrics(tmp_path, rows, tail="not json\n" + json.dumps(trainer_row(2)) + "\n")
    err = run_failing([str(tmp_path)], capsys)
    assert "metrics.jsonl: line 3 is malformed" in err
    assert not (tmp_path / "plots").exists()


def test_nothing_to_plot(tmp_path, capsys):
    write_metrics(tmp_path, [{"step": 1, "role": "trainer", "time": 1.0, telemetry.TRAIN_LEARNING_RATE: 1e-5}])
    err = run_failing([str(tmp_path)], capsys)
    assert "nothing to plot" in err and telemetry.TRAIN_REWARD in err
    write_metrics(tmp_path, [], tail=TRUNCATED_TAIL)
    err = run_failing([str(tmp_path)], capsys)
    assert "no complete line yet" in err


def test_unwritable_output_dir(tmp_path, capsys):
    write_metrics(tmp_path, [trainer_row(1), trainer_row(2)])
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    err = run_failing([str(tmp_path), "--output", str(a_file)], capsys)
    assert f"cannot write plots to {a_file}: it exists and is not a directory" in err
    err = run_failing([str(tmp_path), "--output", str(a_file / "plots")], capsys)
    assert f"cannot write plots to {a_file / 'plots'}" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_dir(tmp_path, capsys):
    write_metrics(tmp_path, [trainer_row(1), trainer_row(2)])
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    try:
        err = run_failing([str(tmp_path), "--output", str(read_only)], capsys)
        assert f"cannot write plots to {read_only}: Permission denied" in err
    finally:
        read_only.chmod(0o700)


def test_negative_smoothing_is_a_usage_error(run_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), "--smooth", "-1"])
    assert exit_info.value.code == 2
    assert "--smooth: must be >= 0" in capsys.readouterr().err

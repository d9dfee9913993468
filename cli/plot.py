"""`primerl plot RUN_DIR`: PNG curves of a run (reward, loss, off-policy lag, throughput) from its metrics.jsonl."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "primerl plot"
DESCRIPTION = """\
Write PNG curves of a run from {RUN_DIR}/metrics.jsonl (written by the trainer, orchestrator and sft daemons):

  reward.png      train/reward per step with a band of the 10th-90th percentile of its rollouts' rewards
                  (rollout/reward_p10/_p90; older runs: ± rollout/reward_std within the rewards' min-max),
                  eval/<env>/reward as markers
  loss.png        train/loss and sft/loss; train/kl_divergence on a second panel
  lag.png         async/off_policy_lag_mean and _max
  throughput.png  rollout tokens/s and trainer loss tokens/s; trainer step time and wait for data
  summary.png     the four above in a 2x2 grid

A figure without data is skipped with a note. Works on a run in progress (a half-written last line is
ignored); run it again to refresh. Exit status 0 when plots were written, 2 on any error."""


def _smooth_steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, help="the run's output directory (holds metrics.jsonl)"
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="DIR",
        type=Path,
        default=None,
        help="where to write the PNGs, created if missing (default: RUN_DIR/plots)",
    )
    parser.add_argument(
        "--smooth",
        metavar="N",
        type=_smooth_steps,
        default=0,
        help="also draw a moving average over the last N logged steps next to each raw curve (default: 0, off)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from primerl.runtime.run_files import METRICS_FILE
    from primerl.runtime.run_metrics import MetricsFileError, read_metrics_file
    from primerl.supervisor.run_series import extract_series

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        return _fail(f"run directory {run_dir} {what}")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        return _fail(
            f"no {METRICS_FILE} in {run_dir}: the trainer, orchestrator and sft daemons append one line per step "
            f"to {{output_dir}}/{METRICS_FILE}, so either the run has not reached step 1 yet or {run_dir} is "
            f"not the run's output directory"
        )
    try:
        metrics = read_metrics_file(metrics_path)
    except MetricsFileError as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(f"cannot read {metrics_path}: {err.strerror or err}")
    if metrics.dropped_last_line:
        _note(f"{metrics_path}: {metrics.dropped_last_line} (the run may still be writing it)")
    if not metrics.rows:
        return _fail(f"{metrics_path} has no complete line yet: nothing to plot")

    from primerl.supervisor.run_plots import plan_plots, write_plots

    plan = plan_plots(extract_series(metrics.rows))
    if not plan.figures:
        return _fail(
            f"nothing to plot: none of the {len(metrics.rows)} rows of {metrics_path} has a metric that a figure "
            f"uses ({'; '.join(plan.skipped)})"
        )
    for line in plan.skipped:
        _note(line)
    output_dir: Path = args.output if args.output is not None else run_dir / "plots"
    if output_dir.exists() and not output_dir.is_dir():
        return _fail(f"cannot write plots to {output_dir}: it exists and is not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        written = write_plots(plan, output_dir, smooth_steps=args.smooth, title=run_dir.resolve().name)
    except OSError as err:
        return _fail(f"cannot write plots to {output_dir}: {err.strerror or err}")
    for path in written:
        print(path)
    return 0


def _note(message: str) -> None:
    print(f"{PROG}: note: {message}", file=sys.stderr)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2

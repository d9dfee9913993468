"""The figures of ``primerl plot``: which curves go in which panel (pure, testable) and drawing them to PNG.

The reward's band shows where the batch's rollout rewards lie, never outside them: the 10th to 90th percentile
of each step's rollout rewards (``rollout/reward_p10`` / ``_p90``). Runs logged before those metrics existed get
mean ± std (``rollout/reward_std``), clipped to the step's ``rollout/reward_min`` / ``_max`` where logged.

Drawing uses matplotlib's Agg canvas on ``Figure`` objects directly, never pyplot, so no window can open and
no global figure state is kept between calls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from primerl.proto import telemetry
from primerl.supervisor.run_series import Series, eval_reward_names, moving_average, ratio_series

FIGURE_DPI = 100


@dataclass(frozen=True)
class Band:
    """A shaded band: ``low`` to ``high`` on the steps both have, named ``label`` in the legend."""

    low: Series
    high: Series
    label: str


@dataclass(frozen=True)
class Curve:
    label: str
    series: Series
    markers_only: bool = False  # eval points: sparse, drawn as markers and never smoothed
    band: Band | None = None


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    curves: list[Curve] = field(default_factory=list)


def _curves(series: dict[str, Series], labels: dict[str, str]) -> list[Curve]:
    return [Curve(label, series[name]) for name, label in labels.items() if len(series.get(name, ())) > 0]


def reward_panel(series: dict[str, Series]) -> Panel:
    curves = []
    if len(series.get(telemetry.TRAIN_REWARD, ())) > 0:
        curves.append(Curve("train reward", series[telemetry.TRAIN_REWARD], band=reward_band(series)))
    for env_id, name in eval_reward_names(series).items():
        if len(series[name]) > 0:
            curves.append(Curve(f"eval {env_id}", series[name], markers_only=True))
    return Panel("Reward", "reward", curves)


def reward_band(series: dict[str, Series]) -> Band | None:
    """Percentiles 10-90 of the rollout rewards when logged, else mean ± std clipped to the rewards' min/max."""
    p10, p90 = series.get(telemetry.ROLLOUT_REWARD_P10), series.get(telemetry.ROLLOUT_REWARD_P90)
    if p10 is not None and p90 is not None and len(p10) and len(p90):
        return Band(p10, p90, "10th-90th percentile of rollouts")
    mean, std = series.get(telemetry.TRAIN_REWARD), series.get(telemetry.ROLLOUT_REWARD_STD)
    if mean is None or std is None or not len(std):
        return None
    steps, mean_index, std_index = np.intersect1d(mean.steps, std.steps, return_indices=True)
    low = mean.values[mean_index] - std.values[std_index]
    high = mean.values[mean_index] + std.values[std_index]
    floor = _on_steps(series.get(telemetry.ROLLOUT_REWARD_MIN), steps)
    ceiling = _on_steps(series.get(telemetry.ROLLOUT_REWARD_MAX), steps)
    clipped = np.isfinite(floor).any() or np.isfinite(ceiling).any()
    low = np.where(np.isfinite(floor), np.maximum(low, floor), low)
    high = np.where(np.isfinite(ceiling), np.minimum(high, ceiling), high)
    return Band(Series(steps, low), Series(steps, high), "± std, within min-max" if clipped else "± std")


def _on_steps(bound: Series | None, steps: np.ndarray) -> np.ndarray:
    """``bound``'s values on ``steps`` (NaN where it has none)."""
    values = np.full(len(steps), np.nan)
    if bound is not None:
        _, step_index, bound_index = np.intersect1d(steps, bound.steps, return_indices=True)
        values[step_index] = bound.values[bound_index]
    return values


def loss_panel(series: dict[str, Series]) -> Panel:
    return Panel("Loss", "loss", _curves(series, {telemetry.TRAIN_LOSS: "RL loss", telemetry.SFT_LOSS: "SFT loss"}))


def kl_panel(series: dict[str, Series]) -> Panel:
    return Panel("KL divergence", "KL", _curves(series, {telemetry.TRAIN_KL_DIVERGENCE: "KL divergence"}))


def lag_panel(series: dict[str, Series]) -> Panel:
    labels = {telemetry.ASYNC_OFF_POLICY_LAG_MEAN: "mean", telemetry.ASYNC_OFF_POLICY_LAG_MAX: "max"}
    return Panel("Off-policy lag", "policy versions behind", _curves(series, labels))


def tokens_per_s_panel(series: dict[str, Series]) -> Panel:
    curves = _curves(series, {telemetry.ROLLOUT_TOKENS_PER_S: "rollout tokens/s"})
    if telemetry.TRAIN_NUM_LOSS_TOKENS in series and telemetry.PERF_STEP_TIME_S in series:
        trainer = ratio_series(series[telemetry.TRAIN_NUM_LOSS_TOKENS], series[telemetry.PERF_STEP_TIME_S])
        if len(trainer) > 0:
            curves.append(Curve("trainer loss tokens/s", trainer))
    return Panel("Throughput", "tokens / s", curves)


def step_time_panel(series: dict[str, Series]) -> Panel:
    labels = {
        telemetry.PERF_STEP_TIME_S: "trainer step",
        telemetry.PERF_WAIT_FOR_DATA_S: "trainer waiting for data",
        telemetry.ROLLOUT_GENERATION_TIME: "rollout generation",
    }
    return Panel("Time per step", "seconds", _curves(series, labels))


@dataclass(frozen=True)
class FigureSpec:
    name: str
    panels: tuple[Callable[[dict[str, Series]], Panel], ...]
    # What would feed it, for the note when it is skipped.
    sources: str


FIGURES = (
    FigureSpec("reward", (reward_panel,), "train/reward or eval/<env>/reward (orchestrator)"),
    FigureSpec("loss", (loss_panel, kl_panel), "train/loss or train/kl_divergence (trainer), sft/loss (sft)"),
    FigureSpec("lag", (lag_panel,), "async/off_policy_lag_mean or _max (orchestrator)"),
    FigureSpec(
        "throughput",
        (tokens_per_s_panel, step_time_panel),
        "rollout/tokens_per_s (orchestrator), train/num_loss_tokens with perf/step_time_s (trainer)",
    ),
)
SUMMARY_NAME = "summary"


@dataclass(frozen=True)
class PlotPlan:
    # figure name -> its non-empty panels, in FIGURES order; the summary is drawn when any is present.
    figures: dict[str, list[Panel]]
    # One line per figure left out, saying which metrics it needs.
    skipped: list[str]


def plan_plots(series: dict[str, Series]) -> PlotPlan:
    figures, skipped = {}, []
    for spec in FIGURES:
        panels = [panel for panel in (build(series) for build in spec.panels) if panel.curves]
        if panels:
            figures[spec.name] = panels
        else:
            skipped.append(f"{spec.name}.png skipped: no {spec.sources} in the metrics")
    return PlotPlan(figures, skipped)


def write_plots(plan: PlotPlan, output_dir: Path, smooth_steps: int = 0, title: str = "") -> list[Path]:
    """Draw every planned figure and the 2x2 summary into ``output_dir`` (which must exist); the paths
    written, in order. Each file is written beside its final name and renamed, so a reader never sees half
    a PNG. Raises ``OSError`` when a file cannot be written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    for name, panels in plan.figures.items():
        figure = Figure(figsize=(8, 3.2 * len(panels)), dpi=FIGURE_DPI, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, panel in zip(axes, panels):
            draw_panel(ax, panel, smooth_steps)
        for ax in axes[:-1]:
            ax.set_xlabel("")
        if title:
            figure.suptitle(title)
        written.append(_save(figure, output_dir / f"{name}.png"))
    if plan.figures:
        figure = Figure(figsize=(12, 7.5), dpi=FIGURE_DPI, layout="constrained")
        FigureCanvasAgg(figure)
        for ax, spec in zip(figure.subplots(2, 2).flat, FIGURES):
            panels = plan.figures.get(spec.name)
            if panels:
                draw_panel(ax, panels[0], smooth_steps)
            else:
                ax.set_title(spec.name.capitalize())
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
                ax.set_xticks([])
                ax.set_yticks([])
        if title:
            figure.suptitle(title)
        written.append(_save(figure, output_dir / f"{SUMMARY_NAME}.png"))
    return written


def draw_panel(ax, panel: Panel, smooth_steps: int) -> None:
    from matplotlib.ticker import MaxNLocator

    colors = [f"C{i}" for i in range(10)]
    for index, curve in enumerate(panel.curves):
        color = colors[index % len(colors)]
        steps, values = curve.series.steps, curve.series.values
        if curve.markers_only:
            ax.plot(steps, values, linestyle="none", marker="D", markersize=5, color=color, label=curve.label)
            continue
        if curve.band is not None:
            common, low_index, high_index = np.intersect1d(
                curve.band.low.steps, curve.band.high.steps, return_indices=True
            )
            ax.fill_between(
                common,
                curve.band.low.values[low_index],
                curve.band.high.values[high_index],
                color=color,
                alpha=0.15,
                linewidth=0,
                label=f"{curve.label} {curve.band.label}",
            )
        marker = "o" if len(steps) < 2 else None
        if smooth_steps > 1:
            ax.plot(steps, values, color=color, alpha=0.35, linewidth=1, marker=marker, label=f"{curve.label} (raw)")
            ax.plot(
                steps,
                moving_average(values, smooth_steps),
                color=color,
                linewidth=2,
                label=f"{curve.label} (mean of {smooth_steps})",
            )
        else:
            ax.plot(steps, values, color=color, linewidth=1.5, marker=marker, label=curve.label)
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")


def _save(figure, path: Path) -> Path:
    partial = path.with_name(f".{path.name}.partial")
    try:
        figure.savefig(partial, format="png")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path

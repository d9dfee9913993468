"""Advice lines: what to add when one role waits on another, judged over windows of steps (pure logic).

The roles name their advice through ``primerl.proto.telemetry`` (this package imports nothing of primerl);
each piece is a stable log event (a warning, at most once per window of ``window`` steps) and a pair of step
metrics that every row carries once the first window is complete (``primerl status`` shows the advice whose
flag is 1, ``status_lines``):

- trainer, rank 0 (``ADVICE_TRAINER_WAITS``, ``WaitWindow``): over the window the trainer waited for batches
  (``perf/wait_for_data_s``) longer than it computed (``perf/step_time_s``): inference is the bottleneck, add
  inference workers. ``advice/add_inference`` (0/1), ``advice/trainer_wait_to_compute`` (the window's ratio);
- orchestrator (``ADVICE_ORCHESTRATOR_WAITS``, ``WaitWindow``): it waited for policies (dispatch held by the async
  bound, and blocked on the send queue while the trainer is behind) longer than it worked (the rest of its step
  time): the trainer is the bottleneck, add trainer ranks. ``advice/add_trainer``,
  ``advice/orchestrator_wait_to_work``;
- orchestrator (``ADVICE_MOST_ROLLOUTS_DISCARDED``, ``DiscardWindow``): more than half of the completion tokens
  generated over the window were discarded (stale, filtered, failed, cancelled: ``rollout/tokens_discarded`` of
  ``rollout/tokens_generated``). ``advice/rollouts_discarded``, ``advice/discarded_fraction``.

The first step of each role is left out (it includes start-up: loading the model, vLLM's first compile).
Durations below ``MIN_WAIT_S`` over a whole window give no advice (too little to act on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_WINDOW = 10
"""Steps per window."""
MIN_WAIT_S = 1.0
"""A window whose waits sum to less gives no advice."""
DISCARD_THRESHOLD = 0.5


@dataclass
class Advice:
    """One piece of advice: its event (the log line) and the figures of the window behind it."""

    event: str
    figures: dict[str, float] = field(default_factory=dict)


class WaitWindow:
    """Sums of the time a role waited and the time it worked over ``window`` steps; at the end of each window,
    ``Advice`` when it waited longer than it worked (and at least ``min_wait_s``)."""

    def __init__(
        self,
        event: str,
        flag: str,
        ratio_name: str,
        *,
        window: int = DEFAULT_WINDOW,
        min_wait_s: float = MIN_WAIT_S,
        skip_steps: int = 1,
    ):
        if window < 1:
            raise ValueError(f"the advice window must be at least 1 step, got {window}")
        self.event, self.flag, self.ratio_name = event, flag, ratio_name
        self.window, self.min_wait_s = window, min_wait_s
        self._to_skip = skip_steps
        self._steps = 0
        self._waited = self._worked = 0.0
        self.metrics: dict[str, float] = {}  # of the latest complete window, in every row after it

    def add(self, waited_s: float, worked_s: float) -> Advice | None:
        if self._to_skip > 0:
            self._to_skip -= 1
            return None
        self._steps += 1
        self._waited += max(0.0, waited_s)
        self._worked += max(0.0, worked_s)
        if self._steps < self.window:
            return None
        waited, worked, steps = self._waited, self._worked, self._steps
        self._steps, self._waited, self._worked = 0, 0.0, 0.0
        ratio = waited / worked if worked > 0 else float(waited > 0) * 1e9
        advised = waited > worked and waited >= self.min_wait_s
        self.metrics = {self.flag: float(advised), self.ratio_name: min(ratio, 1e9)}
        if not advised:
            return None
        return Advice(self.event, {"waited_s": round(waited, 2), "worked_s": round(worked, 2), "steps": steps})


class DiscardWindow:
    """Completion tokens generated and discarded over ``window`` steps: ``Advice`` when more than ``threshold`` of
    them were discarded. Steps whose metrics lack the token counts are not counted."""

    def __init__(
        self,
        event: str,
        flag: str,
        fraction_name: str,
        *,
        generated_key: str,
        discarded_key: str,
        window: int = DEFAULT_WINDOW,
        threshold: float = DISCARD_THRESHOLD,
    ):
        if window < 1:
            raise ValueError(f"the advice window must be at least 1 step, got {window}")
        self.event, self.flag, self.fraction_name = event, flag, fraction_name
        self.generated_key, self.discarded_key = generated_key, discarded_key
        self.window, self.threshold = window, threshold
        self._steps = 0
        self._generated = self._discarded = 0.0
        self.metrics: dict[str, float] = {}

    def add(self, step_metrics: Mapping[str, float]) -> Advice | None:
        if self.generated_key not in step_metrics or self.discarded_key not in step_metrics:
            return None
        self._steps += 1
        self._generated += float(step_metrics[self.generated_key])
        self._discarded += float(step_metrics[self.discarded_key])
        if self._steps < self.window:
            return None
        generated, discarded, steps = self._generated, self._discarded, self._steps
        self._steps, self._generated, self._discarded = 0, 0.0, 0.0
        fraction = discarded / generated if generated > 0 else 0.0
        advised = fraction > self.threshold
        self.metrics = {self.flag: float(advised), self.fraction_name: fraction}
        if not advised:
            return None
        return Advice(
            self.event,
            {
                "tokens_generated": int(generated),
                "tokens_discarded": int(discarded),
                "discarded_fraction": round(fraction, 3),
                "steps": steps,
            },
        )


def status_lines(last_metrics: Mapping[str, float], advice: Sequence[tuple[str, str, str]]) -> list[str]:
    """The advice in force, one line each, from a run's latest metrics (``primerl status``): ``advice`` lists
    (flag metric, event, figure metric) of each window."""
    lines = []
    for flag, event, figure in advice:
        if last_metrics.get(flag, 0.0) >= 1.0:
            value = last_metrics.get(figure)
            lines.append(f"{event} ({figure} {value:.2f} over the last window)" if value is not None else event)
    return lines


__all__ = ["DEFAULT_WINDOW", "Advice", "DiscardWindow", "WaitWindow", "status_lines"]

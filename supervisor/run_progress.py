"""The live progress line of `primerl rl` (``Progress``), fed from the broker's run status, and the summary it
prints at the end (``run_summary``).

Each figure belongs to the step it is shown with. The broker merges the roles' last metrics by name, so
``train/reward`` there is the orchestrator's latest batch, usually a step or more ahead of the trainer. The
orchestrator reports the step of its batch as ``orchestrator/step`` alongside; ``Progress`` keeps the rewards of
recent batches by step and shows, next to ``step N``, the reward of the batch trained at step N. When that batch's
reward was not seen (not yet reported, or missed between two polls), it shows the newest reward it has and says
which batch it is from: ``reward 0.512 (batch 7)``. The loss is the trainer's, of its latest reported step.
Interleaved trajectories trained as branching samples show as ``fallbacks N`` (over the run) once there are any.
``gen N tok/s`` is the orchestrator's generation throughput over a trailing window, not a per-step figure.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primerl.proto import telemetry

MAX_BATCHES = 64  # rewards of recent batches kept by step


@dataclass
class Progress:
    """What the progress line shows, from the broker's run status."""

    step: int = 0
    max_steps: int = 0
    reward: float | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    served_version: int | None = None
    published_version: int = 0
    step_times: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, step) when the step changed
    # train/reward of the orchestrator's recent batches by step (``orchestrator/step``), newest MAX_BATCHES kept
    batch_rewards: dict[int, float] = field(default_factory=dict)
    # the step of ``reward`` when the orchestrator did not say it (an older orchestrator): None
    reward_step: int | None = None
    num_interleave_fallbacks: int = 0

    def update(self, status) -> None:
        from primerl.proto.v1 import common_pb2

        metrics = status.last_metrics
        if telemetry.TRAIN_REWARD in metrics:
            self.reward = metrics[telemetry.TRAIN_REWARD]
            self.reward_step = None
            if telemetry.ORCHESTRATOR_STEP in metrics:
                self.reward_step = int(metrics[telemetry.ORCHESTRATOR_STEP])
                self.batch_rewards[self.reward_step] = self.reward
                while len(self.batch_rewards) > MAX_BATCHES:
                    del self.batch_rewards[min(self.batch_rewards)]
        self.loss = metrics.get(telemetry.TRAIN_LOSS, self.loss)
        self.tokens_per_s = metrics.get(telemetry.ROLLOUT_TOKENS_PER_S, self.tokens_per_s)
        self.num_interleave_fallbacks = max(
            self.num_interleave_fallbacks, int(metrics.get(telemetry.ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL, 0))
        )
        self.max_steps = status.max_steps or self.max_steps
        self.published_version = status.latest_policy_version
        versions = [
            w.policy_version
            for w in status.workers
            if w.role == common_pb2.ROLE_INFERENCE and w.HasField("policy_version")
        ]
        if versions:
            self.served_version = min(versions)
        if status.trainer_step != self.step or not self.step_times:
            self.step_times.append((time.monotonic(), status.trainer_step))
        self.step = status.trainer_step

    def eta_s(self) -> float | None:
        if not self.max_steps or len(self.step_times) < 2:
            return None
        (first_s, first_step), (last_s, last_step) = self.step_times[0], self.step_times[-1]
        if last_step <= first_step:
            return None
        per_step_s = (last_s - first_s) / (last_step - first_step)
        return max(0, self.max_steps - self.step) * per_step_s

    def line(self) -> str:
        def number(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        max_steps = str(self.max_steps) if self.max_steps else "?"
        served = "-" if self.served_version is None else str(self.served_version)
        lag = "-" if self.served_version is None else str(max(0, self.step - self.served_version))
        eta = self.eta_s()
        return (
            f"step {self.step}/{max_steps}  reward {self.reward_text()}  loss {number(self.loss, '.4f')}  "
            f"gen {number(self.tokens_per_s, '.0f')} tok/s  served v{served} (lag {lag})  "
            f"{f'fallbacks {self.num_interleave_fallbacks}  ' if self.num_interleave_fallbacks else ''}"
            f"ETA {'-' if eta is None else duration(eta)}"
        )

    def reward_text(self) -> str:
        """The reward of the batch trained at the shown step, else the newest one labelled with its batch."""
        if self.step in self.batch_rewards:
            return format(self.batch_rewards[self.step], ".3f")
        if self.reward is None:
            return "-"
        batch = "latest batch" if self.reward_step is None else f"batch {self.reward_step}"
        return f"{self.reward:.3f} ({batch})"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def run_summary(rows: list[dict], progress: Progress, children: Iterable[Any], wall_s: float, run_dir: Path) -> str:
    """The closing summary of a run that finished: steps, wall time and each role's start-up, the reward of the
    first and last batch, the policy version served, and the interleave fallbacks when there were any.
    ``rows``: the run's ``metrics.jsonl``; ``children``: the roles' processes (``name``, ``ready_s``)."""
    rewards = [
        r[telemetry.TRAIN_REWARD] for r in rows if r.get("role") == "orchestrator" and telemetry.TRAIN_REWARD in r
    ]
    trainer_rows = [r for r in rows if r.get("role") == "trainer"]
    steps = trainer_rows[-1]["step"] if trainer_rows else progress.step
    reward = f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "-"
    orchestrator_rows = [r for r in rows if r.get("role") == "orchestrator"]
    fallbacks = orchestrator_rows[-1].get(telemetry.ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL, 0) if orchestrator_rows else 0
    served = "-" if progress.served_version is None else str(progress.served_version)
    startup = ", ".join(f"{c.name} {c.ready_s:.1f} s" for c in children if c.ready_s is not None)
    text = (
        f"primerl rl: run finished: {steps} steps in {duration(wall_s)} (start-up {startup})\n"
        f"  reward (first -> last step): {reward}\n"
        f"  policy version served by inference: {served} (trainer published {progress.published_version})\n"
        f"  run directory: {run_dir}"
    )
    if fallbacks:
        text += (
            f"\n  interleave fallbacks: {int(fallbacks)} multi-turn rollouts trained as branching samples "
            "(turns that do not extend the previous one; rollout/interleave_fallbacks/<reason> in metrics.jsonl)"
        )
    return text + token_summary(orchestrator_rows)


def token_summary(orchestrator_rows: list[dict]) -> str:
    """The run's completion tokens: generated, trained, discarded by reason (``rollout/tokens_*`` summed over the
    orchestrator's step rows); "" when the rows have none."""
    from primerl.orchestrator.step_metrics import DISCARD_REASONS
    from primerl.proto.telemetry import ROLLOUT_TOKENS_DISCARDED, ROLLOUT_TOKENS_GENERATED, ROLLOUT_TOKENS_TRAINED

    generated = sum(r.get(ROLLOUT_TOKENS_GENERATED, 0.0) for r in orchestrator_rows)
    if not generated:
        return ""
    trained = sum(r.get(ROLLOUT_TOKENS_TRAINED, 0.0) for r in orchestrator_rows)
    reasons = {
        why: sum(r.get(f"{ROLLOUT_TOKENS_DISCARDED}/{why}", 0.0) for r in orchestrator_rows) for why in DISCARD_REASONS
    }
    discarded = sum(reasons.values())
    by_reason = ", ".join(f"{why} {int(n)}" for why, n in reasons.items() if n) or "none"
    return (
        f"\n  tokens: {int(generated)} generated, {int(trained)} trained, {int(discarded)} discarded "
        f"({discarded / generated:.1%}; {by_reason})"
    )

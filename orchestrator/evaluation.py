"""Evaluate a policy on an environment split: rollout groups through an env worker, then their summary.

Used by `primerl eval` (a model served by an in-process vLLM server or any OpenAI-compatible endpoint) and
by the orchestrator's periodic evals.

    groups = run_eval_groups(worker, range(100), num_rollouts=3, base_url=url, model=name, sampling=params)
    summary = summarize_groups(groups, num_requested=100 * 3)
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from primerl.orchestrator.seeds import rollout_seed_base
from primerl.orchestrator.trajectory import RolloutGroup, Split
from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator")


@dataclass
class EvalSummary:
    """Mean reward (and the environment's metrics) over the rollouts that finished without error."""

    num_rollouts: int = 0
    num_errors: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    mean_completion_tokens: float = 0.0
    truncation_rate: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few, for the report

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """Flat `prefix/name` metrics (what the orchestrator reports as `eval/<env>/...`)."""
        out = {
            f"{prefix}/reward": self.reward_mean,
            f"{prefix}/reward_std": self.reward_std,
            f"{prefix}/num_rollouts": float(self.num_rollouts),
            f"{prefix}/errors": float(self.num_errors),
            f"{prefix}/mean_length": self.mean_completion_tokens,
            f"{prefix}/truncation_rate": self.truncation_rate,
        }
        out.update({f"{prefix}/{name}": value for name, value in self.metrics.items()})
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


MAX_REPORTED_ERRORS = 5


def summarize_groups(
    groups: Iterable[RolloutGroup], failed_groups: Mapping[int, str] | None = None, rollouts_per_group: int = 1
) -> EvalSummary:
    """Summary of finished groups; each entry of `failed_groups` (example index -> error) counts as
    `rollouts_per_group` failed rollouts."""
    rewards: list[float] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    per_metric: dict[str, list[float]] = collections.defaultdict(list)
    summary = EvalSummary()
    for index, error in (failed_groups or {}).items():
        summary.num_errors += rollouts_per_group
        if len(summary.errors) < MAX_REPORTED_ERRORS:
            summary.errors.append(f"example {index}: {error}")
    for group in groups:
        for rollout in group.rollouts:
            if not rollout.ok or rollout.reward is None or not math.isfinite(rollout.reward):
                summary.num_errors += 1
                if len(summary.errors) < MAX_REPORTED_ERRORS:
                    summary.errors.append(
                        f"example {group.example_index} rollout {rollout.rollout_index}: "
                        f"{rollout.error_type or 'no reward'}: {rollout.error}"
                    )
                continue
            rewards.append(float(rollout.reward))
            lengths.append(rollout.num_completion_tokens)
            truncated.append(rollout.is_truncated)
            for name, value in rollout.metrics.items():
                if value is not None and math.isfinite(value):
                    per_metric[name].append(float(value))
    if rewards:
        mean = sum(rewards) / len(rewards)
        summary.num_rollouts = len(rewards)
        summary.reward_mean = mean
        summary.reward_std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        summary.mean_completion_tokens = sum(lengths) / len(lengths)
        summary.truncation_rate = sum(truncated) / len(truncated)
        summary.metrics = {name: sum(values) / len(values) for name, values in sorted(per_metric.items())}
    return summary


def run_eval_groups(
    worker: Any,
    example_indices: Iterable[int],
    *,
    num_rollouts: int,
    base_url: str,
    model: str,
    sampling: Mapping[str, Any],
    split: Split = "eval",
    api_key: str = "EMPTY",
    max_concurrent_groups: int = 16,
    timeout_s: float = 600.0,
    on_group: Callable[[RolloutGroup], None] | None = None,
) -> tuple[list[RolloutGroup], dict[int, str]]:
    """Roll out every example (at most `max_concurrent_groups` at once) on `worker` (an `EnvClient`).

    Returns the finished groups in example order and the examples whose request failed (index -> error).
    `on_group` sees each group as it finishes (progress, streaming results to a file). A `seed` in `sampling`
    seeds each example's rollouts apart (``primerl.orchestrator.seeds``, by example index): the same figures
    whatever the order in which the examples run, where the server honours per-request seeds."""
    if max_concurrent_groups < 1:
        raise ValueError(f"max_concurrent_groups must be >= 1, got {max_concurrent_groups}")
    pending = iter(example_indices)
    inflight: dict[concurrent.futures.Future, int] = {}
    finished: dict[int, RolloutGroup] = {}
    failed: dict[int, str] = {}

    def submit_next() -> bool:
        index = next(pending, None)
        if index is None:
            return False
        example_sampling = dict(sampling)
        if example_sampling.get("seed") is not None:
            example_sampling["seed"] = rollout_seed_base(int(example_sampling["seed"]), index, num_rollouts)
        future = worker.submit_rollout(
            index,
            split=split,
            num_rollouts=num_rollouts,
            base_url=base_url,
            model=model,
            api_key=api_key,
            sampling=example_sampling,
            timeout_s=timeout_s,
        )
        inflight[future] = index
        return True

    while len(inflight) < max_concurrent_groups and submit_next():
        pass
    while inflight:
        done, _ = concurrent.futures.wait(list(inflight), return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            index = inflight.pop(future)
            try:
                group = future.result()
            except Exception as exc:  # the worker's error for this example; the others go on
                failed[index] = f"{type(exc).__name__}: {exc}"
            else:
                finished[index] = group
                if on_group is not None:
                    on_group(group)
            submit_next()
    return [finished[i] for i in sorted(finished)], failed


def evaluate_workers(
    eval_workers: Mapping[str, Any],
    eval_config: Any,
    *,
    base_url: str,
    model: str,
    api_key: str,
    sampling: Mapping[str, Any],
    timeout_s: float,
) -> dict[str, float]:
    """The orchestrator's periodic eval: each eval environment's eval split (at most ``eval_config.num_examples``
    examples, ``eval_config.rollouts_per_example`` rollouts each) as ``eval/<env id>/...`` metrics. Failed groups
    are logged and counted in the summary."""
    metrics: dict[str, float] = {}
    for env_id, worker in eval_workers.items():
        count = worker.info.num_eval_examples
        if eval_config.num_examples is not None:
            count = min(count, eval_config.num_examples)
        groups, failed = run_eval_groups(
            worker,
            range(count),
            num_rollouts=eval_config.rollouts_per_example,
            base_url=base_url,
            model=model,
            api_key=api_key,
            sampling=sampling,
            split="eval",  # seeded by example index when seeded
            max_concurrent_groups=max(1, count),
            timeout_s=timeout_s,
        )
        for index, error in failed.items():  # counted and reported like training rollouts
            log.warning("eval group failed", env_id=env_id, example_index=index, error=error)
        summary = summarize_groups(groups, failed, rollouts_per_group=eval_config.rollouts_per_example)
        failed_rollouts = summary.num_errors - len(failed) * eval_config.rollouts_per_example
        if failed_rollouts:  # the failed groups were logged above; the summary lists their errors first
            first = summary.errors[min(len(failed), MAX_REPORTED_ERRORS) :]
            log.warning("eval rollouts failed", env_id=env_id, num_errors=failed_rollouts, first=first)
        metrics.update(summary.as_metrics(f"{telemetry.EVAL_PREFIX}{env_id}"))
    return metrics

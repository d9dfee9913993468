"""The orchestrator's metrics of a step: its per-phase timers and the metrics of the batch it sends.

Per-phase timers (``StepTimers``), in every training row: ``perf/step_s`` (= ``rollout/generation_time``),
``perf/dispatch_s``, ``perf/collect_wait_s`` (the main loop idle, waiting for rollouts), ``perf/to_samples_s``,
``perf/advantages_s``, ``perf/packing_s`` (sums over the step); ``perf/send_wait_s`` (the main loop blocked on
the send queue) and ``perf/send_s`` (the latest completed send); per rollout group, means over the groups that
finished during the step: ``perf/env_roundtrip_s`` (submit to answer), ``perf/inference_wait_s`` (the group's
model calls, as the env worker timed them), ``perf/env_score_s``, ``perf/env_encode_s`` and
``perf/env_overhead_s`` (round trip minus the worker's own time: the pipe, JSON, queueing).

Metrics of the batch (``batch_metrics``): ``train/reward``, ``rollout/reward_std`` and where the rollout
rewards lie (``rollout/reward_min``, ``_max``, ``_p10``, ``_p90``); ``rollout/tokens_per_s`` is generation
throughput, the completion tokens of the groups that finished over a trailing window of wall time
(``primerl.orchestrator.throughput``), not a per-step figure; ``rollout/completion_tokens`` counts those
collected during the step. ``rollout/interleave_fallbacks`` (and ``/<reason>``; ``_total`` over the run):
trajectories of the step that could not be interleaved and were trained as branching samples (a warning the first
time per reason). With several environments: ``env/<id>/reward``, ``env/<id>/num_rollouts``, ``_num_samples``
(of any kind: classic or verifiers v1), and ``env/<id>/stale_groups_cancelled`` when some of its groups outlived the
async bound this step (an environment much slower than the others: raise ``max_async_level``).
Failed rollouts: ``rollout/errors`` and ``rollout/errors/<kind>``; ``rollout/rescheduled``,
``rollout/stale_groups_cancelled``. Inference workers (``RolloutScheduler.worker_metrics``): ``rollout/retried``
(rollouts dispatched again because their worker could not be reached or left: not errors), ``inference/workers``
and ``inference/workers_serving`` (listed, and serving the current version), ``inference/workers_joined`` and
``inference/workers_left`` (this step), ``inference/workers_silent`` (workers whose groups were dispatched again
this step because none came back: ``RolloutScheduler.retry_silent``), ``inference/join_to_serving_s`` (the
longest a worker that joined this step took from registering to serving the current version; absent when none).

``batch/zero_advantage_rollouts``: rollouts of the batch whose group has no signal (every advantage 0; none with
``constant_trainer_batch_size`` unless the step was filled: ``batch/filled_with_dropped_rollouts``).

Waste (``token_metrics``; completion tokens, per step): ``rollout/tokens_generated`` (of the rollouts that came back
during the step, plus an estimate for the groups cancelled in flight), ``rollout/tokens_trained`` (of the step's
batch), ``rollout/tokens_discarded`` and ``rollout/tokens_discarded/<reason>`` (``stale``: waiting groups too old
for the batch; ``filtered``: groups dropped by the difficulty filter or as zero-advantage; ``failed``: failed or
malformed rollouts and groups dispatched again; ``cancelled``: groups cancelled in flight, estimated at the
environment's mean tokens per rollout; ``surplus``: groups beyond the surplus bound), ``rollout/discarded_fraction``
(discarded over generated, this step); with several environments ``env/<id>/tokens_generated``, ``_trained`` and
``_discarded``. Over a run, generated = trained + discarded + what is still waiting or in flight.

Teacher (with ``[orchestrator.teacher]``; ``primerl.orchestrator.teacher_scoring``): ``teacher/requests``
(teacher requests that ended this step, answered or not), ``teacher/request_s`` (their mean seconds),
``teacher/retried`` (requests sent again), ``teacher/errors`` (requests that failed, retried or not),
``teacher/inflight`` (requests in flight when the step's row is made), ``teacher/dispatch_waits``. A group the
teacher could not score counts in ``rollout/errors`` and ``rollout/errors/teacher_<kind>`` (its rollouts).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from primerl.proto import telemetry

if TYPE_CHECKING:
    from primerl.orchestrator.filtering import AssembledBatch
    from primerl.orchestrator.trajectory import RolloutGroup

DISCARD_REASONS = ("stale", "filtered", "failed", "cancelled", "surplus")

_GROUP_TIMINGS = (("generate_s", "inference_wait_s"), ("score_s", "env_score_s"), ("encode_s", "env_encode_s"))
_STEP_PHASES = ("dispatch_s", "collect_wait_s", "to_samples_s", "advantages_s", "packing_s", "send_wait_s", "send_s")
_GROUP_MEANS = ("env_roundtrip_s", "inference_wait_s", "env_score_s", "env_encode_s", "env_overhead_s")


class StepTimers:
    """Seconds spent per phase of one step, and the env-worker timings of the groups that finished in it."""

    def __init__(self) -> None:
        self.totals: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - started

    def add_group(self, rollout_group: RolloutGroup) -> None:
        """A finished group's env-worker timings and round trip (means are taken in ``metrics``)."""
        timings = rollout_group.timings
        roundtrip_s = rollout_group.roundtrip_s
        self.totals["groups_timed"] += 1
        for wire_name, name in _GROUP_TIMINGS:
            self.totals[f"group_{name}"] += float(timings.get(wire_name, 0.0))
        if roundtrip_s is not None:
            self.totals["group_env_roundtrip_s"] += roundtrip_s
            if "total_s" in timings:
                self.totals["group_env_overhead_s"] += max(0.0, roundtrip_s - float(timings["total_s"]))

    def metrics(self, elapsed_s: float) -> dict[str, float]:
        groups = max(1, self.totals["groups_timed"])
        metrics = {f"perf/{name}": float(self.totals[name]) for name in _STEP_PHASES}
        for name in _GROUP_MEANS:
            metrics[f"perf/{name}"] = float(self.totals[f"group_{name}"]) / groups
        metrics[telemetry.PERF_STEP_S] = elapsed_s
        return metrics


def batch_metrics(
    batch: AssembledBatch,
    counters: collections.Counter,
    fallbacks: collections.Counter,
    *,
    elapsed_s: float,
    tokens_per_s: float,
    multi_env: bool,
) -> dict[str, float]:
    """The metrics of a step's batch (``filtering.Batch``) and of the rollouts collected during the step
    (``counters``, ``fallbacks``); only finite numbers."""
    rewards = [reward for g in batch.groups for reward in g.rollout_rewards()]
    rollouts = [samples for g in batch.groups for samples in g.rollouts().values()]
    lengths = [sum(s.num_completion_tokens or 0 for s in samples) for samples in rollouts]
    metrics = {
        telemetry.TRAIN_REWARD: float(np.mean(rewards)),
        telemetry.ROLLOUT_REWARD_STD: float(np.std(rewards)),
        telemetry.ROLLOUT_MEAN_LENGTH: float(np.mean(lengths)),
        telemetry.ROLLOUT_TRUNCATION_RATE: float(np.mean([any(s.truncated for s in samples) for samples in rollouts])),
        telemetry.ROLLOUT_GENERATION_TIME: elapsed_s,
        telemetry.ROLLOUT_TOKENS_PER_S: tokens_per_s,
        telemetry.ROLLOUT_COMPLETION_TOKENS: float(counters["completion_tokens"]),  # of rollouts collected this step
        **reward_spread_metrics(rewards),
        **fallback_metrics(fallbacks),
        **(env_reward_metrics(batch.groups) if multi_env else {}),
        telemetry.ROLLOUT_ERRORS: float(
            counters["rollout_errors"] + counters["env_errors"] + counters["teacher_errors"]
        ),
        **{f"rollout/{name}": float(count) for name, count in counters.items() if name.startswith("errors/")},
        telemetry.ROLLOUT_RESCHEDULED: float(counters["rescheduled"]),
        telemetry.ROLLOUT_STALE_GROUPS_CANCELLED: float(counters["stale_groups_cancelled"]),
        **(
            {
                f"env/{name.split('/', 1)[1]}/stale_groups_cancelled": float(count)
                for name, count in counters.items()
                if name.startswith("stale_groups_cancelled/")
            }
            if multi_env
            else {}
        ),
        **batch.metrics,
        telemetry.BATCH_ZERO_ADVANTAGE_ROLLOUTS: float(sum(g.num_rollouts for g in batch.groups if not g.has_signal)),
        **token_metrics(batch, counters, multi_env=multi_env),
    }
    return finite(metrics)


def token_metrics(batch: AssembledBatch, counters: collections.Counter, *, multi_env: bool) -> dict[str, float]:
    """Generated, trained and discarded completion tokens of the step (module docstring), from the scheduler's
    ``tokens_generated/<env>`` and ``tokens_discarded/<reason>/<env>`` counters and the batch's own."""
    generated: collections.Counter = collections.Counter()
    trained: collections.Counter = collections.Counter()
    discarded: collections.Counter = collections.Counter()  # (reason, env)
    for name, count in counters.items():
        kind, _, rest = name.partition("/")
        if kind == "tokens_generated":
            generated[rest] += count
        elif kind == "tokens_discarded":
            reason, _, env_id = rest.partition("/")
            discarded[reason, env_id] += count
    discarded.update(getattr(batch, "discarded_tokens", None) or {})  # a batch made outside the assembler has none
    for group in batch.groups:
        trained[group.env_id] += group.num_completion_tokens
    num_generated = sum(generated.values())
    num_discarded = sum(discarded.values())
    metrics = {
        telemetry.ROLLOUT_TOKENS_GENERATED: float(num_generated),
        telemetry.ROLLOUT_TOKENS_TRAINED: float(sum(trained.values())),
        telemetry.ROLLOUT_TOKENS_DISCARDED: float(num_discarded),
        telemetry.ROLLOUT_DISCARDED_FRACTION: num_discarded / num_generated if num_generated else 0.0,
    }
    for reason in DISCARD_REASONS:
        metrics[f"{telemetry.ROLLOUT_TOKENS_DISCARDED}/{reason}"] = float(
            sum(count for (why, _), count in discarded.items() if why == reason)
        )
    if multi_env:
        for env_id in sorted({*generated, *trained, *(env_id for _, env_id in discarded)}):
            metrics[f"env/{env_id}/tokens_generated"] = float(generated[env_id])
            metrics[f"env/{env_id}/tokens_trained"] = float(trained[env_id])
            metrics[f"env/{env_id}/tokens_discarded"] = float(
                sum(count for (_, env), count in discarded.items() if env == env_id)
            )
    return metrics


def finite(metrics: dict[str, Any]) -> dict[str, float]:
    """The entries that are finite numbers, as floats."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def reward_spread_metrics(rewards: list[float]) -> dict[str, float]:
    """Where the batch's rollout rewards lie: min, max and the 10th/90th percentiles (the plot's band)."""
    if not rewards:
        return {}
    p10, p90 = np.percentile(rewards, [10, 90])
    return {
        telemetry.ROLLOUT_REWARD_MIN: float(min(rewards)),
        telemetry.ROLLOUT_REWARD_MAX: float(max(rewards)),
        telemetry.ROLLOUT_REWARD_P10: float(p10),
        telemetry.ROLLOUT_REWARD_P90: float(p90),
    }


def fallback_metrics(fallbacks: collections.Counter) -> dict[str, float]:
    """``rollout/interleave_fallbacks`` (trajectories of this step's rollouts that could not be interleaved and
    were trained as branching samples) and one ``rollout/interleave_fallbacks/<reason>`` per reason seen."""
    return {
        telemetry.ROLLOUT_INTERLEAVE_FALLBACKS: float(sum(fallbacks.values())),
        **{
            f"{telemetry.ROLLOUT_INTERLEAVE_FALLBACKS}/{reason}": float(count)
            for reason, count in sorted(fallbacks.items())
        },
    }


def env_reward_metrics(groups: list) -> dict[str, float]:
    """Per environment of a batch: ``env/<id>/reward`` (mean rollout reward), ``env/<id>/num_rollouts`` and
    ``env/<id>/num_samples``."""
    rewards: dict[str, list[float]] = collections.defaultdict(list)
    num_samples: collections.Counter = collections.Counter()
    for group in groups:
        rewards[group.env_id].extend(group.rollout_rewards().tolist())
        num_samples[group.env_id] += len(group.samples)
    metrics = {}
    for env_id in sorted(rewards):
        if rewards[env_id]:
            metrics[f"{telemetry.ENV_PREFIX}{env_id}/reward"] = float(np.mean(rewards[env_id]))
        metrics[f"{telemetry.ENV_PREFIX}{env_id}/num_rollouts"] = float(len(rewards[env_id]))
        metrics[f"{telemetry.ENV_PREFIX}{env_id}/num_samples"] = float(num_samples[env_id])
    return metrics


__all__ = [
    "DISCARD_REASONS",
    "StepTimers",
    "batch_metrics",
    "token_metrics",
    "env_reward_metrics",
    "fallback_metrics",
    "finite",
    "reward_spread_metrics",
]

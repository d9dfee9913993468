"""The async bound: how far rollout generation may run ahead of training (``max_async_level``).

Versions and steps. Policy version 0 is the initial weights; the trainer publishes version n after training step n.
Training steps are numbered from ``first_step`` (1 in ``primerl.trainer.runner``), so the trainer starts step n
holding version ``n - first_step``: the version the batch of step n would have if training were fully on-policy.

A sample's off-policy lag at step n is ``(n - first_step) - policy_version``: how many versions it is behind the
trainer (``OrchestratorConfig.max_async_level``: "a sample may be at most this many policy versions behind the
trainer"). The bound is lag <= max_async_level, i.e. the batch of step n only holds samples of versions

    >= min_policy_version(n) = n - first_step - max_async_level

With ``first_step = 0`` this is the issue's ``n - max_async_level``; with the trainer's 1-based steps the same
rule needs ``first_step = 1``, otherwise ``max_async_level = 1`` would be fully on-policy and
``max_async_level = 0`` would wait forever (step 1 would need version 1, which exists only after step 1).

- ``may_dispatch``: rollouts for step n may start only when the inference workers serve a version >= that minimum
  (otherwise the orchestrator waits for the next weight update).
- ``is_fresh``: a batch (or group) for step n may hold a sample only if its oldest token's version is >= it.
- ``stale_groups``: in-flight groups that can no longer make it into step n; the orchestrator cancels them.
- ``last_step``: the last step a group of a version can go into; the scheduler dispatches no more groups than the
  batches up to it need, so that groups are not generated only to go stale.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import numpy as np

from primerl.proto import telemetry


class AsyncBound:
    def __init__(self, max_async_level: int = 1, *, first_step: int = 1):
        if max_async_level < 0:
            raise ValueError(f"max_async_level must be >= 0, got {max_async_level}")
        self.max_async_level = max_async_level
        self.first_step = first_step

    def trainer_policy_version(self, step: int) -> int:
        """The version the trainer holds when it starts ``step``."""
        return step - self.first_step

    def min_policy_version(self, step: int) -> int:
        """The oldest version a sample of ``step``'s batch may come from (never below 0)."""
        return max(0, self.trainer_policy_version(step) - self.max_async_level)

    def last_step(self, policy_version: int) -> int:
        """The last step whose batch may hold a sample of ``policy_version`` (``min_policy_version(step) <=
        policy_version``): what a group dispatched with that version can still be trained in."""
        return policy_version + self.first_step + self.max_async_level

    def may_dispatch(self, next_batch_step: int, current_policy_version: int) -> bool:
        """Whether rollouts for ``next_batch_step`` may be generated with ``current_policy_version``."""
        return current_policy_version >= self.min_policy_version(next_batch_step)

    def is_fresh(self, sample_min_policy_version: int, step: int) -> bool:
        """Whether a sample (group) whose oldest token has this version may go into ``step``'s batch."""
        return sample_min_policy_version >= self.min_policy_version(step)

    def stale_groups(self, inflight: Mapping[Hashable, int], step: int) -> list[Hashable]:
        """Keys of in-flight groups (key -> the oldest policy version they were generated with) too old for
        ``step``'s batch; cancel them."""
        oldest_allowed = self.min_policy_version(step)
        return [key for key, policy_version in inflight.items() if policy_version < oldest_allowed]

    def off_policy_lags(self, step: int, policy_versions: Iterable[int]) -> np.ndarray:
        """Lag of each version at ``step`` (int64): the trainer's version minus the sample's."""
        versions = np.fromiter((int(v) for v in policy_versions), dtype=np.int64)
        return self.trainer_policy_version(step) - versions

    def lag_metrics(self, step: int, policy_versions: Iterable[int]) -> dict[str, float]:
        """``async/off_policy_lag_{mean,max,min}`` over the given versions (e.g. one per sample or per token)."""
        lags = self.off_policy_lags(step, policy_versions)
        if lags.size == 0:
            return {
                telemetry.ASYNC_OFF_POLICY_LAG_MEAN: 0.0,
                telemetry.ASYNC_OFF_POLICY_LAG_MAX: 0.0,
                telemetry.ASYNC_OFF_POLICY_LAG_MIN: 0.0,
            }
        return {
            telemetry.ASYNC_OFF_POLICY_LAG_MEAN: float(lags.mean()),
            telemetry.ASYNC_OFF_POLICY_LAG_MAX: float(lags.max()),
            telemetry.ASYNC_OFF_POLICY_LAG_MIN: float(lags.min()),
        }

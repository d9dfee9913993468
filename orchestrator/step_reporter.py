"""The metrics row of each step the orchestrator sends (``step_metrics``), with what it tracks over the run: the
advice windows (``primerl.runtime.advice``) and the interleave fallbacks, each reason warned once."""

from __future__ import annotations

import collections

from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.filtering import AssembledBatch
from primerl.orchestrator.step_metrics import batch_metrics, finite
from primerl.orchestrator.types import StepReport
from primerl.proto import telemetry
from primerl.proto.packing import PackedStep
from primerl.runtime.advice import DiscardWindow, WaitWindow
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator")


class StepReporter:
    """Each step's metrics from its batch, its packing and the scheduler's ``StepReport``."""

    def __init__(self, config: OrchestratorConfig, bound: AsyncBound):
        self.multi_env = len(config.env) > 1
        self.bound = bound
        # advice: "add trainer" and "more than half of the rollouts were discarded"
        self.policy_waits = WaitWindow(
            telemetry.ADVICE_ORCHESTRATOR_WAITS,
            telemetry.ADVICE_ADD_TRAINER,
            telemetry.ADVICE_ORCHESTRATOR_WAIT_TO_WORK,
        )
        self.discards = DiscardWindow(
            telemetry.ADVICE_MOST_ROLLOUTS_DISCARDED,
            telemetry.ADVICE_ROLLOUTS_DISCARDED,
            telemetry.ADVICE_DISCARDED_FRACTION,
            generated_key=telemetry.ROLLOUT_TOKENS_GENERATED,
            discarded_key=telemetry.ROLLOUT_TOKENS_DISCARDED,
        )
        self._fallback_reasons_logged: set[str] = set()
        self._num_fallbacks_total = 0

    def metrics(
        self,
        step: int,
        batch: AssembledBatch,
        packed: PackedStep,
        report: StepReport,
        *,
        elapsed_s: float,
        waited_s: float,
        concurrency: dict[str, float],
    ) -> dict[str, float]:
        """The step's row; ``waited_s``: how long it waited for policies (``advise``)."""
        versions = [s.min_policy_version for s in batch.samples]
        metrics = batch_metrics(
            batch,
            report.counters,
            report.fallbacks,
            elapsed_s=elapsed_s,
            tokens_per_s=report.tokens_per_s,
            multi_env=self.multi_env,
        )
        metrics.update(
            finite(
                {
                    **packed.metrics(),
                    **self.bound.lag_metrics(step, versions),
                    **report.timers.metrics(elapsed_s),
                    **report.worker_metrics,
                }
            )
        )
        metrics.update(concurrency)
        self.advise(metrics, elapsed_s, waited_s)
        self.log_new_fallbacks(report.fallbacks)
        self._num_fallbacks_total += sum(report.fallbacks.values())
        metrics[telemetry.ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL] = float(self._num_fallbacks_total)
        return metrics

    def advise(self, metrics: dict[str, float], elapsed_s: float, waited_s: float) -> None:
        """The advice of the step's window: ``waited_s`` waiting for policies (dispatch held by the async bound,
        the send queue full while the trainer is behind) against the rest of the step, and the discarded share of
        the generated tokens; logged once per window, flags in the rows."""
        for advice in (self.policy_waits.add(waited_s, elapsed_s - waited_s), self.discards.add(metrics)):
            if advice is not None:
                log.warning(advice.event, **advice.figures)
        metrics.update({**self.policy_waits.metrics, **self.discards.metrics})

    def log_new_fallbacks(self, fallbacks: collections.Counter) -> None:
        """Once per reason and run: interleaved trajectories that were trained as branching samples instead."""
        for reason, count in fallbacks.items():
            if reason not in self._fallback_reasons_logged:
                self._fallback_reasons_logged.add(reason)
                log.warning(
                    "interleaved trajectories fall back to branching samples (more samples, prompts "
                    "trained again); counted in rollout/interleave_fallbacks",
                    reason=reason,
                    num_this_step=count,
                )

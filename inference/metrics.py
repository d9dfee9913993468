"""The inference daemon's primerl families, served on vLLM's own ``GET /metrics`` (the API port, run token
required like every route but /health), next to vLLM's ``vllm:*`` families:

    primerl_inference_policy_version                 policy version served
    primerl_inference_weight_updates_applied_total   weight updates applied
    primerl_inference_weight_updates_refused_total   weight updates refused (the previous version kept serving)
    primerl_inference_last_update_ms                 the last applied update, from its arrival to resumed serving
    primerl_inference_last_update_phase_ms{phase}    its phases: check, stage, load (before the pause), wait_engine
                                                     (pausing), engine, reset_cache
    primerl_inference_update_pause_ms                histogram of each applied update's generation pause (ms),
                                                     from the pause request to resumed serving
    primerl_inference_join_to_serving_seconds        from registering to serving the version current then
    primerl_inference_engine_stalled                 1 while the engine core does not answer its probe (stalled)
    primerl_inference_engine_stalls_total            times the engine was found stalled

vLLM's route serves prometheus_client's global registry (``vllm.v1.metrics.prometheus.get_prometheus_registry``),
so these families are registered there, once per process. In prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set, which primerl-infer never does itself) the values go through its files like
vLLM's own; the gauges say how to merge them (``mostrecent``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from primerl.proto import telemetry

_lock = threading.Lock()
_families: InferenceFamilies | None = None


@dataclass(frozen=True)
class InferenceFamilies:
    policy_version: Gauge
    updates_applied: Counter
    updates_refused: Counter
    last_update_ms: Gauge
    last_update_phase_ms: Gauge
    update_pause_ms: Histogram
    join_to_serving_s: Gauge
    engine_stalled: Gauge
    engine_stalls: Counter


UPDATE_PAUSE_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)
"""Bucket bounds (ms) of the generation-pause histogram: the target is <= 50 ms at 100M parameters."""


def inference_families() -> InferenceFamilies:
    """The families, made (and registered in the global registry) on first use."""
    global _families
    with _lock:
        if _families is None:
            _families = InferenceFamilies(
                policy_version=Gauge(
                    telemetry.INFERENCE_POLICY_VERSION, "Policy version served.", multiprocess_mode="mostrecent"
                ),
                updates_applied=Counter(telemetry.INFERENCE_WEIGHT_UPDATES_APPLIED, "Weight updates applied."),
                updates_refused=Counter(
                    telemetry.INFERENCE_WEIGHT_UPDATES_REFUSED,
                    "Weight updates refused (the previous version kept serving).",
                ),
                last_update_ms=Gauge(
                    telemetry.INFERENCE_LAST_UPDATE_MS,
                    "Milliseconds of the last applied update, from its arrival to resumed serving.",
                    multiprocess_mode="mostrecent",
                ),
                last_update_phase_ms=Gauge(
                    telemetry.INFERENCE_LAST_UPDATE_PHASE_MS,
                    "Milliseconds of each phase "
                    "of the last applied update (check; stage: payload into the shared "
                    "file; load: waiting for the load beside the served weights; "
                    "wait_engine: pausing generation; engine: the switch or the worker's "
                    "reload; reset_cache).",
                    ["phase"],
                    multiprocess_mode="mostrecent",
                ),
                update_pause_ms=Histogram(
                    telemetry.INFERENCE_UPDATE_PAUSE_MS,
                    "Generation pause of each applied weight update, from the pause request to resumed serving (ms).",
                    buckets=UPDATE_PAUSE_BUCKETS_MS,
                ),
                join_to_serving_s=Gauge(
                    telemetry.INFERENCE_JOIN_TO_SERVING_SECONDS,
                    "Seconds from registering with the broker to serving the policy version that was current then.",
                    multiprocess_mode="mostrecent",
                ),
                engine_stalled=Gauge(
                    telemetry.INFERENCE_ENGINE_STALLED_GAUGE,
                    "1 while the engine core does not answer its probe within engine_stall_timeout_s (stalled).",
                    multiprocess_mode="mostrecent",
                ),
                engine_stalls=Counter(telemetry.INFERENCE_ENGINE_STALLS, "Times the engine was found stalled."),
            )
        return _families

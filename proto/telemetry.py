"""Telemetry names that tools and tests read: step-metric keys, Prometheus metric names and log event names.

They are an interface (``primerl status``, ``primerl plot``, the benchmarks, the chaos and multihost checks and
W&B dashboards match on them): a value never changes; producers and readers both use these constants.

- Step-metric keys: the keys of a ``metrics.jsonl`` row (and of W&B and the broker's metrics report). The trainer
  writes ``train/<name>`` for each statistic of its step; the keys below are the ones read by name.
- Prometheus names: the base name of each family; a counter is exposed with ``_total`` appended, a histogram with
  ``_bucket``, ``_count`` and ``_sum`` (``prometheus_client``'s convention).
- Log events: the first argument of ``log.info`` and its kin, the ``event`` field of a JSON log line.
"""

from __future__ import annotations

# -- step-metric keys (metrics.jsonl) ------------------------------------------------------------------------------
ORCHESTRATOR_STEP = "orchestrator/step"
TRAIN_REWARD = "train/reward"
TRAIN_LOSS = "train/loss"
TRAIN_LEARNING_RATE = "train/learning_rate"
TRAIN_KL_DIVERGENCE = "train/kl_divergence"
TRAIN_TEACHER_KL = "train/teacher_kl"
TRAIN_NUM_LOSS_TOKENS = "train/num_loss_tokens"
TRAIN_NUM_MICRO_BATCHES = "train/num_micro_batches"
SFT_LOSS = "sft/loss"
PERF_STEP_TIME_S = "perf/step_time_s"
"""The trainer's compute time of the step (forward, backward, optimizer), without waiting for data or I/O."""
PERF_WAIT_FOR_DATA_S = "perf/wait_for_data_s"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
ROLLOUT_GENERATION_TIME = "rollout/generation_time"
ROLLOUT_MEAN_LENGTH = "rollout/mean_length"
ROLLOUT_REWARD_STD = "rollout/reward_std"
ROLLOUT_REWARD_MIN = "rollout/reward_min"
ROLLOUT_REWARD_MAX = "rollout/reward_max"
ROLLOUT_REWARD_P10 = "rollout/reward_p10"
ROLLOUT_REWARD_P90 = "rollout/reward_p90"
ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL = "rollout/interleave_fallbacks_total"
ASYNC_OFF_POLICY_LAG_MEAN = "async/off_policy_lag_mean"
ASYNC_OFF_POLICY_LAG_MAX = "async/off_policy_lag_max"

# -- Prometheus metric names ---------------------------------------------------------------------------------------
BROKER_WORKERS = "primerl_broker_workers"
BROKER_WEIGHT_BYTES_RECEIVED = "primerl_broker_weight_bytes_received"
BROKER_WEIGHT_BYTES_PUSHED = "primerl_broker_weight_bytes_pushed"
BROKER_WEIGHT_UPDATES_STORED = "primerl_broker_weight_updates_stored"
BROKER_WEIGHT_FORWARD_LAG_SECONDS = "primerl_broker_weight_forward_lag_seconds"
BROKER_LATEST_POLICY_VERSION = "primerl_broker_latest_policy_version"
BROKER_COMMITTED_STEP = "primerl_broker_committed_step"
BROKER_TRAINER_STEP = "primerl_broker_trainer_step"
BROKER_ORCHESTRATOR_STEP = "primerl_broker_orchestrator_step"
BROKER_ROLLOUT_CONNECTIONS = "primerl_broker_rollout_connections"
BROKER_ROLLOUT_CONNECTIONS_REFUSED = "primerl_broker_rollout_connections_refused"
BROKER_ROLLOUT_BATCHES_QUEUED = "primerl_broker_rollout_batches_queued"
BROKER_ROLLOUT_BYTES_SPOOLED = "primerl_broker_rollout_bytes_spooled"
BROKER_ROLLOUT_BATCHES_RECEIVED = "primerl_broker_rollout_batches_received"
INFERENCE_POLICY_VERSION = "primerl_inference_policy_version"
INFERENCE_WEIGHT_UPDATES_APPLIED = "primerl_inference_weight_updates_applied"
INFERENCE_WEIGHT_UPDATES_REFUSED = "primerl_inference_weight_updates_refused"
INFERENCE_LAST_UPDATE_MS = "primerl_inference_last_update_ms"
INFERENCE_LAST_UPDATE_PHASE_MS = "primerl_inference_last_update_phase_ms"
INFERENCE_UPDATE_PAUSE_MS = "primerl_inference_update_pause_ms"
INFERENCE_JOIN_TO_SERVING_SECONDS = "primerl_inference_join_to_serving_seconds"
TRAINER_STEP = "primerl_trainer_step"
TRAINER_LOSS = "primerl_trainer_loss"
TRAINER_LOSS_TOKENS = "primerl_trainer_loss_tokens"
ORCHESTRATOR_STEP_GAUGE = "primerl_orchestrator_step"
ORCHESTRATOR_INFLIGHT_ROLLOUTS = "primerl_orchestrator_inflight_rollouts"
ORCHESTRATOR_ROLLOUT_ERRORS = "primerl_orchestrator_rollout_errors"

# -- log events ----------------------------------------------------------------------------------------------------
STEP_DONE = "step done"
"""Trainer, rank 0: a step is trained and recorded (``from_checkpoint`` when written again after a restart)."""
RESUMED_FROM_CHECKPOINT = "resumed from checkpoint"
CHECKPOINT_SAVED = "checkpoint saved"
POLICY_PUBLISHED = "policy published"
TRAINING_FINISHED = "training finished"
STEP_SENDING = "step sending"
"""Orchestrator: a step's batches are about to be sent (with their per-rank digests); ``step sent`` follows."""
STEP_SENT = "step sent"
BATCH_SENT = "batch sent"
ALL_STEPS_PRODUCED = "all steps produced"
ROLLOUT_FAILED = "rollout failed"
STOPPING = "stopping"
WAITING_FOR_THE_BROKER = "waiting for the broker"
WEIGHT_UPDATE_STORED = "weight update stored"
"""Broker: a weight update is stored in full and its fan-out to the inference workers begins."""
WEIGHT_UPDATE_RECEIVED = "weight update received"
WEIGHT_UPDATE_APPLIED = "applied weight update"
"""Inference, in the engine: the weights are loaded into the model (phases in ms)."""
WEIGHT_UPDATE_LIVE = "weight update live"
"""Inference: the new policy version serves requests."""

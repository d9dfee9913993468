"""Config of the orchestrator daemon (`primerl-orchestrator`). Imports neither torch, vLLM nor verifiers.

Key names and defaults follow prime-rl's orchestrator config (`[orchestrator.sampling]`, `[[orchestrator.env]]`...).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from primerl.runtime.config_base import BaseConfig, ConfigWarning, nearest_divisors, nearest_multiples
from primerl.runtime.config_common import BrokerConnection, DaemonLog, MetricsEndpoint, WandbLogging
from primerl.runtime.cpu_budget import ThreadsConfig

# `[orchestrator.buffer] type = ...` as older prime-rl versions spell the filtering switch.
BUFFER_TYPES = {"online-difficulty": True, "simple": False}


class OrchestratorModelConfig(BaseConfig):
    """The model that rollouts are requested from (its name on the inference server)."""

    name: str = Field(min_length=1, description="Model id as served by the inference workers.")


class SamplingConfig(BaseConfig):
    """Sampling parameters of every rollout request."""

    max_tokens: int | None = Field(
        None, ge=1, description="Max tokens per model turn (not per trajectory); unset: up to the context limit."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0.5-1.0 gives diverse groups).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest token set of this mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens (-1: no limit).")
    min_p: float = Field(0.0, ge=0, le=1, description="Drop tokens below min_p times the top token's probability.")
    repetition_penalty: float = Field(1.0, gt=0, description="Penalty on tokens already present (1.0: none).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a model turn.")
    seed: int | None = Field(None, description="Base seed of the sampling requests (unset: random).")


class BufferConfig(BaseConfig):
    """Which rollout groups are kept for training."""

    online_difficulty_filtering: bool = Field(
        False,
        description="Drop groups whose rewards are all equal (no learning signal) and those outside the bounds "
        'below. `type = "online-difficulty"` is an alias.',
    )
    min_reward: float | None = Field(None, description="Drop groups whose mean reward is below this (too hard).")
    max_reward: float | None = Field(None, description="Drop groups whose mean reward is above this (too easy).")
    min_reward_variance: float = Field(0.0, ge=0, description="Drop groups whose reward variance is below this.")

    @model_validator(mode="before")
    @classmethod
    def _accept_type(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "type" not in data:
            return data
        data = dict(data)
        buffer_type = data.pop("type")
        if buffer_type not in BUFFER_TYPES:
            expected = ", ".join(f'"{t}"' for t in BUFFER_TYPES)
            raise ValueError(f"type must be one of {expected}, got {buffer_type!r}")
        enabled = BUFFER_TYPES[buffer_type]
        if data.setdefault("online_difficulty_filtering", enabled) != enabled:
            raise ValueError(
                f'type = "{buffer_type}" contradicts online_difficulty_filtering = '
                f"{str(data['online_difficulty_filtering']).lower()}: keep one of them"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> BufferConfig:
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ValueError(
                f"min_reward ({self.min_reward}) must be <= max_reward ({self.max_reward}): groups are kept when "
                "their mean reward lies between the two; swap them"
            )
        bounds = [k for k in ("min_reward", "max_reward") if getattr(self, k) is not None]
        if self.min_reward_variance > 0:
            bounds.append("min_reward_variance")
        if bounds and not self.online_difficulty_filtering:
            warnings.warn(
                f"buffer: {', '.join(bounds)} has no effect while online_difficulty_filtering = false",
                ConfigWarning,
                stacklevel=2,
            )
        return self


class AdvantageConfig(BaseConfig):
    """Group-relative advantages."""

    std_normalize: bool = Field(False, description="Divide advantages by the group's reward standard deviation.")
    length_penalty: float = Field(
        0.0, ge=0, description="Subtracted from the reward per completion token, as a fraction of max_tokens."
    )


EnvKind = Literal["auto", "classic", "v1"]


class EnvConfig(BaseConfig):
    """One verifiers environment: a classic one (`load_environment(**args)`, run by an env worker in `env_python`)
    or a verifiers v1 one (a Taskset/Harness package, served by verifiers' env server in `env_v1_python`)."""

    id: str = Field(min_length=1, description="Environment id (the package name, e.g. `primeintellect/gsm8k`).")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of `load_environment` (classic), or the taskset's config (v1: the "
        "`taskset` table of verifiers' EnvConfig, without `id`).",
    )
    weight: float = Field(1.0, gt=0, description="Relative sampling weight among the environments.")
    kind: EnvKind = Field(
        "auto",
        description='Which kind of environment `id` is: "classic" (verifiers <= 0.3, `load_environment`), "v1" '
        '(verifiers 0.4 Taskset/Harness), or "auto": the kind the installed package has (the classic env '
        "interpreter is asked first, then the v1 one; an id listed in neither is loaded as classic).",
    )
    v1_config: dict[str, Any] = Field(
        default_factory=dict,
        description="v1 only: the rest of verifiers' EnvConfig (agent roles, `agent.harness.*`, timeouts, "
        "retries); the taskset is `id` with `args`. Local runtimes only (no sandbox).",
    )

    @model_validator(mode="after")
    def _check_v1(self) -> EnvConfig:
        taskset = self.v1_config.get("taskset")
        if isinstance(taskset, dict) and "id" in taskset:
            raise ValueError(
                f"v1_config.taskset.id ({taskset['id']!r}) is not allowed: the taskset is the "
                f"environment's `id` ({self.id!r}); remove taskset.id from v1_config"
            )
        if self.v1_config and self.kind == "classic":
            raise ValueError(
                f'v1_config is set but kind = "classic" ({self.id!r}): v1_config configures verifiers '
                'v1 environments only; remove it or set kind = "v1" (or "auto")'
            )
        return self


class EvalConfig(BaseConfig):
    """Evaluation during training; off when absent."""

    interval: int = Field(100, ge=1, description="Evaluate every `interval` steps.")
    num_examples: int | None = Field(None, ge=1, description="Examples per environment (unset: all).")
    rollouts_per_example: int = Field(1, ge=1, description="Rollouts per example.")
    env: list[EnvConfig] = Field(
        min_length=1,
        description="Environments to evaluate on (`[[orchestrator.eval.env]]`): a classic one on its eval split, a v1 "
        'one on the tasks its `args` give (e.g. `split = "eval"` for examples/reverse_text_v1).',
    )


class TeacherConfig(BaseConfig):
    """The teacher that scores the student's own rollouts (online distillation); off when absent.

    Each finished sample's token ids are sent to the teacher's `/v1/completions` with `prompt_logprobs`, and the
    teacher's logprob of every sampled token becomes the sample's `teacher_logprobs`. prime-rl's spelling
    `[orchestrator.teacher_model.client] base_url = [...]` / `[orchestrator.teacher_model.model] name = ...` loads
    into the same settings.
    """

    model: str | None = Field(
        None,
        min_length=1,
        description="Model name the teacher serves (unset: the first model the teacher lists in GET /v1/models).",
    )
    base_url: list[str] = Field(
        default_factory=list,
        description="Teacher endpoints (`http://host:port`, with or without a trailing `/v1`); empty: the teacher "
        "workers (role teacher) that the broker lists, followed as they join and leave.",
    )
    api_key_var: str | None = Field(
        None,
        min_length=1,
        description="Environment variable holding the API key of an external teacher endpoint (sent as a Bearer "
        "token); broker-listed teachers take the run token like inference workers.",
    )
    timeout_s: float = Field(120.0, gt=0, description="A teacher request that takes longer is retried.")
    max_retries: int = Field(
        3,
        ge=0,
        description="Retries of a failed teacher request (on another endpoint when there is one) before "
        "its rollout group is dropped and counted as an error.",
    )
    max_inflight: int = Field(32, ge=1, description="Teacher requests in flight at once, over all endpoints.")

    @model_validator(mode="before")
    @classmethod
    def _accept_single_url(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("base_url"), str):
            return {**data, "base_url": [data["base_url"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> TeacherConfig:
        for url in self.base_url:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"teacher.base_url entry {url!r} must start with http:// or https://")
        return self


def _teacher_from_prime_rl(data: dict[str, Any]) -> dict[str, Any]:
    """Moves prime-rl's `teacher_model = {client = {...}, model = {name}}` into `teacher`."""
    alias = data["teacher_model"]
    if not isinstance(alias, dict):
        raise ValueError(
            "teacher_model must be a table with `client` and `model` tables (or use [orchestrator.teacher])"
        )
    if data.get("teacher") is not None:
        raise ValueError(
            "the teacher is set twice: keep [orchestrator.teacher] or [orchestrator.teacher_model], not both"
        )
    unknown = set(alias) - {"client", "model"}
    if unknown:
        raise ValueError(f"teacher_model: unknown keys {sorted(unknown)}; expected `client` and `model`")
    client = dict(alias.get("client") or {})
    teacher: dict[str, Any] = {}
    for key, target in (
        ("base_url", "base_url"),
        ("api_key_var", "api_key_var"),
        ("timeout", "timeout_s"),
        ("timeout_s", "timeout_s"),
        ("max_retries", "max_retries"),
    ):
        if key in client:
            teacher[target] = client.pop(key)
    if client:
        raise ValueError(f"teacher_model.client: unsupported keys {sorted(client)}")
    model = alias.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError("teacher_model.model must be a table with `name`")
    if model.get("name") is not None:
        teacher["model"] = model["name"]
    rest = {k: v for k, v in data.items() if k != "teacher_model"}
    return {**rest, "teacher": teacher}


class ConcurrencyConfig(BaseConfig):
    """Adaptive concurrency (prime-rl's `[orchestrator.concurrency]`): the rollouts kept in flight are steered, per
    inference worker, toward a target share of the worker's KV cache (vLLM's `vllm:kv_cache_usage_perc` on its
    `/metrics`), backing off at `kv_backoff` or when the worker preempts requests. Without this table the number
    in flight is fixed (`max_inflight`)."""

    table_example: ClassVar[str] = "kv_target = 0.8\nmax_inflight = 256"

    initial_inflight: int | None = Field(
        None,
        ge=1,
        description="Rollouts in flight at the start (unset: the fixed `max_inflight` of the orchestrator, "
        "else 2 x batch_size), clamped to [min_inflight, max_inflight].",
    )
    min_inflight: int = Field(1, ge=1, description="Fewest rollouts in flight; `min_inflight = max_inflight` is fixed.")
    max_inflight: int | None = Field(
        1024, ge=1, description="Most rollouts in flight over all workers (the fixed cap that stays); unset: none."
    )
    kv_target: float = Field(0.8, gt=0, lt=1, description="KV-cache use (0-1) each inference worker is steered toward.")
    kv_backoff: float = Field(
        0.95, gt=0, le=1, description="KV-cache use (0-1) at which a worker's share is cut back at once."
    )
    poll_interval_s: float = Field(1.0, gt=0, description="Seconds between reads of each worker's `/metrics`.")

    @model_validator(mode="after")
    def _check(self) -> ConcurrencyConfig:
        if self.kv_backoff <= self.kv_target:
            raise ValueError(
                f"concurrency.kv_backoff ({self.kv_backoff}) must be above kv_target ({self.kv_target}), "
                "e.g. kv_target = 0.8, kv_backoff = 0.95"
            )
        if self.max_inflight is not None and self.min_inflight > self.max_inflight:
            raise ValueError(
                f"concurrency.min_inflight ({self.min_inflight}) is above max_inflight ({self.max_inflight}): "
                "lower min_inflight or raise max_inflight"
            )
        return self


class OrchestratorConfig(BaseConfig):
    """The orchestrator: rollouts, rewards, advantages, filtering, packing."""

    model: OrchestratorModelConfig = Field(description="The model that rollouts are requested from.")
    env: list[EnvConfig] = Field(
        min_length=1, description="Training environments: add one `[[orchestrator.env]]` table with `id` per env."
    )
    batch_size: int = Field(128, ge=1, description="Samples (rollouts) per training step.")
    rollouts_per_example: int = Field(
        8, ge=1, description="Rollouts per example (the group size); must divide `batch_size`."
    )
    seq_len: int = Field(2048, ge=1, description="Max tokens of one sample (prompt and all turns).")
    oversampling_factor: float = Field(
        1.0,
        ge=1,
        description="Accepted for prime-rl configs and superseded (prime-rl removed it): the rollouts in flight are "
        "`max_inflight` or `[orchestrator.concurrency]`.",
    )
    max_async_level: int = Field(
        1, ge=0, description="A sample may be at most this many policy versions behind the trainer."
    )
    constant_trainer_batch_size: bool = Field(
        True,
        description="Drop groups whose advantages are all 0 before counting and collect until the step has "
        "`batch_size` rollouts that carry signal (prime-rl's default); false: they count toward the batch.",
    )
    max_inflight: int | None = Field(
        None,
        ge=1,
        description="Rollouts in flight at once, fixed (unset: 2 x batch_size); `[orchestrator.concurrency]` "
        "steers it by the inference workers' KV-cache use instead.",
    )
    concurrency: ConcurrencyConfig | None = Field(
        None, description="Adaptive concurrency toward a KV-cache target; fixed `max_inflight` when absent."
    )
    trajectory_strategy: Literal["interleaved", "branching"] = Field(
        "interleaved",
        description="How multi-turn trajectories become samples; use `branching` for models whose chat template "
        "rewrites earlier turns (Qwen3 and other thinking models).",
    )
    mask_truncated_completions: bool = Field(False, description="Give no loss to tokens of truncated rollouts.")
    zero_truncated_completions: bool = Field(False, description="Give reward 0 to truncated rollouts.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Which rollout groups are kept.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage computation.")
    eval: EvalConfig | None = Field(None, description="Evaluation during training; off when absent.")
    env_python: Path | None = Field(
        None,
        description="Python interpreter of the env-worker processes (unset: $PRIMERL_ENV_PYTHON, else "
        ".venv-envs/bin/python beside primerl's venv when it exists, else the orchestrator's own).",
    )
    env_v1_python: Path | None = Field(
        None,
        description="Python interpreter of the verifiers v1 env servers (unset: $PRIMERL_ENV_V1_PYTHON, else "
        ".venv-envs-v1/bin/python beside primerl's venv when it exists, else the orchestrator's own).",
    )
    v1_max_workers: int = Field(
        1,
        ge=1,
        description="Worker processes of each v1 env server (verifiers' serve_env `max_workers`; 1: one "
        "in-process server).",
    )
    rollout_timeout_s: float = Field(1800.0, gt=0, description="A rollout that takes longer is abandoned.")
    worker_silence_timeout_s: float | None = Field(
        None,
        ge=0,
        description="An inference worker whose oldest group in flight is this old, and which returned no rollout "
        "for as long while other workers returned theirs (a cut connection, a request stuck on it), "
        "is silent: its groups are cancelled and dispatched again elsewhere, and it gets one group at a time until "
        "it answers. Unset: 4 x the slowest of the last 64 groups, at least 10 s (none before 8 groups came back). "
        "0: off (only rollout_timeout_s bounds a request).",
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps (unset: no limit).")
    num_train_ranks: int = Field(
        1, ge=1, description="Trainer ranks that each get their share of every step (set from trainer_gpu_ids)."
    )
    broker: BrokerConnection
    output_dir: Path = Field(Path("outputs"), description="Directory for rollout logs and eval results.")
    wandb: WandbLogging
    prometheus: MetricsEndpoint
    log: DaemonLog
    threads: ThreadsConfig = Field(
        default_factory=ThreadsConfig, description="CPU thread budget of the orchestrator and its env workers."
    )
    teacher: TeacherConfig | None = Field(
        None,
        description="Teacher that scores every rollout for online distillation (`[orchestrator.teacher]`; "
        "prime-rl's `[orchestrator.teacher_model]` is an alias); off when absent.",
    )

    @model_validator(mode="before")
    @classmethod
    def _accept_buffer_oversampling(cls, data: Any) -> Any:
        """`oversampling_factor` may also be written under `[orchestrator.buffer]`; it lives here."""
        if isinstance(data, dict) and "teacher_model" in data:
            data = _teacher_from_prime_rl(data)
        if not isinstance(data, dict) or not isinstance(data.get("buffer"), dict):
            return data
        if "oversampling_factor" not in data["buffer"]:
            return data
        buffer = dict(data["buffer"])
        factor = buffer.pop("oversampling_factor")
        if "oversampling_factor" in data and data["oversampling_factor"] != factor:
            raise ValueError(
                f"oversampling_factor is set twice with different values: {data['oversampling_factor']} and "
                f"buffer.oversampling_factor = {factor}; keep one (`oversampling_factor` under [orchestrator])"
            )
        return {**data, "buffer": buffer, "oversampling_factor": factor}

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example:
            multiples = " or ".join(str(m) for m in nearest_multiples(self.batch_size, self.rollouts_per_example))
            divisors = " or ".join(str(d) for d in nearest_divisors(self.batch_size, self.rollouts_per_example))
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by rollouts_per_example "
                f"({self.rollouts_per_example}): use batch_size = {multiples}, "
                f"or rollouts_per_example = {divisors}"
            )
        return self

    @property
    def num_inflight_rollouts(self) -> int:
        """Rollouts kept in flight without `[orchestrator.concurrency]`: `max_inflight`, else 2 x batch_size (what
        the scheduler has always kept; `oversampling_factor` is superseded)."""
        if self.max_inflight is not None:
            return self.max_inflight
        return 2 * self.batch_size

    @property
    def num_examples_per_step(self) -> int:
        """Dataset examples behind one training batch."""
        return self.batch_size // self.rollouts_per_example

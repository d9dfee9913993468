"""Config of an inference daemon (`primerl-infer`, one vLLM engine). Imports neither torch nor vLLM.

Key names and defaults follow prime-rl's inference config (`[inference.model]`, `gpu_memory_utilization`...);
most fields map one to one onto vLLM engine arguments.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from primerl.runtime.addresses import check_advertise_host
from primerl.runtime.config_base import BaseConfig
from primerl.runtime.config_common import BrokerConnection, DaemonLog
from primerl.runtime.cpu_budget import ThreadsConfig

# LoRA ranks that vLLM accepts for `max_lora_rank`.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank_for(rank: int) -> int:
    """The smallest `max_lora_rank` that vLLM accepts and that fits an adapter of this rank."""
    for candidate in VLLM_LORA_RANKS:
        if candidate >= rank:
            return candidate
    return rank


class InferenceModelConfig(BaseConfig):
    """The served model (vLLM engine arguments)."""

    name: str = Field(min_length=1, description="Hugging Face model id or local path.")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="Weights and activations dtype (`auto`: FP16 for FP32/FP16 models, BF16 for BF16 ones)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context length (prompt and output); must be >= seq_len (unset: the model's)."
    )
    enforce_eager: bool = Field(False, description="Run without CUDA graphs or compilation.")
    enable_auto_tool_choice: bool = Field(False, description="Let the model decide when to call tools.")
    tool_call_parser: str | None = Field(None, description="vLLM tool-call parser (`hermes` for Qwen models).")
    reasoning_parser: str | None = Field(None, description="vLLM reasoning parser (`qwen3`, `deepseek_r1`).")

    @model_validator(mode="after")
    def _check(self) -> InferenceModelConfig:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                'enable_auto_tool_choice = true needs a tool_call_parser (e.g. tool_call_parser = "hermes")'
            )
        return self


class ParallelConfig(BaseConfig):
    """How one inference daemon spreads over its GPUs."""

    tp: int = Field(1, ge=1, description="Tensor-parallel size (GPUs per model replica).")
    dp: int = Field(1, ge=1, description="Data-parallel size (model replicas).")


class ServerConfig(BaseConfig):
    """The OpenAI-compatible HTTP server."""

    host: str = Field(
        "127.0.0.1", min_length=1, description="Interface the HTTP server binds (`0.0.0.0` for all interfaces)."
    )
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="Host in the URL this worker registers with the broker, which the orchestrator and its env "
        "workers dial, when it differs from `host` (NAT, a wildcard bind). Unset: `host` when it is a concrete "
        "address; with a wildcard `host`, the address of this machine's interface that routes to the broker "
        "(`broker.address`), else this machine's host name.",
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="HTTP port (0: a free port, found by the orchestrator through the broker, where every inference "
        "worker registers the address it bound).",
    )

    @field_validator("advertise_host")
    @classmethod
    def _check_advertise_host(cls, host: str | None) -> str | None:
        return None if host is None else check_advertise_host(host, "inference.server.advertise_host")


class InferenceConfig(BaseConfig):
    """One inference daemon: a vLLM engine that serves rollouts and applies weight updates in flight, or (role
    teacher) a frozen model that scores the student's rollouts for online distillation."""

    role: Literal["inference", "teacher"] = Field(
        "inference",
        description="`inference`: serves the policy's rollouts and applies the trainer's weight updates in flight. "
        "`teacher`: serves its fixed model (online distillation: the orchestrator asks it for the logprobs of the "
        "student's sampled tokens); registers with the broker as a teacher, never receives weight updates, serves "
        "no LoRA adapters.",
    )
    model: InferenceModelConfig = Field(description="The served model.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (0.6-0.9 typical)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size in bytes; overrides gpu_memory_utilization (set it on CPU)."
    )
    weight_relay_host: str | None = Field(
        None,
        min_length=1,
        description='Take part in relay fan-out of weight updates (`broker.weight_fanout = "chain"`): bind a relay '
        "socket on this address (a free port), which the other inference workers must reach, and forward the "
        "chunks of each update to the next worker of the broker's chain while loading them. Unset: the broker "
        "sends this worker every chunk itself. Off on a CURVE-encrypted wire.",
    )
    engine_stall_timeout_s: float = Field(
        60.0,
        ge=0,
        description="Gray failures: the daemon probes its engine core (a cheap utility call, answered between two "
        "model steps); unanswered this long, the engine counts as stalled: `/health` answers 503, heartbeats say "
        "`serving: false` and the orchestrator sends it no rollouts (its groups in flight go elsewhere) until it "
        "answers again. Keep it above the longest model step. A weight update holding the engine counts only after "
        "4 times the longest of the last 16 updates (at least this; before the first update and at most: 10 times "
        "this); a probe sent before the update came counts as usual. 0: off.",
    )
    enable_lora: bool = Field(False, description="Serve LoRA adapters (on when the trainer trains LoRA).")
    max_lora_rank: int | None = Field(
        None, ge=1, description="Largest adapter rank served (unset: vLLM's default, 16); must be >= lora.rank."
    )
    max_loras: int = Field(
        4, ge=1, description="Adapters resident at once; keep above the versions alive during an update."
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallelism.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server.")
    broker: BrokerConnection
    log: DaemonLog
    threads: ThreadsConfig = Field(
        default_factory=ThreadsConfig,
        description="CPU thread budget: vLLM's OpenMP threads and their CPU binding (`cpus`), the wait policy.",
    )

    @model_validator(mode="after")
    def _check_teacher(self) -> InferenceConfig:
        if self.role == "teacher" and self.enable_lora:
            raise ValueError(
                'role = "teacher" serves a fixed model and no LoRA adapters: set enable_lora = false (a teacher '
                "with an adapter: merge it into the model directory and serve that)"
            )
        return self

"""Config of the trainer daemon (`primerl-trainer`). Imports neither torch nor vLLM.

Key names and defaults follow prime-rl's trainer config (`[trainer.model]`, `[trainer.optim]`, `[trainer.ckpt]`...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from primerl.runtime.config_base import BaseConfig
from primerl.runtime.config_common import BrokerConnection, DaemonLog, MetricsEndpoint, WandbLogging
from primerl.runtime.cpu_budget import ThreadsConfig

DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

TrainDtype = Literal["bfloat16", "float32"]


class ActivationCheckpointConfig(BaseConfig):
    """Activation checkpointing: recompute activations in the backward pass instead of storing them."""

    table_example: ClassVar[str] = "freq = 1  # checkpoint every layer (full activation checkpointing)"

    freq: int = Field(1, ge=1, description="Checkpoint every `freq`-th layer; 1 = every layer (full AC).")


class LoRAConfig(BaseConfig):
    """Train a LoRA adapter instead of all weights (peft)."""

    rank: int = Field(16, ge=1, description="LoRA rank r (16-64 typical).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES),
        min_length=1,
        description="Names of the linear modules that get an adapter.",
    )


class ModelConfig(BaseConfig):
    """The model being trained."""

    name: str = Field(min_length=1, description="Hugging Face model id or local path.")
    optimization_dtype: TrainDtype = Field(
        "float32", description="Precision of the forward and backward passes (`bfloat16` or `float32`)."
    )
    reduce_dtype: TrainDtype = Field(
        "float32", description="Precision of the gradient reduction across ranks (`bfloat16` or `float32`)."
    )
    ac: ActivationCheckpointConfig | None = Field(
        None, description="Activation checkpointing; off when absent. Write `[trainer.model.ac] freq = 1`."
    )
    lora: LoRAConfig | None = Field(
        None,
        description="LoRA training; full fine-tuning when absent. `[trainer.model.experimental.lora]` is an alias.",
    )
    parallel: Literal["ddp", "fsdp2"] | None = Field(
        None,
        description="How ranks share the model: `ddp` replicates it, `fsdp2` shards it (unset: `ddp` with several "
        "ranks, the only layout whose weights are published, checkpointed and exported; one rank needs neither). "
        "`fsdp2` with several ranks is refused at start-up.",
    )
    fsdp_cpu_offload: bool = Field(False, description="Keep sharded parameters and optimizer state in CPU memory.")

    @model_validator(mode="before")
    @classmethod
    def _accept_experimental_lora(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("experimental"), dict):
            return data
        data = dict(data)
        experimental = dict(data.pop("experimental"))
        if "lora" in experimental:
            if "lora" in data:
                raise ValueError(
                    "LoRA is set twice, in `lora` and in `experimental.lora`: keep one (`[trainer.model.lora]`)"
                )
            data["lora"] = experimental.pop("lora")
        if experimental:
            data["experimental"] = experimental  # reported as unknown keys
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.fsdp_cpu_offload and self.parallel != "fsdp2":
            raise ValueError('fsdp_cpu_offload = true needs parallel = "fsdp2"')
        return self


class TokenizerConfig(BaseConfig):
    """The tokenizer used to build training batches."""

    name: str | None = Field(None, description="Tokenizer id or path; defaults to `model.name`.")


class OptimizerConfig(BaseConfig):
    """AdamW."""

    lr: float = Field(1e-6, gt=0, description="Learning rate (1e-6 to 1e-5 for full fine-tuning, higher for LoRA).")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay (0.0 is common for RL).")
    betas1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    betas2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    max_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global norm.")


class SchedulerConfig(BaseConfig):
    """Learning-rate schedule, with linear warm-up."""

    type: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Shape after warm-up: constant, linear decay or cosine decay to `min_lr`."
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from 0 to `optim.lr`.")
    min_lr: float = Field(0.0, ge=0, description="Learning rate at the last step for the decaying schedules.")


class _TauCommon(BaseConfig):
    type: str = Field(description="Loss recipe.")
    teacher_tau: float = Field(
        0.0,
        ge=0,
        description="Weight of on-policy distillation: each token's advantage gets `teacher_tau * "
        "(teacher logprob - student logprob)` added (the reverse KL to the teacher on the student's own samples). "
        "Above 0 it needs a teacher scoring every rollout (`[orchestrator.teacher]`, or `[teacher]` in `primerl rl`)."
        " `teacher_tau = 1` with `adv_tau = 0` is pure on-policy distillation; both above 0 add it to RL.",
    )
    adv_tau: float = Field(
        1.0,
        ge=0,
        description="Weight of the reward advantage in each token's advantage (0: rewards are ignored, "
        "e.g. pure distillation with `teacher_tau > 0`).",
    )

    @model_validator(mode="after")
    def _check_taus(self) -> _TauCommon:
        if self.teacher_tau == 0 and self.adv_tau == 0:
            raise ValueError(
                "adv_tau = 0 and teacher_tau = 0 leave nothing to learn: set adv_tau > 0 (RL), "
                "teacher_tau > 0 (distillation from [orchestrator.teacher]) or both"
            )
        return self


class _LossCommon(_TauCommon):
    max_is_ratio: float = Field(
        2.0, gt=0, description="Token importance ratios (trainer / inference policy) are truncated at this value."
    )


class DefaultLossConfig(_LossCommon):
    """prime-rl's default recipe: mask tokens whose trainer and inference probabilities differ too much, plus a
    squared log-ratio penalty."""

    type: Literal["default"] = Field("default", description="Loss recipe.")
    prob_diff_low: float = Field(
        0.2, ge=0, description="Mask a token when its trainer probability is this much below the inference one."
    )
    prob_diff_high: float = Field(
        0.2, ge=0, description="Mask a token when its trainer probability is this much above the inference one."
    )
    sq_log_ratio_coef: float = Field(
        1e-3, ge=0, description="Coefficient of the squared log-ratio (trainer vs inference) penalty."
    )


class GRPOLossConfig(_LossCommon):
    """PPO-style clipped objective with group advantages (GRPO)."""

    type: Literal["grpo"] = Field("grpo", description="Loss recipe.")
    eps_low: float = Field(0.2, ge=0, description="Ratio clipped below at 1 - eps_low.")
    eps_high: float = Field(0.2, ge=0, description="Ratio clipped above at 1 + eps_high.")


class CISPOLossConfig(_LossCommon):
    """CISPO: clipped importance-sampling weights on the policy gradient of every token (no token is dropped)."""

    type: Literal["cispo"] = Field("cispo", description="Loss recipe.")
    eps_low: float | None = Field(None, ge=0, description="IS weight clipped below at 1 - eps_low (unset: no bound).")
    eps_high: float = Field(0.2, ge=0, description="IS weight clipped above at 1 + eps_high.")


class IPOLossConfig(_TauCommon):
    """prime-rl's IPO (its default RL loss): a symmetric trust region that masks the policy gradient of tokens whose
    trainer probability moved more than `eps` (absolute) from the inference one, the importance-weighted policy
    gradient on the rest, and an optional squared log-ratio penalty (`kl_tau`) on every token."""

    type: Literal["ipo"] = Field("ipo", description="Loss recipe.")
    eps: float = Field(
        0.3,
        ge=0,
        description="Trust region: a token whose |trainer probability - inference probability| is above this gets no "
        "policy gradient (prime-rl's `eps`; older prime-rl wrote `ipo_threshold`).",
    )
    kl_tau: float = Field(
        0.0, ge=0, description="Coefficient of the squared log-ratio (trainer vs inference) penalty (0: off)."
    )

    @model_validator(mode="before")
    @classmethod
    def _accept_ipo_threshold(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ipo_threshold" in data:
            data = dict(data)
            threshold = data.pop("ipo_threshold")
            if "eps" in data and data["eps"] != threshold:
                raise ValueError(
                    f"the IPO trust region is set twice: eps = {data['eps']} and ipo_threshold = {threshold}; "
                    "keep `eps` (prime-rl renamed ipo_threshold to eps)"
                )
            data["eps"] = threshold
        return data


class IcePopLossConfig(_TauCommon):
    """IcePop (prime-rl's opt-in loss): the importance-weighted policy gradient of tokens whose importance ratio
    (trainer / inference probability) lies in [`ratio_low`, `ratio_high`]; tokens outside get none (masked, not
    clipped). No KL term."""

    type: Literal["icepop"] = Field("icepop", description="Loss recipe.")
    ratio_low: float = Field(0.2, gt=0, description="Tokens whose importance ratio is below this are masked.")
    ratio_high: float = Field(5.0, gt=0, description="Tokens whose importance ratio is above this are masked.")

    @model_validator(mode="after")
    def _check_band(self) -> IcePopLossConfig:
        if self.ratio_low >= self.ratio_high:
            raise ValueError(
                f"loss.ratio_low ({self.ratio_low}) must be below loss.ratio_high ({self.ratio_high}), "
                "e.g. ratio_low = 0.2, ratio_high = 5.0"
            )
        return self


LossConfig = Annotated[
    Union[DefaultLossConfig, GRPOLossConfig, CISPOLossConfig, IPOLossConfig, IcePopLossConfig],
    Field(discriminator="type"),
]


class KLConfig(BaseConfig):
    """KL penalty against the reference (initial) policy; off when absent."""

    beta: float = Field(0.001, ge=0, description="KL coefficient (the starting value when `target_kl` is set).")
    target_kl: float | None = Field(None, gt=0, description="Adapt beta after each step to keep the KL near this.")


class CheckpointConfig(BaseConfig):
    """Checkpoints of model, optimizer and progress; no checkpoints when absent."""

    interval: int | None = Field(None, ge=1, description="Save every `interval` steps (unset: only the last step).")
    keep_last: int | None = Field(None, ge=1, description="Keep only the newest `keep_last` checkpoints (unset: all).")
    keep_interval: int | None = Field(
        None, ge=1, description="Also keep every checkpoint whose step is a multiple of this, whatever `keep_last`."
    )
    resume_step: int | None = Field(None, ge=1, description="Resume from the checkpoint of this step.")
    dir: Path | None = Field(None, description="Checkpoint directory; defaults to `{output_dir}/checkpoints`.")

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if self.interval and self.keep_interval and self.keep_interval % self.interval:
            raise ValueError(
                f"keep_interval ({self.keep_interval}) must be a multiple of interval ({self.interval}), "
                f"otherwise no saved step is ever kept by it; e.g. keep_interval = "
                f"{max(self.interval, self.keep_interval // self.interval * self.interval)}"
            )
        return self


class WeightBroadcastConfig(BaseConfig):
    """How new policies reach the inference workers."""

    type: Literal["full", "lora", "delta"] | None = Field(
        None,
        description="`full` weights, the `lora` adapter only, or a `delta` to the previous version "
        "(default: `lora` when LoRA is on, else `full`).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype of the published `full` and `delta` weights: the dtype inference serves, cast from the "
        "trainer's own (e.g. FP32 master weights). `auto`: the model's dtype as trained; `primerl rl` sets the "
        "inference workers' `dtype` here when that one is explicit. 16-bit weights are half the bytes of FP32, and "
        "most of their elements keep their bits from one step to the next (`delta` then sends only those that "
        "changed). LoRA adapters keep their training dtype.",
    )
    stream: bool | Literal["auto"] = Field(
        "auto",
        description="Send a `full` update larger than one chunk while it is still being written: the first chunks "
        "leave while later tensors are cast or copied from the GPU (asynchronous copies into pinned host memory), "
        "and the payload's digest follows in the last chunk. `auto`: when the trainer's weights are on a GPU (on "
        "CPU the copies would compete for the cores the broker and inference use on a small machine; measured in "
        "docs/weight-updates.md). The broker and inference workers must read that digest (`Chunk.payload_digest`: "
        "those of this release on); `false` for older ones: the whole payload is written and hashed before it is "
        "sent, as before.",
    )
    transport: Literal["auto", "socket"] = Field(
        "auto",
        description="How an update's bytes reach the broker and the inference workers. `auto`: where the broker runs "
        "on the trainer's host, the trainer writes each update once into shared memory (`/dev/shm`) and the broker "
        "hands the workers on that host a descriptor of it, not the bytes; workers on other hosts, and every worker "
        "when the broker is elsewhere, get the bytes over the socket. `socket`: always the bytes over the socket. An "
        "encrypted (CURVE) wire always uses the socket.",
    )


class TrainerConfig(BaseConfig):
    """One trainer (1..N ranks started by torchrun)."""

    model: ModelConfig = Field(description="The model being trained.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Learning-rate schedule.")
    loss: LossConfig = Field(default_factory=DefaultLossConfig, description="RL loss, chosen by `type`.")
    kl: KLConfig | None = Field(None, description="KL penalty to the reference policy; off when absent.")
    ckpt: CheckpointConfig | None = Field(None, description="Checkpointing; off when absent.")
    weight_broadcast: WeightBroadcastConfig = Field(
        default_factory=WeightBroadcastConfig, description="How new policies are published."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Samples per micro-batch per rank (unset: samples are packed up to `seq_len` tokens)."
    )
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step per rank (unset: all that the step's batch holds)."
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (unset: no limit).")
    data_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Longest wait for one step's micro-batches from the broker before the trainer gives up.",
    )
    seq_len: int = Field(2048, ge=1, description="Tokens per packed training sequence.")
    broker: BrokerConnection
    output_dir: Path = Field(Path("outputs"), description="Directory for weights, checkpoints and logs.")
    wandb: WandbLogging
    prometheus: MetricsEndpoint
    log: DaemonLog
    threads: ThreadsConfig = Field(
        default_factory=ThreadsConfig, description="CPU thread budget of each rank (`primerl.runtime.cpu_budget`)."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_loss_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("loss"), dict) and "type" not in data["loss"]:
            data = {**data, "loss": {"type": "default", **data["loss"]}}
        return data

    @model_validator(mode="after")
    def _resolve(self) -> TrainerConfig:
        if self.weight_broadcast.type == "lora" and self.model.lora is None:
            raise ValueError(
                'weight_broadcast.type = "lora" needs LoRA training: add a [trainer.model.lora] table, '
                'or use weight_broadcast.type = "full"'
            )
        if self.tokenizer.name is None:
            self.tokenizer.name = self.model.name
        if self.weight_broadcast.type is None:
            self.weight_broadcast.type = "lora" if self.model.lora is not None else "full"
        return self

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go: `ckpt.dir`, else `{output_dir}/checkpoints`."""
        if self.ckpt is not None and self.ckpt.dir is not None:
            return self.ckpt.dir
        return self.output_dir / "checkpoints"


class SFTDataConfig(BaseConfig):
    """The SFT dataset: a JSONL file of chat samples."""

    path: Path = Field(
        description='JSONL file; each line `{"messages": [...]}` or `{"prompt": [...], "completion": [...]}`.'
    )
    batch_size: int = Field(8, ge=1, description="Samples per optimizer step (over all ranks).")
    epochs: int = Field(1, ge=1, description="Passes over the dataset (when `max_steps` is unset).")
    seed: int = Field(
        0,
        description="Seed of the sample order (shuffled each epoch) and of the run's random streams (Python, "
        "NumPy, torch: LoRA initialisation, dropout): the same seed, data and config give the same weights.",
    )


class SFTThreadsConfig(ThreadsConfig):
    """CPU thread budget of `primerl sft`. Unlike the daemons it is a batch job that normally has the machine to
    itself, so its idle OpenMP threads spin by default: on 2 idle cores the demo's SFT step took 0.115 s with 2
    spinning threads, 0.155 s with one thread and 0.223 s with 2 sleeping ones."""

    wait_policy: Literal["passive", "active"] = Field(
        "active",
        description="OpenMP wait policy: `active` (default here) idle threads spin, fastest when the job "
        "has the cores to itself; `passive` they sleep at once (set it when other work shares the cores).",
    )


class SFTConfig(TrainerConfig):
    """`primerl sft`: supervised fine-tuning on chat samples (masked cross-entropy on assistant tokens)."""

    data: SFTDataConfig = Field(description="The dataset.")
    threads: SFTThreadsConfig = Field(
        default_factory=SFTThreadsConfig, description="CPU thread budget (`primerl.runtime.cpu_budget`)."
    )

"""What the RL trainer (``primerl.trainer.runner``) and SFT (``primerl.trainer.sft_runner``) set up the same way:
the model (wrapped for several ranks), its optimizer, learning-rate schedule and step function, the checkpoint a
run resumes from and the ones it saves, and the warning for config options that have no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from primerl.configs.trainer import KLConfig, TrainerConfig
from primerl.runtime.log_setup import get_logger
from primerl.trainer.distributed import DistInfo, barrier, unwrap_model, wrap_model

if TYPE_CHECKING:
    import torch

    from primerl.trainer.train_step import Objective, TrainStep

__all__ = ["Training", "build_training", "resume_from_checkpoint", "save_training_checkpoint", "warn_unused_options"]

log = get_logger("primerl.trainer")


@dataclass(frozen=True)
class Training:
    """The trained model (DDP-wrapped with several ranks), its optimizer, scheduler and step function."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step_fn: TrainStep


def build_training(
    config: TrainerConfig,
    parallel: str,
    dist_info: DistInfo,
    max_steps: int,
    objective: Objective,
    *,
    kl_config: KLConfig | None = None,
) -> Training:
    """Load ``config.model`` and build what trains it for ``max_steps`` steps with ``objective``; with
    ``kl_config``, a frozen reference copy of the model (no LoRA, no activation checkpointing) for the KL penalty."""
    from primerl.trainer.model import load_model
    from primerl.trainer.optim import build_optimizer, build_scheduler
    from primerl.trainer.train_step import TrainStep

    model = wrap_model(load_model(config.model), parallel, dist_info)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps)
    reference = None
    if kl_config is not None:
        reference = load_model(config.model.model_copy(update={"lora": None, "ac": None})).eval()
        reference.requires_grad_(False)
    step_fn = TrainStep(
        model,
        optimizer,
        scheduler,
        objective,
        dist_info,
        max_grad_norm=config.optim.max_norm,
        reference_model=reference,
        kl_config=kl_config,
    )
    return Training(model, optimizer, scheduler, step_fn)


def resume_from_checkpoint(config: TrainerConfig, training: Training, rank: int) -> dict[str, Any] | None:
    """With ``[ckpt]``: restore ``training`` from the checkpoint of ``ckpt.resume_step`` (default: the newest one)
    and return its ``extra_state``; None when there is none to resume from."""
    from primerl.trainer.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = config.ckpt
    if ckpt is None:
        return None
    resume = ckpt.resume_step if ckpt.resume_step is not None else latest_checkpoint(config.checkpoint_dir)
    if resume is None:
        return None
    return load_checkpoint(
        config.checkpoint_dir,
        resume,
        model=unwrap_model(training.model),
        optimizer=training.optimizer,
        scheduler=training.scheduler,
        rank=rank,
    )


def save_training_checkpoint(
    config: TrainerConfig, training: Training, step: int, extra_state: dict[str, Any], dist_info: DistInfo
) -> None:
    """Every rank: the checkpoint of ``step`` (``primerl.trainer.checkpoint.save_checkpoint``) of ``training``."""
    from primerl.trainer.checkpoint import save_checkpoint

    save_checkpoint(
        config.checkpoint_dir,
        step,
        model=unwrap_model(training.model),
        optimizer=training.optimizer,
        scheduler=training.scheduler,
        extra_state=extra_state,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        barrier=lambda: barrier(dist_info),
    )


def warn_unused_options(config: TrainerConfig) -> None:
    """Options that exist for config compatibility but change nothing in this trainer: say so once."""
    unused = []
    if config.micro_batch_size is not None:
        unused.append("micro_batch_size (the orchestrator packs micro-batches up to seq_len)")
    if config.gradient_accumulation_steps is not None:
        unused.append("gradient_accumulation_steps (every micro-batch of a step is accumulated into one update)")
    if config.model.reduce_dtype != "float32":
        unused.append("model.reduce_dtype (gradients are reduced in the parameters' dtype)")
    if config.model.fsdp_cpu_offload:
        unused.append("model.fsdp_cpu_offload (no CPU offloading is built)")
    for option in unused:
        log.warning("config option has no effect", option=option)

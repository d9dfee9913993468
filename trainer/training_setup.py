"""What the RL trainer (``primerl.trainer.runner``) and SFT (``primerl.trainer.sft_runner``) set up the same way:
the model (wrapped for several ranks), its optimizer, learning-rate schedule and step function, the checkpoint a
run resumes from (and the refusal to train a step the broker already committed) and the ones it saves, and the
warning for config options that have no effect.
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
    return load_checkpoint(config.checkpoint_dir, resume, rank=rank, **_checkpointed(training))


def save_training_checkpoint(
    config: TrainerConfig, training: Training, step: int, extra_state: dict[str, Any], dist_info: DistInfo
) -> None:
    """Every rank: the checkpoint of ``step`` (``primerl.trainer.checkpoint.save_checkpoint``) of ``training``."""
    from primerl.trainer.checkpoint import save_checkpoint

    save_checkpoint(
        config.checkpoint_dir,
        step,
        extra_state=extra_state,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        barrier=lambda: barrier(dist_info),
        **_checkpointed(training),
    )


def _checkpointed(training: Training) -> dict[str, Any]:
    """What a checkpoint of ``training`` holds, as ``save_checkpoint``'s and ``load_checkpoint``'s arguments."""
    return {"model": unwrap_model(training.model), "optimizer": training.optimizer, "scheduler": training.scheduler}


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


class CannotResume(ValueError):
    """This trainer would train a step the broker already committed (a config or run-directory problem: exit 2)."""


def refuse_going_back(config: TrainerConfig, start_step: int, committed: int) -> None:
    """Before registering: refuse (``CannotResume``, exit 2) to train a step the broker has already committed
    (``committed``: the last one). Its batches are released, and training it again would train a step twice. This is
    a trainer restarted without ``[trainer.ckpt]`` (nothing to resume from), or one whose newer checkpoints were
    removed."""
    if start_step > committed:
        return
    if config.ckpt is None:
        raise CannotResume(
            f"the broker has committed steps 1-{committed} of this run and this trainer would start again at "
            f"step {start_step}: without [trainer.ckpt] there is no checkpoint to resume from, so a restarted "
            "trainer cannot continue the run. Start a new run (a fresh output_dir, so a fresh broker spool), "
            "or add [trainer.ckpt] to make runs resumable"
        )
    resumed = f"no checkpoint under {config.checkpoint_dir}"
    if start_step > 1:
        resumed = f"it resumes from the checkpoint of step {start_step - 1}"
    raise CannotResume(
        f"the broker has committed steps through {committed} of this run, but this trainer would start at "
        f"step {start_step} ({resumed}): the checkpoint of step {committed} or later is missing. Restore it (or "
        "set ckpt.dir to where it is; drop an older ckpt.resume_step), or start a new run"
    )

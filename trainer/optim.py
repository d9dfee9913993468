"""AdamW, the learning-rate schedule and gradient clipping of the trainer.

Schedule, for optimizer step ``s`` = 1, 2, ... (the scheduler has been stepped ``s - 1`` times when step ``s``
runs, so ``scheduler.step()`` goes right after ``optimizer.step()``), with ``W = warmup_steps``, ``N = max_steps``:

- warm-up, ``s <= W``: ``lr * s / W`` (a straight line from 0, reaching ``lr`` at step W; no step runs at 0);
- then ``constant``: ``lr``; ``linear``: ``min_lr + (lr - min_lr) * (1 - p)``; ``cosine``:
  ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``, where ``p = (s - W) / (N - W)``, so step N runs at
  ``min_lr`` (and any step past N too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from primerl.configs.trainer import OptimizerConfig, SchedulerConfig

if TYPE_CHECKING:
    import torch

__all__ = ["build_optimizer", "build_scheduler", "clip_grad_norm", "lr_factor", "no_weight_decay"]


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases and norm weights are not decayed: every parameter with fewer than 2 dimensions (RMSNorm/LayerNorm
    weights and all biases are 1-D; weight matrices and embeddings are 2-D)."""
    return param.ndim < 2 or name.endswith(".bias")


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model`` only, in two groups: ``decay`` (weight decay of the
    config) and ``no_decay`` (biases and norms, weight decay 0). Empty groups are left out."""
    import torch

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if no_weight_decay(name, param) else decay).append(param)
    if not decay and not no_decay:
        raise ValueError(f"{type(model).__name__} has no trainable parameter: nothing to optimize")
    groups = [
        {"params": params, "weight_decay": weight_decay, "name": group_name}
        for group_name, params, weight_decay in (("decay", decay, config.weight_decay), ("no_decay", no_decay, 0.0))
        if params
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.betas1, config.betas2))


def lr_factor(config: SchedulerConfig, max_steps: int | None) -> Callable[[int], float]:
    """The multiplier of ``lr`` as a function of the number of scheduler steps taken so far (LambdaLR's input).
    See the module docstring for the schedule; raises ValueError for a schedule that needs ``max_steps``."""
    warmup = config.warmup_steps
    kind = config.type
    if kind != "constant":
        if max_steps is None:
            raise ValueError(
                f'scheduler.type = "{kind}" decays the learning rate until max_steps, but max_steps is not set: '
                'set trainer max_steps, or use scheduler.type = "constant"'
            )
        if max_steps <= warmup:
            raise ValueError(
                f"scheduler.warmup_steps ({warmup}) must be below max_steps ({max_steps}) for a {kind} decay: "
                f"lower warmup_steps or raise max_steps"
            )

    def factor(num_steps_taken: int, *, lr: float = 1.0, min_lr: float = 0.0) -> float:
        step = num_steps_taken + 1
        if step <= warmup:
            return step / warmup
        if kind == "constant":
            return 1.0
        assert max_steps is not None
        progress = min(1.0, (step - warmup) / (max_steps - warmup))
        shape = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr / lr + (1.0 - min_lr / lr) * shape

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: SchedulerConfig, max_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR following the module docstring's schedule; ``min_lr`` is absolute (the same for every group).
    Call ``scheduler.step()`` once after each ``optimizer.step()``."""
    import torch

    shape = lr_factor(config, max_steps)
    lambdas = []
    for group in optimizer.param_groups:
        lr = group.get("initial_lr", group["lr"])
        if config.min_lr > lr and config.type != "constant":
            raise ValueError(f"scheduler.min_lr ({config.min_lr}) is above optim.lr ({lr}): lower min_lr")
        lambdas.append(lambda n, lr=lr: shape(n, lr=lr, min_lr=config.min_lr))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients of the trainable parameters of ``model`` to a global L2 norm of ``max_norm``; returns
    the norm before clipping (``inf``/``nan`` when a gradient is not finite: the gradients are then garbage
    and the caller should skip the step). Parameters without a gradient are ignored."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the norm over all shards
        norm = norm.full_tensor()
    return float(norm)

"""One optimizer step over one step's micro-batches: the compute loop of the trainer, with no sockets.

Every rank calls ``step`` with its own micro-batches. Losses are sums over a rank's tokens divided by the
step's loss-token count over ALL ranks (``losses.py``); DDP and FSDP average gradients over ranks, so each
rank scales its loss by the world size before ``backward``: the summed gradient is then the token mean of
the whole step, identical for 1 or N ranks. Ranks with fewer micro-batches than the others run zero-weight
passes so that every collective of the backward is matched.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from primerl.configs.trainer import KLConfig
from primerl.trainer.batch import MicroBatch, packed_token_logprobs, router_aux_term
from primerl.trainer.distributed import DistInfo, all_reduce_sum
from primerl.trainer.losses import AdaptiveKLController, LossOutput, kl_penalty, rl_loss, sft_loss

# objective(batch, logprobs, num_loss_tokens) -> LossOutput
Objective = Callable[[MicroBatch, torch.Tensor, int], LossOutput]


@dataclass
class StepStats:
    step: int
    loss: float
    num_loss_tokens: int
    grad_norm: float
    learning_rate: float
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase: forward, backward, optimizer...

    def as_metrics(self, prefix: str = "train") -> dict[str, float]:
        out = {
            f"{prefix}/loss": self.loss,
            f"{prefix}/grad_norm": self.grad_norm,
            f"{prefix}/learning_rate": self.learning_rate,
            f"{prefix}/num_loss_tokens": float(self.num_loss_tokens),
        }
        out.update({f"{prefix}/{name}": value for name, value in self.metrics.items()})
        return out


class TrainStep:
    """Forward, loss, backward over micro-batches, then clip, optimizer and scheduler step."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        objective: Objective,
        dist_info: DistInfo,
        *,
        max_grad_norm: float,
        reference_model: torch.nn.Module | None = None,
        kl_config: KLConfig | None = None,
    ):
        if (reference_model is None) != (kl_config is None):
            raise ValueError("a KL penalty needs both the frozen reference model and its config")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.objective = objective
        self.dist = dist_info
        self.max_grad_norm = max_grad_norm
        self.reference_model = reference_model
        self.kl_config = kl_config
        self.kl_controller = AdaptiveKLController(kl_config) if kl_config is not None else None

    def step(
        self, step: int, micro_batches: Sequence[MicroBatch], before_update: Callable[[], None] | None = None
    ) -> StepStats:
        """One optimizer step. ``before_update`` runs after the last backward and before the parameters change
        (the runner waits there until the previous step's publish and checkpoint have read the weights).
        ``StepStats.timings``: ``forward_s`` (forward, logprobs, loss), ``backward_s``, ``update_wait_s`` (in
        ``before_update``), ``optimizer_s`` (clip, optimizer and scheduler step, zero_grad)."""
        self.model.train()
        forward_s = backward_s = 0.0
        # Every rank reaches the same decisions from the same reduced numbers: none raises alone.
        num_loss_tokens = int(all_reduce_sum(sum(b.num_loss_tokens for b in micro_batches), self.dist))
        num_passes = all_reduce_max(len(micro_batches), self.dist)
        fewest_batches = -all_reduce_max(-len(micro_batches), self.dist)
        if num_loss_tokens == 0:
            raise ValueError(
                f"step {step} has no loss tokens on any rank: nothing to learn from (all rollouts failed?)"
            )
        if fewest_batches == 0:
            raise ValueError(
                f"step {step}: a rank got no micro-batches while others did; the packer must give every rank one"
            )
        totals: dict[str, float] = {}
        loss_sum = 0.0
        entropy_sum = 0.0
        for index in range(num_passes):
            padding = index >= len(micro_batches)  # a pass that only matches the other ranks' collectives
            batch = micro_batches[min(index, len(micro_batches) - 1)]
            with self._no_sync(last=index == num_passes - 1):
                started_s = time.perf_counter()
                router_aux: dict = {}  # filled for a mixture-of-experts model (batch.router_aux_term)
                logprobs, entropy = packed_token_logprobs(self.model, batch, router_aux=router_aux)
                out = self.objective(batch, logprobs, num_loss_tokens)
                loss = out.loss
                if router_aux:
                    aux = router_aux_term(router_aux, batch.num_loss_tokens, num_loss_tokens)
                    loss = loss + aux.loss
                    out.metrics.update(aux.metrics)
                if self.reference_model is not None and not padding:
                    kl = self._kl(batch, logprobs, num_loss_tokens)
                    loss = loss + kl.loss
                    out.metrics.update(kl.metrics)
                scale = 0.0 if padding else float(self.dist.world_size)
                forward_done_s = time.perf_counter()
                (loss * scale).backward()
                forward_s += forward_done_s - started_s
                backward_s += time.perf_counter() - forward_done_s
            if padding:
                continue
            loss_sum += float(loss.detach())
            if entropy is not None:
                entropy_sum += float(entropy[batch.loss_mask].sum()) / num_loss_tokens
            for name, value in out.metrics.items():
                totals[name] = totals.get(name, 0.0) + value
        grad_norm, learning_rate, update_wait_s, optimizer_s = self._update(step, before_update)
        timings = {
            "forward_s": forward_s,
            "backward_s": backward_s,
            "update_wait_s": update_wait_s,
            "optimizer_s": optimizer_s,
        }
        totals["entropy"] = entropy_sum
        summed = {name: all_reduce_sum(value, self.dist) for name, value in totals.items() if name != "kl_beta"}
        if self.kl_controller is not None and "reference_kl" in summed:
            summed["kl_beta"] = self.kl_controller.update(summed["reference_kl"])
        return StepStats(
            step=step,
            loss=all_reduce_sum(loss_sum, self.dist),
            num_loss_tokens=num_loss_tokens,
            grad_norm=grad_norm,
            learning_rate=learning_rate,
            metrics=summed,
            timings=timings,
        )

    def _update(self, step: int, before_update: Callable[[], None] | None) -> tuple[float, float, float, float]:
        """``before_update``, then clip, optimizer and scheduler step: (grad norm, learning rate, seconds waited in
        ``before_update``, seconds of the update). A non-finite gradient norm skips the step (FloatingPointError)."""
        wait_started_s = time.perf_counter()
        if before_update is not None:
            before_update()
        update_started_s = time.perf_counter()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"step {step}: gradient norm is {grad_norm}; the step was skipped")
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, learning_rate, update_started_s - wait_started_s, time.perf_counter() - update_started_s

    def _kl(self, batch: MicroBatch, logprobs: torch.Tensor, num_loss_tokens: int) -> LossOutput:
        with torch.no_grad():
            reference_logprobs, _ = packed_token_logprobs(self.reference_model, batch, with_entropy=False)
        return kl_penalty(
            self.kl_config, self.kl_controller.beta, logprobs, reference_logprobs, batch.loss_mask, num_loss_tokens
        )

    def _no_sync(self, *, last: bool):
        """DDP: reduce gradients only in the last backward of the step (FSDP2 and 1 rank: no-op)."""
        no_sync = getattr(self.model, "no_sync", None)
        if last or no_sync is None:
            return contextlib.nullcontext()
        return no_sync()


def all_reduce_max(value: int, dist_info: DistInfo) -> int:
    if not dist_info.enabled:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def rl_objective(loss_config) -> Objective:
    """The RL loss of ``loss_config``; with ``teacher_tau > 0`` it adds on-policy distillation (``losses.py``)."""

    def objective(batch: MicroBatch, logprobs: torch.Tensor, num_loss_tokens: int) -> LossOutput:
        return rl_loss(
            loss_config,
            logprobs,
            batch.inference_logprobs,
            batch.advantages,
            batch.loss_mask,
            num_loss_tokens,
            teacher_logprobs=batch.teacher_logprobs,
        )

    return objective


def sft_objective(batch: MicroBatch, logprobs: torch.Tensor, num_loss_tokens: int) -> LossOutput:
    return sft_loss(logprobs, batch.loss_mask, num_loss_tokens)


def distillation_objective(loss_config) -> Objective:
    """Pure on-policy distillation with the recipe of ``loss_config``: rewards ignored (``adv_tau = 0``),
    ``teacher_tau`` as set (1 when unset). Every micro-batch needs ``teacher_logprobs``."""
    pure = loss_config.model_copy(update={"adv_tau": 0.0, "teacher_tau": loss_config.teacher_tau or 1.0})
    return rl_objective(pure)

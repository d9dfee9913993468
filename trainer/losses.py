"""Token-level losses of the trainer: RL (default recipe, GRPO, CISPO, IPO, IcePop), KL penalty, SFT and distillation.

Every loss here works on packed 1-D token tensors of one micro-batch (what the broker delivers) and returns
the SUM over its loss tokens divided by ``num_loss_tokens``: the number of loss tokens of the whole step
across all ranks and micro-batches. Summing the returned losses over micro-batches (and over ranks) gives
the token mean of the step, whatever the packing, so 1 rank and N ranks compute the same number.

Notation per token: ``logprobs`` (trainer, differentiable), ``inference_logprobs`` (what the inference
worker reported when it sampled the token), ``log_ratio = logprobs - inference_logprobs`` and
``ratio = exp(log_ratio)``: the importance ratio between the policy being trained and the one that
generated the token. Gradients flow only through ``logprobs``.

Metrics (detached floats, token sums divided by the same ``num_loss_tokens`` so they add up across
micro-batches): ``kl_divergence`` (k3 estimate of KL(inference || trainer) on the sampled tokens: how far the
policy being trained has moved from the one that sampled them), ``reference_kl`` (the KL penalty's k3 KL to
the frozen reference policy, with ``[trainer.kl]``),
``is_truncated`` (fraction of tokens whose ratio was truncated at ``max_is_ratio``; the loss types that have it),
``masked`` (fraction masked by the default recipe's and IPO's probability-difference tests, or outside IcePop's
ratio band), ``clipped`` (GRPO/CISPO ratio clipping),
``teacher_kl`` (with teacher logprobs: the token mean of ``logprobs - teacher_logprobs``, the sampled-token
estimate of the reverse KL(student || teacher); falls as the student takes on the teacher's distribution).

On-policy distillation (``teacher_tau`` / ``adv_tau`` of every RL loss type, like prime-rl's): the advantage
each RL loss uses per token is ``adv_tau * advantage + teacher_tau * (teacher_logprob - logprob)``, detached.
The second term is the negative per-token reverse KL to the teacher on the student's own samples, so the
importance weight, masking and clipping of the loss type apply to it exactly as to the reward advantage;
``teacher_tau = 1, adv_tau = 0`` is pure on-policy distillation, both above 0 add it to RL.

prime-rl's losses, per loss token with advantage A (``docs/losses-and-concurrency.md``):

- IPO (``type = "ipo"``; eps 0.3, kl_tau 0): ``-keep * A * ratio + kl_tau * log_ratio**2``, ``keep`` the tokens
  with ``|p_trainer - p_inference| <= eps``;
- IcePop (``type = "icepop"``; ratio_low 0.2, ratio_high 5.0): ``-keep * A * ratio``, ``keep`` the tokens with
  ``ratio_low <= ratio <= ratio_high`` (tested in log space).

Their ratio is differentiable (its gradient is ``ratio * grad logprob``) and is replaced by 0 on masked tokens
before the exponential, so a rejected extreme ratio cannot make ``0 * inf = NaN``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from primerl.configs.trainer import (
    CISPOLossConfig,
    DefaultLossConfig,
    GRPOLossConfig,
    IcePopLossConfig,
    IPOLossConfig,
    KLConfig,
)

RLLossConfig = DefaultLossConfig | GRPOLossConfig | CISPOLossConfig | IPOLossConfig | IcePopLossConfig


@dataclass
class LossOutput:
    """``loss`` is differentiable; ``metrics`` are detached token sums / num_loss_tokens (see module doc)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probability of each token given the ones before it, for one packed sequence.

    ``logits`` [n, vocab] from the model on ``input_ids`` [n]; position t's logits predict token t + 1, so
    entry t of the result is the logprob of ``input_ids[t]`` (entry 0, which has no context, is 0 and must
    be masked). ``temperatures`` [n]: the sampling temperature of each token; logits are divided by it so
    the logprobs are those of the distribution the token was sampled from (what vLLM reports as
    processed logprobs).
    """
    if logits.dim() != 2 or input_ids.dim() != 1 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} do not match")
    scaled = at_least_float32(logits[:-1])
    if temperatures is not None:
        scaled = scaled / temperatures[1:].to(scaled.dtype).clamp_min(1e-6).unsqueeze(-1)
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(1), picked])


def token_entropy(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the predicted distribution for each token (aligned like ``token_logprobs``), detached."""
    with torch.no_grad():
        scaled = at_least_float32(logits[:-1])
        if temperatures is not None:
            scaled = scaled / temperatures[1:].to(scaled.dtype).clamp_min(1e-6).unsqueeze(-1)
        log_p = torch.log_softmax(scaled, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return torch.cat([entropy.new_zeros(1), entropy])


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are upcast: log-softmax over a vocabulary needs float32 at least."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _check_shapes(*tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"token tensors must be 1-D and of equal length, got {sorted(shapes)}")


def _mask_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def rl_loss(
    config: RLLossConfig,
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    num_loss_tokens: int,
    teacher_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The policy-gradient loss selected by ``config.type``; see the module docstring for conventions.

    ``teacher_logprobs`` (the teacher's logprob of each sampled token, as the orchestrator attached it) turn
    on the distillation term when ``config.teacher_tau > 0`` (required then) and the ``teacher_kl`` metric.
    """
    _check_shapes(logprobs, inference_logprobs, advantages, loss_mask)
    if num_loss_tokens < 1:
        raise ValueError(f"num_loss_tokens must be >= 1, got {num_loss_tokens}")
    mask = loss_mask.bool()
    inference_logprobs = inference_logprobs.to(logprobs.dtype)
    metrics: dict[str, float] = {}
    advantages = config.adv_tau * advantages.to(logprobs.dtype)
    if teacher_logprobs is not None:
        _check_shapes(logprobs, teacher_logprobs)
        teacher_advantage = teacher_advantages(logprobs, teacher_logprobs)
        metrics["teacher_kl"] = float(_mask_sum(-teacher_advantage, mask)) / num_loss_tokens
        if config.teacher_tau > 0:
            advantages = advantages + config.teacher_tau * teacher_advantage
    elif config.teacher_tau > 0:
        raise ValueError(
            f"loss.teacher_tau = {config.teacher_tau} needs the teacher's logprobs in every micro-batch, and this "
            "one has none: give the orchestrator a teacher ([orchestrator.teacher], or a [teacher] table in "
            "`primerl rl`) or set [trainer.loss] teacher_tau = 0"
        )
    log_ratio = logprobs - inference_logprobs
    if isinstance(config, (IPOLossConfig, IcePopLossConfig)):
        per_token, masked = _masked_ratio_loss(config, logprobs, inference_logprobs, log_ratio, advantages, mask)
        metrics["masked"] = float(_mask_sum(masked.float(), mask)) / num_loss_tokens
        loss = _mask_sum(per_token, mask) / num_loss_tokens
        metrics["kl_divergence"] = (
            float(_mask_sum(k3_kl(logprobs.detach(), inference_logprobs), mask)) / num_loss_tokens
        )
        return LossOutput(loss, metrics)
    ratio = torch.exp(log_ratio)
    detached_ratio = ratio.detach()
    truncated = detached_ratio > config.max_is_ratio
    is_weight = detached_ratio.clamp(max=config.max_is_ratio)

    if isinstance(config, DefaultLossConfig):
        # Policy gradient with truncated importance weights, on tokens where the two policies still agree:
        # a token whose probability the trainer already raised (A > 0) or lowered (A < 0) by more than the
        # threshold against the inference policy is masked, so no update pushes further out of the region
        # where the inference samples are informative.
        prob_diff = (logprobs.exp() - inference_logprobs.exp()).detach()
        diverged = torch.where(advantages > 0, prob_diff > config.prob_diff_high, prob_diff < -config.prob_diff_low)
        keep = mask & ~diverged
        per_token = -is_weight * advantages * logprobs
        per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
        per_token = per_token + config.sq_log_ratio_coef * torch.where(mask, log_ratio**2, torch.zeros_like(log_ratio))
        metrics["masked"] = float(_mask_sum(diverged.float(), mask)) / num_loss_tokens
    elif isinstance(config, GRPOLossConfig):
        capped = torch.minimum(ratio, torch.full_like(ratio, config.max_is_ratio))
        clipped_ratio = capped.clamp(1 - config.eps_low, 1 + config.eps_high)
        per_token = -torch.minimum(capped * advantages, clipped_ratio * advantages)
        is_clipped = (detached_ratio < 1 - config.eps_low) | (detached_ratio > 1 + config.eps_high)
        metrics["clipped"] = float(_mask_sum(is_clipped.float(), mask)) / num_loss_tokens
    elif isinstance(config, CISPOLossConfig):
        low = 0.0 if config.eps_low is None else 1 - config.eps_low
        weight = is_weight.clamp(min=low, max=1 + config.eps_high)
        per_token = -weight * advantages * logprobs
        metrics["clipped"] = float(_mask_sum((weight != is_weight).float(), mask)) / num_loss_tokens
    else:
        raise ValueError(f"unknown loss type {getattr(config, 'type', config)!r}")

    loss = _mask_sum(per_token, mask) / num_loss_tokens
    metrics["is_truncated"] = float(_mask_sum(truncated.float(), mask)) / num_loss_tokens
    metrics["kl_divergence"] = float(_mask_sum(k3_kl(logprobs.detach(), inference_logprobs), mask)) / num_loss_tokens
    return LossOutput(loss, metrics)


def _masked_ratio_loss(
    config: IPOLossConfig | IcePopLossConfig,
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and masked tokens of IPO and IcePop (module docstring): the policy gradient through the
    differentiable importance ratio on the tokens kept, none on the others."""
    with torch.no_grad():
        if isinstance(config, IPOLossConfig):
            masked = (logprobs.exp() - inference_logprobs.exp()).abs() > config.eps
        else:  # inclusive band, in log space: no overflow for extreme ratios
            masked = (log_ratio < math.log(config.ratio_low)) | (log_ratio > math.log(config.ratio_high))
    keep = mask & ~masked
    lowest = torch.finfo(log_ratio.dtype).min
    kept_ratio = torch.exp(torch.where(keep, log_ratio, torch.full_like(log_ratio, lowest)))  # 0 where masked
    per_token = -advantages * kept_ratio
    if isinstance(config, IPOLossConfig) and config.kl_tau > 0:
        per_token = per_token + config.kl_tau * log_ratio**2
    return per_token, masked


def teacher_advantages(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per token, ``teacher_logprob - student_logprob`` (detached): the distillation advantage.

    The student logprob is the TRAINER's (``logprobs``), not the inference worker's: the gradient of the
    reverse KL(pi || teacher) on samples from the inference copy mu is E_mu[w * grad log pi * (log pi -
    log teacher)], w the importance weight, so it is the policy being trained whose logprob belongs there.
    The inference logprob is the sampler's, up to ``max_async`` versions old and computed by another
    kernel; with it the term would distill a policy the trainer has already moved away from. ``teacher_kl``
    is measured from the same value, so it tracks the policy being trained.
    """
    return (teacher_logprobs.to(logprobs.dtype) - logprobs).detach()


def k3_kl(logprobs: torch.Tensor, other_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(other || policy) from samples of ``other``: exp(d) - d - 1, d = other - policy.

    Non-negative, zero where the two agree; its gradient through ``logprobs`` pulls the policy towards
    ``other``.
    """
    delta = other_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def kl_penalty(
    config: KLConfig,
    beta: float,
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    num_loss_tokens: int,
) -> LossOutput:
    """``beta`` times the k3 KL between the policy and the frozen reference, on the sampled tokens."""
    _check_shapes(logprobs, reference_logprobs, loss_mask)
    mask = loss_mask.bool()
    kl = k3_kl(logprobs, reference_logprobs.to(logprobs.dtype))
    kl_sum = _mask_sum(kl, mask) / num_loss_tokens
    return LossOutput(beta * kl_sum, {"reference_kl": float(kl_sum.detach()), "kl_beta": beta})


class AdaptiveKLController:
    """Keeps the measured KL near ``target_kl`` by scaling beta after each step (fixed beta without a target).

    The classic proportional rule: the error (KL / target - 1, clipped to +-0.2) moves beta by that fraction
    per step, so beta reacts smoothly and never jumps.
    """

    def __init__(self, config: KLConfig):
        self.target_kl = config.target_kl
        self.beta = config.beta

    def update(self, measured_kl: float) -> float:
        if self.target_kl is not None:
            error = max(-0.2, min(0.2, measured_kl / self.target_kl - 1.0))
            self.beta *= 1.0 + error
        return self.beta


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, num_loss_tokens: int) -> LossOutput:
    """Masked cross-entropy: the negative logprob of the target (assistant) tokens."""
    _check_shapes(logprobs, loss_mask)
    mask = loss_mask.bool()
    nll = _mask_sum(-logprobs, mask) / num_loss_tokens
    return LossOutput(nll, {"nll": float(nll.detach())})


def distillation_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    num_loss_tokens: int,
    *,
    max_is_ratio: float = 2.0,
) -> LossOutput:
    """Pure on-policy distillation with plain importance weights truncated at ``max_is_ratio``.

    The RL loss with ``adv_tau = 0, teacher_tau = 1`` and weights ``min(ratio, max_is_ratio)`` (CISPO whose
    upper clip is the truncation): each sampled token's advantage is ``teacher_logprob - student_logprob``.
    ``reverse_kl`` is the same number as ``teacher_kl``.
    """
    config = CISPOLossConfig(
        max_is_ratio=max_is_ratio, eps_high=max_is_ratio - 1 if max_is_ratio > 1 else 0.0, teacher_tau=1.0, adv_tau=0.0
    )
    out = rl_loss(
        config,
        logprobs,
        inference_logprobs,
        torch.zeros_like(logprobs),
        loss_mask,
        num_loss_tokens,
        teacher_logprobs=teacher_logprobs,
    )
    out.metrics["reverse_kl"] = out.metrics["teacher_kl"]
    return out

"""Each loss against a reference computed by hand (plain Python floats) on small tensors, and zero gradient
on masked tokens."""

from __future__ import annotations

import math

import pytest
import torch

from primerl.configs.trainer import CISPOLossConfig, DefaultLossConfig, GRPOLossConfig, KLConfig, TrainerConfig
from primerl.trainer.batch import MicroBatch
from primerl.trainer.losses import (
    AdaptiveKLController,
    distillation_loss,
    k3_kl,
    kl_penalty,
    rl_loss,
    sft_loss,
    token_entropy,
    token_logprobs,
)
from primerl.trainer.train_step import distillation_objective, rl_objective

# Four tokens: ratios exp(lp - ilp) of about 1.105, 0.741, 2.718 and 1.0; the last one is masked.
TRAINER = [-1.0, -0.6, -0.5, -2.0]
INFERENCE = [-1.1, -0.3, -1.5, -2.0]
ADVANTAGES = [1.0, -0.5, 2.0, 3.0]
MASK = [True, True, True, False]
NUM_TOKENS = 5  # the step has 5 loss tokens over all micro-batches; this micro-batch holds 3


def tensors():
    logprobs = torch.tensor(TRAINER, dtype=torch.float64, requires_grad=True)
    return (
        logprobs,
        torch.tensor(INFERENCE, dtype=torch.float64),
        torch.tensor(ADVANTAGES, dtype=torch.float64),
        torch.tensor(MASK),
    )


def by_hand(per_token, with_mask=MASK) -> float:
    return sum(value for value, keep in zip(per_token, with_mask) if keep) / NUM_TOKENS


def test_default_recipe_matches_hand_computation():
    config = DefaultLossConfig(prob_diff_low=0.2, prob_diff_high=0.2, sq_log_ratio_coef=1e-3, max_is_ratio=2.0)
    logprobs, inference, advantages, mask = tensors()
    out = rl_loss(config, logprobs, inference, advantages, mask, NUM_TOKENS)
    expected = []
    kept = []
    for lp, ilp, a in zip(TRAINER, INFERENCE, ADVANTAGES):
        ratio = math.exp(lp - ilp)
        weight = min(ratio, 2.0)
        diff = math.exp(lp) - math.exp(ilp)
        diverged = diff > 0.2 if a > 0 else diff < -0.2
        kept.append(not diverged)
        pg = 0.0 if diverged else -weight * a * lp
        expected.append(pg + 1e-3 * (lp - ilp) ** 2)
    # token 2: p_train 0.607 vs p_inf 0.223 with A > 0 -> masked; token 1: 0.549 vs 0.741 with A < 0 -> diff -0.192 kept
    assert kept[:3] == [True, True, False]
    assert out.loss.item() == pytest.approx(by_hand(expected), rel=1e-12)
    assert out.metrics["masked"] == pytest.approx(1 / NUM_TOKENS)
    assert out.metrics["is_truncated"] == pytest.approx(1 / NUM_TOKENS)  # token 2's ratio 2.718 > 2
    out.loss.backward()
    # d/dlp of the masked-out token 2: only the squared log-ratio term remains
    assert logprobs.grad[2].item() == pytest.approx(2e-3 * (TRAINER[2] - INFERENCE[2]) / NUM_TOKENS, rel=1e-9)
    assert logprobs.grad[3].item() == 0.0
    assert logprobs.grad[0].item() == pytest.approx((-math.exp(0.1) * 1.0 + 2e-3 * 0.1) / NUM_TOKENS, rel=1e-9)


def test_grpo_matches_hand_computation():
    config = GRPOLossConfig(eps_low=0.2, eps_high=0.2, max_is_ratio=2.0)
    logprobs, inference, advantages, mask = tensors()
    out = rl_loss(config, logprobs, inference, advantages, mask, NUM_TOKENS)
    expected = []
    for lp, ilp, a in zip(TRAINER, INFERENCE, ADVANTAGES):
        ratio = min(math.exp(lp - ilp), 2.0)
        clipped = min(max(ratio, 0.8), 1.2)
        expected.append(-min(ratio * a, clipped * a))
    assert out.loss.item() == pytest.approx(by_hand(expected), rel=1e-12)
    assert out.metrics["clipped"] == pytest.approx(2 / NUM_TOKENS)  # 0.741 < 0.8 and 2.718 > 1.2
    out.loss.backward()
    # token 0 (ratio 1.105, inside the clip range): gradient -A * ratio; token 2 (clipped, A > 0): none
    assert logprobs.grad[0].item() == pytest.approx(-math.exp(0.1) / NUM_TOKENS, rel=1e-9)
    assert logprobs.grad[2].item() == 0.0
    assert logprobs.grad[3].item() == 0.0


def test_cispo_matches_hand_computation():
    config = CISPOLossConfig(eps_high=0.2, max_is_ratio=2.0)
    logprobs, inference, advantages, mask = tensors()
    out = rl_loss(config, logprobs, inference, advantages, mask, NUM_TOKENS)
    weights = [min(min(math.exp(lp - ilp), 2.0), 1.2) for lp, ilp in zip(TRAINER, INFERENCE)]
    expected = [-w * a * lp for w, a, lp in zip(weights, ADVANTAGES, TRAINER)]
    assert out.loss.item() == pytest.approx(by_hand(expected), rel=1e-12)
    out.loss.backward()
    # every unmasked token keeps a gradient (CISPO drops none): -weight * A
    for index in range(3):
        assert logprobs.grad[index].item() == pytest.approx(-weights[index] * ADVANTAGES[index] / NUM_TOKENS, rel=1e-9)
    assert logprobs.grad[3].item() == 0.0


def test_kl_divergence_is_the_k3_estimate_and_zero_for_identical_policies():
    logprobs, inference, advantages, mask = tensors()
    out = rl_loss(DefaultLossConfig(), logprobs, inference, advantages, mask, NUM_TOKENS)
    expected = [math.exp(ilp - lp) - (ilp - lp) - 1 for lp, ilp in zip(TRAINER, INFERENCE)]
    assert out.metrics["kl_divergence"] == pytest.approx(by_hand(expected), rel=1e-12)
    same = rl_loss(DefaultLossConfig(), logprobs, logprobs.detach().clone(), advantages, mask, NUM_TOKENS)
    assert same.metrics["kl_divergence"] == 0.0


def test_kl_penalty_and_adaptive_beta():
    logprobs, _, _, mask = tensors()
    reference = torch.tensor([-1.2, -0.6, -0.4, -9.0], dtype=torch.float64)
    out = kl_penalty(KLConfig(beta=0.1), 0.1, logprobs, reference, mask, NUM_TOKENS)
    expected = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(TRAINER, reference.tolist())]
    assert out.loss.item() == pytest.approx(0.1 * by_hand(expected), rel=1e-12)
    assert out.metrics["reference_kl"] == pytest.approx(by_hand(expected), rel=1e-12)
    out.loss.backward()
    assert logprobs.grad[3].item() == 0.0 and logprobs.grad[1].item() == 0.0  # equal to the reference: no pull
    controller = AdaptiveKLController(KLConfig(beta=0.1, target_kl=0.01))
    assert controller.update(0.05) == pytest.approx(0.12)  # far above target: +20 %
    assert controller.update(0.0) == pytest.approx(0.12 * 0.8)  # far below: -20 %
    assert AdaptiveKLController(KLConfig(beta=0.1)).update(5.0) == 0.1  # no target: fixed


def test_sft_is_masked_mean_negative_logprob():
    logprobs, _, _, mask = tensors()
    out = sft_loss(logprobs, mask, NUM_TOKENS)
    assert out.loss.item() == pytest.approx(by_hand([-lp for lp in TRAINER]), rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([-1 / NUM_TOKENS] * 3 + [0.0])


def test_distillation_rewards_teacher_agreement():
    logprobs, inference, _, mask = tensors()
    teacher = torch.tensor([-0.5, -0.6, -3.0, 0.0], dtype=torch.float64)
    out = distillation_loss(logprobs, inference, teacher, mask, NUM_TOKENS, max_is_ratio=2.0)
    expected = []
    for lp, ilp, t in zip(TRAINER, INFERENCE, teacher.tolist()):
        weight = min(math.exp(lp - ilp), 2.0)
        expected.append(-weight * (t - lp) * lp)
    assert out.loss.item() == pytest.approx(by_hand(expected), rel=1e-12)
    assert out.metrics["reverse_kl"] == pytest.approx(by_hand([lp - t for lp, t in zip(TRAINER, teacher.tolist())]))
    out.loss.backward()
    assert logprobs.grad[3].item() == 0.0
    assert logprobs.grad[1].item() == 0.0  # student already agrees with the teacher on token 1
    assert logprobs.grad[0].item() < 0  # teacher likes token 0 more: descending the loss raises its logprob


TEACHER = [-0.5, -0.6, -3.0, 0.0]  # likes token 0 more than the trainer does, agrees on 1, dislikes 2
LOSS_TYPES = (DefaultLossConfig, GRPOLossConfig, CISPOLossConfig)


def with_grad(loss_fn):
    logprobs = torch.tensor(TRAINER, dtype=torch.float64, requires_grad=True)
    out = loss_fn(logprobs)
    out.loss.backward()
    return out, logprobs.grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_teacher_term_is_rl_on_the_mixed_advantage(loss_type):
    """With teacher logprobs the loss is the same RL loss on adv_tau * A + teacher_tau * (teacher - trainer)."""
    _, inference, advantages, mask = tensors()
    teacher = torch.tensor(TEACHER, dtype=torch.float64)
    config = loss_type(teacher_tau=0.5, adv_tau=2.0)
    mixed, mixed_grad = with_grad(
        lambda lp: rl_loss(config, lp, inference, advantages, mask, NUM_TOKENS, teacher_logprobs=teacher)
    )
    mixed_advantages = torch.tensor(
        [2 * a + 0.5 * (t - lp) for a, t, lp in zip(ADVANTAGES, TEACHER, TRAINER)], dtype=torch.float64
    )
    plain, plain_grad = with_grad(lambda lp: rl_loss(loss_type(), lp, inference, mixed_advantages, mask, NUM_TOKENS))
    assert mixed.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    assert torch.allclose(mixed_grad, plain_grad, atol=1e-15)
    assert mixed.metrics["teacher_kl"] == pytest.approx(by_hand([lp - t for lp, t in zip(TRAINER, TEACHER)]), rel=1e-12)
    assert "teacher_kl" not in plain.metrics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_pure_distillation_moves_the_student_towards_the_teacher(loss_type):
    """teacher_tau = 1, adv_tau = 0, tokens sampled by the policy being trained (ratio 1): descending the loss
    raises the logprob of the token the teacher likes more, lowers the one it likes less, leaves the agreed one."""
    logprobs, _, _, mask = tensors()
    inference = logprobs.detach().clone()
    teacher = torch.tensor(TEACHER, dtype=torch.float64)
    config = loss_type(teacher_tau=1.0, adv_tau=0.0)
    out, grad = with_grad(
        lambda lp: rl_loss(
            config, lp, inference, torch.zeros(4, dtype=torch.float64), mask, NUM_TOKENS, teacher_logprobs=teacher
        )
    )
    assert grad[0].item() < 0  # teacher -0.5 > student -1.0
    assert grad[1].item() == pytest.approx(0.0, abs=1e-15)  # equal
    assert grad[2].item() > 0  # teacher -3.0 < student -0.5
    assert grad[3].item() == 0.0  # masked
    assert out.metrics["teacher_kl"] == pytest.approx((-0.5 + 0.0 + 2.5) / NUM_TOKENS, rel=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_adv_tau_zero_ignores_rewards_and_adv_tau_scales_them(loss_type):
    _, inference, advantages, mask = tensors()
    teacher = torch.tensor(TEACHER, dtype=torch.float64)
    pure = loss_type(teacher_tau=1.0, adv_tau=0.0)
    first, first_grad = with_grad(
        lambda lp: rl_loss(pure, lp, inference, advantages, mask, NUM_TOKENS, teacher_logprobs=teacher)
    )
    second, second_grad = with_grad(
        lambda lp: rl_loss(pure, lp, inference, -7.0 * advantages + 3.0, mask, NUM_TOKENS, teacher_logprobs=teacher)
    )
    assert first.loss.item() == second.loss.item() and torch.equal(first_grad, second_grad)
    # without a teacher term adv_tau is a plain factor on the advantage
    scaled, _ = with_grad(lambda lp: rl_loss(loss_type(adv_tau=3.0), lp, inference, advantages, mask, NUM_TOKENS))
    tripled, _ = with_grad(lambda lp: rl_loss(loss_type(), lp, inference, 3.0 * advantages, mask, NUM_TOKENS))
    assert scaled.loss.item() == pytest.approx(tripled.loss.item(), rel=1e-12)


def test_teacher_tau_without_teacher_logprobs_names_the_teacher_settings():
    logprobs, inference, advantages, mask = tensors()
    with pytest.raises(ValueError, match=r"\[orchestrator\.teacher\].*\[teacher\].*teacher_tau = 0"):
        rl_loss(DefaultLossConfig(teacher_tau=0.5), logprobs, inference, advantages, mask, NUM_TOKENS)
    # teacher logprobs without teacher_tau: measured (teacher_kl), not trained on
    teacher = torch.tensor(TEACHER, dtype=torch.float64)
    watched = rl_loss(DefaultLossConfig(), logprobs, inference, advantages, mask, NUM_TOKENS, teacher_logprobs=teacher)
    plain = rl_loss(DefaultLossConfig(), logprobs, inference, advantages, mask, NUM_TOKENS)
    assert watched.loss.item() == plain.loss.item() and watched.metrics["teacher_kl"] > 0
    with pytest.raises(ValueError, match="equal length"):
        rl_loss(DefaultLossConfig(), logprobs, inference, advantages, mask, NUM_TOKENS, teacher_logprobs=teacher[:3])


def test_loss_taus_in_the_config():
    config = TrainerConfig.model_validate({"model": {"name": "m"}, "loss": {"teacher_tau": 1.0, "adv_tau": 0.0}})
    assert (config.loss.type, config.loss.teacher_tau, config.loss.adv_tau) == ("default", 1.0, 0.0)
    grpo = TrainerConfig.model_validate({"model": {"name": "m"}, "loss": {"type": "grpo", "teacher_tau": 0.1}})
    assert (grpo.loss.teacher_tau, grpo.loss.adv_tau) == (0.1, 1.0)
    assert (DefaultLossConfig().teacher_tau, DefaultLossConfig().adv_tau) == (0.0, 1.0)
    with pytest.raises(ValueError, match="nothing to learn"):
        CISPOLossConfig(adv_tau=0.0)
    with pytest.raises(ValueError, match="teacher_tau"):
        GRPOLossConfig(teacher_tau=-1.0)


def micro_batch(trainer_like: list[float], teacher: list[float] | None) -> MicroBatch:
    n = len(trainer_like)
    return MicroBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        position_ids=torch.arange(n),
        loss_mask=torch.tensor(MASK),
        advantages=torch.tensor(ADVANTAGES, dtype=torch.float32),
        inference_logprobs=torch.tensor(INFERENCE, dtype=torch.float32),
        temperatures=torch.ones(n),
        teacher_logprobs=None if teacher is None else torch.tensor(teacher),
    )


def test_objectives_pass_the_teacher_logprobs():
    """rl_objective carries the micro-batch's teacher_logprobs; distillation_objective is the same loss recipe
    with adv_tau = 0 and teacher_tau 1 (or as set)."""
    logprobs = torch.tensor(TRAINER, dtype=torch.float32)
    batch = micro_batch(TRAINER, TEACHER)
    mixed = rl_objective(GRPOLossConfig(teacher_tau=0.3))(batch, logprobs, NUM_TOKENS)
    direct = rl_loss(
        GRPOLossConfig(teacher_tau=0.3),
        logprobs,
        batch.inference_logprobs,
        batch.advantages,
        batch.loss_mask,
        NUM_TOKENS,
        teacher_logprobs=batch.teacher_logprobs,
    )
    assert mixed.loss.item() == direct.loss.item() and "teacher_kl" in mixed.metrics
    distilled = distillation_objective(GRPOLossConfig())(batch, logprobs, NUM_TOKENS)
    pure = rl_loss(
        GRPOLossConfig(teacher_tau=1.0, adv_tau=0.0),
        logprobs,
        batch.inference_logprobs,
        batch.advantages,
        batch.loss_mask,
        NUM_TOKENS,
        teacher_logprobs=batch.teacher_logprobs,
    )
    assert distilled.loss.item() == pure.loss.item()
    with pytest.raises(ValueError, match="orchestrator.teacher"):
        distillation_objective(DefaultLossConfig())(micro_batch(TRAINER, None), logprobs, NUM_TOKENS)


def test_token_logprobs_shift_temperature_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64)
    ids = torch.tensor([3, 1, 4, 1, 5])
    temps = torch.tensor([1.0, 1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    out = token_logprobs(logits, ids, temps)
    assert out[0].item() == 0.0
    for t in range(1, 5):
        row = (logits[t - 1] / temps[t]).tolist()
        log_z = math.log(sum(math.exp(v) for v in row))
        assert out[t].item() == pytest.approx(row[ids[t].item()] - log_z, rel=1e-12)
    entropy = token_entropy(logits, temps)
    row = (logits[0] / temps[1]).tolist()
    log_z = math.log(sum(math.exp(v) for v in row))
    assert entropy[1].item() == pytest.approx(-sum(math.exp(v - log_z) * (v - log_z) for v in row), rel=1e-12)
    with pytest.raises(ValueError):
        token_logprobs(logits, ids[:3])


def test_losses_add_up_across_micro_batches_like_one_batch():
    """Splitting a step's tokens over micro-batches (or ranks) gives the same total loss and gradient."""
    torch.manual_seed(1)
    n = 12
    trainer = torch.randn(n, dtype=torch.float64).clamp(max=-0.05)
    inference = trainer + 0.05 * torch.randn(n, dtype=torch.float64)
    advantages = torch.randn(n, dtype=torch.float64)
    mask = torch.rand(n) > 0.3
    total = int(mask.sum())
    teacher = trainer + 0.3 * torch.randn(n, dtype=torch.float64)
    for config in (
        DefaultLossConfig(),
        GRPOLossConfig(),
        CISPOLossConfig(),
        DefaultLossConfig(teacher_tau=0.5),
        GRPOLossConfig(teacher_tau=1.0, adv_tau=0.0),
        CISPOLossConfig(teacher_tau=2.0, adv_tau=0.5),
    ):
        whole = trainer.clone().requires_grad_(True)
        whole_out = rl_loss(config, whole, inference, advantages, mask, total, teacher_logprobs=teacher)
        whole_out.loss.backward()
        parts = trainer.clone().requires_grad_(True)
        outs = [
            rl_loss(
                config,
                parts[i : i + 4],
                inference[i : i + 4],
                advantages[i : i + 4],
                mask[i : i + 4],
                total,
                teacher_logprobs=teacher[i : i + 4],
            )
            for i in range(0, n, 4)
        ]
        sum(out.loss for out in outs).backward()
        assert torch.allclose(whole.grad, parts.grad, atol=1e-12)
        assert sum(out.metrics["teacher_kl"] for out in outs) == pytest.approx(
            whole_out.metrics["teacher_kl"], rel=1e-12
        )


def test_bad_inputs_are_refused():
    logprobs, inference, advantages, mask = tensors()
    with pytest.raises(ValueError, match="equal length"):
        rl_loss(DefaultLossConfig(), logprobs, inference[:3], advantages, mask, NUM_TOKENS)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        rl_loss(DefaultLossConfig(), logprobs, inference, advantages, mask, 0)
    assert k3_kl(torch.zeros(2), torch.zeros(2)).tolist() == [0.0, 0.0]

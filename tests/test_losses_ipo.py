"""prime-rl's IPO and IcePop losses: numbers against a hand computation, gradient direction, masking, NaN safety,
the config names and defaults, and the teacher/adv_tau terms they share with the other RL losses."""

from __future__ import annotations

import math

import pytest
import torch

from primerl.configs.trainer import IcePopLossConfig, IPOLossConfig, TrainerConfig
from primerl.trainer.losses import rl_loss
from tests.test_losses import ADVANTAGES, INFERENCE, MASK, NUM_TOKENS, TEACHER, TRAINER, by_hand, tensors, with_grad


def test_prime_rl_names_and_defaults():
    ipo = IPOLossConfig()
    assert (ipo.eps, ipo.kl_tau, ipo.adv_tau, ipo.teacher_tau) == (0.3, 0.0, 1.0, 0.0)  # prime-rl #3586
    icepop = IcePopLossConfig()
    assert (icepop.ratio_low, icepop.ratio_high, icepop.adv_tau) == (0.2, 5.0, 1.0)  # prime-rl #3526
    config = TrainerConfig.model_validate({"model": {"name": "m"}, "loss": {"type": "ipo", "eps": 0.2, "kl_tau": 1e-3}})
    assert isinstance(config.loss, IPOLossConfig) and (config.loss.eps, config.loss.kl_tau) == (0.2, 1e-3)
    older = TrainerConfig.model_validate({"model": {"name": "m"}, "loss": {"type": "ipo", "ipo_threshold": 0.1}})
    assert older.loss.eps == 0.1  # prime-rl's name before #3418
    with pytest.raises(ValueError, match="set twice"):
        IPOLossConfig.model_validate({"eps": 0.3, "ipo_threshold": 0.1})
    with pytest.raises(ValueError, match="ratio_low"):
        IcePopLossConfig(ratio_low=5.0, ratio_high=0.2)
    icepop = TrainerConfig.model_validate({"model": {"name": "m"}, "loss": {"type": "icepop", "ratio_high": 4.0}})
    assert isinstance(icepop.loss, IcePopLossConfig) and icepop.loss.ratio_high == 4.0


def test_ipo_matches_hand_computation():
    config = IPOLossConfig(eps=0.3, kl_tau=1e-3)
    logprobs, inference, advantages, mask = tensors()
    out = rl_loss(config, logprobs, inference, advantages, mask, NUM_TOKENS)
    expected, kept = [], []
    for lp, ilp, a in zip(TRAINER, INFERENCE, ADVANTAGES):
        keep = abs(math.exp(lp) - math.exp(ilp)) <= 0.3
        kept.append(keep)
        expected.append((-a * math.exp(lp - ilp) if keep else 0.0) + 1e-3 * (lp - ilp) ** 2)
    # token 2: p_train 0.607 vs p_inf 0.223 -> |diff| 0.383 > 0.3 masked whatever the sign of A; token 1: 0.192 kept
    assert kept[:3] == [True, True, False]
    assert out.loss.item() == pytest.approx(by_hand(expected), rel=1e-12)
    assert out.metrics["masked"] == pytest.approx(1 / NUM_TOKENS)
    assert "is_truncated" not in out.metrics  # IPO has no truncation
    out.loss.backward()
    grad = logprobs.grad
    # d/dlp of -A * exp(lp - ilp) is -A * ratio; the squared log-ratio adds 2 kl_tau (lp - ilp)
    assert grad[0].item() == pytest.approx((-1.0 * math.exp(0.1) + 2e-3 * 0.1) / NUM_TOKENS, rel=1e-9)
    assert grad[1].item() == pytest.approx((0.5 * math.exp(-0.3) + 2e-3 * -0.3) / NUM_TOKENS, rel=1e-9)
    assert grad[2].item() == pytest.approx(2e-3 * 1.0 / NUM_TOKENS, rel=1e-9)  # masked: only the KL term
    assert grad[3].item() == 0.0


def test_ipo_default_has_no_kl_term():
    logprobs, inference, advantages, mask = tensors()
    out, grad = with_grad(lambda lp: rl_loss(IPOLossConfig(), lp, inference, advantages, mask, NUM_TOKENS))
    assert grad[2].item() == 0.0  # masked and kl_tau = 0: no gradient at all
    assert out.loss.item() == pytest.approx(by_hand([-math.exp(0.1), 0.5 * math.exp(-0.3), 0.0, 0.0]), rel=1e-12)


def test_icepop_matches_hand_computation():
    logprobs, inference, advantages, mask = tensors()
    # ratios 1.105, 0.741, 2.718: all inside the default band [0.2, 5.0]
    out, grad = with_grad(lambda lp: rl_loss(IcePopLossConfig(), lp, inference, advantages, mask, NUM_TOKENS))
    ratios = [math.exp(lp - ilp) for lp, ilp in zip(TRAINER, INFERENCE)]
    assert out.loss.item() == pytest.approx(by_hand([-a * r for a, r in zip(ADVANTAGES, ratios)]), rel=1e-12)
    assert out.metrics["masked"] == 0.0
    for i in range(3):
        assert grad[i].item() == pytest.approx(-ADVANTAGES[i] * ratios[i] / NUM_TOKENS, rel=1e-9)
    # a narrower band masks token 2 (ratio e = 2.718 > 2) and token 1 (0.741 < 0.8)
    out, grad = with_grad(
        lambda lp: rl_loss(IcePopLossConfig(ratio_low=0.8, ratio_high=2.0), lp, inference, advantages, mask, 5)
    )
    assert out.loss.item() == pytest.approx(by_hand([-ratios[0], 0.0, 0.0, 0.0]), rel=1e-12)
    assert out.metrics["masked"] == pytest.approx(2 / NUM_TOKENS)
    assert grad[1].item() == 0.0 and grad[2].item() == 0.0


def test_icepop_band_is_inclusive():
    inference = torch.tensor([0.0, 0.0], dtype=torch.float64)
    logprobs = torch.tensor([math.log(0.2), math.log(5.0)], dtype=torch.float64, requires_grad=True)
    out = rl_loss(
        IcePopLossConfig(),
        logprobs,
        inference,
        torch.ones(2, dtype=torch.float64),
        torch.tensor([True, True]),
        2,
    )
    assert out.metrics["masked"] == 0.0


@pytest.mark.parametrize("config", [IPOLossConfig(), IcePopLossConfig()])
def test_gradient_direction(config):
    """Descending the loss raises the logprob of a token with A > 0 and lowers one with A < 0; a masked extreme
    ratio contributes no gradient and no NaN."""
    logprobs = torch.tensor([-1.0, -1.0, -0.01], dtype=torch.float64, requires_grad=True)
    inference = torch.tensor([-1.0, -1.0, -900.0], dtype=torch.float64)  # token 2: ratio exp(900) overflows
    advantages = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    out = rl_loss(config, logprobs, inference, advantages, torch.tensor([True, True, True]), 3)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0].item() < 0 < logprobs.grad[1].item()
    assert logprobs.grad[2].item() == 0.0
    with torch.no_grad():  # one step of gradient descent moves the policy the way the advantages say
        stepped = logprobs - 0.1 * logprobs.grad
    assert stepped[0] > logprobs[0] and stepped[1] < logprobs[1]


@pytest.mark.parametrize("loss_type", [IPOLossConfig, IcePopLossConfig])
def test_teacher_term_and_adv_tau(loss_type):
    """The distillation term and adv_tau work as for every RL loss: the same loss on adv_tau * A + teacher_tau *
    (teacher - trainer)."""
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
    assert MASK[3] is False and mixed_grad[3].item() == 0.0


@pytest.mark.parametrize("loss", ["ipo", "icepop"])
def test_a_prime_rl_loss_table_trains_the_tiny_model(small_tiny_model, tmp_path, loss):
    """`[trainer.loss] type = "ipo" | "icepop"` as a prime-rl config writes it: a few optimizer steps on on-policy
    samples raise the logprob of the tokens with positive advantage relative to those with negative advantage."""
    import numpy as np
    from support.trainer_runs import packed, samples
    from transformers import AutoModelForCausalLM

    from primerl.runtime.config_loader import load_config
    from primerl.trainer.batch import MicroBatch
    from primerl.trainer.distributed import DistInfo
    from primerl.trainer.losses import token_logprobs
    from primerl.trainer.train_step import TrainStep, rl_objective

    path = tmp_path / "trainer.toml"
    path.write_text(f'[model]\nname = "{small_tiny_model}"\n\n[loss]\ntype = "{loss}"\n')
    config = load_config(TrainerConfig, ["@", str(path)])
    assert config.loss.type == loss
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(small_tiny_model, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    group = samples(0, count=4)
    for index, sample in enumerate(group):
        sample["advantages"] = np.full(len(sample["input_ids"]), 1.0 if index % 2 == 0 else -1.0, np.float32)

    def logprobs_of(sample) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.as_tensor(sample["input_ids"])
            return token_logprobs(model(ids.unsqueeze(0)).logits[0], ids)

    def objective() -> float:  # sum over samples of A * mean logprob of the loss tokens
        return sum(
            float(s["advantages"][0]) * float(logprobs_of(s)[torch.as_tensor(s["loss_mask"])].mean()) for s in group
        )

    for sample in group:  # sampled by the policy being trained: ratio 1 at the first step
        sample["inference_logprobs"] = logprobs_of(sample).numpy().astype(np.float32)
    before = objective()
    step_fn = TrainStep(
        model, optimizer, scheduler, rl_objective(config.loss), DistInfo(0, 1, 0, None), max_grad_norm=1.0
    )
    for step in range(1, 6):
        stats = step_fn.step(step, [MicroBatch.from_tensors(packed(group))])
        assert np.isfinite(stats.loss) and "train/masked" in stats.as_metrics()
    assert objective() > before + 0.5, (before, objective())

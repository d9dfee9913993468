"""The trainer's optimizer step: packing-independent, rank-count-independent, and SFT learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.trainer_runs import packed, samples

from primerl.trainer.batch import MicroBatch
from primerl.trainer.config import DefaultLossConfig
from primerl.trainer.distributed import DistInfo
from primerl.trainer.train_step import TrainStep, rl_objective, sft_objective

SCRIPT = Path(__file__).parent / "scripts" / "train_ranks.py"
ONE_RANK = DistInfo(0, 1, 0, None)


@pytest.fixture
def model_dir(small_tiny_model):
    return small_tiny_model


def fresh(model_dir, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return model, optimizer, scheduler


def synthetic(count=4, seed=0):
    return samples(seed)[:count]


def pack(group):
    return MicroBatch.from_tensors(packed(group))


def test_packing_does_not_change_the_update(model_dir):
    group = synthetic()
    results = []
    for packing in ([group], [group[:2], group[2:]], [[s] for s in group]):
        model, optimizer, scheduler = fresh(model_dir)
        stats = TrainStep(model, optimizer, scheduler, rl_objective(DefaultLossConfig()), ONE_RANK,
                          max_grad_norm=1.0).step(1, [pack(g) for g in packing])
        results.append((stats.loss, stats.grad_norm, [p.detach().clone() for p in model.parameters()]))
    for loss, grad_norm, params in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-10)
        assert grad_norm == pytest.approx(results[0][1], abs=1e-10)
        for a, b in zip(params, results[0][2]):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_step_reports_the_metrics_users_expect(model_dir):
    model, optimizer, scheduler = fresh(model_dir)
    stats = TrainStep(model, optimizer, scheduler, rl_objective(DefaultLossConfig()), ONE_RANK, max_grad_norm=1.0).step(
        1, [pack(synthetic())])
    metrics = stats.as_metrics()
    for name in ("train/loss", "train/grad_norm", "train/learning_rate", "train/entropy", "train/kl_divergence",
                 "train/is_truncated", "train/masked"):
        assert name in metrics and np.isfinite(metrics[name]), name
    assert metrics["train/entropy"] > 0


def test_sft_lowers_the_loss_on_a_toy_dataset(model_dir):
    model, optimizer, scheduler = fresh(model_dir, dtype=torch.float32)
    group = synthetic(count=4)
    step_fn = TrainStep(model, optimizer, scheduler, sft_objective, ONE_RANK, max_grad_norm=1.0)
    losses = [step_fn.step(step, [pack(group)]).loss for step in range(1, 16)]
    assert losses[-1] < losses[0] - 1.0, losses  # memorising 4 random sequences: about 7.0 -> 5.0 nats
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_a_step_without_loss_tokens_is_refused(model_dir):
    model, optimizer, scheduler = fresh(model_dir)
    group = synthetic(count=2)
    for sample in group:
        sample["loss_mask"] = np.zeros_like(sample["loss_mask"])
    with pytest.raises(ValueError, match="no loss tokens"):
        TrainStep(model, optimizer, scheduler, sft_objective, ONE_RANK, max_grad_norm=1.0).step(1, [pack(group)])


def run_ranks(model_dir, tmp_path, world_size, parallel):
    out = tmp_path / f"ranks{world_size}-{parallel}.json"
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={world_size}", str(SCRIPT),
                             "--model", str(model_dir), "--out", str(out), "--parallel", parallel],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_match_one_rank(model_dir, tmp_path, parallel):
    one = run_ranks(model_dir, tmp_path, 1, parallel)
    two = run_ranks(model_dir, tmp_path, 2, parallel)
    assert np.allclose(one["losses"], two["losses"], atol=1e-5, rtol=0), (one, two)
    assert np.allclose(one["grad_norms"], two["grad_norms"], atol=1e-5, rtol=0)
    assert two["param_sum"] == pytest.approx(one["param_sum"], abs=1e-5)

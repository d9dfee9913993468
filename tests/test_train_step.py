"""The trainer's optimizer step: packing-independent, rank-count-independent, and SFT learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.numerics import FLOAT32_EPS, RL_LOSS_ATOL, assert_weights_match, machine_description
from support.trainer_runs import packed, samples

from primerl.configs.trainer import DefaultLossConfig, OptimizerConfig
from primerl.proto import telemetry
from primerl.trainer.batch import MicroBatch
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
        stats = TrainStep(
            model, optimizer, scheduler, rl_objective(DefaultLossConfig()), ONE_RANK, max_grad_norm=1.0
        ).step(1, [pack(g) for g in packing])
        results.append((stats.loss, stats.grad_norm, [p.detach().clone() for p in model.parameters()]))
    for loss, grad_norm, params in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-10)
        assert grad_norm == pytest.approx(results[0][1], abs=1e-10)
        for a, b in zip(params, results[0][2]):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_step_reports_the_metrics_users_expect(model_dir):
    model, optimizer, scheduler = fresh(model_dir)
    stats = TrainStep(model, optimizer, scheduler, rl_objective(DefaultLossConfig()), ONE_RANK, max_grad_norm=1.0).step(
        1, [pack(synthetic())]
    )
    metrics = stats.as_metrics()
    for name in (
        telemetry.TRAIN_LOSS,
        "train/grad_norm",
        telemetry.TRAIN_LEARNING_RATE,
        "train/entropy",
        telemetry.TRAIN_KL_DIVERGENCE,
        "train/is_truncated",
        "train/masked",
    ):
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


GRAD_ROUNDING = FLOAT32_EPS * OptimizerConfig().max_norm
"""How much one element of the (clipped) gradient may differ between 1 and 2 ranks: the ranks sum the per-token
gradients in another order (and torchrun gives each of 2 ranks 1 thread, 1 rank all of them), which changes
float32's rounding; no clipped element exceeds max_norm = 1, whose float32 spacing is eps32 = 1.19e-7. Measured
(Intel Xeon, AVX-512, ddp and fsdp2): at most 4.1e-8 over the 3 steps, the effect of the weights that already
differ included."""


def grad_norm_rtol(largest_tensor_numel: int) -> float:
    """How far two runs' gradient norms may be apart, relative. The norm is float32's sqrt of a sum of squares, and
    torch's CPU kernel accumulates a tensor's squares in vector lanes (8 with AVX2 or without, 16 with AVX-512): a
    lane adds up to numel / 8 squares one after the other, each addition rounding by up to eps32 / 2 of the sum.
    The sum of squares is then within numel / 8 * eps32 / 2 of itself (relative), the norm within half that, and
    two runs (FSDP2 shards the sums differently) within numel / 8 * eps32 / 2: 4.9e-4 for the tiny model's 65536-
    element embedding. The gradients' own difference moves the norm by < 1e-6. Tiny squares added to a large sum
    all round the same way, so the worst case is not far-fetched: one element of 1 among 65535 of 2^-13 loses the
    squares of the small ones in its lane, 1.2e-4 of the sum. Measured: 8.5e-6 between fsdp2 runs, 5.8e-6 against
    float64 in one run. A missing average over ranks would be a factor 2."""
    return largest_tensor_numel / 8 * FLOAT32_EPS / 2


def run_ranks(model_dir, tmp_path, world_size, parallel):
    prefix = tmp_path / f"ranks{world_size}-{parallel}"
    out, weights, denominators = (
        prefix.with_suffix(suffix) for suffix in (".json", ".safetensors", ".adam.safetensors")
    )
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            f"--nproc-per-node={world_size}",
            str(SCRIPT),
            "--model",
            str(model_dir),
            "--out",
            str(out),
            "--weights",
            str(weights),
            "--adam-denominators",
            str(denominators),
            "--parallel",
            parallel,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), load_file(weights), load_file(denominators)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_match_one_rank(model_dir, tmp_path, parallel):
    """The same global batch on 1 and 2 ranks: the same losses, gradient norms and weights, up to float32's
    rounding of sums taken in another order (bounds: `RL_LOSS_ATOL`, `grad_norm_rtol`, `GRAD_ROUNDING`)."""
    one, one_weights, one_denominators = run_ranks(model_dir, tmp_path, 1, parallel)
    two, two_weights, _ = run_ranks(model_dir, tmp_path, 2, parallel)
    machines = (
        f"1 rank: {machine_description(one['num_threads'])}; "
        f"2 ranks: {two['cpu_capability']} kernels, {two['num_threads']} threads each"
    )
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=0, atol=RL_LOSS_ATOL, err_msg=machines)
    rtol = grad_norm_rtol(max(tensor.numel() for tensor in one_weights.values()))
    np.testing.assert_allclose(two["grad_norms"], one["grad_norms"], rtol=rtol, atol=0, err_msg=machines)
    print(
        assert_weights_match(
            one_weights,
            two_weights,
            one_denominators,
            lr=one["learning_rate"],
            num_steps=len(one["losses"]),
            grad_rounding=GRAD_ROUNDING,
            context=machines,
        )
    )

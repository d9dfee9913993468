"""Run a few RL optimizer steps on synthetic samples with N ranks (under torchrun) and write what rank 0 saw.

Rank r trains on samples r, r + N, r + 2N, ... of the same global batch, so any N sees the same data.
Rank 0 writes
- `--out` (JSON): each step's loss and gradient norm, and the rank's torch thread count and CPU capability (they
  decide how float32 sums are rounded);
- `--weights` (safetensors): every parameter after the last step, whole (gathered from the shards under FSDP2),
  under its name in the unwrapped model; a tied weight once;
- `--adam-denominators` (safetensors): per parameter element, the smallest AdamW denominator
  sqrt(v_hat) + eps over the steps, which says how much a rounding difference in the gradients can move the
  element (`support.numerics.adam_weight_tolerance`).
Used by tests/test_train_step.py to check that 1 and 2 ranks give the same losses and weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from primerl.configs.trainer import DefaultLossConfig, OptimizerConfig
from primerl.trainer.batch import MicroBatch
from primerl.trainer.distributed import init_distributed, shutdown_distributed, unwrap_model, wrap_model
from primerl.trainer.train_step import TrainStep, rl_objective

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the samples every trainer test uses
from support.trainer_runs import packed, samples  # noqa: E402

LEARNING_RATE = 1e-3


def pack(group: list[dict[str, np.ndarray]]) -> MicroBatch:
    return MicroBatch.from_tensors(packed(group))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly FSDP2-sharded) parameter or optimizer state, on the CPU; a collective for a
    sharded one, so every rank calls it in the same order."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().cpu()


def adam_denominators(
    named_params: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Each parameter's AdamW denominator after the step just taken: sqrt(v / (1 - beta2^t)) + eps."""
    (group,) = optimizer.param_groups
    beta2, eps = group["betas"][1], group["eps"]
    out = {}
    for name, param in named_params:
        state = optimizer.state[param]
        bias_correction = 1 - beta2 ** float(state["step"])
        out[name] = (whole(state["exp_avg_sq"]).double() / bias_correction).sqrt() + eps
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--adam-denominators", required=True)
    parser.add_argument("--parallel", default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    info = init_distributed()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = wrap_model(model, args.parallel, info)
    named_params = list(unwrap_model(model).named_parameters())  # a tied weight once
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step_fn = TrainStep(
        model, optimizer, scheduler, rl_objective(DefaultLossConfig()), info, max_grad_norm=OptimizerConfig().max_norm
    )
    losses, grad_norms = [], []
    smallest: dict[str, torch.Tensor] = {}
    for step in range(1, args.steps + 1):
        mine = samples(step)[info.rank :: info.world_size]
        micro_batches = [pack(mine[i : i + 2]) for i in range(0, len(mine), 2)]
        stats = step_fn.step(step, micro_batches)
        losses.append(stats.loss)
        grad_norms.append(stats.grad_norm)
        for name, denominator in adam_denominators(named_params, optimizer).items():
            smallest[name] = torch.minimum(smallest[name], denominator) if name in smallest else denominator
    weights = {name: whole(param).contiguous() for name, param in named_params}
    if info.rank == 0:
        save_file(weights, args.weights)
        save_file({name: d.float().contiguous() for name, d in smallest.items()}, args.adam_denominators)
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "losses": losses,
                    "grad_norms": grad_norms,
                    "learning_rate": LEARNING_RATE,
                    "max_grad_norm": OptimizerConfig().max_norm,
                    "num_threads": torch.get_num_threads(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                },
                handle,
            )
    shutdown_distributed(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())

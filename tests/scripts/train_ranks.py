"""Run a few RL optimizer steps on synthetic samples with N ranks (under torchrun) and write what rank 0 saw.

Rank r trains on samples r, r + N, r + 2N, ... of the same global batch, so any N sees the same data.
Used by tests/test_train_step.py to check that 1 and 2 ranks give the same losses and weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from primerl.trainer.batch import MicroBatch
from primerl.trainer.config import DefaultLossConfig, OptimizerConfig
from primerl.trainer.distributed import init_distributed, shutdown_distributed, wrap_model
from primerl.trainer.train_step import TrainStep, rl_objective

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the samples every trainer test uses
from support.trainer_runs import packed, samples  # noqa: E402


def pack(group: list[dict[str, np.ndarray]]) -> MicroBatch:
    return MicroBatch.from_tensors(packed(group))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parallel", default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    info = init_distributed()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = wrap_model(model, args.parallel, info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step_fn = TrainStep(model, optimizer, scheduler, rl_objective(DefaultLossConfig()), info,
                        max_grad_norm=OptimizerConfig().max_norm)
    losses, grad_norms = [], []
    for step in range(1, args.steps + 1):
        mine = samples(step)[info.rank :: info.world_size]
        micro_batches = [pack(mine[i : i + 2]) for i in range(0, len(mine), 2)]
        stats = step_fn.step(step, micro_batches)
        losses.append(stats.loss)
        grad_norms.append(stats.grad_norm)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if info.enabled and args.parallel == "fsdp2" else getattr(model, "module", model).state_dict()
    if info.rank == 0:
        checksum = float(sum(t.double().sum() for t in state.values()))
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "grad_norms": grad_norms, "param_sum": checksum}, handle)
    shutdown_distributed(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())

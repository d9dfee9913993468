#!/usr/bin/env python
"""b. The trainer daemon's step vs a bare transformers loop on the very same micro-batches, side by side.

    .venv/bin/python bench/trainer_step.py [--model DIR] [--repeats 5] [--load both|none|burn]
        [--untuned] [--markdown bench/sections/b.md] [--quick]

One step = the demo's shape: 64 samples (prompt 30-45 tokens, completion 4-18 loss tokens) packed by the
orchestrator's rule into micro-batches of at most 256 tokens (~14 micro-batches, ~700 loss tokens).

- **daemon**: what ``primerl-trainer`` runs per step: ``MicroBatch.from_tensors`` on the frame arrays (the decode
  its fetch thread does; counted here, so the ratio is conservative) and ``TrainStep.step`` with the RL loss of
  ``[trainer.loss]`` defaults (padded per-sample forward, token logprobs and entropies, loss, backward, clip,
  AdamW, scheduler).
- **bare**: the loop a user would write: per micro-batch one forward of the packed [1, n] tokens, log-softmax
  gather, advantage-weighted loss, backward; then clip and AdamW.

Same model weights (two copies), same tokens, AdamW, and the same threads: both run in this process under the
trainer's default budget from ``primerl.runtime.cpu_budget`` (applied before torch loads). The two alternate
within each repeat (order flipped every repeat), after ``--warmup`` untimed steps.

Load: ``none`` (alone) and ``burn``: a CPU-burning process standing in for vLLM generating flat out: one process
with the inference role's budget (1 OpenMP thread per CPU of the inference share, bound there, passive wait
policy) doing float32 matmuls of the tiny model's size in a loop. ``both`` (default) measures both.

``--untuned`` also runs the bare loop in a child process with the pre-budget settings (torch's default: one
thread per CPU, OpenMP's default active wait policy) under the same load, to show what the budget buys.

Target b: daemon step / bare step <= 1.25 under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Section, Stats, target_line  # noqa: E402

TARGET = 1.25
SEQ_LEN = 256
NUM_SAMPLES = 64

BURN_CODE = """
import os, sys, torch
cpus = [int(c) for c in sys.argv[1].split(",")]
os.sched_setaffinity(0, cpus)
torch.set_num_threads(len(cpus))
a = torch.randn(512, 128); w = torch.randn(128, 2048)
print("burning", flush=True)
while True:
    (a @ w).softmax(-1).sum()
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant and load (>= 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--load", choices=("both", "none", "burn"), default="both")
    parser.add_argument("--untuned", action="store_true", help="also time the bare loop with pre-budget threads")
    parser.add_argument("--markdown", type=Path, default=None, help="write this part's RESULTS.md section here")
    parser.add_argument("--quick", action="store_true", help="3 repeats, 1 warm-up (for trying the harness)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the raw times here")
    parser.add_argument("--child-bare", action="store_true", help=argparse.SUPPRESS)  # --untuned's child
    return parser


# ------------------------------------------------------------------------------------------------ the data
def make_step_tensors(vocab_size: int, seed: int) -> list[dict]:
    """One step's micro-batches as the broker delivers them (numpy arrays per tensor name), packed greedily."""
    import numpy as np

    rng = random.Random(seed)
    samples = []
    for _ in range(NUM_SAMPLES):
        prompt, completion = rng.randint(30, 45), rng.randint(4, 18)
        ids = [rng.randrange(3, vocab_size) for _ in range(prompt + completion)]
        samples.append((ids, prompt, rng.choice((-1.0, -0.5, 0.5, 1.0))))
    micro_batches, current = [], []
    for sample in samples:
        if current and sum(len(s[0]) for s in current) + len(sample[0]) > SEQ_LEN:
            micro_batches.append(current)
            current = []
        current.append(sample)
    micro_batches.append(current)
    out = []
    for batch in micro_batches:
        ids, pos, mask, adv, logp = [], [], [], [], []
        for tokens, prompt, advantage in batch:
            n = len(tokens)
            ids += tokens
            pos += list(range(n))
            mask += [False] * prompt + [True] * (n - prompt)
            adv += [advantage] * n
            logp += [-rng.uniform(0.5, 5.0) if i >= prompt else 0.0 for i in range(n)]
        out.append(
            {
                "input_ids": np.array(ids, dtype=np.int64),
                "position_ids": np.array(pos, dtype=np.int64),
                "loss_mask": np.array(mask, dtype=np.bool_),
                "advantages": np.array(adv, dtype=np.float32),
                "inference_logprobs": np.array(logp, dtype=np.float32),
                "temperatures": np.ones(len(ids), dtype=np.float32),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------- variants
class DaemonStep:
    """The trainer daemon's per-step code path (decode + TrainStep.step), on its own copy of the model."""

    def __init__(self, model_dir: Path):
        from primerl.configs.trainer import DefaultLossConfig, ModelConfig, OptimizerConfig, SchedulerConfig
        from primerl.trainer.distributed import DistInfo
        from primerl.trainer.model import load_model
        from primerl.trainer.optim import build_optimizer, build_scheduler
        from primerl.trainer.train_step import TrainStep, rl_objective

        self.model = load_model(ModelConfig(name=str(model_dir)))
        optimizer = build_optimizer(self.model, OptimizerConfig(lr=5e-4, weight_decay=0.0))
        scheduler = build_scheduler(optimizer, SchedulerConfig(), None)
        self.step_fn = TrainStep(
            self.model,
            optimizer,
            scheduler,
            rl_objective(DefaultLossConfig()),
            DistInfo(0, 1, 0, None),
            max_grad_norm=1.0,
        )
        self.step_index = 0

    def __call__(self, tensors: list[dict]) -> float:
        from primerl.trainer.batch import MicroBatch

        started = time.perf_counter()
        micro_batches = [MicroBatch.from_tensors(t) for t in tensors]
        self.step_index += 1
        self.step_fn.step(self.step_index, micro_batches)
        return time.perf_counter() - started


class BareStep:
    """A plain transformers loop over the same micro-batches (packed [1, n] forward, AdamW)."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=5e-4, weight_decay=0.0)

    def __call__(self, tensors: list[dict]) -> float:
        torch = self.torch
        started = time.perf_counter()
        batches = [{k: torch.from_numpy(v) for k, v in t.items()} for t in tensors]
        num_loss_tokens = sum(int(b["loss_mask"].sum()) for b in batches)
        for b in batches:
            ids = b["input_ids"][None]
            logits = self.model(input_ids=ids, position_ids=b["position_ids"][None], use_cache=False).logits[0]
            logprobs = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            mask = b["loss_mask"][1:]
            loss = -(b["advantages"][1:] * logprobs * mask).sum() / num_loss_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started


# ------------------------------------------------------------------------------------------------ load
class Burner:
    """The stand-in for vLLM generating flat out (module docstring); a context manager."""

    def __init__(self, cpus: list[int]):
        self.cpus = cpus
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Burner:
        from primerl.runtime.cpu_budget import ThreadsConfig, role_env

        env = {**os.environ, **role_env("inference", ThreadsConfig(num_threads=len(self.cpus), cpus=self.cpus))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", BURN_CODE, ",".join(map(str, self.cpus))], env=env, stdout=subprocess.PIPE, text=True
        )
        line = self.process.stdout.readline()  # started and burning
        if "burning" not in line:
            raise RuntimeError(f"the CPU burner did not start: {line!r}")
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def untuned_bare(model_dir: Path, args: argparse.Namespace) -> list[float]:
    """The bare loop in a child with torch's default threads and OpenMP's default (active) wait policy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "OPENBLAS_", "KMP_"))}
    cmd = [
        sys.executable,
        __file__,
        "--child-bare",
        "--model",
        str(model_dir),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["bare"]


def child_bare(args: argparse.Namespace) -> int:
    import torch

    bare = BareStep(args.model)
    tensors = make_step_tensors(bare.model.config.vocab_size, args.seed)
    for _ in range(args.warmup):
        bare(tensors)
    times = [bare(tensors) for _ in range(args.repeats)]
    print(json.dumps({"bare": times, "threads": torch.get_num_threads()}))
    return 0


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 3, 1
    if args.repeats < 3 and not args.child_bare:
        raise SystemExit("--repeats must be >= 3 (min/median/max)")
    if args.child_bare:
        return child_bare(args)

    from primerl.runtime.cpu_budget import apply_budget, available_cpus, default_budgets

    cpus = available_cpus()
    budgets = default_budgets(cpus, gpus=False)
    trainer_budget = apply_budget("trainer", budgets["trainer"])  # before torch loads, as primerl-trainer does
    import torch

    torch.manual_seed(args.seed)
    section = Section("b. Trainer daemon step vs a bare loop on the same micro-batches", argv=sys.argv)
    with tempfile.TemporaryDirectory(prefix="primerl-bench-b-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from primerl.trainer.tiny_model import build_tiny_model

            model_dir = Path(tmp) / "tiny-model"
            build_tiny_model(model_dir)
        daemon, bare = DaemonStep(model_dir), BareStep(model_dir)
        bare.model.load_state_dict(daemon.model.state_dict())  # the same weights
        tensors = make_step_tensors(bare.model.config.vocab_size, args.seed)
        num_tokens = sum(len(t["input_ids"]) for t in tensors)
        num_loss = sum(int(t["loss_mask"].sum()) for t in tensors)
        loads = ["none", "burn"] if args.load == "both" else [args.load]
        results: dict[str, dict[str, Stats]] = {}
        raw: dict[str, dict[str, list[float]]] = {}
        for load in loads:
            burner = Burner(budgets["inference"].cpus) if load == "burn" else None
            if burner is not None:
                burner.__enter__()
            try:
                for _ in range(args.warmup):
                    daemon(tensors)
                    bare(tensors)
                stats = {"daemon": Stats(), "bare": Stats(), "ratio": Stats()}
                for repeat in range(args.repeats):
                    order = (daemon, bare) if repeat % 2 == 0 else (bare, daemon)
                    times = {id(fn): fn(tensors) for fn in order}
                    d, b = times[id(daemon)], times[id(bare)]
                    stats["daemon"].add(d)
                    stats["bare"].add(b)
                    stats["ratio"].add(d / b)
                    print(
                        f"[b] load {load} repeat {repeat}: daemon {d:.3f} s, bare {b:.3f} s, ratio {d / b:.2f}",
                        flush=True,
                    )
                if args.untuned:
                    stats["untuned"] = Stats()
                    for value in untuned_bare(model_dir, args):
                        stats["untuned"].add(value)
            finally:
                if burner is not None:
                    burner.__exit__(None, None, None)
            results[load] = stats
            raw[load] = {name: s.values for name, s in stats.items()}

    load_names = {"none": "alone", "burn": f"under load (CPU burner on CPUs {budgets['inference'].cpus})"}
    section.line(
        f"One step: {len(tensors)} micro-batches of <= {SEQ_LEN} tokens ({num_tokens} tokens, {num_loss} "
        f"loss tokens), model {'a fresh tiny model' if args.model is None else args.model}; "
        f"threads: {trainer_budget.num_threads} intra-op, wait policy {trainer_budget.wait_policy} "
        f"(trainer budget on {len(cpus)} CPUs). Seconds per step, median (min–max, n)."
    )
    section.line()
    rows = []
    for load, stats in results.items():
        row = [load_names[load], stats["daemon"].cell(), stats["bare"].cell(), stats["ratio"].cell()]
        if args.untuned:
            row.append(stats["untuned"].cell())
        rows.append(row)
    header = ["load", "daemon step, s", "bare loop, s", "daemon / bare (per repeat)"]
    if args.untuned:
        header.append("bare loop, untuned threads, s")
    section.table(header, rows)
    for load, stats in results.items():
        if load == "burn" or len(results) == 1:
            section.line(target_line(f"b: daemon / bare step {load_names[load]}", stats["ratio"].median, "<=", TARGET))
    section.line()
    section.line(
        "The daemon also fetches and decodes the next step on its fetch thread and publishes, "
        "checkpoints and commits on its IO thread while the compute loop goes on (`perf/*` metrics)."
    )
    if args.markdown:
        section.write(args.markdown)
    print(section.text())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

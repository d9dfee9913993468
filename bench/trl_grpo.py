#!/usr/bin/env python
"""TRL's ``GRPOTrainer`` on the demo's reverse-text task, the peer that ``bench/rl_vs_trl.py`` compares against.

Runs in the bench's own interpreter (``.venv-bench``: torch 2.13.0 CPU, trl 1.16.0, the transformers and accelerate
of ``.venv``; built by ``make bench``), one process, generation with transformers ``generate`` (no vLLM):

    .venv-bench/bin/python bench/trl_grpo.py --model runs/bench/sft/weights/step_1000 --data prompts.jsonl \
        --output-dir /tmp/trl --max-steps 30 --result /tmp/trl/result.json [--wall-budget-s 200] [--launch-time T]

``--data`` is a JSONL file, one line per prompt in the order they are used (``{"prompt": [messages], "answer":
"..."}``): ``rl_vs_trl.py`` writes it from the environment's own train split, in the order primerl's orchestrator
draws examples (``EnvSampler``, seed 0), so both trainers see the same prompts in the same order.

Settings matched to ``examples/reverse_text_rl.toml`` (the demo) and primerl's defaults:

=========================================  =================================================================
primerl                                    TRL ``GRPOConfig`` here
=========================================  =================================================================
batch_size 64, rollouts_per_example 8      ``per_device_train_batch_size=64``, ``num_generations=8``,
                                           ``gradient_accumulation_steps=1``: 8 prompts x 8 rollouts a step
sampling.max_tokens 24, temperature 1      ``max_completion_length=24``, ``temperature=1.0``, ``top_p=1.0``,
                                           ``top_k=0`` (off), ``use_vllm=False``
advantage = reward - group mean            ``scale_rewards="none"`` (no std scaling)
no KL term                                 ``beta=0.0`` (no reference model)
loss: token sum / loss tokens of the step  ``loss_type="dapo"`` (normalised by the completion tokens of the
                                           whole batch); ``num_iterations=1`` (one update per generation, ratio 1)
AdamW lr 5e-4 constant, wd 0, betas        ``learning_rate=5e-4``, ``lr_scheduler_type="constant"``,
(0.9, 0.999), eps 1e-8, clip norm 1.0      ``warmup_steps=0``, ``weight_decay=0.0``, ``adam_beta1/2``,
                                           ``adam_epsilon=1e-8``, ``max_grad_norm=1.0``; fp32, CPU
example order: EnvSampler                  ``shuffle_dataset=False`` on the pre-ordered ``--data``
=========================================  =================================================================

Reward: ``lcs_reward_text`` is the environment's ``lcs_reward`` (examples/reverse_text) on the text of the last
assistant message, re-implemented here because this interpreter has no verifiers; tests/test_bench_reward.py
checks that the two agree on many completions.

The result file (JSON) holds the launch time, when the first rollouts were scored, the wall time at the end of
every optimizer step, each step's mean reward, and where the final model was saved (``--output-dir``/final,
a Hugging Face directory ``primerl eval`` serves). ``--wall-budget-s`` stops training at the first step end past
that many seconds after launch (the "equal wall time" run); ``--max-steps`` caps the steps either way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any


def normalize(text: str | None) -> str:
    """Letters separated by single spaces (the environment's ``normalize``)."""
    return " ".join((text or "").split())


def completion_text(completion: Any) -> str | None:
    """What verifiers' ``Parser.parse_answer`` returns for a completion: the string itself, or the content of the
    last assistant message (None when there is none)."""
    if isinstance(completion, str):
        return completion
    assistant = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    if not assistant:
        return None
    content = assistant[-1].get("content") or ""
    if isinstance(content, list):
        content = " ".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ).strip()
    return content if isinstance(content, str) else ""


def lcs_reward_text(completion: Any, answer: str) -> float:
    """The reverse-text reward: difflib's ratio between the answer's letters and the reversed string's (0..1)."""
    parsed = normalize(completion_text(completion)).split(" ")
    return SequenceMatcher(None, parsed, normalize(answer).split(" "), autojunk=False).ratio()


def read_prompts(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), list) or not isinstance(row.get("answer"), str):
                raise ValueError(
                    f"{path}:{number}: each line needs 'prompt' (a list of messages) and 'answer' (a string)"
                )
            rows.append({"prompt": row["prompt"], "answer": row["answer"]})
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory (the SFT checkpoint)")
    parser.add_argument("--data", type=Path, required=True, help="JSONL prompts in order (see the module doc)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True, help="where the timings (JSON) go")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument(
        "--wall-budget-s",
        type=float,
        default=None,
        help="stop at the first step end this long after launch (equal-wall-time runs)",
    )
    parser.add_argument(
        "--launch-time",
        type=float,
        default=None,
        help="Unix time the caller launched this process (default: when this module started)",
    )
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--rollouts-per-prompt", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true", help="do not save the final model")
    return parser


MODULE_START_TIME = time.time()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    launch_time = args.launch_time or MODULE_START_TIME
    if args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    rows = read_prompts(args.data)
    needed = args.max_steps * args.prompts_per_step
    if len(rows) < needed:
        raise ValueError(f"{args.data} has {len(rows)} prompts, {args.max_steps} steps need {needed}")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    timeline: dict[str, Any] = {
        "launch_time": launch_time,
        "first_rollouts_time": None,
        "step_end_times": [],
        "step_rewards": [],
        "num_threads": torch.get_num_threads(),
    }
    pending_rewards: list[float] = []

    def reverse_text_reward(prompts, completions, answer, **kwargs) -> list[float]:
        if timeline["first_rollouts_time"] is None:
            timeline["first_rollouts_time"] = time.time()
        rewards = [lcs_reward_text(c, a) for c, a in zip(completions, answer)]
        pending_rewards.extend(rewards)
        return rewards

    class Timeline(TrainerCallback):
        def on_step_end(self, train_args, state, control, **kwargs):
            now = time.time()
            timeline["step_end_times"].append(now)
            timeline["step_rewards"].append(sum(pending_rewards) / len(pending_rewards) if pending_rewards else None)
            pending_rewards.clear()
            if args.wall_budget_s is not None and now - launch_time >= args.wall_budget_s:
                control.should_training_stop = True
            return control

    config = GRPOConfig(
        output_dir=str(args.output_dir / "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.prompts_per_step * args.rollouts_per_prompt,
        gradient_accumulation_steps=1,
        num_generations=args.rollouts_per_prompt,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,
        scale_rewards="none",
        loss_type="dapo",
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        shuffle_dataset=False,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reverse_text_reward],
        args=config,
        train_dataset=Dataset.from_list(rows[:needed]),
        processing_class=tokenizer,
        callbacks=[Timeline()],
    )
    timeline["setup_done_time"] = time.time()
    trainer.train()
    timeline["train_end_time"] = time.time()
    timeline["num_steps"] = len(timeline["step_end_times"])
    if not args.no_save:
        final = args.output_dir / "final"
        trainer.save_model(str(final))
        tokenizer.save_pretrained(str(final))
        timeline["final_model"] = str(final)
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(timeline, indent=1))
    print(f"trl_grpo: {timeline['num_steps']} steps, result in {args.result}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

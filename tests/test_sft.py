"""`primerl sft`: chat samples tokenized with the assistant tokens as the only loss tokens, packed, trained."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.numerics import FLOAT32_EPS, assert_weights_match, machine_description

from primerl.proto import telemetry
from primerl.trainer.sft_data import as_training_samples, pack_for_ranks, read_chat_samples, tokenize_conversation

BIN = Path(sys.executable).parent


@pytest.fixture
def model_dir(small_tiny_model):
    return small_tiny_model


def reverse_dataset(path: Path, count: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            letters = [rng.choice("abcd") for _ in range(rng.randint(3, 6))]
            handle.write(
                json.dumps(
                    {
                        "prompt": [
                            {"role": "system", "content": "Reverse the letters."},
                            {"role": "user", "content": " ".join(letters)},
                        ],
                        "completion": [{"role": "assistant", "content": " ".join(reversed(letters))}],
                    }
                )
                + "\n"
            )
    return path


def test_only_assistant_tokens_are_loss_tokens(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "user", "content": "a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "d a"},
        {"role": "assistant", "content": "a d"},
    ]
    sample = tokenize_conversation(tokenizer, messages)
    assert sample.input_ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    loss_text = tokenizer.decode([t for t, keep in zip(sample.input_ids, sample.loss_mask) if keep])
    assert loss_text.replace("\n", "") == "c b a<|im_end|>a d<|im_end|>"


def test_packing_respects_seq_len_and_keeps_every_token(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = [
        tokenize_conversation(tokenizer, m) for m in read_chat_samples(reverse_dataset(tmp_path / "d.jsonl", 20))
    ]
    for num_ranks in (1, 2, 3):
        per_rank = pack_for_ranks(as_training_samples(samples), seq_len=96, num_ranks=num_ranks)
        assert len(per_rank) == num_ranks and all(per_rank)  # every rank gets its share
        batches = [b for batches in per_rank for b in batches]
        assert all(b.num_tokens <= 96 for b in batches)
        assert sum(b.num_tokens for b in batches) == sum(len(s.input_ids) for s in samples)
        assert sum(b.num_loss_tokens for b in batches) == sum(sum(s.loss_mask) for s in samples)


def test_a_rank_without_samples_gets_a_padding_micro_batch(model_dir, tmp_path):
    """Fewer samples than ranks (a small batch_size): the rank left over still has a micro-batch, with no loss."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sample = tokenize_conversation(tokenizer, read_chat_samples(reverse_dataset(tmp_path / "d.jsonl", 1))[0])
    first, second = pack_for_ranks(as_training_samples([sample]), seq_len=96, num_ranks=2, pad_token_id=7)
    assert first[0].num_loss_tokens == sum(sample.loss_mask)
    assert len(second) == 1 and second[0].input_ids.tolist() == [7] and second[0].num_loss_tokens == 0


def test_bad_dataset_lines_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        read_chat_samples(bad)
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="no assistant message"):
        read_chat_samples(bad)


@pytest.mark.slow
def test_sft_command_lowers_the_loss_and_exports_weights(model_dir, tmp_path):
    data = reverse_dataset(tmp_path / "reverse.jsonl")
    out = tmp_path / "out"
    result = subprocess.run(
        [
            str(BIN / "primerl"),
            "sft",
            "--model.name",
            str(model_dir),
            "--data.path",
            str(data),
            "--data.batch-size",
            "16",
            "--data.epochs",
            "6",
            "--optim.lr",
            "3e-3",
            "--seq-len",
            "256",
            "--output-dir",
            str(out),
            "--model.parallel",
            "ddp",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {row["role"] for row in rows} == {"sft"} and [row["step"] for row in rows] == list(range(1, 25))
    losses = [row[telemetry.SFT_LOSS] for row in rows]
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses
    from transformers import AutoModelForCausalLM

    weights = out / "weights" / "step_24"
    assert (weights / "STABLE").exists()
    AutoModelForCausalLM.from_pretrained(weights)
    # vLLM serves the exported weights, with logprobs equal to transformers'
    check = subprocess.run(
        [str(BIN / "primerl"), "generate", str(weights), "--num-prompts", "2", "--max-tokens", "8", "--check-logprobs"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


SFT_LR = 3e-3


def sft_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--model.name",
        str(model_dir),
        "--data.path",
        str(data),
        "--data.batch-size",
        "4",
        "--seq-len",
        "256",
        "--optim.lr",
        str(SFT_LR),
        "--output-dir",
        str(out),
        *extra,
    ]


def exported_tensors(weights: Path) -> dict:
    from safetensors.torch import load_file

    assert (weights / "STABLE").exists(), sorted(p.name for p in weights.parent.iterdir())
    return load_file(weights / "model.safetensors")


def smallest_adam_denominators(model_dir: Path, checkpoints: Path, steps: range) -> dict:
    """Per parameter element, the smallest AdamW denominator sqrt(v_hat) + eps over `steps`, from the optimizer
    state of each step's checkpoint (what `support.numerics.adam_weight_tolerance` needs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from primerl.configs.trainer import OptimizerConfig
    from primerl.trainer.optim import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    smallest: dict = {}
    for step in steps:
        optimizer = build_optimizer(model, OptimizerConfig())  # the run's groups; load_state_dict sets the rest
        optimizer.load_state_dict(torch.load(checkpoints / f"step_{step}" / "optimizer.pt", weights_only=True))
        for group in optimizer.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for param in group["params"]:
                state = optimizer.state[param]
                denominator = (state["exp_avg_sq"].double() / (1 - beta2 ** float(state["step"]))).sqrt() + eps
                smallest[param] = torch.minimum(smallest[param], denominator) if param in smallest else denominator
    return {name: smallest[param] for name, param in model.named_parameters()}


@pytest.mark.slow
def test_two_ranks_train_the_same_model_as_one(model_dir, tmp_path):
    """4 samples a step, mostly one micro-batch: with two ranks the orchestrator's packer splits the samples (before,
    rank 1 got none and the step failed). Same data order, same update: the weights match one rank's, up to
    float32's rounding of the gradients summed in another order, which AdamW turns into a whole step for an element
    whose gradient is that rounding (`support.numerics.adam_weight_tolerance`; the one-rank run checkpoints every
    step for its optimizer state)."""
    from primerl.configs.trainer import OptimizerConfig

    data = reverse_dataset(tmp_path / "reverse.jsonl", count=16)
    one = subprocess.run(
        [
            str(BIN / "primerl"),
            *sft_args(model_dir, data, tmp_path / "one", "--max-steps", "3", "--ckpt.interval", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node=2",
            str(BIN / "primerl"),
            *sft_args(model_dir, data, tmp_path / "two", "--max-steps", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one_weights = exported_tensors(tmp_path / "one" / "weights" / "step_3")
    two_weights = exported_tensors(tmp_path / "two" / "weights" / "step_3")
    denominators = smallest_adam_denominators(model_dir, tmp_path / "one" / "checkpoints", range(1, 4))
    # every element of the clipped gradient is <= max_norm, whose float32 spacing bounds its rounding difference
    machines = f"{machine_description()}; the runs: 1 rank, 2 under torchrun"
    print(
        assert_weights_match(
            one_weights,
            two_weights,
            denominators,
            lr=SFT_LR,
            num_steps=3,
            grad_rounding=FLOAT32_EPS * OptimizerConfig().max_norm,
            context=machines,
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]  # rank 0 alone writes the rows


@pytest.mark.slow
def test_fsdp2_with_two_ranks_is_refused_before_the_model_loads(model_dir, tmp_path):
    data = reverse_dataset(tmp_path / "reverse.jsonl", count=8)
    result = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node=2",
            str(BIN / "primerl"),
            *sft_args(model_dir, data, tmp_path / "out", "--max-steps", "2", "--model.parallel", "fsdp2"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "exitcode: 2" in output, output[-3000:]  # each rank: a config problem
    assert 'model.parallel = "fsdp2" with 2 ranks' in output and 'set model.parallel = "ddp"' in output
    assert "Loading weights" not in output and not (tmp_path / "out" / "weights").exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_sft_exits_non_zero_and_exports_only_the_step_reached(model_dir, tmp_path, signum):
    data = reverse_dataset(tmp_path / "reverse.jsonl")
    out = tmp_path / "out"
    log_path = tmp_path / "sft.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            [str(BIN / "primerl"), *sft_args(model_dir, data, out, "--max-steps", "100000", "--ckpt.interval", "1000")],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while "step=3 " not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        process.send_signal(signum)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    text = log_path.read_text()
    assert code == 128 + signum, text[-3000:]  # 130 for SIGINT, 143 for SIGTERM
    exported = [p.name for p in (out / "weights").iterdir()]
    assert len(exported) == 1 and exported[0] != "step_100000", exported
    reached = int(exported[0].removeprefix("step_"))
    assert 3 <= reached < 100000
    exported_tensors(out / "weights" / exported[0])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == reached
    assert f"interrupted by {signum.name} after step {reached} of 100000" in text
    assert not any(line.startswith("weights: ") for line in text.splitlines())  # the success line: final weights only
    # [ckpt]: the step reached is checkpointed, and a re-run resumes after it
    assert (out / "checkpoints" / f"step_{reached}" / "STABLE").exists()
    again = subprocess.run(
        [
            str(BIN / "primerl"),
            *sft_args(model_dir, data, out, "--max-steps", str(reached + 1), "--ckpt.interval", "1000"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"start_step={reached + 1}" in again.stdout + again.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, reached + 2))


@pytest.mark.slow
def test_the_same_sft_run_twice_gives_the_same_weights(model_dir, tmp_path):
    """The demo's first half is reproducible: data order, initialisation (a LoRA adapter's too) and every update
    come from data.seed, so two runs export identical tensors; another seed gives other weights."""
    data = reverse_dataset(tmp_path / "reverse.jsonl")
    lora = ["--model.lora.rank", "4"]
    weights = []
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        result = subprocess.run(
            [
                str(BIN / "primerl"),
                *sft_args(model_dir, data, tmp_path / name, "--max-steps", "4", "--data.seed", seed, *lora),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        weights.append(exported_tensors(tmp_path / name / "weights" / "step_4"))
    first, second, other_seed = weights
    assert all(first[name].equal(second[name]) for name in first)
    assert not all(first[name].equal(other_seed[name]) for name in first)

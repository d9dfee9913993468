"""`primerl sft`: chat samples tokenized with the assistant tokens as the only loss tokens, packed, trained."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.trainer.sft_data import pack_samples, read_chat_samples, tokenize_conversation
from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model",
                            TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1))


def reverse_dataset(path: Path, count: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            letters = [rng.choice("abcd") for _ in range(rng.randint(3, 6))]
            handle.write(json.dumps({"prompt": [{"role": "system", "content": "Reverse the letters."},
                                                {"role": "user", "content": " ".join(letters)}],
                                     "completion": [{"role": "assistant", "content": " ".join(reversed(letters))}]}) + "\n")
    return path


def test_only_assistant_tokens_are_loss_tokens(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "c b a"},
                {"role": "user", "content": "d a"}, {"role": "assistant", "content": "a d"}]
    sample = tokenize_conversation(tokenizer, messages)
    assert sample.input_ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    loss_text = tokenizer.decode([t for t, keep in zip(sample.input_ids, sample.loss_mask) if keep])
    assert loss_text.replace("\n", "") == "c b a<|im_end|>a d<|im_end|>"


def test_packing_respects_seq_len_and_keeps_every_token(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = [tokenize_conversation(tokenizer, m) for m in read_chat_samples(reverse_dataset(tmp_path / "d.jsonl", 20))]
    batches = pack_samples(samples, seq_len=96)
    assert all(b.num_tokens <= 96 for b in batches)
    assert sum(b.num_tokens for b in batches) == sum(len(s.input_ids) for s in samples)
    assert sum(b.num_loss_tokens for b in batches) == sum(sum(s.loss_mask) for s in samples)


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
        [str(BIN / "primerl"), "sft", "--model.name", str(model_dir), "--data.path", str(data), "--data.batch-size", "16",
         "--data.epochs", "6", "--optim.lr", "3e-3", "--seq-len", "256", "--output-dir", str(out), "--model.parallel", "ddp"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {row["role"] for row in rows} == {"sft"} and [row["step"] for row in rows] == list(range(1, 25))
    losses = [row["sft/loss"] for row in rows]
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses
    from transformers import AutoModelForCausalLM

    weights = out / "weights" / "step_24"
    assert (weights / "STABLE").exists()
    AutoModelForCausalLM.from_pretrained(weights)
    # vLLM serves the exported weights, with logprobs equal to transformers'
    check = subprocess.run([str(BIN / "primerl"), "generate", str(weights), "--num-prompts", "2", "--max-tokens", "8",
                            "--check-logprobs"], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]

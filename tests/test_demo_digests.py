"""The demo's inputs are byte-identical on every machine: the tiny model and its tokenizer (`primerl
init-tiny-model`), the SFT data (`primerl sft-data reverse-text` and the chatty rewrite, as `make run` makes them)
and the token ids SFT trains on. Their sha256 digests are pinned here, so drift (a new transformers, tokenizers or
verifiers release, a change to the builder, the environment or the chat template) fails CI instead of moving the
README's figures silently. Fast: nothing is trained.

When a digest changes on purpose, re-run `make run`, put the new figures in the docs and the new digests here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(ROOT / ".venv-envs" / "bin" / "python"))

# runs/demo/tiny-model/ (`primerl init-tiny-model`, seed 0, the default shape)
TINY_MODEL_DIGESTS = {
    "model.safetensors": "3e5c2fe17842cb947abab4807824925af28df6f9a0a4eca5e9419a957154de55",
    "tokenizer.json": "7b21b33d0cd720e6cff39421521a9e4b3b7413cb2e866d977140411346ef4490",
    "tokenizer_config.json": "2403d5896f2fea7775a0e19fea1e922ef3b31f4a84c10b61e2969a12ec6f6e54",
    "chat_template.jinja": "2eefca287a0f008b170ce31bc2c4dabb398a64eb74716bf64db5d9a21da50da9",
    "generation_config.json": "e9506ca20cd0a3f7a57f4114555c44856bd90147bf41a349415ef0cae60ff8a1",
    "primerl_tiny_model.json": "351c85778126becfc2859ce746ea449154f88ae9dfae745721e573739dbca4db",
}
# config.json without its "transformers_version" (canonical JSON: sorted keys)
TINY_MODEL_CONFIG_DIGEST = "0518bf6508412edfbb8b0d29194720000d23e2b139fd0b62b366dc618a820b89"
# runs/demo/sft/clean.jsonl (`primerl sft-data reverse-text`) and data.jsonl (examples/reverse_text/chatty_sft_data.py)
SFT_CLEAN_DIGEST = "569d886c0c15695011e024baede265910fb5f50651735b43b8b8a631d50a563a"
SFT_DATA_DIGEST = "a26c4ac3a9d60614f9fb7a95379d0555bce3b695b28e960256be449a1dad6d45"
# the token ids and loss masks `primerl sft` trains on (trainer.sft_data.tokenize_conversation over data.jsonl)
SFT_TOKENS_DIGEST = "55a510e1581fc35fd8cf1c1d0f4a61fc47c277df0164d07b38b03e6ddb63b052"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def config_digest(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def tokens_digest(model_dir: Path, data: Path) -> str:
    from transformers import AutoTokenizer

    from primerl.trainer.sft_data import read_chat_samples, tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    digest = hashlib.sha256()
    for messages in read_chat_samples(data):
        sample = tokenize_conversation(tokenizer, messages)
        digest.update(json.dumps([sample.input_ids, [int(m) for m in sample.loss_mask]]).encode() + b"\n")
    return digest.hexdigest()


def test_tiny_model_files_are_the_pinned_bytes(tiny_model: Path):
    """The session's build of the default spec (conftest) is the demo's model, byte for byte."""
    assert {name: sha256(tiny_model / name) for name in TINY_MODEL_DIGESTS} == TINY_MODEL_DIGESTS
    assert config_digest(tiny_model) == TINY_MODEL_CONFIG_DIGEST


@pytest.mark.skipif(not Path(ENV_PYTHON).exists(), reason=f"no env interpreter at {ENV_PYTHON} (make setup)")
def test_sft_data_and_its_tokens_are_the_pinned_bytes(tiny_model: Path, tmp_path: Path):
    """`make run`'s two data steps through the user's commands, then the tokenization SFT trains on."""
    env = {**os.environ, "PRIMERL_ENV_PYTHON": ENV_PYTHON, "HF_HUB_OFFLINE": "1"}
    clean, data = tmp_path / "clean.jsonl", tmp_path / "data.jsonl"
    result = subprocess.run(
        [str(BIN / "primerl"), "sft-data", "reverse-text", "-o", str(clean)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reverse_text" / "chatty_sft_data.py"), str(clean), str(data)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (sha256(clean), sha256(data)) == (SFT_CLEAN_DIGEST, SFT_DATA_DIGEST)
    assert tokens_digest(tiny_model, data) == SFT_TOKENS_DIGEST

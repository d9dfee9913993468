"""The tiny model builder: deterministic files, loadable by transformers, ChatML template, shape validation."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from primerl.cli import tiny_model as tiny_model_cli
from primerl.trainer.tiny_model import (
    IM_END,
    IM_START,
    SPEC_FILE,
    TinyModelSpec,
    build_tiny_model,
    count_parameters,
    read_spec,
    train_tokenizer,
)

SMALL = TinyModelSpec(seed=0, hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1)


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture
def default_model(tiny_model: Path) -> Path:
    return tiny_model  # the session's build of the default spec (conftest)


def test_same_seed_gives_identical_files_and_other_seed_other_weights(tmp_path: Path) -> None:
    import torch

    rng_state = torch.random.get_rng_state()
    first = file_hashes(build_tiny_model(tmp_path / "a", SMALL))
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # the caller's RNG is left alone
    second = file_hashes(build_tiny_model(tmp_path / "b", SMALL))
    other = file_hashes(build_tiny_model(tmp_path / "c", TinyModelSpec(**{**vars(SMALL), "seed": 1})))

    assert first == second
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        SPEC_FILE,
    } <= set(first)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_build_refuses_non_empty_dir_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        build_tiny_model(out, SMALL)
    assert (out / "precious.txt").read_text() == "keep me"

    build_tiny_model(out, SMALL, overwrite=True)
    assert not (out / "precious.txt").exists()
    assert read_spec(out) == SMALL
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directories left behind


def test_default_model_loads_in_transformers_and_generates(default_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model)
    assert model.dtype == torch.float32
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokenizer)
    assert tokenizer.eos_token == IM_END
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.pad_token_id is not None and model.generation_config.pad_token_id == tokenizer.pad_token_id

    inputs = tokenizer(["Reverse the string: a b c", "hello"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    output = model.generate(**inputs, max_new_tokens=5, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    assert output.shape[0] == 2 and output.shape[1] >= inputs["input_ids"].shape[1] + 1


def test_parameter_count_is_small(default_model: Path) -> None:
    num_params = count_parameters(default_model)
    assert 100_000 < num_params < 3_000_000


def test_chat_template_renders_chatml(default_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse: a b c"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nReverse: a b c{IM_END}\n{IM_START}assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(ids) == tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3  # special tokens stay single tokens
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith(f"{IM_START}assistant\n")


def test_tokenizer_round_trips_any_text_and_matches_trained_bpe(default_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    trained = train_tokenizer()
    for text in ["Reverse the string: abcdhgfe", "héllo wörld 日本 🙂\ttabs\n\nnewlines", "x = [1, 2, 3]; y += 4"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert trained.encode(text).ids == ids
    # The toy task's strings: spaced letters and digits are one token per character.
    assert len(tokenizer.encode(" a b c d e f g h")) == 8
    assert len(tokenizer.encode("31415926")) == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 100}, "head_dim"),
        ({"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}, "head_dim"),
        ({"num_attention_heads": 3}, "divisible"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"vocab_size": 10}, "vocab_size"),
    ],
)
def test_invalid_shapes_raise_clear_value_errors(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path / "model", TinyModelSpec(**overrides))
    assert not (tmp_path / "model").exists()


def test_cli_builds_is_idempotent_and_reports_bad_values(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "m"
    args = [str(out), "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--layers", "1"]
    assert tiny_model_cli.main(args) == 0
    assert "parameters" in capsys.readouterr().out
    assert tiny_model_cli.main(args) == 0  # same options: nothing to do
    assert "nothing to do" in capsys.readouterr().out
    assert tiny_model_cli.main(args + ["--seed", "1"]) == 2  # other options: refuses to overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert tiny_model_cli.main(args + ["--seed", "1", "--overwrite"]) == 0
    assert read_spec(out).seed == 1

    assert tiny_model_cli.main([str(tmp_path / "bad"), "--hidden", "100"]) == 2
    assert "head_dim" in capsys.readouterr().err
    assert tiny_model_cli.main([str(tmp_path / "bad"), "--hidden", "abc"]) == 2
    assert "invalid int value" in capsys.readouterr().err
    assert tiny_model_cli.main(["--help"]) == 0
    assert "init-tiny-model" in capsys.readouterr().out

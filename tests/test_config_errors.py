"""Config mistakes get specific messages: cross-field rules, unknown keys (with suggestions), wrong types and
bounds, TOML errors, mixed shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.rl_configs import BASE, LAB, VF_RL, config_writer, error_of, load

from primerl.configs.rl_shapes import detect_shape
from primerl.runtime.config_base import ConfigError


@pytest.fixture
def write(tmp_path: Path):
    return config_writer(tmp_path)


@pytest.fixture
def base(write) -> Path:
    return write("base.toml", BASE)


# --- cross-field rules -------------------------------------------------------------------------------------------


def test_batch_size_divisibility_names_nearest_values(base: Path) -> None:
    message = error_of(base, "--orchestrator.batch-size", "100", "--orchestrator.rollouts-per-example", "16")
    assert "batch_size (100) must be divisible by rollouts_per_example (16)" in message
    assert "batch_size = 96 or 112" in message and "rollouts_per_example = 10 or 20" in message
    assert "`orchestrator`" in message


def test_more_rollout_peers_than_the_broker_admits(base: Path) -> None:
    message = error_of(base, "--trainer-gpu-ids", "[1, 2, 3]", "--broker.max-rollout-connections", "3")
    assert (
        "broker.max_rollout_connections (3) is less than the rollout peers of this run: 3 trainer ranks + 1 "
        "orchestrator = 4; set broker.max_rollout_connections = 4 or more" in message
    )


def test_fsdp2_with_several_trainer_ranks_is_refused_before_the_start(base: Path) -> None:
    message = error_of(base, "--trainer-gpu-ids", "[1, 2]", "--trainer.model.parallel", "fsdp2")
    assert 'trainer.model.parallel = "fsdp2" with 2 trainer ranks' in message
    assert 'set [trainer.model] parallel = "ddp", or leave it unset' in message


def test_several_trainer_ranks_with_parallel_unset_are_fine(base: Path) -> None:
    config = load("@", base, "--trainer-gpu-ids", "[1, 2]")
    assert config.trainer.model.parallel in (None, "ddp")


def test_max_model_len_below_seq_len(base: Path) -> None:
    message = error_of(base, "--inference.model.max-model-len", "512")
    assert "inference.model.max_model_len (512) is smaller than seq_len (1024)" in message
    assert "max_model_len >= 1024" in message


def test_max_model_len_equal_or_above_seq_len_is_fine(base: Path) -> None:
    assert load("@", base, "--inference.model.max-model-len", "1024").inference.model.max_model_len == 1024
    assert load("@", base, "--inference.model.max-model-len", "4096").inference.model.max_model_len == 4096


def test_lora_rank_above_max_lora_rank(base: Path) -> None:
    message = error_of(base, "--trainer.model.lora.rank", "64", "--inference.max-lora-rank", "32")
    assert "inference.max_lora_rank (32) is smaller than trainer.model.lora.rank (64)" in message
    assert "max_lora_rank = 64" in message


def test_max_lora_rank_follows_lora_rank_when_unset(base: Path) -> None:
    config = load("@", base, "--trainer.model.lora.rank", "20")
    assert config.inference.enable_lora is True
    assert config.inference.max_lora_rank == 32  # the next rank vLLM accepts
    assert config.trainer.weight_broadcast.type == "lora"


def test_lora_broadcast_with_lora_disabled_in_inference(base: Path) -> None:
    message = error_of(base, "--trainer.model.lora.rank", "8", "--inference.enable-lora", "false")
    assert "inference.enable_lora = false" in message


def test_overlapping_gpu_ids(base: Path) -> None:
    message = error_of(base, "--trainer-gpu-ids", "[0,1]")
    assert "GPUs [0] are in both inference_gpu_ids [0] and trainer_gpu_ids [0, 1]" in message


def test_inference_gpus_must_match_parallelism(base: Path) -> None:
    assert load("@", base, "--inference-gpu-ids", "[0,2]").inference.parallel.dp == 2
    message = error_of(base, "--inference-gpu-ids", "[0,2]", "--inference.parallel.dp", "1")
    assert "inference_gpu_ids has 2" in message


def test_min_reward_above_max_reward(base: Path) -> None:
    message = error_of(
        base,
        "--orchestrator.buffer.online-difficulty-filtering",
        "--orchestrator.buffer.min-reward",
        "0.9",
        "--orchestrator.buffer.max-reward",
        "0.1",
    )
    assert "`orchestrator.buffer`" in message and "min_reward (0.9) must be <= max_reward (0.1)" in message


def test_min_reward_above_max_reward_in_lab_shape(write) -> None:
    path = write("lab.toml", LAB + "[difficulty_filter]\nmin_reward = 0.9\nmax_reward = 0.1\n")
    assert "min_reward (0.9) must be <= max_reward (0.1)" in error_of(path)


def test_micro_batch_size_times_ranks_must_divide_batch_size(base: Path) -> None:
    message = error_of(base, "--trainer.micro-batch-size", "3")
    assert "micro_batch_size x trainer ranks = 3 x 1 = 3" in message and "batch_size = 15 or 18" in message
    assert load("@", base, "--trainer.micro-batch-size", "4").trainer.micro_batch_size == 4


def test_weight_broadcast_lora_requires_lora(base: Path) -> None:
    message = error_of(base, "--trainer.weight-broadcast.type", "lora")
    assert 'weight_broadcast.type = "lora" needs LoRA training' in message


def test_conflicting_oversampling_factor(write) -> None:
    path = write("c.toml", BASE + "[orchestrator.buffer]\noversampling_factor = 3.0\n")
    message = error_of(path, "--orchestrator.oversampling-factor", "2")
    assert "oversampling_factor is set twice" in message
    assert load("@", path).orchestrator.oversampling_factor == 3.0  # alone, buffer-level is accepted


def test_buffer_type_alias_and_conflict(base: Path) -> None:
    config = load("@", base, "--orchestrator.buffer.type", "online-difficulty")
    assert config.orchestrator.buffer.online_difficulty_filtering is True
    message = error_of(
        base, "--orchestrator.buffer.type", "online-difficulty", "--no-orchestrator.buffer.online-difficulty-filtering"
    )
    assert "contradicts online_difficulty_filtering = false" in message


def test_lora_and_experimental_lora_together(base: Path) -> None:
    message = error_of(base, "--trainer.model.lora.rank", "8", "--trainer.model.experimental.lora.rank", "8")
    assert "LoRA is set twice" in message


def test_missing_model_name(write) -> None:
    path = write("m.toml", "[[orchestrator.env]]\nid = 'x'\n")
    assert '`[model] name = "..."`' in error_of(path)


def test_broker_tls_needs_both_files(base: Path) -> None:
    assert "set both `tls_cert_path` and `tls_key_path`" in error_of(base, "--broker.tls-cert-path", "c.pem")


def test_broker_beyond_loopback_needs_token(base: Path) -> None:
    assert "set `run_token`" in error_of(base, "--broker.host", "0.0.0.0")
    config = load("@", base, "--broker.host", "0.0.0.0", "--broker.run-token", "s3cret")
    assert config.trainer.broker.run_token == "s3cret" and config.trainer.broker.address == "127.0.0.1:50051"


def test_several_cross_field_problems_are_listed_one_by_one(base: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load("@", base, "--trainer-gpu-ids", "[0]", "--inference.model.max-model-len", "512")
    assert len(info.value.problems) == 2 and "2 problems" in str(info.value)


def test_several_problems_are_listed_together(base: Path) -> None:
    message = error_of(base, "--orchestrator.bach-size", "64", "--trainer.optim.lr", "fast")
    assert "2 problems" in message
    assert "unknown key `orchestrator.bach_size`" in message and "`trainer.optim.lr`: expected a number" in message


# --- unknown keys, types, TOML ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--orchestrator.bach-size", "unknown key `orchestrator.bach_size`; did you mean `batch_size`?"),
        ("--trainer.model.lora.rnak", "unknown key `trainer.model.lora.rnak`; did you mean `rank`?"),
        (
            "--orchestrator.sampling.temprature",
            "unknown key `orchestrator.sampling.temprature`; did you mean `temperature`?",
        ),
        ("--trainer.ckpt.keep-lst", "unknown key `trainer.ckpt.keep_lst`; did you mean `keep_last`?"),
        ("--inference.model.tool-call-parse", "did you mean `tool_call_parser`?"),
        ("--wandb.projec", "unknown key `wandb.projec`; did you mean `project`?"),
    ],
)
def test_unknown_key_with_suggestion(base: Path, override: str, expected: str) -> None:
    message = error_of(base, override, "1")
    assert expected in message
    assert message.count("unknown key") == 1  # shared tables are not copied (and reported) into every role


def test_unknown_key_inside_array_of_tables(write) -> None:
    path = write("e.toml", BASE.replace('id = "reverse-text"', 'idd = "reverse-text"'))
    message = error_of(path)
    assert "unknown key `orchestrator.env[0].idd`; did you mean `id`?" in message


def test_unknown_key_inside_discriminated_union(base: Path) -> None:
    message = error_of(base, "--trainer.loss.type", "grpo", "--trainer.loss.eps-lo", "0.1")
    assert "unknown key `trainer.loss.eps_lo`; did you mean `eps_low`?" in message


def test_unknown_loss_type(base: Path) -> None:
    message = error_of(base, "--trainer.loss.type", "ppo")
    assert "`trainer.loss.type`: expected one of 'default', 'grpo', 'cispo', 'ipo', 'icepop', got \"ppo\"" in message


def test_unknown_top_level_key_without_close_match_lists_valid_keys(write) -> None:
    message = error_of(write("u.toml", BASE + "\n[zzz]\nq = 1\n"))
    assert "unknown key `zzz`; valid keys here:" in message and "orchestrator" in message


def test_unknown_key_in_lab_shape(write) -> None:
    message = error_of(write("l.toml", LAB.replace("batch_size", "bach_size")))
    assert "unknown key `bach_size`; did you mean `batch_size`? [flat lab shape]" in message
    message = error_of(write("l2.toml", LAB + "[sampling]\ntemprature = 0.5\n"))
    assert "unknown key `sampling.temprature`; did you mean `temperature`?" in message
    message = error_of(write("l3.toml", LAB + "[lora]\nrank = 8\n"))
    assert "unknown key `lora.rank`; did you mean `r`?" in message


def test_unknown_key_in_legacy_shape(write) -> None:
    message = error_of(write("v.toml", VF_RL + "learning_rat = 1e-5\n"))
    assert "unknown key `trainer.args.learning_rat`; did you mean `learning_rate`? [legacy vf-rl shape]" in message
    message = error_of(write("v2.toml", VF_RL + "[inference.args]\ntool_call_parsr = 'hermes'\n"))
    assert "unknown key `inference.args.tool_call_parsr`; did you mean `tool_call_parser`?" in message
    message = error_of(write("v3.toml", "max_steps = 3\n" + VF_RL))
    assert "`max_steps` goes under [trainer.args]" in message


def test_union_section_as_string(base: Path) -> None:
    message = error_of(base, "--trainer.loss", '"grpo"')
    assert '`trainer.loss` must be a table, not a string ("grpo")' in message and 'type = "grpo"' in message


def test_activation_checkpointing_as_string(write) -> None:
    path = write("ac.toml", BASE + '\n[trainer.model]\nac = "full"\n')
    message = error_of(path)
    assert '`trainer.model.ac` must be a table, not a string ("full")' in message
    assert "[trainer.model.ac]\n  freq = 1" in message


@pytest.mark.parametrize(
    ("override", "value", "expected"),
    [
        ("--orchestrator.batch-size", "abc", '`orchestrator.batch_size`: expected an integer, got string "abc"'),
        ("--orchestrator.sampling.temperature", "hot", "`orchestrator.sampling.temperature`: expected a number"),
        ("--orchestrator.sampling.stop", "[1]", "`orchestrator.sampling.stop[0]`: expected a string, got integer 1"),
        ("--inference-gpu-ids", '"0,1"', "`inference_gpu_ids`: expected an array"),
        ("--orchestrator.env", '"x"', "`orchestrator.env`: expected an array"),
        (
            "--trainer.model.optimization-dtype",
            "bfloat",
            "expected 'bfloat16' or 'float32', got \"bfloat\"; did you mean \"bfloat16\"?",
        ),
        (
            "--inference.gpu-memory-utilization",
            "1.5",
            "`inference.gpu_memory_utilization`: must be less than or equal to 1 (got 1.5)",
        ),
        ("--orchestrator.env", "[]", "`orchestrator.env` needs at least 1 item(s)"),
    ],
)
def test_wrong_types_and_bounds(base: Path, override: str, value: str, expected: str) -> None:
    assert expected in error_of(base, override, value)


def test_toml_syntax_error_names_file_and_line(write) -> None:
    path = write("bad.toml", "[model]\nname = 'x'\nmax_steps = = 3\n")
    message = error_of(path)
    assert str(path) in message and "line 3" in message and "max_steps = = 3" in message


def test_missing_file(tmp_path: Path) -> None:
    message = error_of(tmp_path / "nope.toml")
    assert "config file not found" in message and "nope.toml" in message


def test_mixed_shapes(write) -> None:
    message = error_of(write("mix.toml", LAB + "[orchestrator]\nseq_len = 10\n"))
    assert "mixes config shapes" in message
    assert "`batch_size`: flat lab shape" in message and "`orchestrator`: prime-rl shape" in message
    assert "`batch_size` -> `orchestrator.batch_size`" in message
    message = error_of(write("mix2.toml", VF_RL + "[orchestrator]\nseq_len = 10\n"))
    assert "legacy vf-rl shape" in message and "prime-rl shape" in message


def test_shape_detection() -> None:
    assert detect_shape({"model": {"name": "x"}, "orchestrator": {}}) == "prime-rl"
    assert detect_shape({"model": "x", "max_steps": 3}) == "prime-rl"  # model string is shorthand everywhere
    assert detect_shape({"model": "x", "env": [{"id": "e"}]}) == "lab"
    assert detect_shape({"model": "x", "env": {"id": "e"}}) == "vf-rl"
    assert detect_shape({"trainer": {"gpus": 1}}) == "vf-rl"
    assert detect_shape({"max_steps": 3}) == "prime-rl"
    with pytest.raises(ConfigError, match="mixes config shapes"):
        detect_shape({"trainer": {"gpus": 1, "optim": {}}})

"""Config mistakes get specific messages; layering, command-line overrides and the dry run behave as documented."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
import typing
from pathlib import Path

import pydantic
import pytest

from primerl.broker.config import BrokerConfig
from primerl.cli.rl import main as rl_main
from primerl.cli.rl_config import RLConfig
from primerl.inference.config import InferenceConfig
from primerl.orchestrator.config import OrchestratorConfig
from primerl.runtime.config_base import ConfigError, ConfigWarning
from primerl.runtime.config_loader import (
    dump_toml,
    load_config,
    load_role_config,
    parse_config_args,
    parse_override_value,
)
from primerl.cli.config_shapes import LAB_SAMPLING_KEYS, detect_shape
from primerl.trainer.config import TrainerConfig

BASE = """
inference_gpu_ids = [0]
trainer_gpu_ids = [1]
max_steps = 10
seq_len = 1024

[model]
name = "tiny-model"

[orchestrator]
batch_size = 16
rollouts_per_example = 4

[[orchestrator.env]]
id = "reverse-text"
args = { max_len = 8 }
"""

LAB = """
model = "tiny-model"
batch_size = 16
rollouts_per_example = 4

[[env]]
id = "reverse-text"
"""

VF_RL = """
model = "tiny-model"

[env]
id = "reverse-text"

[trainer.args]
batch_size = 16
rollouts_per_example = 4
"""


@pytest.fixture
def write(tmp_path: Path):
    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def base(write) -> Path:
    return write("base.toml", BASE)


def load(*argv: str | Path, **overrides) -> RLConfig:
    return load_config(RLConfig, [str(a) if isinstance(a, Path) else a for a in argv], overrides or None)


def error_of(*argv: str | Path) -> str:
    with pytest.raises(ConfigError) as info:
        load("@", *argv) if argv and isinstance(argv[0], Path) else load(*argv)
    return str(info.value)


# --- cross-field rules -------------------------------------------------------------------------------------------


def test_batch_size_divisibility_names_nearest_values(base: Path) -> None:
    message = error_of(base, "--orchestrator.batch-size", "100", "--orchestrator.rollouts-per-example", "16")
    assert "batch_size (100) must be divisible by rollouts_per_example (16)" in message
    assert "batch_size = 96 or 112" in message and "rollouts_per_example = 10 or 20" in message
    assert "`orchestrator`" in message


def test_more_rollout_peers_than_the_broker_admits(base: Path) -> None:
    message = error_of(base, "--trainer-gpu-ids", "[1, 2, 3]", "--broker.max-rollout-connections", "3")
    assert "broker.max_rollout_connections (3) is less than the rollout peers of this run: 3 trainer ranks + 1 " \
           "orchestrator = 4; set broker.max_rollout_connections = 4 or more" in message


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
    message = error_of(base, "--orchestrator.buffer.online-difficulty-filtering",
                       "--orchestrator.buffer.min-reward", "0.9", "--orchestrator.buffer.max-reward", "0.1")
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
    message = error_of(base, "--orchestrator.buffer.type", "online-difficulty",
                       "--no-orchestrator.buffer.online-difficulty-filtering")
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
        ("--orchestrator.sampling.temprature", "unknown key `orchestrator.sampling.temprature`; did you mean "
                                               "`temperature`?"),
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
    assert "`trainer.loss.type`: expected one of 'default', 'grpo', 'cispo', got \"ppo\"" in message


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
        ("--trainer.model.optimization-dtype", "bfloat", "expected 'bfloat16' or 'float32', got \"bfloat\"; "
                                                         "did you mean \"bfloat16\"?"),
        ("--inference.gpu-memory-utilization", "1.5", "`inference.gpu_memory_utilization`: must be less than or "
                                                      "equal to 1 (got 1.5)"),
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


# --- translations of the lab and vf-rl shapes ------------------------------------------------------------------


def test_lab_lora_and_kl_only_when_enabled(write) -> None:
    config = load("@", write("l.toml", LAB + "[lora]\nenabled = false\nr = 8\n[kl_penalty]\nenabled = false\n"))
    assert config.trainer.model.lora is None and config.trainer.kl is None
    assert config.trainer.weight_broadcast.type == "full" and config.inference.enable_lora is False


def test_lab_sampling_keys_exist_in_orchestrator() -> None:
    assert LAB_SAMPLING_KEYS <= set(OrchestratorConfig.model_fields["sampling"].annotation.model_fields)


def test_vf_rl_translation(write) -> None:
    text = VF_RL + textwrap.dedent("""
        learning_rate = 3e-5
        lr_scheduler_type = "cosine"
        warmup_steps = 5
        max_grad_norm = 0.5
        temperature = 0.8
        top_k = 20
        use_lora = false
        bf16 = true
        gradient_checkpointing = true
        beta = 0.05
        [trainer]
        gpus = 2
        [inference]
        gpus = 1
        [inference.args]
        gpu_memory_utilization = 0.5
        max_model_len = 4096
        dtype = "bfloat16"
        reasoning_parser = "qwen3"
    """)
    config = load("@", write("v.toml", text))
    assert config.inference_gpu_ids == [0] and config.trainer_gpu_ids == [1, 2]
    trainer = config.trainer
    assert trainer.optim.lr == 3e-5 and trainer.optim.max_norm == 0.5
    assert trainer.scheduler.type == "cosine" and trainer.scheduler.warmup_steps == 5
    assert trainer.model.lora is None and trainer.model.optimization_dtype == "bfloat16"
    assert trainer.model.ac.freq == 1 and trainer.kl.beta == 0.05
    assert config.orchestrator.sampling.temperature == 0.8 and config.orchestrator.sampling.top_k == 20
    assert config.inference.gpu_memory_utilization == 0.5 and config.inference.model.dtype == "bfloat16"
    assert config.inference.model.reasoning_parser == "qwen3"


def test_vf_rl_unknown_scheduler(write) -> None:
    message = error_of(write("v.toml", VF_RL + 'lr_scheduler_type = "polynomial"\n'))
    assert "lr_scheduler_type" in message and "cosine" in message


# --- layering and overrides -------------------------------------------------------------------------------------


def test_later_files_win_with_deep_merge(base: Path, write) -> None:
    first = write("a.toml", "[orchestrator.sampling]\ntemperature = 0.5\nmax_tokens = 64\n")
    second = write("b.toml", """
        max_steps = 20
        [orchestrator.sampling]
        temperature = 0.9
        [[orchestrator.env]]
        id = "other-env"
    """)
    config = load("@", base, "@", first, f"@{second}")
    assert config.max_steps == 20 and config.trainer.max_steps == 20
    assert config.orchestrator.sampling.temperature == 0.9  # later file wins
    assert config.orchestrator.sampling.max_tokens == 64  # tables merge
    assert config.orchestrator.batch_size == 16  # from the first file
    assert [e.id for e in config.orchestrator.env] == ["other-env"]  # arrays replace


def test_files_in_different_shapes_merge(base: Path, write) -> None:
    lab_override = write("lab.toml", "batch_size = 32\n[sampling]\nmax_tokens = 99\n")
    config = load("@", base, "@", lab_override)
    assert config.orchestrator.batch_size == 32 and config.orchestrator.sampling.max_tokens == 99


def test_overrides_win_over_files(base: Path) -> None:
    config = load("@", base, "--orchestrator.batch-size", "64", "--trainer.optim.lr=3e-6",
                  "--orchestrator.sampling.stop", '["</s>", "###"]', "--inference-gpu-ids=[2,3]")
    assert config.orchestrator.batch_size == 64 and config.trainer.optim.lr == 3e-6
    assert config.orchestrator.sampling.stop == ["</s>", "###"] and config.inference_gpu_ids == [2, 3]
    assert config.inference.parallel.dp == 2


def test_overrides_as_keyword_dict(base: Path) -> None:
    config = load_config(RLConfig, [base], {"orchestrator.batch_size": 32, "trainer": {"optim": {"lr": 2e-6}}})
    assert config.orchestrator.batch_size == 32 and config.trainer.optim.lr == 2e-6


def test_boolean_overrides(base: Path) -> None:
    config = load("@", base, "--orchestrator.zero-truncated-completions", "--no-orchestrator.mask-truncated-"
                  "completions", "--orchestrator.buffer.online-difficulty-filtering")
    assert config.orchestrator.zero_truncated_completions is True
    assert config.orchestrator.mask_truncated_completions is False
    assert config.orchestrator.buffer.online_difficulty_filtering is True


def test_override_of_unknown_key_suggests(base: Path) -> None:
    message = error_of(base, "--trainer.optim.learning-rate", "1e-5")
    assert "unknown key `trainer.optim.learning_rate`" in message


def test_lab_shaped_overrides(write) -> None:
    config = load("@", write("l.toml", LAB), "--batch-size", "32", "--learning-rate", "2e-5")
    assert config.orchestrator.batch_size == 32 and config.trainer.optim.lr == 2e-5


def test_explicit_role_value_wins_over_shared(base: Path) -> None:
    config = load("@", base, "--seq-len", "8192", "--orchestrator.seq-len", "4096")
    assert config.orchestrator.seq_len == 4096 and config.trainer.seq_len == 8192
    assert config.inference.model.max_model_len == 8192


def test_model_name_mismatch_warns(base: Path) -> None:
    with pytest.warns(ConfigWarning, match="inference.model.name = 'other' differs from the run's model"):
        config = load("@", base, "--inference.model.name", "other")
    assert config.inference.model.name == "other" and config.trainer.model.name == "tiny-model"


def test_parse_config_args() -> None:
    parsed = parse_config_args(
        ["@", "a.toml", "@b.toml", "c.toml", "--x.y-z", "64", "--lr=1e-5", "--flag", "--no-other", "--ids",
         "[0, 1]", "--name", "Qwen/Qwen3-4B", "--quoted", '"7"', "--dry-run", "--write", "out", "--last"],
        cli_flags={"--dry-run"}, cli_options={"--write"},
    )
    assert parsed.files == [Path("a.toml"), Path("b.toml"), Path("c.toml")]
    assert parsed.overrides == {"x": {"y_z": 64}, "lr": 1e-5, "flag": True, "other": False, "ids": [0, 1],
                                "name": "Qwen/Qwen3-4B", "quoted": "7", "last": True}
    assert parsed.rest == ["--dry-run", "--write", "out"]


def test_parse_config_args_errors() -> None:
    with pytest.raises(ConfigError, match="`@` must be followed by a config file"):
        parse_config_args(["@"])
    with pytest.raises(ConfigError, match="conflicts with --a"):
        parse_config_args(["--a", "1", "--a.b", "2"])


def test_parse_override_value() -> None:
    assert parse_override_value("64") == 64 and parse_override_value("1e-5") == 1e-5
    assert parse_override_value("true") is True and parse_override_value("[0,1]") == [0, 1]
    assert parse_override_value('"x"') == "x" and parse_override_value("hermes") == "hermes"
    assert parse_override_value("2024-01-01") == "2024-01-01"


# --- role configs on their own ----------------------------------------------------------------------------------


def test_role_config_from_argv(write) -> None:
    path = write("trainer.toml", "[model]\nname = 'tiny'\n[optim]\nlr = 1e-6\n")
    config = load_config(TrainerConfig, ["@", str(path), "--optim.lr", "1e-5", "--model.lora.rank", "4"])
    assert config.optim.lr == 1e-5 and config.model.lora.rank == 4 and config.tokenizer.name == "tiny"
    assert config.weight_broadcast.type == "lora"
    with pytest.raises(ConfigError, match="unknown key `optim.learning_rate`"):
        load_config(TrainerConfig, ["@", str(path), "--optim.learning-rate", "1e-5"])
    with pytest.raises(ConfigError, match="unexpected arguments: stray"):
        load_config(TrainerConfig, ["@", str(path), "stray"])


def test_load_role_config_keeps_the_command_flags(write) -> None:
    path = write("orchestrator.toml", "batch_size = 8\n[model]\nname = 'tiny'\n[[env]]\nid = 'e'\n")
    config, rest = load_role_config(OrchestratorConfig, ["@", str(path), "--rollouts-per-example", "2", "--check"],
                                    cli_flags={"--check"})
    assert config.batch_size == 8 and config.rollouts_per_example == 2 and rest == ["--check"]
    with pytest.raises(ConfigError, match="batch_size = 6 or 9"):
        load_role_config(OrchestratorConfig, ["@", str(path), "--rollouts-per-example", "3"])


def test_every_field_has_a_description() -> None:
    seen: set[type] = set()
    missing: list[str] = []

    def visit(model: type[pydantic.BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            for tp in _types_in(field.annotation):
                if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
                    visit(tp)

    for model in (RLConfig, BrokerConfig, TrainerConfig, OrchestratorConfig, InferenceConfig):
        visit(model)
    assert not missing


def _types_in(tp: object) -> list[object]:
    found = [tp]
    for arg in typing.get_args(tp):
        found.extend(_types_in(arg))
    return found


def test_config_modules_import_without_torch_or_vllm() -> None:
    code = ("import sys, primerl.cli.rl, primerl.cli.rl_config; "
            "print([m for m in ('torch', 'vllm', 'transformers', 'verifiers') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_dump_drops_none_and_keeps_field_order(base: Path) -> None:
    trainer = load("@", base).trainer
    text = dump_toml(trainer)
    assert "kl" not in tomllib.loads(text) and "ckpt" not in tomllib.loads(text)
    assert list(tomllib.loads(text)["model"])[:2] == ["name", "optimization_dtype"]


# --- primerl rl --------------------------------------------------------------------------------------------------


def test_dry_run_prints_each_role(base: Path, capsys) -> None:
    assert rl_main(["@", str(base), "--dry-run", "--orchestrator.batch-size", "32"]) == 0
    out = capsys.readouterr().out
    sections = out.split("# --- ")[1:]
    assert [s.split(" ---")[0] for s in sections] == ["broker", "trainer", "orchestrator", "inference"]
    orchestrator = tomllib.loads(sections[2].split("---\n", 1)[1])
    assert orchestrator["batch_size"] == 32 and orchestrator["env"][0]["id"] == "reverse-text"


def test_dry_run_redacts_token_and_write_keeps_it(base: Path, tmp_path: Path, capsys) -> None:
    assert rl_main(["@", str(base), "--broker.run-token", "s3cret", "--dry-run"]) == 0
    assert "s3cret" not in capsys.readouterr().out
    out_dir = tmp_path / "resolved"
    assert rl_main(["@", str(base), "--broker.run-token", "s3cret", "--dry-run", "--write", str(out_dir)]) == 0
    assert load_config(TrainerConfig, [out_dir / "trainer.toml"]).broker.run_token == "s3cret"
    assert load_config(RLConfig, [out_dir / "rl.toml"]).orchestrator.batch_size == 16


def test_rl_errors_exit_2_without_traceback(base: Path, capsys) -> None:
    assert rl_main(["@", str(base), "--orchestrator.bach-size", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "did you mean `batch_size`?" in err and "Traceback" not in err


def test_rl_help_and_usage(capsys) -> None:
    assert rl_main(["--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out
    assert rl_main([]) == 2
    assert rl_main(["@", "x.toml", "stray"]) == 2


def test_dry_run_in_subprocess(base: Path) -> None:
    code = f"from primerl.cli.rl import main; raise SystemExit(main(['@', {str(base)!r}, '--dry-run']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "# --- trainer ---" in result.stdout


def test_dry_run_error_in_subprocess(write) -> None:
    path = write("bad.toml", BASE + '\n[trainer.model]\nac = "full"\n')
    code = f"from primerl.cli.rl import main; raise SystemExit(main(['@', {str(path)!r}, '--dry-run']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "[trainer.model.ac]" in result.stderr and "Traceback" not in result.stderr


def test_dry_run_through_primerl_module(base: Path) -> None:
    pytest.importorskip("primerl.cli.main", reason="the umbrella CLI (cli/main.py) is not written yet")
    result = subprocess.run([sys.executable, "-m", "primerl", "rl", "@", str(base), "--dry-run"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "# --- inference ---" in result.stdout

"""Config layering as documented: the lab and vf-rl shapes' translations, later files and command-line overrides
winning, role configs on their own, field descriptions, and `primerl rl --dry-run`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
import typing
from pathlib import Path

import pydantic
import pytest
from support.rl_configs import BASE, LAB, VF_RL, config_writer, error_of, load

from primerl.cli.rl import main as rl_main
from primerl.configs.broker import BrokerConfig
from primerl.configs.inference import InferenceConfig
from primerl.configs.orchestrator import OrchestratorConfig
from primerl.configs.rl import RLConfig
from primerl.configs.rl_shapes import LAB_SAMPLING_KEYS
from primerl.configs.trainer import TrainerConfig
from primerl.runtime.config_base import ConfigError, ConfigWarning
from primerl.runtime.config_loader import (
    dump_toml,
    load_config,
    load_role_config,
    parse_config_args,
    parse_override_value,
)


@pytest.fixture
def write(tmp_path: Path):
    return config_writer(tmp_path)


@pytest.fixture
def base(write) -> Path:
    return write("base.toml", BASE)


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
    second = write(
        "b.toml",
        """
        max_steps = 20
        [orchestrator.sampling]
        temperature = 0.9
        [[orchestrator.env]]
        id = "other-env"
    """,
    )
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
    config = load(
        "@",
        base,
        "--orchestrator.batch-size",
        "64",
        "--trainer.optim.lr=3e-6",
        "--orchestrator.sampling.stop",
        '["</s>", "###"]',
        "--inference-gpu-ids=[2,3]",
    )
    assert config.orchestrator.batch_size == 64 and config.trainer.optim.lr == 3e-6
    assert config.orchestrator.sampling.stop == ["</s>", "###"] and config.inference_gpu_ids == [2, 3]
    assert config.inference.parallel.dp == 2


def test_overrides_as_keyword_dict(base: Path) -> None:
    config = load_config(RLConfig, [base], {"orchestrator.batch_size": 32, "trainer": {"optim": {"lr": 2e-6}}})
    assert config.orchestrator.batch_size == 32 and config.trainer.optim.lr == 2e-6


def test_boolean_overrides(base: Path) -> None:
    config = load(
        "@",
        base,
        "--orchestrator.zero-truncated-completions",
        "--no-orchestrator.mask-truncated-completions",
        "--orchestrator.buffer.online-difficulty-filtering",
    )
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
        [
            "@",
            "a.toml",
            "@b.toml",
            "c.toml",
            "--x.y-z",
            "64",
            "--lr=1e-5",
            "--flag",
            "--no-other",
            "--ids",
            "[0, 1]",
            "--name",
            "Qwen/Qwen3-4B",
            "--quoted",
            '"7"',
            "--dry-run",
            "--write",
            "out",
            "--last",
        ],
        cli_flags={"--dry-run"},
        cli_options={"--write"},
    )
    assert parsed.files == [Path("a.toml"), Path("b.toml"), Path("c.toml")]
    assert parsed.overrides == {
        "x": {"y_z": 64},
        "lr": 1e-5,
        "flag": True,
        "other": False,
        "ids": [0, 1],
        "name": "Qwen/Qwen3-4B",
        "quoted": "7",
        "last": True,
    }
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
    config, rest = load_role_config(
        OrchestratorConfig, ["@", str(path), "--rollouts-per-example", "2", "--check"], cli_flags={"--check"}
    )
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
    code = (
        "import sys, primerl.cli.rl, primerl.configs.rl; "
        "print([m for m in ('torch', 'vllm', 'transformers', 'verifiers') if m in sys.modules])"
    )
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
    result = subprocess.run(
        [sys.executable, "-m", "primerl", "rl", "@", str(base), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "# --- inference ---" in result.stdout


def test_the_trainer_publishes_in_the_dtype_inference_serves(write) -> None:
    assert load("@", write("a.toml", BASE)).trainer.weight_broadcast.dtype == "auto"
    served = load("@", write("b.toml", BASE + '\n[inference.model]\ndtype = "bfloat16"\n'))
    assert served.trainer.weight_broadcast.dtype == "bfloat16"
    own = load(
        "@",
        write(
            "c.toml", BASE + '\n[inference.model]\ndtype = "bfloat16"\n[trainer.weight_broadcast]\ndtype = "float32"\n'
        ),
    )
    assert own.trainer.weight_broadcast.dtype == "float32"  # set explicitly: kept

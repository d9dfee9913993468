"""The preflight (`primerl.cli.preflight`): each check on its own, then the issue's table of a new user's mistakes
through the real `primerl rl` command: exit status 2, one line saying what is wrong and how to fix it, no
traceback on the console, and vLLM never started (no inference log, no `inference.ready.json`)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.probes import free_port

from primerl.cli.preflight.base import Finding, error, report, run_checks, warning
from primerl.cli.preflight.model import looks_like_hub_id, model_checks, name_problem
from primerl.cli.preflight.system import PortUse, port_check, port_problem, wandb_check
from primerl.orchestrator.envs.checks import EnvUse, check_environments, length_findings
from primerl.runtime.config_common import WandbConfig

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
FIXTURES = REPO_ROOT / "tests" / "env_fixtures"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
CLI_TIMEOUT_S = 240  # the preflight takes seconds; a run that got past it would start vLLM and be stopped here


@pytest.fixture(scope="module")
def env_python() -> str:
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    return ENV_PYTHON


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter without verifiers: a fresh virtual environment with nothing installed."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return str(venv / "bin" / "python")


# ------------------------------------------------------------------------------------------- the runner
def test_checks_run_at_once_and_report_in_order(tmp_path, capsys):
    def slow(finding: Finding):
        def check() -> list[Finding]:
            time.sleep(0.5)
            return [finding]

        return check

    def broken() -> list[Finding]:
        raise RuntimeError("a bug in a check")

    started_s = time.monotonic()
    result = run_checks(
        {
            "a": slow(error("first")),
            "b": slow(warning("second")),
            "c": broken,
            "d": slow(error("third", "Traceback: details")),
        }
    )
    assert time.monotonic() - started_s < 1.4  # 3 x 0.5 s, concurrently
    assert [f.message for f in result.findings][:2] == ["first", "second"]
    assert (
        "the c check could not run (RuntimeError: a bug in a check); starting without it" in result.findings[2].message
    )
    assert not result.findings[2].error  # a bug of the preflight does not stop a run
    assert [f.message for f in result.errors] == ["first", "third"]

    log = tmp_path / "logs" / "preflight.log"
    assert report("primerl rl", result, log) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["primerl rl: first", "primerl rl: third"]  # errors first, then warnings
    assert err[2] == "primerl rl: warning: second"
    assert err[-1].startswith("primerl rl: the preflight found 2 problems in") and str(log) in err[-1]
    text = log.read_text()
    assert "Traceback: details" in text and "RuntimeError: a bug in a check" in text  # details: the log only
    assert "Traceback" not in "\n".join(err)


def test_warnings_alone_do_not_stop(capsys):
    assert report("primerl rl", run_checks({"w": lambda: [warning("just so you know")]}), None) is None
    assert capsys.readouterr().err == "primerl rl: warning: just so you know\n"


def test_a_check_that_hangs_is_left_behind():
    result = run_checks({"hang": lambda: [time.sleep(5)] and [], "quick": lambda: []}, timeout_s=0.3)
    assert [f.message for f in result.findings] == ["the hang check did not finish within 0.3 s; starting without it"]


# ------------------------------------------------------------------------------------------------ ports
def test_a_taken_port_names_the_address_and_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        use = PortUse("inference.server.port", "inference.server.host", "127.0.0.1", port)
        assert port_problem(use) == (
            f"inference.server.port = {port}: 127.0.0.1:{port} is already in use by another "
            "process (another run?); set inference.server.port to a free port, or 0 to pick one"
        )
        assert [f.message for f in port_check([use, use])()] == [port_problem(use)]  # said once
    assert port_problem(use) is None  # free again
    assert port_problem(PortUse("broker.grpc_port", "broker.host", "127.0.0.1", 0)) is None


def test_a_host_that_is_not_this_machine():
    problem = port_problem(PortUse("broker.grpc_port", "broker.host", "192.0.2.1", free_port()))
    assert problem == (
        "broker.host = '192.0.2.1' is not an address of this machine; set it to one (127.0.0.1, or "
        "0.0.0.0 for all interfaces)"
    )


# ------------------------------------------------------------------------------------------------ models
def test_model_names(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert name_problem("model.name", str(tiny_model), "model") is None
    assert name_problem("model.name", str(tiny_model), "tokenizer") is None
    assert name_problem("model.name", "runs/demo/no-such-model", "model") == (
        f"model.name = 'runs/demo/no-such-model' does not exist (no {tmp_path}/runs/demo/no-such-model); give the "
        "path of a model directory"
    )
    hub = name_problem("model.name", "someorg/some-model", "model")
    assert hub.startswith("model.name = 'someorg/some-model' is neither a directory")
    assert "nor a model in the Hugging Face cache, and downloads are off (HF_HUB_OFFLINE=1)" in hub
    assert "`hf download someorg/some-model --local-dir DIR`" in hub
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in name_problem("model.name", "empty", "model")
    assert "holds no tokenizer files" in name_problem("trainer.tokenizer.name", "empty", "tokenizer")
    run = tmp_path / "run" / "weights" / "step_3"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert name_problem("model.name", "run", "model") == (
        "model.name = 'run' is a run directory, not a model; give its exported weights, e.g. "
        f"{Path('run/weights/step_3')}"
    )
    (tmp_path / "nowts").mkdir()
    (tmp_path / "nowts" / "config.json").write_text("{}")
    assert "holds a config.json but no weights" in name_problem("inference.model.name", "nowts", "model")
    (tmp_path / "file.toml").write_text("")
    assert "is a file, not a model directory" in name_problem("model.name", "file.toml", "model")


def test_hub_ids_and_the_trainer(monkeypatch):
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and looks_like_hub_id("gpt2")
    assert not looks_like_hub_id("runs/demo/tiny-model") and not looks_like_hub_id("./model")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    # downloads allowed: vLLM may fetch an id it does not have, the trainer (a directory only) may not
    assert name_problem("inference.model.name", "someorg/some-model", "model") is None
    findings = model_checks(
        {
            "trainer.model.name": ("someorg/some-model", "model"),
            "inference.model.name": ("someorg/some-model", "model"),
        },
        shared_name="someorg/some-model",
    )()
    assert len(findings) == 1 and findings[0].message.startswith("model.name = 'someorg/some-model' is neither")


def test_a_cached_hub_id_serves_vllm_and_the_trainer_gets_its_directory(tmp_path):
    """An id in the local Hugging Face cache: fine for vLLM; the trainer loads from a directory only, so the line
    gives the cached snapshot to use. (A subprocess: huggingface_hub reads HF_HUB_CACHE when it is imported.)"""
    snapshot = tmp_path / "hub" / "models--someorg--some-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    code = (
        "from primerl.cli.preflight.model import name_problem as p\n"
        "print(p('inference.model.name', 'someorg/some-model', 'model'))\n"
        "print(p('model.name', 'someorg/some-model', 'model', local_only=True))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "None",
        f"model.name = 'someorg/some-model' is a Hugging Face id, but the trainer loads from a directory only; "
        f"set model.name to its cached copy: {snapshot}",
    ]


def test_one_line_for_a_name_shared_by_every_role(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    gone = "runs/demo/gone"
    names = {
        "trainer.model.name": (gone, "model"),
        "trainer.tokenizer.name": (gone, "tokenizer"),
        "inference.model.name": (gone, "model"),
    }
    assert [f.message for f in model_checks(names, shared_name=gone)()] == [
        f"model.name = '{gone}' does not exist (no {tmp_path}/{gone}); give the path of a model directory"
    ]


# ------------------------------------------------------------------------------------------------ W&B
def test_wandb_without_a_login_is_a_warning_for_all_roles(no_wandb_login, tmp_path):
    from types import SimpleNamespace

    trainer = SimpleNamespace(wandb=WandbConfig(name="demo"), output_dir=tmp_path)
    orchestrator = SimpleNamespace(wandb=WandbConfig(name="demo"), output_dir=tmp_path)
    findings = wandb_check({"trainer": trainer, "orchestrator": orchestrator})()
    assert len(findings) == 1 and not findings[0].error
    assert findings[0].message.startswith(
        "W&B (trainer and orchestrator): W&B is on ([wandb], or run_name in a vf-rl "
        "config) but this machine has no W&B login"
    )
    assert wandb_check({"trainer": SimpleNamespace(wandb=None, output_dir=tmp_path)})() == []


# ------------------------------------------------------------------------------------------ environments
def use(env_id: str, args: dict | None = None, setting: str = "orchestrator.env[0]") -> EnvUse:
    return EnvUse(setting, env_id, args or {}, "train")


def check(uses: list[EnvUse], python: str, **overrides) -> list[Finding]:
    settings = dict(
        setting="orchestrator.env_python",
        tokenizer=None,
        seq_len=256,
        max_model_len=256,
        max_tokens=24,
        prefix="orchestrator.",
    )
    return check_environments(uses, python, python, **{**settings, **overrides})


def test_environments_that_load_and_fit_give_nothing(env_python, tiny_model):
    assert (
        check(
            [use("reverse-text"), use("reverse-text-multiturn", setting="orchestrator.env[1]")],
            env_python,
            tokenizer=str(tiny_model),
        )
        == []
    )


def test_an_unknown_id_gets_a_did_you_mean(env_python):
    [finding] = check([use("revers-text")], env_python)
    assert finding.message.startswith(
        'orchestrator.env[0].id "revers-text" is not an installed environment; did you mean "reverse-text"'
    )
    assert finding.message.endswith("? Install yours with `primerl env install PATH`.")
    assert "ModuleNotFoundError" in finding.detail


def test_a_load_environment_that_raises(env_python, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))  # the env worker inherits it
    [finding] = check([use("broken_load_env", {"level": 3})], env_python)
    assert finding.message == (
        'orchestrator.env[0] "broken_load_env": load_environment(level=3) raised KeyError: '
        "'missing_setting: load_environment is broken on purpose'; fix the environment or its "
        "args (orchestrator.env[0].args); the traceback is in the log"
    )
    assert "Traceback" in finding.detail


def test_an_interpreter_without_verifiers_is_one_line(bare_python):
    findings = check([use("reverse-text"), use("reverse-text-multiturn", setting="orchestrator.env[1]")], bare_python)
    assert [f.message for f in findings] == [
        f"the env interpreter {bare_python} cannot import verifiers: install it there (`{bare_python} -m pip install "
        "verifiers==0.3.1`, or `primerl env install PATH` with the default interpreter) or set "
        "orchestrator.env_python to an interpreter that has it"
    ]


def test_an_environment_without_examples(env_python, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    [finding] = check([use("empty_dataset_env", {"min_len": 2})], env_python)
    assert finding.message == (
        'orchestrator.env[0] "empty_dataset_env" has no training examples: '
        "load_environment(min_len=2) gave an empty dataset; check orchestrator.env[0].args"
    )


def test_an_environment_listed_twice():
    from primerl.cli.preflight.envs import env_checks
    from primerl.configs.orchestrator import OrchestratorConfig

    config = OrchestratorConfig.model_validate({"model": {"name": "m"}, "env": [{"id": "a"}, {"id": "b"}, {"id": "a"}]})
    assert [f.message for f in env_checks(config, prefix="orchestrator.", tokenizer=None, max_model_len=None)()] == [
        'orchestrator.env[2].id "a" is listed twice (also orchestrator.env[0]); keep one table per environment (its '
        "weight sets how often it is sampled)"
    ]


def test_prompt_lengths_after_the_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = [{"role": "system", "content": "Reverse the letters."}, {"role": "user", "content": "a b c"}]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    env = use("reverse-text")
    fits = dict(seq_len=length + 24, max_model_len=length + 24, max_tokens=24, prefix="orchestrator.")
    assert length_findings(env, [prompt], tokenizer, **fits) == []
    [too_long] = length_findings(env, [prompt, "a"], tokenizer, **{**fits, "seq_len": length})
    assert too_long.message == (
        f'orchestrator.env[0] "reverse-text": prompts are up to {length} tokens after the chat template (2 sampled), '
        f"which leaves no room for a completion within orchestrator.seq_len = {length}; raise seq_len above {length} "
        "+ orchestrator.sampling.max_tokens (24), or shorten the prompts (orchestrator.env[0].args)"
    )
    [refused] = length_findings(env, [prompt], tokenizer, **{**fits, "max_model_len": length + 23})
    assert refused.message.endswith(
        f"> inference.model.max_model_len = {length + 23}: vLLM would refuse them; raise "
        f"max_model_len (and seq_len) to {length + 24} or more, or lower "
        "orchestrator.sampling.max_tokens"
    )


# ------------------------------------------------- the table: mistakes through `primerl rl`
def primerl_rl(
    run_dir: Path, *args: str, env: dict | None = None, config: Path = EXAMPLE
) -> tuple[subprocess.CompletedProcess, float]:
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": ENV_PYTHON,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **(env or {}),
    }
    env.pop("PRIMERL_SKIP_PREFLIGHT", None)
    command = [
        str(BIN / "primerl"),
        "rl",
        "@",
        str(config),
        "--output-dir",
        str(run_dir),
        "--max-steps",
        "2",
        "--broker.grpc-port",
        str(free_port()),
        *args,
    ]
    started_s = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env, cwd=run_dir.parent)
    return result, time.monotonic() - started_s


def finding_lines(stderr: str) -> list[str]:
    """The lines of the preflight's findings (not config warnings, not its closing summary)."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("primerl rl: ") and not line.startswith("primerl rl: the preflight found")
    ]


MISTAKES = {
    # name: (extra args, extra environment, the one line (a regex))
    "env id typo": (
        ["--orchestrator.env", '[{id = "revers-text"}]'],
        {},
        r'orchestrator\.env\[0\]\.id "revers-text" is not an installed environment; did you mean '
        r'"reverse-text".*\? Install yours with `primerl env install PATH`\.',
    ),
    "load_environment raises": (
        ["--orchestrator.env", '[{id = "broken_load_env"}]'],
        {"PYTHONPATH": str(FIXTURES)},
        r'orchestrator\.env\[0\] "broken_load_env": load_environment\(\) raised KeyError: '
        r"'missing_setting: load_environment is broken on purpose'; fix the environment",
    ),
    "verifiers missing": (
        ["--orchestrator.env-python", "{bare}"],
        {},
        r"the env interpreter \S+ \(given\) cannot import verifiers: install it there",
    ),
    "model path missing": (
        ["--model.name", "runs/demo/no-such-model"],
        {},
        r"model\.name = 'runs/demo/no-such-model' does not exist \(no \S+\); give the path of a "
        r"model directory",
    ),
    "hub id not cached": (
        ["--model.name", "someorg/some-model"],
        {},
        r"model\.name = 'someorg/some-model' is neither a directory \(no \S+\) nor a model in the "
        r"Hugging Face cache, and downloads are off \(HF_HUB_OFFLINE=1\)",
    ),
    "prompt longer than seq_len": (
        ["--seq-len", "32"],
        {},
        r'orchestrator\.env\[0\] "reverse-text": prompts are up to \d+ tokens after the chat '
        r"template \(8 sampled\), which leaves no room for a completion within "
        r"orchestrator\.seq_len = 32",
    ),
    "port taken": (
        ["--inference.server.port", "{taken}"],
        {},
        r"inference\.server\.port = (\d+): 127\.0\.0\.1:\1 is already in use by another process",
    ),
}


# Found by the checks that run before any role starts (milliseconds); the others (environments, prompts) run while
# the roles start, unless --preflight-first (below: test_a_mistake_found_beside_the_start_stops_every_role).
FOUND_BEFORE_THE_START = {"model path missing", "hub id not cached", "port taken"}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_is_one_line_and_exit_2_before_vllm_starts(mistake, tiny_model, env_python, bare_python, tmp_path):
    extra, env, line = MISTAKES[mistake]
    if mistake not in FOUND_BEFORE_THE_START:
        extra = [*extra, "--preflight-first"]
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        values = {"bare": bare_python, "taken": str(taken.getsockname()[1])}
        args = [arg.format(**values) if arg.startswith("{") else arg for arg in extra]
        if "--model.name" not in args:
            args += ["--model.name", str(tiny_model)]
        result, wall_s = primerl_rl(run_dir, *args, env=env)
    output = result.stdout + result.stderr
    print(f"\n{mistake}: exit {result.returncode} after {wall_s:.1f} s\n{result.stderr}")
    assert result.returncode == 2, output[-4000:]
    lines = finding_lines(result.stderr)
    assert len(lines) == 1 and re.fullmatch(r"primerl rl: " + line + ".*", lines[0]), output[-4000:]
    assert "Traceback" not in output
    assert re.search(
        r"the preflight found 1 problem in [\d.]+ s; nothing was started; details in \S+preflight\.log", result.stderr
    )
    # vLLM was never started: no inference log, no ready file, no role process at all
    assert not (run_dir / "logs" / "inference.log").exists() and not (run_dir / "inference.ready.json").exists()
    assert not (run_dir / "pids.json").exists()
    assert (run_dir / "logs" / "preflight.log").stat().st_size > 0


SLOW_BROKEN_ENV = """\
import os, time
from pathlib import Path

def load_environment(**kwargs):
    started = Path(os.environ["WAIT_FOR_FILE"])
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise KeyError("missing_setting: load_environment is broken on purpose")
"""


@pytest.mark.slow
def test_a_mistake_found_beside_the_start_stops_every_role(tiny_model, env_python, tmp_path):
    """The default order: the environments load in the preflight while the roles start. An environment that
    fails only once inference has started (it waits for inference's log) still ends the run with the one line
    and exit status 2, every role started meanwhile stopped, and no rollout generated."""
    run_dir = tmp_path / "run"
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    (fixtures / "slow_broken_env.py").write_text(SLOW_BROKEN_ENV)
    result, wall_s = primerl_rl(
        run_dir,
        "--model.name",
        str(tiny_model),
        "--orchestrator.env",
        '[{id = "slow_broken_env"}]',
        env={"PYTHONPATH": str(fixtures), "WAIT_FOR_FILE": str(run_dir / "logs" / "inference.log")},
    )
    output = result.stdout + result.stderr
    print(f"\nexit {result.returncode} after {wall_s:.1f} s\n{output}")
    assert result.returncode == 2, output[-4000:]
    lines = finding_lines(result.stderr)
    assert len(lines) == 1 and re.fullmatch(
        r'primerl rl: orchestrator\.env\[0\] "slow_broken_env": load_environment\(\) raised KeyError: '
        r"'missing_setting: load_environment is broken on purpose'; fix the environment.*",
        lines[0],
    ), output[-4000:]
    assert "Traceback" not in output
    assert re.search(
        r"the preflight found 1 problem in [\d.]+ s; stopped broker, inference, trainer, orchestrator \(started "
        r"meanwhile\) before any rollout; details in \S+preflight\.log",
        result.stderr,
    ), result.stderr
    # inference had started; every process of every role is gone; no rollout was generated
    assert (run_dir / "logs" / "inference.log").exists()
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"broker", "inference", "trainer", "orchestrator"}
    for role, pid in pids.items():  # each role ran in a process group of its own (pid = group id)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert not _processes_with_environ(f"WAIT_FOR_FILE={run_dir / 'logs' / 'inference.log'}")
    rollouts = run_dir / "rollouts.jsonl"
    assert not rollouts.exists() or rollouts.stat().st_size == 0
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or '"orchestrator"' not in metrics.read_text()


def _processes_with_environ(entry: str) -> list[int]:
    """Live processes of this user whose environment holds ``entry`` (the preflight's env workers included)."""
    found = []
    needle = entry.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(name))
    return found


@pytest.mark.slow
def test_several_mistakes_each_get_their_line(tiny_model, env_python, tmp_path):
    result, _ = primerl_rl(
        tmp_path / "run",
        "--model.name",
        "runs/demo/no-such-model",
        "--orchestrator.env",
        '[{id = "revers-text"}, {id = "reverse-text-multiturn"}]',
    )
    lines = finding_lines(result.stderr)
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert 'orchestrator.env[0].id "revers-text" is not an installed environment' in lines[0]
    assert "model.name = 'runs/demo/no-such-model' does not exist" in lines[1]


VF_RL_EXAMPLE = """\
model = "{model}"

[env]
id = "reverse-text"

[inference]
gpus = 1

[trainer]
gpus = 1

[trainer.args]
run_name = "demo"
batch_size = 16
rollouts_per_example = 4
max_tokens = 24
max_seq_len = 256
"""


@pytest.mark.slow
def test_the_vf_rl_example_without_a_wandb_login_is_a_warning_not_an_exit(
    tiny_model, env_python, no_wandb_login, tmp_path
):
    """`[trainer.args] run_name` turns W&B on; without a login the run goes on offline (`--check`: the preflight
    alone; the roles' own fallback is tested in test_metrics_sink.py)."""
    config = tmp_path / "vf-rl.toml"
    config.write_text(VF_RL_EXAMPLE.format(model=tiny_model))
    run_dir = tmp_path / "run"
    result, _ = primerl_rl(run_dir, "--check", config=config, env={"HOME": str(no_wandb_login)})
    assert result.returncode == 0, result.stderr
    [line] = finding_lines(result.stderr)
    assert line.startswith(
        "primerl rl: warning: W&B (trainer and orchestrator): W&B is on ([wandb], or run_name in a "
        "vf-rl config) but this machine has no W&B login"
    )
    assert f"logging offline to {run_dir / 'wandb'}" in line
    assert not (run_dir / "pids.json").exists()  # --check starts nothing


@pytest.mark.slow
def test_check_on_a_good_config_passes_quietly(tiny_model, env_python, tmp_path):
    result, _ = primerl_rl(tmp_path / "run", "--check", "--model.name", str(tiny_model))
    assert result.returncode == 0 and finding_lines(result.stderr) == [], result.stderr


# ------------------------------------------------------------------------- a daemon started on its own
DAEMON_MISTAKES = {
    "primerl-infer": (
        ["--model.name", "runs/demo/no-such-model", "--server.port", "0"],
        r"model\.name = 'runs/demo/no-such-model' does not exist",
    ),
    "primerl-trainer": (
        ["--model.name", "runs/demo/no-such-model", "--max-steps", "1"],
        r"model\.name = 'runs/demo/no-such-model' does not exist",
    ),
    "primerl-orchestrator": (
        ["--model.name", "{model}", "--env", '[{id = "revers-text"}]'],
        r'env\[0\]\.id "revers-text" is not an installed environment; did you mean "reverse-text"',
    ),
    "primerl-broker": (
        ["--grpc-port", "{taken}", "--rollout-port", "0", "--weight-port", "0"],
        r"grpc_port = (\d+): 127\.0\.0\.1:\1 is already in use by another process \(another run\?\); set grpc_port",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("daemon", list(DAEMON_MISTAKES))
def test_a_daemon_started_alone_checks_its_role(daemon, tiny_model, env_python, tmp_path):
    extra, line = DAEMON_MISTAKES[daemon]
    env = {**os.environ, "PRIMERL_ENV_PYTHON": env_python, "HF_HUB_OFFLINE": "1", "PRIMERL_RUN_TOKEN": "t" * 24}
    env.pop("PRIMERL_SKIP_PREFLIGHT", None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        values = {"model": str(tiny_model), "taken": str(taken.getsockname()[1])}
        args = [arg.format(**values) if arg.startswith("{") else arg for arg in extra]
        if daemon in ("primerl-trainer", "primerl-orchestrator"):
            args += ["--output-dir", str(tmp_path / "out")]
        if daemon == "primerl-broker":
            args += ["--spool-dir", str(tmp_path / "spool")]
        result = subprocess.run(
            [str(BIN / daemon), *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env, cwd=tmp_path
        )
    assert result.returncode == 2, result.stderr[-4000:]
    lines = [x for x in result.stderr.splitlines() if x.startswith(f"{daemon}: ") and "preflight found" not in x]
    assert len(lines) == 1 and re.match(f"{daemon}: {line}", lines[0]), result.stderr[-4000:]
    assert "Traceback" not in result.stdout + result.stderr


def test_under_primerl_rl_the_roles_skip_theirs(monkeypatch):
    from primerl.cli.preflight.roles import role_preflight
    from primerl.configs.inference import InferenceConfig

    config = InferenceConfig.model_validate({"model": {"name": "/no/such/model"}})
    monkeypatch.setenv("PRIMERL_SKIP_PREFLIGHT", "1")
    assert role_preflight("primerl-infer", "inference", config) is None
    monkeypatch.delenv("PRIMERL_SKIP_PREFLIGHT")
    assert role_preflight("primerl-infer", "inference", config) == 2


def test_the_start_gate_opens_on_the_launchers_file_and_a_stop_ends_the_wait(monkeypatch, tmp_path):
    """The orchestrator's side of the preflight run beside the start (``runtime.start_gate``)."""
    import threading

    from primerl.runtime.start_gate import GATE_VAR, open_gate, wait_for_gate

    stop = threading.Event()
    monkeypatch.delenv(GATE_VAR, raising=False)
    assert wait_for_gate(stop)  # not under `primerl rl` (or the preflight ran first): nothing to wait for
    gate = tmp_path / "run" / "preflight.passed"
    monkeypatch.setenv(GATE_VAR, str(gate))
    opener = threading.Timer(0.3, open_gate, args=(gate,))
    started_s = time.monotonic()
    opener.start()
    assert wait_for_gate(stop) and gate.exists()
    assert time.monotonic() - started_s >= 0.25  # it did wait for the file
    gate.unlink()
    stopper = threading.Timer(0.2, stop.set)
    stopper.start()
    assert wait_for_gate(stop) is False  # a stop signal while waiting: no rollout, the orchestrator stops
    opener.join()
    stopper.join()


def test_the_slow_checks_are_the_ones_run_beside_the_start(tiny_model, tmp_path):
    """Ports and memory must be checked before the roles bind them and vLLM takes it; the environments and the
    teacher's tokenizer (seconds) run beside the start."""
    from primerl.cli.preflight.roles import BESIDE_THE_START, BackgroundPreflight, rl_checks
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config

    config = load_config(RLConfig, [EXAMPLE], {"model.name": str(tiny_model), "output_dir": str(tmp_path / "run")})
    names = set(rl_checks(config))
    assert {"ports", "memory", "model"} <= names - BESIDE_THE_START
    assert "environments" in BESIDE_THE_START
    background = BackgroundPreflight(config, tmp_path / "preflight.log")
    assert set(background.checks) == names & BESIDE_THE_START and not background.done()

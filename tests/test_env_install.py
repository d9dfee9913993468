"""`primerl env install|list` and the env-interpreter rule they share with `primerl rl` and `primerl eval`.

The user's path end to end: a ToolEnv project (tests/env_fixtures/tool_echo) installed into an env interpreter,
listed, then evaluated with the tiny model. The env interpreter of that test is a fresh venv that sees the
repository's `.venv-envs` packages through a `.pth` file (so it has verifiers 0.3.1 without a 1-minute pip
install) and gets the fixture installed by the real command, with pip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primerl.cli.env import main as env_main
from primerl.orchestrator.envs import interpreters as rule
from primerl.orchestrator.envs.interpreters import find_env_python, probe_env_python, suggest_env_ids

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
TOOL_FIXTURE = REPO_ROOT / "tests" / "env_fixtures" / "tool_echo"
ENVS_PYTHON = REPO_ROOT / ".venv-envs" / "bin" / "python"
needs_envs_venv = pytest.mark.skipif(not ENVS_PYTHON.exists(), reason=f"no {ENVS_PYTHON}: run `make setup`")


# ------------------------------------------------------------------------------------------- the rule
def test_env_python_rule_explicit_then_variable_then_sibling_venv_then_this_interpreter(tmp_path, monkeypatch):
    main_venv = tmp_path / ".venv"
    monkeypatch.setattr(sys, "prefix", str(main_venv))
    monkeypatch.delenv(rule.ENV_PYTHON_VAR, raising=False)
    assert find_env_python() == rule.EnvPython(sys.executable, "this_interpreter")
    sibling = tmp_path / ".venv-envs" / "bin" / "python"
    sibling.parent.mkdir(parents=True)
    sibling.write_text("")
    assert rule.default_env_venv() == tmp_path / ".venv-envs"
    assert find_env_python() == rule.EnvPython(str(sibling), "env_venv")
    monkeypatch.setenv(rule.ENV_PYTHON_VAR, "/opt/envs/bin/python")
    assert rule.resolve_env_python() == "/opt/envs/bin/python"
    assert find_env_python("/x/bin/python") == rule.EnvPython("/x/bin/python", "explicit")


def test_did_you_mean_among_installed_ids():
    installed = ["reverse-text", "reverse-text-multiturn", "gsm8k"]
    assert suggest_env_ids("revers-text", installed)[0] == "reverse-text"
    assert suggest_env_ids("reverse_text", installed) == ["reverse-text"]
    assert suggest_env_ids("owner/gsm8k", installed) == ["gsm8k"]
    assert suggest_env_ids("something-else", installed) == []


@needs_envs_venv
def test_probe_lists_the_example_environments_without_importing_them():
    info = probe_env_python(ENVS_PYTHON)
    assert info.verifiers_version == rule.VERIFIERS_VERSION
    ids = {env.id: env for env in info.envs}
    assert {"reverse-text", "reverse-text-multiturn"} <= set(ids)
    assert ids["reverse-text"].dist == "reverse-text"
    assert ids["reverse-text"].editable_path == str(REPO_ROOT / "examples" / "reverse_text")
    assert "verifiers" not in {env.dist for env in info.envs}


@needs_envs_venv
def test_list_finds_the_env_venv_beside_primerls_venv_with_nothing_exported():
    env = {k: v for k, v in os.environ.items() if k != rule.ENV_PYTHON_VAR}
    done = subprocess.run(
        [str(BIN / "primerl"), "env", "list", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    if Path(sys.prefix).parent != REPO_ROOT:
        pytest.skip(f"primerl runs from {sys.prefix}, not a venv beside {ENVS_PYTHON.parent.parent}")
    assert listing["python"] == str(ENVS_PYTHON) and listing["source"] == "env_venv"
    assert "reverse-text" in [e["id"] for e in listing["envs"]]


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["install", "./no/such/dir"], "does not exist"),
        (["install", str(REPO_ROOT / "tests")], "no pyproject.toml or setup.py"),
        (["install", str(REPO_ROOT / "Makefile")], "not a wheel or sdist"),
        (["install", "bad spec !!"], "neither a directory nor a valid PyPI requirement"),
        (["install", str(TOOL_FIXTURE), "-a", "[1]"], "--env-args must be a JSON object"),
        (["install", str(TOOL_FIXTURE), "--env-python", "/nonexistent/python3-custom"], "is not DIR/bin/python"),
        (["list", "--env-python", "/nonexistent/bin/python"], "does not exist: create it with `primerl env install"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert env_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------- the user's path
def _env_venv_seeing_the_repo_envs(venv: Path) -> Path:
    """A venv whose site-packages has a .pth to .venv-envs' (verifiers 0.3.1, pip) but none of its .pth-activated
    editable installs: the example environments are not importable there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run(
        [str(ENVS_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    own = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    (Path(own) / "_primerl_test_base.pth").write_text(purelib + "\n")
    return venv / "bin" / "python"


def _primerl(*argv: str, env_python: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop(rule.ENV_PYTHON_VAR, None)
    if env_python is not None:
        env[rule.ENV_PYTHON_VAR] = str(env_python)
    return subprocess.run([str(BIN / "primerl"), *argv], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.vllm
@needs_envs_venv
def test_install_a_tool_env_list_it_and_evaluate_it_with_tools_on_and_a_quiet_console(tmp_path):
    from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

    python = _env_venv_seeing_the_repo_envs(tmp_path / "envs")
    assert "tool-echo" not in [e.id for e in probe_env_python(python).envs]

    installed = _primerl("env", "install", str(TOOL_FIXTURE), "--env-python", str(python))
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert "tool-echo: loads (ToolEnv; 6 train, 6 eval examples" in installed.stdout
    assert "primerl eval tool-echo -m MODEL" in installed.stdout

    listed = _primerl("env", "list", env_python=python)
    assert listed.returncode == 0 and "tool-echo" in listed.stdout and "reverse-text" not in listed.stdout
    assert f"editable: {TOOL_FIXTURE}" in listed.stdout

    model = build_tiny_model(tmp_path / "model", TinyModelSpec(seed=3))
    out = tmp_path / "eval"
    result = _primerl(
        "eval", "tool-echo", "-m", str(model), "-n", "3", "-r", "2", "-t", "8", "-o", str(out), env_python=python
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_rollouts"] == 6 and summary["num_errors"] == 0, summary["errors"]
    console = (result.stdout + result.stderr).strip().splitlines()
    assert len(console) <= 7, console  # "starting vLLM ..." and the 5-line summary
    assert "auto tool choice with the hermes parser" in result.stderr and str(out / "eval.log") in result.stderr
    assert not any("WARNING" in line or "Exception ignored" in line for line in console), console
    log = (out / "eval.log").read_text()
    assert "WARNING" in log

    off = _primerl(
        "eval",
        "tool-echo",
        "-m",
        str(model),
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "8",
        "-o",
        str(tmp_path / "off"),
        "--no-enable-auto-tool-choice",
        env_python=python,
    )
    assert off.returncode == 1  # no rollout finished: every request was refused
    assert "400" in off.stderr and "--enable-auto-tool-choice" in off.stderr

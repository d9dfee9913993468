"""The commands a user types: every console script answers --help, and the per-role configs that
`primerl rl --dry-run --write` produces load in the role daemons' own commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_CONFIGS = REPO_ROOT / "tests" / "data" / "user_configs"
BIN = Path(sys.executable).parent
SCRIPTS = ["primerl", "primerl-broker", "primerl-trainer", "primerl-infer", "primerl-orchestrator"]


def run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_scripts_answer_help(script):
    path = BIN / script
    assert path.exists(), f"{script} is not installed next to {sys.executable}; reinstall with `make setup`"
    result = run(str(path), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_unknown_command_is_an_error():
    result = run(sys.executable, "-m", "primerl", "trian")
    assert result.returncode == 2
    assert "unknown command 'trian'" in result.stderr and "commands:" in result.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in REFERENCE_CONFIGS.glob("*.toml")))
def test_role_configs_written_by_rl_load_in_each_daemon(config, tmp_path):
    written = run(
        sys.executable,
        "-m",
        "primerl",
        "rl",
        "@",
        str(REFERENCE_CONFIGS / config),
        "--dry-run",
        "--write",
        str(tmp_path),
    )
    assert written.returncode == 0, written.stderr
    for script, role in [
        ("primerl-broker", "broker"),
        ("primerl-trainer", "trainer"),
        ("primerl-infer", "inference"),
        ("primerl-orchestrator", "orchestrator"),
    ]:
        result = run(str(BIN / script), "@", str(tmp_path / f"{role}.toml"), "--dry-run")
        assert result.returncode == 0, f"{script}: {result.stderr}"
        assert result.stdout.strip(), f"{script} printed no config"


def test_role_daemon_reports_config_errors_without_traceback(tmp_path):
    bad = tmp_path / "trainer.toml"
    bad.write_text('[model]\nname = "m"\n[optim]\nlrr = 1e-5\n')
    result = run(str(BIN / "primerl-trainer"), "@", str(bad), "--dry-run")
    assert result.returncode == 2
    assert "unknown key `optim.lrr`; did you mean `lr`?" in result.stderr
    assert "Traceback" not in result.stderr


def test_rl_help_documents_restarts_and_bad_restart_settings_are_clear_errors(tmp_path):
    result = run(str(BIN / "primerl"), "rl", "--help")
    assert result.returncode == 0, result.stderr
    for flag in (
        "--restart {on-failure,never}",
        "--restart-limit N",
        "--restart-window-s S",
        "--restart-delay-s S",
        "--restart-delay-max-s S",
        "Restart=on-failure",
    ):
        assert flag in result.stdout, flag
    config = REPO_ROOT / "examples" / "reverse_text_rl.toml"
    bad = run(str(BIN / "primerl"), "rl", "@", str(config), "--run-dir", str(tmp_path / "run"), "--restart", "always")
    assert bad.returncode == 2 and "invalid choice: 'always'" in bad.stderr
    bad = run(
        str(BIN / "primerl"), "rl", "@", str(config), "--run-dir", str(tmp_path / "run"), "--restart-delay-s", "60"
    )
    assert bad.returncode == 2 and "restart delays must satisfy 0 <= delay (60 s) <= max delay (30 s)" in bad.stderr
    assert not (tmp_path / "run").exists()  # nothing started

"""`primerl env install` of a verifiers v1 environment: recognised by its pyproject or its `__all__`, installed into
the v1 env venv (verifiers 0.4.0 pinned), checked the way a run serves it; the probe tells both kinds apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from primerl.cli.env_v1 import is_v1_project
from primerl.orchestrator.envs.interpreters import find_env_python, find_v1_env_python, probe_env_python

REPO = Path(__file__).resolve().parents[1]
PRIMERL = [sys.executable, "-m", "primerl.cli.main"]


def test_a_v1_project_is_recognised_by_its_requirement_or_its_exports(tmp_path: Path) -> None:
    assert is_v1_project(REPO / "examples" / "reverse_text_v1")
    assert not is_v1_project(REPO / "examples" / "reverse_text")
    exports = tmp_path / "by_exports"
    (exports / "my_env").mkdir(parents=True)
    (exports / "pyproject.toml").write_text('[project]\nname = "my-env"\ndependencies = []\n')
    (exports / "my_env" / "__init__.py").write_text('from .t import MyTaskset\n__all__ = ["MyTaskset"]\n')
    assert is_v1_project(exports)
    requirement = tmp_path / "by_requirement"
    requirement.mkdir()
    (requirement / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["verifiers>=0.4.0"]\n')
    assert is_v1_project(requirement)
    (requirement / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["verifiers>=0.3,<0.4"]\n')
    assert not is_v1_project(requirement)


def test_the_probe_tells_the_kinds_apart() -> None:
    classic, v1 = find_env_python(), find_v1_env_python()
    if classic.source == "this_interpreter" or v1.source == "this_interpreter":
        pytest.skip("`make setup` builds .venv-envs and .venv-envs-v1")
    assert {env.id: env.kind for env in probe_env_python(classic.path).envs}.get("reverse-text") == "classic"
    info = probe_env_python(v1.path)
    assert info.verifiers_version == "0.4.0"
    assert {env.id: env.kind for env in info.envs}.get("reverse-text-v1") == "v1"


def test_a_v1_environment_is_refused_by_a_classic_interpreter() -> None:
    classic = find_env_python()
    if classic.source == "this_interpreter":
        pytest.skip("`make setup` builds .venv-envs")
    done = subprocess.run(
        [*PRIMERL, "env", "install", str(REPO / "examples" / "reverse_text_v1"), "--env-python", classic.path],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert "not 0.4" in done.stderr and "v1 env venv" in done.stderr


@pytest.mark.slow
def test_reinstalling_the_example_checks_that_it_serves_locally() -> None:
    v1 = find_v1_env_python()
    if v1.source == "this_interpreter":
        pytest.skip("`make setup` builds .venv-envs-v1")
    done = subprocess.run(
        [*PRIMERL, "env", "install", str(REPO / "examples" / "reverse_text_v1"), "--env-python", v1.path],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reverse-text-v1: serves locally" in done.stdout and "verifiers 0.4.0" in done.stdout


def test_list_shows_the_v1_environments_beside_the_classic_ones() -> None:
    if find_v1_env_python().source == "this_interpreter" or find_env_python().source == "this_interpreter":
        pytest.skip("`make setup` builds .venv-envs and .venv-envs-v1")
    done = subprocess.run(
        [*PRIMERL, "env", "list"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr
    assert "v1 env python:" in done.stdout and "reverse-text-v1" in done.stdout and "(v1)" in done.stdout

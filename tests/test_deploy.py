"""The systemd units start the daemons with command lines the daemons accept."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((REPO_ROOT / "deploy" / "systemd").glob("*.service"))
BIN = Path(sys.executable).parent
# The least each role's config file must say (the broker has a default for every key).
MINIMAL_CONFIGS = {
    "primerl-trainer": '[model]\nname = "some/model"\n',
    "primerl-infer": '[model]\nname = "some/model"\n',
    "primerl-orchestrator": '[model]\nname = "some/model"\n[[env]]\nid = "reverse-text"\n',
}


def exec_start(unit: Path) -> list[str]:
    lines = [line for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, f"{unit.name}: one ExecStart expected"
    return shlex.split(lines[0].removeprefix("ExecStart="))


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_unit_command_line_is_accepted(unit, tmp_path):
    argv = exec_start(unit)
    program = BIN / Path(argv[0]).name
    assert program.exists(), f"{unit.name} starts {argv[0]}, which this package does not install"
    config = tmp_path / "role.toml"
    config.write_text(MINIMAL_CONFIGS.get(unit.stem, ""))
    args = [str(config) if a.startswith("/etc/primerl/") and a.endswith(".toml") else a for a in argv[1:]]
    result = subprocess.run([str(program), *args, "--dry-run"], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(BIN), "PRIMERL_RUN_TOKEN": "t"})
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_unit_file_syntax(unit):
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in result.stderr.splitlines() if unit.name in line and "Failed to resolve" not in line
                and "executable" not in line.lower() and "user" not in line.lower()]
    assert not problems, problems

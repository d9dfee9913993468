"""Which interpreter runs the environments (the env workers): one rule for every command that starts them, and what
that interpreter has installed.

The rule (`resolve_env_python`), first match wins:
  1. the interpreter given explicitly (`env_python` in a config, `--env-python` on a command line);
  2. `$PRIMERL_ENV_PYTHON`;
  3. `.venv-envs/bin/python` next to the virtual environment primerl runs from (`<sys.prefix>/../.venv-envs`),
     when it exists: the env venv that `make setup` and `primerl env install` build;
  4. this interpreter.
Rule 3 is why nothing has to be exported: `make setup` puts `.venv` and `.venv-envs` side by side, and
`primerl env install` creates `.venv-envs` there when no env interpreter exists yet. It depends only on where
primerl is installed, not on the working directory, so every role of a run, started from anywhere, agrees.
Rule 4 serves environments installed next to primerl itself (possible only where verifiers and vLLM agree).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

ENV_PYTHON_VAR = "PRIMERL_ENV_PYTHON"
ENV_VENV_NAME = ".venv-envs"
VERIFIERS_VERSION = "0.3.1"
"""verifiers pinned in a new env venv: 0.4 dropped the classic `load_environment` API; 0.2-0.3 need mcp<2."""
HTTPX_AIOHTTP_VERSION = "0.2.0"
"""Installed next to it: the env worker's model requests cost ~7x less CPU than with httpx's own transport."""
PROBE_SCRIPT = Path(__file__).parent / "remote" / "probe.py"
PROBE_TIMEOUT_S = 60.0

Source = Literal["explicit", "env_var", "env_venv", "this_interpreter"]


@dataclasses.dataclass(frozen=True)
class EnvPython:
    """The env interpreter and which rule chose it (`source`)."""

    path: str
    source: Source

    def describe(self) -> str:
        why = {
            "explicit": "given",
            "env_var": f"${ENV_PYTHON_VAR}",
            "env_venv": f"the {ENV_VENV_NAME} next to primerl's venv",
            "this_interpreter": "primerl's own interpreter",
        }[self.source]
        return f"{self.path} ({why})"


def default_env_venv() -> Path:
    """Where the env venv lives by default: `.venv-envs` beside the virtual environment primerl runs from."""
    return Path(sys.prefix).parent / ENV_VENV_NAME


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def find_env_python(explicit: object = None) -> EnvPython:
    """The env interpreter by the module's rule, with the rule that chose it."""
    if explicit is not None:
        return EnvPython(str(explicit), "explicit")
    if os.environ.get(ENV_PYTHON_VAR):
        return EnvPython(os.environ[ENV_PYTHON_VAR], "env_var")
    candidate = venv_python(default_env_venv())
    if candidate.exists():
        return EnvPython(str(candidate), "env_venv")
    return EnvPython(sys.executable, "this_interpreter")


def resolve_env_python(explicit: object = None) -> str:
    """`explicit` when given, else $PRIMERL_ENV_PYTHON, else `<sys.prefix>/../.venv-envs/bin/python` when it
    exists, else this interpreter."""
    return find_env_python(explicit).path


# ---- verifiers v1 (0.4) environments -------------------------------------------------------------------------------
V1_ENV_PYTHON_VAR = "PRIMERL_ENV_V1_PYTHON"
V1_ENV_VENV_NAME = ".venv-envs-v1"
VERIFIERS_V1_VERSION = "0.4.0"
"""verifiers pinned in the v1 env venv: 0.4 holds only `verifiers.v1` (Taskset / Task / Harness and the env server
`verifiers.v1.serve.serve_env`, which the orchestrator starts there: `remote/v1_bootstrap.py`)."""


def default_v1_env_venv() -> Path:
    """Where the v1 env venv lives by default: `.venv-envs-v1` beside the virtual environment primerl runs from."""
    return Path(sys.prefix).parent / V1_ENV_VENV_NAME


def find_v1_env_python(explicit: object = None) -> EnvPython:
    """The interpreter of verifiers v1 environments (their env server), by the same rule as `find_env_python`
    with `$PRIMERL_ENV_V1_PYTHON` and `.venv-envs-v1`."""
    if explicit is not None:
        return EnvPython(str(explicit), "explicit")
    if os.environ.get(V1_ENV_PYTHON_VAR):
        return EnvPython(os.environ[V1_ENV_PYTHON_VAR], "env_var")
    candidate = venv_python(default_v1_env_venv())
    if candidate.exists():
        return EnvPython(str(candidate), "env_venv")
    return EnvPython(sys.executable, "this_interpreter")


class EnvProbeError(RuntimeError):
    """The env interpreter could not be asked what it has installed (missing, broken, or timed out)."""


@dataclasses.dataclass(frozen=True)
class InstalledEnv:
    """An environment installed in the env interpreter (see `remote/probe.py` for how it is recognised)."""

    id: str
    module: str
    dist: str
    version: str
    editable_path: str | None
    kind: str = "classic"
    """"classic" (`load_environment`, verifiers <= 0.3) or "v1" (a Taskset/Harness, verifiers 0.4)."""


@dataclasses.dataclass(frozen=True)
class EnvInterpreterInfo:
    python: str
    verifiers_version: str | None
    envs: list[InstalledEnv]


def probe_env_python(python: str | os.PathLike[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> EnvInterpreterInfo:
    """Ask `python` which verifiers and which environments it has (reads package metadata; imports none)."""
    if not Path(python).exists():
        raise EnvProbeError(f"env python {python} does not exist")
    try:
        done = subprocess.run(
            [str(python), str(PROBE_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise EnvProbeError(f"env python {python} did not list its packages within {timeout_s:g} s") from None
    except OSError as exc:
        raise EnvProbeError(f"env python {python} cannot be run: {exc}") from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise EnvProbeError(f"env python {python} failed to list its packages (exit {done.returncode}): {tail[0]}")
    try:
        raw = json.loads(done.stdout.strip().splitlines()[-1])
        envs = [InstalledEnv(**env) for env in raw["envs"]]
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise EnvProbeError(f"env python {python} gave an unreadable package list: {exc}") from None
    return EnvInterpreterInfo(python=raw["python"], verifiers_version=raw["verifiers"], envs=envs)


def installed_env_ids(python: str | os.PathLike[str] | None = None) -> list[str]:
    """Ids of the environments installed in `python` (default: the env interpreter by the rule), sorted; for
    did-you-mean suggestions. Raises `EnvProbeError` when the interpreter cannot be asked."""
    return [env.id for env in probe_env_python(python or resolve_env_python()).envs]


def suggest_env_ids(env_id: str, installed: list[str], *, limit: int = 3) -> list[str]:
    """Installed ids close to `env_id` (a typo, `_` for `-`), best first."""
    import difflib

    normal = {candidate.replace("_", "-").lower(): candidate for candidate in installed}
    wanted = env_id.replace("_", "-").lower().split("/")[-1]
    if wanted in normal:
        return [normal[wanted]]
    return [normal[m] for m in difflib.get_close_matches(wanted, list(normal), n=limit, cutoff=0.6)]

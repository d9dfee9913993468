"""Which kind each configured environment is, and so which interpreter and client run it: a classic verifiers
environment (`load_environment`, an env worker in the classic env interpreter: `classic.ClassicEnvClient`) or a
verifiers v1 one (a Taskset/Harness package, verifiers' env server in the v1 env interpreter:
`v1.V1EnvClient`). Imports no verifiers.

`kind = "classic"` or `"v1"` in an env table decides it. `kind = "auto"` (the default) asks the interpreters what
they have installed (`interpreters.probe_env_python`, package metadata only, ~0.1-0.5 s each), in this order:
  1. listed in the classic interpreter as a classic environment -> classic (today's behaviour, unchanged);
  2. listed in the v1 interpreter as a v1 environment -> v1;
  3. listed nowhere -> classic, marked `listed = False`: an environment importable without being an installed
     distribution (a module on PYTHONPATH) still loads; if it does not, `not_installed_message` is the error.
The v1 interpreter is probed only when some `auto` environment is not a listed classic one. A v1 package found
only in the classic interpreter (it cannot run there: that one has verifiers 0.3) is refused with the command
that installs it where it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from primerl.orchestrator.envs.interpreters import EnvInterpreterInfo, EnvProbeError, EnvPython, probe_env_python

INSTALL_COMMAND = "primerl env install PATH"


@dataclass(frozen=True)
class ResolvedEnv:
    """One env table with its kind decided: `setting` names the table (`orchestrator.env[1]`), `python` is the
    interpreter that runs it, `listed` whether that interpreter lists it as installed."""

    setting: str
    env: Any  # orchestrator.config.EnvConfig
    kind: str  # "classic" | "v1"
    python: str
    listed: bool = True


def normalize_env_id(env_id: str) -> str:
    """verifiers' rule for both kinds: `owner/name@version` -> `name`, `-` and `_` alike, lower case."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("_", "-").lower()


class _Listings:
    """Each interpreter probed once, on first need; a probe that fails counts as listing nothing (its error is
    kept for the message)."""

    def __init__(self, probe: Callable[[str], EnvInterpreterInfo]) -> None:
        self._probe = probe
        self._kinds: dict[str, dict[str, str]] = {}
        self.errors: dict[str, str] = {}

    def kinds(self, python: str) -> dict[str, str]:
        """{normalized id: kind} of what `python` has installed."""
        if python not in self._kinds:
            try:
                envs = self._probe(python).envs
            except EnvProbeError as exc:
                self.errors[python] = str(exc)
                envs = []
            self._kinds[python] = {normalize_env_id(env.id): env.kind for env in envs}
        return self._kinds[python]


def resolve_env_kinds(
    envs: Sequence[tuple[str, Any]],
    *,
    classic: EnvPython,
    v1: EnvPython,
    probe: Callable[[str], EnvInterpreterInfo] = probe_env_python,
) -> list[ResolvedEnv]:
    """The kind of every `(setting, EnvConfig)` (module docstring); ValueError for a v1 package that is installed
    only where it cannot run."""
    listings = _Listings(probe)
    resolved = []
    for setting, env in envs:
        if env.kind == "classic":
            resolved.append(ResolvedEnv(setting, env, "classic", classic.path))
            continue
        if env.kind == "v1":
            resolved.append(ResolvedEnv(setting, env, "v1", v1.path))
            continue
        wanted = normalize_env_id(env.id)
        classic_kind = listings.kinds(classic.path).get(wanted)
        if classic_kind == "classic":
            resolved.append(ResolvedEnv(setting, env, "classic", classic.path))
            continue
        if listings.kinds(v1.path).get(wanted) == "v1":
            resolved.append(ResolvedEnv(setting, env, "v1", v1.path))
            continue
        if classic_kind == "v1":
            raise ValueError(
                f'{setting}.id "{env.id}" is a verifiers v1 environment, installed only in the classic env '
                f"interpreter {classic.describe()}, which cannot run it (verifiers 0.3); install it into the v1 one "
                f"with `{INSTALL_COMMAND}` (it recognises v1 packages), or set orchestrator.env_v1_python to an "
                "interpreter that has it"
            )
        resolved.append(ResolvedEnv(setting, env, "classic", classic.path, listed=False))
    return resolved


def not_installed_message(
    setting: str, env_id: str, *, classic: EnvPython, v1: EnvPython, probe_errors: dict[str, str] | None = None
) -> str:
    """The error of an environment found in neither interpreter: both interpreters and how to install it."""
    notes = "".join(f" ({error})" for error in (probe_errors or {}).values())
    return (
        f'{setting}.id "{env_id}" is not an installed environment: neither the classic env interpreter '
        f"{classic.describe()} nor the verifiers v1 one {v1.describe()} has it{notes}. Install it with "
        f"`{INSTALL_COMMAND}` (a classic package goes to the first, a v1 one to the second; `primerl env list` "
        f"shows what each has), or set {setting}.kind and orchestrator.env_python / env_v1_python"
    )


def is_missing_module(error: BaseException, env_id: str) -> bool:
    """Whether a classic env worker's load error says the environment's module does not exist."""
    module = env_id.replace("-", "_").split("/")[-1]  # verifiers 0.3's rule: id reverse-text is module reverse_text
    return f"No module named '{module}'" in str(error)


__all__ = [
    "INSTALL_COMMAND",
    "ResolvedEnv",
    "is_missing_module",
    "normalize_env_id",
    "not_installed_message",
    "resolve_env_kinds",
]

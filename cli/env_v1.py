"""`primerl env install` for verifiers v1 environments (verifiers 0.4: a Taskset / Harness package).

A project directory is a v1 environment when its pyproject requires verifiers>=0.4, or when one of its top-level
packages exports a Taskset or Harness class in `__all__` (`--v1` says so for a wheel or a PyPI package). It goes
into the v1 env venv (`.venv-envs-v1` beside primerl's venv, or `--env-python`), created with
`verifiers==VERIFIERS_V1_VERSION` pinned, and is checked the way a run uses it: the bootstrap resolves its
config with the local runtime, refuses a sandbox or an installing harness, and lists its first tasks.
Nothing is downloaded at rollout time: the harness and its dependencies are installed here.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from primerl.orchestrator.envs.interpreters import (
    V1_ENV_PYTHON_VAR,
    VERIFIERS_V1_VERSION,
    EnvProbeError,
    EnvPython,
    default_v1_env_venv,
    find_v1_env_python,
    probe_env_python,
    venv_python,
)

V1_EXPORT = re.compile(r"__all__\s*=\s*[\[(][^\])]*\w*(Taskset|Harness)\b", re.S)
V1_REQUIREMENT = re.compile(r"^\s*verifiers\b[^;]*(>=|==|~=)\s*0\.([4-9]|\d\d)", re.I)
CHECK_TIMEOUT_S = 300.0


def is_v1_project(path: Path) -> bool:
    """A v1 environment project: requires verifiers>=0.4, or exports a Taskset/Harness from a top-level package."""
    import tomllib

    pyproject = path / "pyproject.toml"
    if pyproject.is_file():
        try:
            dependencies = tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", [])
        except tomllib.TOMLDecodeError:
            dependencies = []
        if any(isinstance(dep, str) and V1_REQUIREMENT.search(dep) for dep in dependencies):
            return True
    for init in [*path.glob("*/__init__.py"), *path.glob("src/*/__init__.py")]:
        try:
            if V1_EXPORT.search(init.read_text(errors="replace")[: 1 << 20]):
                return True
        except OSError:
            continue
    return False


def target_v1_python(explicit: object) -> Path:
    """Where a v1 environment goes: `explicit`, else $PRIMERL_ENV_V1_PYTHON, else the default v1 env venv."""
    found: EnvPython = find_v1_env_python(explicit)
    if found.source == "this_interpreter":
        return venv_python(default_v1_env_venv())
    return Path(found.path).absolute()


def install_v1(args, pip_target: list[str], dist_name: str | None, project_dir: Path | None, *, errors) -> int:
    """Install a v1 environment (see the module docstring); `errors` is cli.env's module (its error types and
    pip helpers), passed in to keep one implementation of them."""
    python = target_v1_python(args.env_python)
    if not python.exists() and not (python.parent.name == "bin" and python.name.startswith("python")):
        raise errors.EnvCommandError(
            f"v1 env python {python} does not exist and is not DIR/bin/python, so no venv "
            "can be created for it: give an existing interpreter or DIR/bin/python"
        )
    started_s = time.monotonic()
    if not python.exists():
        errors.create_venv(python, verbose=args.verbose, what=f"the v1 env venv (verifiers=={VERIFIERS_V1_VERSION})")
    version = _ensure_verifiers_v1(python, verbose=args.verbose, errors=errors)
    print(
        f"primerl env install: installing {args.target} (a verifiers v1 environment) into {python} ...",
        file=sys.stderr,
        flush=True,
    )
    errors.pip_install_pinned(python, args, pip_target, version, f"the v1 env venv keeps verifiers=={version}")
    envs = [env for env in errors._provided_envs(python, dist_name, project_dir) if env.kind == "v1"]
    if not envs:
        raise errors.EnvInstallFailed(
            f"installed {args.target}, but no top-level module of it exports a Taskset or Harness in `__all__`: a "
            "verifiers v1 environment is a package `my_env` (id `my-env`) with `__all__ = ['MyTaskset', ...]`"
        )
    env_args = errors._env_args(args.env_args)
    lines = [_check_serves(python, env.id, env_args, errors=errors) for env in envs]
    elapsed_s = time.monotonic() - started_s
    errors.print_installed(envs, lines, python, elapsed_s, f" (verifiers {version})", "served by its own v1 env server")
    if find_v1_env_python().path != str(python):
        print(
            f"  this is not the default v1 env interpreter: pass --env-v1-python {python} to eval and sft-data, "
            f"or export {V1_ENV_PYTHON_VAR}={python}"
        )
    return 0


def _ensure_verifiers_v1(python: Path, *, verbose: bool, errors) -> str:
    try:
        info = probe_env_python(python)
    except EnvProbeError as exc:
        raise errors.EnvInstallFailed(str(exc)) from None
    if info.verifiers_version:
        if not info.verifiers_version.startswith("0.4"):
            raise errors.EnvCommandError(
                f"{python} has verifiers {info.verifiers_version}, not 0.4: a v1 environment needs the v1 env venv "
                f"(default {default_v1_env_venv()}; --env-python DIR/bin/python creates one)"
            )
        return info.verifiers_version
    print(
        f"primerl env install: installing verifiers=={VERIFIERS_V1_VERSION} into {python} ...",
        file=sys.stderr,
        flush=True,
    )
    errors._pip(
        python,
        ["install", f"verifiers=={VERIFIERS_V1_VERSION}"],
        verbose=verbose,
        what=f"install verifiers=={VERIFIERS_V1_VERSION}",
    )
    return VERIFIERS_V1_VERSION


def _check_serves(python: Path, env_id: str, env_args: dict | None = None, *, errors) -> str:
    """Resolve the environment as a run does (local runtime, no installing harness) with the taskset arguments
    `env_args` (install's --env-args) and list a task."""
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.v1_spec import V1EnvSpec

    spec = V1EnvSpec(str(python), env_id, dict(env_args or {}))
    try:
        tasks = spec.tasks(0, 2, timeout_s=CHECK_TIMEOUT_S)
    except EnvWorkerError as exc:
        raise errors.EnvInstallFailed(
            f"{env_id} is installed, but it cannot be served here: {str(exc).splitlines()[0]}"
        ) from None
    if not tasks:
        raise errors.EnvInstallFailed(f"{env_id} is installed, but its taskset yields no task")
    prompt = tasks[0].get("prompt")
    return f"serves locally (first task: {str(prompt)[:40]!r})"


def v1_listing(explicit: str | None = None) -> dict | None:
    """The v1 env interpreter (`explicit`, else by the rule) and its environments for `primerl env list`, when it
    exists (None otherwise; an explicit one that does not exist is listed with the error)."""
    found = find_v1_env_python(explicit)
    if explicit is not None and not Path(found.path).exists():
        return {"python": found.path, "error": f"{found.path} does not exist", "envs": []}
    if found.source == "this_interpreter" or not Path(found.path).exists():
        return None
    try:
        info = probe_env_python(found.path)
    except EnvProbeError as exc:
        return {"python": found.path, "error": str(exc), "envs": []}
    return {
        "python": found.path,
        "verifiers": info.verifiers_version,
        "envs": [vars(env) for env in info.envs if env.kind == "v1"],
    }

"""`primerl env install PATH|PACKAGE` and `primerl env list`: the environments of the env interpreter.

`install` puts a verifiers environment (a project directory, editable by default, a wheel, or a PyPI package)
into the interpreter `primerl rl`, `primerl eval` and `primerl sft-data` use by default (the rule is in
`primerl.orchestrator.envs.interpreters`), creating the env venv with the pinned verifiers when there is none, then
loads each environment the package provides in an env worker, exactly as a run would, and says how to use it.

    primerl env install ./my_env          # a project directory (pyproject.toml), editable
    primerl env install vf-some-env==0.2  # a PyPI package
    primerl env list
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from primerl.cli.command_args import parse_command_args, parse_env_args
from primerl.orchestrator.envs.interpreters import (
    ENV_PYTHON_VAR,
    HTTPX_AIOHTTP_VERSION,
    VERIFIERS_VERSION,
    EnvProbeError,
    EnvPython,
    default_env_venv,
    find_env_python,
    probe_env_python,
    venv_python,
)

PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg")
ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip")
PIP_TAIL_LINES = 15
LOAD_TIMEOUT_S = 300.0


class EnvCommandError(ValueError):
    """Bad input: the message says what is wrong and how to fix it (exit 2)."""


class EnvInstallFailed(RuntimeError):
    """A step of the install failed (pip, the venv, the load check): the message says which (exit 1)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl env",
        description="Install and list verifiers environments in the environments' interpreter (the env venv).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{install,list}")
    install = commands.add_parser(
        "install",
        help="install an environment (directory, wheel or PyPI package) and check that it loads",
        description="Install a verifiers environment into the env interpreter that `primerl rl` and `primerl eval` "
        "use by default, creating the env venv (verifiers==%s) when there is none; then load it in an env worker."
        % VERIFIERS_VERSION,
    )
    install.add_argument(
        "target",
        metavar="PATH|PACKAGE",
        help="a project directory (pyproject.toml or setup.py), a wheel or sdist file, or a PyPI "
        "requirement such as `vf-env==0.2`",
    )
    install.add_argument(
        "--no-editable",
        dest="editable",
        action="store_false",
        help="copy a project directory into the venv (default: editable, edits apply at once)",
    )
    install.add_argument(
        "-a",
        "--env-args",
        default="{}",
        metavar="JSON",
        help="load_environment arguments for the load check, as a JSON object",
    )
    install.add_argument(
        "--env-python",
        default=None,
        metavar="PATH",
        help=f"the env interpreter to install into; created as a venv when PATH is "
        f"DIR/bin/python and missing (default: ${ENV_PYTHON_VAR}, else {default_env_venv()})",
    )
    install.add_argument(
        "--v1",
        action="store_true",
        help="a verifiers v1 environment (Taskset/Harness, verifiers 0.4): install into the v1 env "
        "venv; found by itself for a project directory",
    )
    install.add_argument("-v", "--verbose", action="store_true", help="show pip's output")
    listing = commands.add_parser("list", help="list the environments installed in the env interpreter")
    listing.add_argument(
        "--env-python",
        default=None,
        metavar="PATH",
        help=f"the env interpreter (default: ${ENV_PYTHON_VAR}, else {default_env_venv()} when it "
        "exists, else primerl's own)",
    )
    listing.add_argument(
        "--env-v1-python",
        default=None,
        metavar="PATH",
        help="the v1 env interpreter, listed beside the classic one (default: "
        "$PRIMERL_ENV_V1_PYTHON, else .venv-envs-v1 next to primerl's venv, when it exists)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_command_args(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        return install(args) if args.command == "install" else list_envs(args)
    except EnvCommandError as exc:
        print(f"primerl env {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except EnvInstallFailed as exc:
        print(f"primerl env {args.command}: error: {exc}", file=sys.stderr)
        return 1


# ------------------------------------------------------------------------------------------------------- list
def list_envs(args: argparse.Namespace) -> int:
    env_python = find_env_python(args.env_python)
    if not Path(env_python.path).exists():
        raise EnvCommandError(
            f"env python {env_python.describe()} does not exist: create it with `primerl env install PATH|PACKAGE`"
        )
    try:
        info = probe_env_python(env_python.path)
    except EnvProbeError as exc:
        raise EnvInstallFailed(str(exc)) from None
    from primerl.cli.env_v1 import v1_listing

    # The v1 interpreter is listed too when the classic one is the default (not chosen by --env-python or $VAR).
    v1 = (
        v1_listing(args.env_v1_python)
        if args.env_v1_python is not None or env_python.source in ("env_venv", "this_interpreter")
        else None
    )
    if args.json:
        print(
            json.dumps(
                {
                    "python": env_python.path,
                    "source": env_python.source,
                    "verifiers": info.verifiers_version,
                    "envs": [vars(env) for env in info.envs],
                    **({"v1": v1} if v1 else {}),
                },
                indent=2,
            )
        )
        return 0
    verifiers = f"verifiers {info.verifiers_version}" if info.verifiers_version else "NO verifiers"
    print(f"env python: {env_python.describe()}; {verifiers}")
    width = max((len(env.id) for env in info.envs), default=0)
    for env in info.envs:
        where = f" (editable: {env.editable_path})" if env.editable_path else ""
        print(f"  {env.id:<{width}}  {env.dist} {env.version}{where}")
    if not info.envs:
        print("  no environments installed: `primerl env install PATH|PACKAGE`")
    if v1:
        state = f"verifiers {v1.get('verifiers')}" if "error" not in v1 else f"error: {v1['error']}"
        print(f"v1 env python: {v1['python']}; {state}")
        for env in v1["envs"]:
            where = f" (editable: {env['editable_path']})" if env["editable_path"] else ""
            print(f"  {env['id']:<{width}}  {env['dist']} {env['version']}{where}  (v1)")
    return 0


# ---------------------------------------------------------------------------------------------------- install
def install(args: argparse.Namespace) -> int:
    env_args = _env_args(args.env_args)
    pip_target, dist_name, project_dir = _classify(args.target, editable=args.editable)
    from primerl.cli.env_v1 import install_v1, is_v1_project

    if args.v1 or (project_dir is not None and is_v1_project(project_dir)):
        return install_v1(args, pip_target, dist_name, project_dir, errors=sys.modules[__name__])
    env_python = find_env_python(args.env_python)
    python = _target_python(env_python)
    started_s = time.monotonic()
    if not python.exists():
        _create_env_venv(python, verbose=args.verbose)
    verifiers_version = _ensure_verifiers(python, verbose=args.verbose)
    print(f"primerl env install: installing {args.target} into {python} ...", file=sys.stderr, flush=True)
    conflict = f"the env venv keeps verifiers=={verifiers_version}; an environment that needs another verifiers "
    pip_install_pinned(python, args, pip_target, verifiers_version, conflict + "cannot be installed into it")
    envs = _provided_envs(python, dist_name, project_dir)
    if not envs:
        raise EnvInstallFailed(
            f"installed {args.target}, but no top-level module of it names `load_environment`: a verifiers "
            "environment is a module `my_env` (id `my-env`) with `def load_environment(**args) -> vf.Environment`"
        )
    loaded = [_check_loads(python, env, env_args) for env in envs]
    print_installed(envs, loaded, python, time.monotonic() - started_s, "", "in the config of `primerl rl`")
    if find_env_python().path != str(python):
        print(
            f"  this is not the default env interpreter: pass --env-python {python} to eval, set "
            f'`env_python = "{python}"` in [orchestrator], or export {ENV_PYTHON_VAR}={python}'
        )
    return 0


def pip_install_pinned(python: Path, args, pip_target: list[str], verifiers_version: str, on_conflict: str) -> None:
    """``pip install`` the target into ``python`` with its verifiers pinned: an environment never moves the env
    venv's verifiers."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="primerl-constraints-") as constraints:
        constraints.write(f"verifiers=={verifiers_version}\n")
        constraints.flush()
        pip_args = ["install", *pip_target, "-c", constraints.name]
        _pip(python, pip_args, verbose=args.verbose, what=f"install {args.target}", on_conflict=on_conflict)


def print_installed(envs: list, lines: list[str], python: Path, elapsed_s: float, note: str, train_note: str) -> None:
    """What `primerl env install` installed, each environment's check line, and how to use the first."""
    editable = " (editable)" if envs[0].editable_path else ""
    print(
        f"primerl env install: installed {envs[0].dist} {envs[0].version}{editable} into {python} in "
        f"{elapsed_s:.0f} s{note}"
    )
    for env, line in zip(envs, lines):
        print(f"  {env.id}: {line}")
    print(f"  evaluate:  primerl eval {envs[0].id} -m MODEL")
    print(f'  train:     [[orchestrator.env]] id = "{envs[0].id}"   ({train_note})')


def _env_args(text: str) -> dict:
    try:
        return parse_env_args(text)
    except ValueError as exc:
        raise EnvCommandError(str(exc)) from None


def _classify(target: str, *, editable: bool) -> tuple[list[str], str | None, Path | None]:
    """pip's arguments for `target`, the distribution name when known, and the project directory if it is one."""
    path = Path(target).expanduser()
    if path.is_dir():
        path = path.resolve()
        if not any((path / name).is_file() for name in PROJECT_FILES):
            raise EnvCommandError(
                f"{target} holds no pyproject.toml or setup.py: not a Python project (an "
                "environment package has one; see examples/reverse_text/pyproject.toml)"
            )
        return (["-e", str(path)] if editable else [str(path)]), _project_name(path), path
    if path.is_file():
        if not path.name.endswith(ARCHIVE_SUFFIXES):
            raise EnvCommandError(
                f"{target} is a file but not a wheel or sdist; give a project directory, a "
                f"{'/'.join(ARCHIVE_SUFFIXES)} file or a PyPI package"
            )
        return [str(path.resolve())], re.split(r"-\d", path.name, maxsplit=1)[0], None
    if "://" in target:
        return [target], None, None
    if "/" in target or target.startswith((".", "~")):
        raise EnvCommandError(f"{target} does not exist: give a project directory, a wheel, or a PyPI package name")
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(target)
    except InvalidRequirement as exc:
        reason = str(exc).splitlines()[0]
        raise EnvCommandError(f"{target!r} is neither a directory nor a valid PyPI requirement ({reason})") from None
    return [target], requirement.name, None


def _project_name(path: Path) -> str | None:
    import tomllib

    pyproject = path / "pyproject.toml"
    if not pyproject.is_file():
        return None
    try:
        return tomllib.loads(pyproject.read_text()).get("project", {}).get("name")
    except tomllib.TOMLDecodeError as exc:
        raise EnvCommandError(f"{pyproject} is not valid TOML: {exc}") from None


def _target_python(env_python: EnvPython) -> Path:
    """Where to install: the env interpreter by the rule, except that primerl's own interpreter is never the
    target (verifiers and vLLM conflict there): the default env venv is created instead."""
    if env_python.source == "this_interpreter":
        return venv_python(default_env_venv())
    python = Path(env_python.path).absolute()
    if not python.exists() and not (python.parent.name == "bin" and python.name.startswith("python")):
        raise EnvCommandError(
            f"env python {env_python.describe()} does not exist and is not DIR/bin/python, so no "
            "venv can be created for it: give an existing interpreter or DIR/bin/python"
        )
    return python


def _create_env_venv(python: Path, *, verbose: bool) -> None:
    create_venv(python, verbose=verbose, what=f"the env venv (verifiers=={VERIFIERS_VERSION})")


def create_venv(python: Path, *, verbose: bool, what: str) -> None:
    """A venv whose interpreter is `python` (DIR/bin/python), with a current pip."""
    venv = python.parent.parent
    print(f"primerl env install: creating {what} at {venv} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if done.returncode != 0 or not python.exists():
        raise EnvInstallFailed(
            f"could not create a venv at {venv}: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
            f" (pass --env-python DIR/bin/python for a writable DIR)"
        )
    _pip(python, ["install", "--upgrade", "pip>=24"], verbose=verbose, what="upgrade pip")


def _ensure_verifiers(python: Path, *, verbose: bool) -> str:
    """The verifiers version of `python`, installing the pinned one (and httpx-aiohttp) when it has none."""
    try:
        info = probe_env_python(python)
    except EnvProbeError as exc:
        raise EnvInstallFailed(str(exc)) from None
    if info.verifiers_version:
        return info.verifiers_version
    print(
        f"primerl env install: installing verifiers=={VERIFIERS_VERSION} into {python} ...", file=sys.stderr, flush=True
    )
    _pip(
        python,
        ["install", f"verifiers=={VERIFIERS_VERSION}", f"httpx-aiohttp=={HTTPX_AIOHTTP_VERSION}"],
        verbose=verbose,
        what=f"install verifiers=={VERIFIERS_VERSION}",
    )
    return VERIFIERS_VERSION


def _pip(python: Path, pip_args: list[str], *, verbose: bool, what: str, on_conflict: str = "") -> None:
    command = [str(python), "-m", "pip", *pip_args, "--disable-pip-version-check"]
    if verbose:
        done = subprocess.run(command, stdin=subprocess.DEVNULL)
        output = ""
    else:
        done = subprocess.run([*command, "-q"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        tail = "\n".join(output.splitlines()[-PIP_TAIL_LINES:])
        if tail:
            print(tail, file=sys.stderr)
        hint = f"; {on_conflict}" if on_conflict and "ResolutionImpossible" in output else ""
        raise EnvInstallFailed(f"pip could not {what} into {python} (exit {done.returncode}; pip's output above{hint})")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _provided_envs(python: Path, dist_name: str | None, project_dir: Path | None) -> list:
    try:
        envs = probe_env_python(python).envs
    except EnvProbeError as exc:
        raise EnvInstallFailed(str(exc)) from None
    if dist_name is not None:
        return [env for env in envs if _normalize(env.dist) == _normalize(dist_name)]
    if project_dir is not None:
        return [env for env in envs if env.editable_path and Path(env.editable_path) == project_dir]
    return []


def _check_loads(python: Path, env, env_args: dict) -> str:
    """Load the environment in an env worker, as a run does; one line about it, or EnvInstallFailed."""
    from primerl.orchestrator.envs.base import EnvWorkerError
    from primerl.orchestrator.envs.classic import ClassicEnvClient
    from primerl.runtime.log_setup import configure_logging

    configure_logging("env", level="error")
    worker = ClassicEnvClient(python, env.id, env_args, start_timeout_s=LOAD_TIMEOUT_S)
    try:
        info = worker.start()
    except EnvWorkerError as exc:
        raise EnvInstallFailed(
            f"{env.dist} is installed, but environment {env.id!r} does not load: "
            f"{str(exc).splitlines()[0]} (fix load_environment; edits of an editable install "
            f"apply at once; re-check with `primerl eval {env.id} ...`)"
        ) from None
    finally:
        worker.close()
    tools = getattr(info, "has_tools", None)
    return (
        f"loads ({info.env_class}; {info.num_examples} train, "
        f"{info.num_eval_examples if info.has_eval_dataset else 'no'} eval examples"
        f"{'; has tools' if tools else ''})"
    )

"""What the systemd-unit tests share: reading unit and environment files the way systemd does, a unit's command
line after systemd's substitutions, the daemons' own `--dry-run` on it, deploy/install.sh, and running a unit's
command line the way systemd would (without systemd, which does not run here) in private namespaces."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
INSTALL_SH = DEPLOY / "install.sh"
BIN = Path(sys.executable).parent
VENV = BIN.parent
ENV_VENV = REPO_ROOT / ".venv-envs"
"""The env workers' environment of this set-up (the orchestrator unit's PRIMERL_ENV_PYTHON)."""
SERVICES = sorted(p.name for p in (DEPLOY / "systemd").glob("*.service"))
# Each unit as a node runs it: the template as two instances (ports 8000 and 8001 from install.sh).
INSTANCES = [s for s in SERVICES if not s.endswith("@.service")] + [
    "primerl-infer@0.service",
    "primerl-infer@1.service",
]
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@dataclass
class Unit:
    """The settings of a unit file (and its drop-ins) that the checks need, each key's values in order."""

    path: Path
    settings: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path, *drop_ins: Path) -> Unit:
        unit = cls(path)
        for file in (path, *drop_ins):
            for line in file.read_text().splitlines():
                if line.startswith(("#", ";", "[")) or "=" not in line:
                    continue
                key, value = line.split("=", 1)
                if key == "ExecStart" and not value:  # a drop-in's empty ExecStart= clears the list
                    unit.settings[key] = []
                    continue
                unit.settings.setdefault(key, []).append(value)
        return unit

    def values(self, key: str) -> list[str]:
        return self.settings.get(key, [])


def read_env_file(path: Path) -> dict[str, str]:
    """A systemd `EnvironmentFile=`: KEY=value lines; comments and blank lines skipped, one pair of quotes dropped."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=value: {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def unit_environment(unit: Unit, root: Path, instance: str) -> dict[str, str]:
    """The environment systemd gives the unit: `Environment=` lines, then its `EnvironmentFile=`s (read from
    ``root``), which win."""
    env: dict[str, str] = {}
    for assignment in unit.values("Environment"):
        for word in shlex.split(assignment):
            key, _, value = word.partition("=")
            env[key] = value
    for name in unit.values("EnvironmentFile"):
        name = name.replace("%i", instance)
        optional = name.startswith("-")
        path = root / name.removeprefix("-").lstrip("/")
        if optional and not path.exists():
            continue
        env.update(read_env_file(path))
    return env


def command_line(unit: Unit, env: dict[str, str], instance: str) -> list[str]:
    """`ExecStart=` as systemd runs it: specifiers, then `${NAME}` as one word (or part of one) and a bare `$NAME`
    word split at whitespace into zero or more words."""
    (exec_start,) = unit.values("ExecStart")
    exec_start = exec_start.replace("%i", instance).replace("%%", "%")
    assert "%" not in exec_start, f"{unit.path.name}: a specifier this check does not expand: {exec_start}"
    argv = []
    for word in shlex.split(exec_start):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            argv += env.get(bare.group(1), "").split()
            continue
        word = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word)
        assert "$" not in word, f"{unit.path.name}: a variable this check does not expand: {word}"
        argv.append(word)
    return argv


def dry_run(argv: list[str], env: dict[str, str], root: Path) -> dict:
    """Run the daemon's own command-line and config parsing (`--dry-run`) on a unit's command line, the files it
    names under /etc/primerl read from ``root``; the resolved config it prints."""
    program = Path(argv[0])
    assert program.exists(), f"{argv[0]} is not installed in this environment"
    args = [str(root / a.lstrip("/")) if a.startswith("/etc/primerl/") else a for a in argv[1:]]
    result = subprocess.run(
        [str(program), *args, "--dry-run"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**env, "PATH": str(BIN), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, f"{shlex.join(argv)}\n{result.stderr}"
    return tomllib.loads(result.stdout)


def run_install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL_SH), *args], capture_output=True, text=True, check=False, timeout=60)


def installed_unit(root: Path, name: str, *drop_ins: Path) -> Unit:
    template = re.sub(r"@[^.]+\.service$", "@.service", name)
    return Unit.read(root / "etc/systemd/system" / template, *drop_ins)


def instance_of(name: str) -> str:
    match = re.search(r"@([^.]+)\.service$", name)
    return match.group(1) if match else ""


def can_unshare_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False, timeout=30).returncode == 0


def start_like_the_unit(shadow: Path, name: str) -> tuple[str, dict[str, str]]:
    """A shell line that starts unit ``name`` as systemd would (its state, cache and runtime directories, then its
    command line and environment, as its user, with its umask, from its working directory, stderr to
    /var/lib/primerl/NAME.log, in the background); the unit's settings."""
    unit = installed_unit(shadow, name)
    env = unit_environment(unit, shadow, instance_of(name))
    argv = command_line(unit, env, instance_of(name))
    env = {**env, "HOME": "/var/lib/primerl", "USER": "primerl", "LOGNAME": "primerl", "PATH": "/usr/bin:/bin"}
    one = {key: values[-1].replace("%i", instance_of(name)) for key, values in unit.settings.items()}
    directories = (
        [f"/var/lib/{d}" for d in one["StateDirectory"].split()]
        + [f"/var/cache/{d}" for d in one.get("CacheDirectory", "").split()]
        + [f"/run/{d}" for d in one["RuntimeDirectory"].split()]
    )
    line = (
        f"install -d -o primerl -g primerl -m {one['StateDirectoryMode']} {' '.join(directories)}; "
        f"(umask {one['UMask']} && cd {one['WorkingDirectory']} && "
        "exec setpriv --reuid=primerl --regid=primerl --init-groups "
        f"--no-new-privs {shlex.join(['env', '-i', *(f'{k}={v}' for k, v in env.items()), *argv])} "
        f"2>/var/lib/primerl/{name}.log) &"
    )
    return line, one


def run_like_systemd(tmp_path: Path, setup: str, body: str, timeout_s: float) -> str:
    """``body`` after install.sh on a real root (``setup`` run after it), in a private mount and network
    namespace: /etc a copy, /var/lib, /var/cache, /run, /tmp and /home empty tmpfs, and / read-only
    (ProtectSystem=strict, PrivateTmp, ProtectHome, roughly: systemd itself does not run here). Its stdout."""
    # This test environment's interpreter may live under /root (pyenv), which user primerl cannot enter: show it
    # just that directory, in a namespace-only /root (install.sh warns about such a venv on a real node).
    interpreter = (VENV / "bin" / "python").resolve()
    interpreter_view = ""
    if interpreter.is_relative_to("/root"):
        top = Path("/root") / interpreter.relative_to("/root").parts[0]
        interpreter_view = (
            f"mkdir {tmp_path}/hold && mount --bind {top} {tmp_path}/hold && "
            f"mount -t tmpfs -o mode=0755 tmpfs /root && mkdir {top} && "
            f"mount --move {tmp_path}/hold {top}"
        )
    script = f"""
set -euo pipefail
mount --make-rprivate /
cp -a /etc {tmp_path}/etc && mount --bind {tmp_path}/etc /etc
{interpreter_view}
for dir in /var/lib /var/cache /run /home; do mount -t tmpfs -o mode=0755 tmpfs $dir; done
ip link set lo up
bash {INSTALL_SH} --venv {VENV} --token t0ken --infer-workers 1 >/dev/null
{setup}
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -o remount,bind,ro /
trap 'for log in /var/lib/primerl/*.log; do echo "== $log"; tail -n 40 $log; done' EXIT
touch /usr/primerl-write-probe 2>/dev/null && echo ROOT_WRITABLE || echo ROOT_READ_ONLY
{body}
"""
    # A pid namespace too: when its first process ends (or is killed), every daemon started in it is killed.
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "-n",
            "-p",
            "-f",
            "--kill-child",
            "--mount-proc",
            "timeout",
            str(int(timeout_s)),
            "bash",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s + 30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ROOT_READ_ONLY" in result.stdout
    return result.stdout


WAIT_FOR = """wait_for() {  # FILE PID SECONDS: until FILE has content, PID has ended, or SECONDS passed
    for _ in $(seq $(( $3 * 10 ))); do [[ -s $1 ]] || ! kill -0 $2 2>/dev/null && break; sleep 0.1; done
    cat $1; echo
}
stop() {  # PID: SIGTERM, then its exit status and the seconds it took
    local started=$(date +%s); kill -TERM $1; set +e; wait $1; echo "EXIT=$? STOP_S=$(( $(date +%s) - started ))"
    set -e
}
"""

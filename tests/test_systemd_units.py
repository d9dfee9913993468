"""The systemd units of deploy/: installed by deploy/install.sh into a temporary root, their command lines (after
systemd's substitutions: instance names, `Environment=`, the environment files install.sh wrote) are accepted by
the real daemons with the example configs, `systemd-analyze` verifies them, and install.sh is idempotent (in a
temporary root, and on a real root inside a private mount namespace). test_systemd_units_running.py runs them."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.systemd_units import (
    BIN,
    DEPLOY,
    INSTALL_SH,
    INSTANCES,
    SERVICES,
    SYSTEMD_ANALYZE,
    VENV,
    Unit,
    can_unshare_mounts,
    command_line,
    dry_run,
    installed_unit,
    instance_of,
    read_env_file,
    run_install,
    unit_environment,
)

needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian: apt-get install systemd)"
)


@pytest.fixture(scope="module")
def node_root(tmp_path_factory) -> Path:
    """A node's filesystem as install.sh leaves it (primerl in this test's virtual environment, two workers)."""
    root = tmp_path_factory.mktemp("node")
    result = run_install("--root", str(root), "--venv", str(VENV), "--infer-workers", "2", "--token", "sekrit")
    assert result.returncode == 0, result.stderr
    return root


@pytest.mark.parametrize("name", INSTANCES)
def test_unit_command_line_is_accepted_by_the_daemon(node_root, name):
    unit = installed_unit(node_root, name)
    env = unit_environment(unit, node_root, instance_of(name))
    config = dry_run(command_line(unit, env, instance_of(name)), env, node_root)
    assert config["log"]["format"] == "json"
    if name.startswith("primerl-broker"):
        assert config["spool_dir"] == "/var/lib/primerl/spool" and config["prometheus"]["port"] == 9310
        assert config["host"] == "0.0.0.0"
    elif name.startswith("primerl-infer"):
        assert config["server"]["port"] == {"": 8000, "0": 8000, "1": 8001}[instance_of(name)]
        assert config["broker"]["address"] == "broker-node:50051"
    else:
        assert config["output_dir"].startswith("/var/lib/primerl/")


def test_per_role_and_per_instance_settings_win(node_root, tmp_path):
    """PRIMERL_INFER_INSTANCE_ARGS (the instance's file) adds a config file and overrides after the shared ones."""
    unit = installed_unit(node_root, "primerl-infer@1.service")
    env = unit_environment(unit, node_root, "1")
    extra = tmp_path / "1.toml"
    extra.write_text("[model]\nmax_model_len = 1024\n")
    env["PRIMERL_INFER_ARGS"] = "--gpu-memory-utilization 0.5"
    env["PRIMERL_INFER_INSTANCE_ARGS"] = f"@ {extra} --server.port 9001"
    config = dry_run(command_line(unit, env, "1"), env, node_root)
    assert config["model"]["max_model_len"] == 1024
    assert config["gpu_memory_utilization"] == 0.5
    assert config["server"]["port"] == 9001


def security_examples(node: str) -> dict[str, str]:
    """The commented examples of the wire-security variables in deploy/etc/primerl.env, for client ``node``."""
    found = re.findall(
        r"^#\s+(PRIMERL_\w+_(?:TLS|CURVE)_ARGS)=(.+)$", (DEPLOY / "etc/primerl.env").read_text(), re.MULTILINE
    )
    return {key: value.replace("NODE", node) for key, value in found}


def test_wire_security_examples_are_accepted(node_root):
    """The TLS/CURVE settings primerl.env shows (once uncommented) name the files `primerl certs` writes, copied to
    /etc/primerl/certs, and are settings the daemons know."""
    examples = security_examples("node1")
    assert set(examples) == {
        f"PRIMERL_{side}_{kind}_ARGS" for side in ("BROKER", "CLIENT") for kind in ("TLS", "CURVE")
    }
    certs = node_root / "etc/primerl/certs"
    result = subprocess.run(
        [str(BIN / "primerl"), "certs", "--out", str(certs), "--host", "broker-node", "--clients", "node1", "--force"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for name in INSTANCES:
        unit = installed_unit(node_root, name)
        env = {**unit_environment(unit, node_root, instance_of(name)), **examples}
        argv = command_line(unit, env, instance_of(name))
        paths = [a for a in argv if a.startswith("/etc/primerl/certs/")]
        assert len(paths) == 5, f"{name}: {argv}"
        missing = [p for p in paths if not (node_root / p.lstrip("/")).exists()]
        assert not missing, f"{name}: `primerl certs` wrote no {missing}"
        config = dry_run(argv, env, node_root)
        security = config if name.startswith("primerl-broker") else config["broker"]
        assert {k for k in security if k.startswith(("tls_", "curve_"))} == (
            {
                "tls_cert_path",
                "tls_key_path",
                "tls_client_ca_path",
                "curve_secret_key_path",
                "curve_authorized_keys_dir",
            }
            if name.startswith("primerl-broker")
            else {"tls_ca_path", "tls_cert_path", "tls_key_path", "curve_secret_key_path", "curve_broker_key_path"}
        )


def test_torchrun_drop_in(node_root):
    """The torchrun drop-in replaces ExecStart with torchrun flags torchrun knows and a trainer command line the
    trainer accepts."""
    drop_in = node_root / "etc/primerl/examples/trainer-torchrun.conf"
    unit = installed_unit(node_root, "primerl-trainer.service", drop_in)
    env = unit_environment(unit, node_root, "")
    argv = command_line(unit, env, "")
    split = next(i for i, a in enumerate(argv) if a.endswith("/primerl-trainer"))
    assert Path(argv[0]).name == "torchrun" and Path(argv[0]).exists()
    check = (
        "import sys; from torch.distributed.run import get_args_parser; "
        "a = get_args_parser().parse_args(sys.argv[1:]); print(a.nnodes, a.nproc_per_node, a.rdzv_endpoint)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, *argv[1 : split + 1]], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "2", "trainer-node-1:29400"]
    dry_run(argv[split:], env, node_root)


def test_units_join_the_target_and_are_hardened(node_root):
    target = Unit.read(node_root / "etc/systemd/system/primerl.target")
    assert target.values("WantedBy") == ["multi-user.target"]
    for name in SERVICES:
        unit = installed_unit(node_root, name)
        one = {key: values[-1] for key, values in unit.settings.items()}
        assert one["PartOf"] == "primerl.target" and one["WantedBy"] == "primerl.target", name
        assert one["Restart"] == "on-failure" and int(one["StartLimitBurst"]) >= 1, name
        assert int(one["StartLimitIntervalSec"]) > 0 and one["RestartPreventExitStatus"] == "2", name
        assert one["NoNewPrivileges"] == "true" and one["ProtectSystem"] == "strict", name
        assert one["PrivateTmp"] == "true" and one["ProtectHome"] == "true", name
        assert one["StandardError"] == "journal" and one["User"] == "primerl", name
        assert one["WorkingDirectory"] == "/var/lib/primerl", name  # writable: relative paths do not hit ProtectSystem
        assert one["StateDirectory"].split()[0] == "primerl" and one["RuntimeDirectory"].startswith("primerl-"), name
        assert one["ExecStart"].startswith(f"{BIN}/"), name
        # Inference and trainer ranks need the GPUs in /dev; the broker and orchestrator do not.
        gpus = name.startswith(("primerl-infer", "primerl-trainer"))
        assert one.get("PrivateDevices", "false") == ("false" if gpus else "true"), name


@needs_systemd_analyze
def test_systemd_analyze_verify(node_root):
    """systemd's own check of every unit, the template as instances and the trainer with its torchrun drop-in:
    no message at all (unknown keys, bad values, missing executables, dependencies on units that do not exist)."""
    unit_dir = node_root / "etc/systemd/system"
    drop_in_dir = unit_dir / "primerl-trainer.service.d"
    drop_in_dir.mkdir(exist_ok=True)
    shutil.copy(node_root / "etc/primerl/examples/trainer-torchrun.conf", drop_in_dir / "torchrun.conf")
    try:
        names = [*INSTANCES, "primerl.target"]
        result = subprocess.run(
            [SYSTEMD_ANALYZE, "verify", "--man=no", "--generators=no", *(f"./{name}" for name in names)],
            cwd=unit_dir,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    finally:
        shutil.rmtree(drop_in_dir)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


@needs_systemd_analyze
@pytest.mark.parametrize("name", INSTANCES)
def test_systemd_analyze_security_exposure(node_root, name):
    """`systemd-analyze security` rates every unit 5.0 or less (out of 10; the units before hardening: 8.7)."""
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", "--threshold=50", f"./{name}"],
        cwd=node_root / "etc/systemd/system",
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout[-600:] + result.stderr


@pytest.mark.skipif(shutil.which("systemctl") is None, reason="systemctl is not installed")
def test_systemctl_enables_units_into_the_target(tmp_path):
    root = tmp_path / "node"
    assert run_install("--root", str(root), "--venv", str(VENV), "--infer-workers", "2").returncode == 0
    result = subprocess.run(
        [
            "systemctl",
            f"--root={root}",
            "enable",
            "primerl.target",
            "primerl-broker.service",
            "primerl-infer@0.service",
            "primerl-infer@1.service",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    wants = root / "etc/systemd/system/primerl.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == [
        "primerl-broker.service",
        "primerl-infer@0.service",
        "primerl-infer@1.service",
    ]
    assert (root / "etc/systemd/system/multi-user.target.wants/primerl.target").is_symlink()


def test_install_is_idempotent_and_keeps_edited_files(tmp_path):
    root = tmp_path / "node"
    first = run_install("--root", str(root), "--venv", str(VENV), "--infer-workers", "1")
    assert first.returncode == 0, first.stderr
    etc = root / "etc/primerl"
    token = read_env_file(etc / "primerl.env")["PRIMERL_RUN_TOKEN"]
    assert re.fullmatch(r"[0-9a-f]{48}", token)
    assert stat.S_IMODE((etc / "primerl.env").stat().st_mode) == 0o640
    assert stat.S_IMODE(etc.stat().st_mode) == 0o750
    assert stat.S_IMODE((root / "var/lib/primerl").stat().st_mode) == 0o750
    edited = etc / "broker.toml"
    edited.write_text('host = "10.0.0.5"\n')
    unit = root / "etc/systemd/system/primerl-broker.service"
    shipped = unit.read_text()
    unit.write_text(shipped + "# a local edit: belongs in a drop-in\n")
    second = run_install("--root", str(root), "--venv", str(VENV), "--infer-workers", "2")
    assert second.returncode == 0, second.stderr
    assert edited.read_text() == 'host = "10.0.0.5"\n'
    assert read_env_file(etc / "primerl.env")["PRIMERL_RUN_TOKEN"] == token
    assert unit.read_text() == shipped
    assert "kept     /etc/primerl/broker.toml (exists)" in second.stdout
    assert "updated  /etc/systemd/system/primerl-broker.service" in second.stdout
    assert read_env_file(etc / "infer/1.env")["PRIMERL_INFER_PORT"] == "8001"
    third = run_install("--root", str(root), "--venv", str(VENV), "--infer-workers", "2")
    assert "wrote" not in third.stdout and "updated" not in third.stdout, third.stdout


def test_install_takes_the_token_of_an_earlier_release(tmp_path):
    root = tmp_path / "node"
    (root / "etc/primerl").mkdir(parents=True)
    (root / "etc/primerl/run-token.env").write_text("PRIMERL_RUN_TOKEN=from-before\n")
    assert run_install("--root", str(root), "--venv", str(VENV)).returncode == 0
    assert read_env_file(root / "etc/primerl/primerl.env")["PRIMERL_RUN_TOKEN"] == "from-before"


def test_install_renders_paths_and_refuses_bad_arguments(tmp_path):
    root = tmp_path / "node"
    result = run_install("--root", str(root), "--venv", "/srv/p/.venv", "--env-venv", "/srv/envs", "--user", "rl")
    assert result.returncode == 0, result.stderr
    assert "WARNING  /srv/p/.venv/bin/primerl-broker is missing" in result.stdout
    orchestrator = Unit.read(root / "etc/systemd/system/primerl-orchestrator.service")
    assert orchestrator.values("ExecStart")[0].startswith("/srv/p/.venv/bin/primerl-orchestrator ")
    assert "PRIMERL_ENV_PYTHON=/srv/envs/bin/python" in orchestrator.values("Environment")
    assert orchestrator.values("User") == ["rl"]
    for args, message in [
        (["--infer-workers", "two"], "--infer-workers takes a number"),
        (["--venv", "relative"], "absolute paths"),
        (["--venv", "/srv/a b"], "cannot hold spaces"),
        (["--bogus"], "unknown argument --bogus"),
        (["--root"], "--root needs a value"),
    ]:
        bad = run_install("--root", str(root), *args) if args[0] != "--root" else run_install(*args)
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)


def test_install_without_root_needs_a_root_dir():
    """Run as another user (as nobody, through setpriv, when the test runs as root), install.sh refuses / itself."""
    as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    if as_user and shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv (util-linux) is missing")
    result = subprocess.run(
        [*as_user, "bash", str(INSTALL_SH)], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 1 and "--root DIR" in result.stderr, result.stderr


@pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and a private mount namespace (unshare -m)")
def test_install_on_a_real_root_in_a_private_mount_namespace(tmp_path):
    """install.sh without --root (system user, owners, modes), twice, in a mount namespace whose /etc is a copy
    and whose /var/lib and /var/cache are empty: the machine's own /etc and /var are not touched."""
    script = f"""
set -euo pipefail
mount --make-rprivate /
cp -a /etc {tmp_path}/etc && mount --bind {tmp_path}/etc /etc
mount -t tmpfs tmpfs /var/lib && mount -t tmpfs tmpfs /var/cache
bash {INSTALL_SH} --venv {VENV} --infer-workers 1 --user primerltest > {tmp_path}/first.txt
bash {INSTALL_SH} --venv {VENV} --infer-workers 1 --user primerltest > {tmp_path}/second.txt
getent passwd primerltest
stat -c '%n %U:%G %a' /etc/primerl /etc/primerl/primerl.env /etc/primerl/infer/0.env /etc/primerl/certs \
    /var/lib/primerl /var/cache/primerl /etc/systemd/system/primerl.target
"""
    result = subprocess.run(
        ["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split(":")[5:] == ["/var/lib/primerl", "/usr/sbin/nologin"]
    assert lines[1:] == [
        "/etc/primerl root:primerltest 750",
        "/etc/primerl/primerl.env root:primerltest 640",
        "/etc/primerl/infer/0.env root:primerltest 640",
        "/etc/primerl/certs root:primerltest 750",
        "/var/lib/primerl primerltest:primerltest 750",
        "/var/cache/primerl primerltest:primerltest 750",
        "/etc/systemd/system/primerl.target root:root 644",
    ]
    first, second = ((tmp_path / f"{n}.txt").read_text() for n in ("first", "second"))
    assert "created  system user primerltest" in first and "exists   primerltest" in second
    assert "wrote" not in second and "updated" not in second, second
    assert "daemon-reload" in second
    host_user = subprocess.run(["getent", "passwd", "primerltest"], capture_output=True, check=False, timeout=30)
    assert host_user.returncode != 0, "the user was made outside the namespace"

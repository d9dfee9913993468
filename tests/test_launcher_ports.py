"""A user's first runs on one machine: ports that never collide, bind errors that name the setting, the run
token in ``RUN_DIR/run.json`` for ``primerl status RUN_DIR``, tmux panes titled with their roles, and an early
failure that stops the run at once.

Fast tests drive the pieces (config resolution, the run file, ``BrokerService`` and the exporters over
loopback); the slow ones start real `primerl rl` runs on the tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.supervisor.run_file import RUN_FILE_NAME, RunFile, RunFileError, read_run_file, write_run_file

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
RUN_TIMEOUT_S = 420
BROKER_PORT_KEYS = ("grpc_port", "rollout_port", "weight_port")


def taken_port() -> socket.socket:
    """A listening socket on a free loopback port: the port stays taken while the socket is open."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def default_ports_config(tmp_path: Path) -> Path:
    """The example without its fixed broker port: every port as a new user's config leaves it."""
    text = re.sub(r"(?m)^(grpc|rollout|weight)_port = .*\n", "", EXAMPLE.read_text())
    text = re.sub(r"(?m)^\[inference.server\]\nport = .*\n", "", text)
    assert not re.search(r"(?m)^\w*port = ", text), text
    path = tmp_path / "default_ports.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------ fast: config
def _load(tmp_path: Path, **overrides):
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config

    return load_config(RLConfig, [default_ports_config(tmp_path)], overrides)


def test_primerl_rl_gives_the_broker_free_ports_unless_the_config_sets_them(tmp_path):
    config = _load(tmp_path)
    assert [getattr(config.broker, key) for key in BROKER_PORT_KEYS] == [50051, 50052, 50053]  # standalone defaults
    launched = config.with_free_broker_ports()
    assert [getattr(launched.broker, key) for key in BROKER_PORT_KEYS] == [0, 0, 0]
    assert launched.inference.server.port == 0  # inference: a free port by default, found through the broker
    assert launched.port_clashes() == []

    explicit = _load(tmp_path, broker={"grpc_port": 50051, "weight_port": 0}).with_free_broker_ports()
    assert [getattr(explicit.broker, key) for key in BROKER_PORT_KEYS] == [50051, 0, 0]
    assert explicit.trainer.broker.address == "127.0.0.1:50051"


def test_an_explicit_free_grpc_port_is_allowed_and_the_run_config_loads_back(tmp_path):
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config, write_toml

    config = _load(tmp_path, broker={"grpc_port": 0})
    assert config.broker.grpc_port == 0
    # `primerl rl` writes rl.toml with the free ports it gave the broker; a re-run from it loads.
    written = write_toml(config.with_free_broker_ports(), tmp_path / "rl.toml")
    again = load_config(RLConfig, [written], {})
    assert [getattr(again.broker, key) for key in BROKER_PORT_KEYS] == [0, 0, 0]


def test_the_standalone_broker_keeps_its_documented_ports():
    from primerl.configs.broker import BrokerConfig

    broker = BrokerConfig()
    assert (broker.grpc_port, broker.rollout_port, broker.weight_port) == (50051, 50052, 50053)


# -------------------------------------------------------------------------------------- fast: run file
def test_the_run_file_is_owner_only_from_its_first_byte_and_reads_back(tmp_path):
    run = RunFile(
        broker_address="127.0.0.1:41235", run_token="s3cret", tls_ca_path=None, run_id="run-1", launcher_pid=os.getpid()
    )
    previous_umask = os.umask(0)  # a permissive umask must not widen it
    try:
        path = write_run_file(tmp_path, run)
    finally:
        os.umask(previous_umask)
    assert path == tmp_path / RUN_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_run_file(tmp_path) == run and read_run_file(path) == run
    assert [p.name for p in tmp_path.iterdir()] == [RUN_FILE_NAME]  # no temporary file left
    write_run_file(tmp_path, RunFile(broker_address="127.0.0.1:1", run_token="other"))  # replaced whole
    assert read_run_file(tmp_path).run_token == "other"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_status_of_a_directory_without_a_run_file_says_what_to_do(tmp_path):
    with pytest.raises(RunFileError, match="does not exist: give the run directory"):
        read_run_file(tmp_path)
    result = subprocess.run(
        [str(BIN / "primerl"), "status", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path / RUN_FILE_NAME} does not exist" in result.stderr and "--broker" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------ fast: bind errors
def test_a_taken_broker_port_names_the_address_and_the_setting(tmp_path):
    from primerl.broker.service import BrokerService, PortUnavailable
    from primerl.configs.broker import BrokerConfig

    for key, what in (("grpc_port", "gRPC"), ("rollout_port", "ZeroMQ rollout"), ("weight_port", "ZeroMQ weight")):
        with taken_port() as taken:
            port = taken.getsockname()[1]
            ports = {name: 0 for name in BROKER_PORT_KEYS} | {key: port}
            config = BrokerConfig(**ports, spool_dir=tmp_path / key, prometheus={"enabled": False})
            with pytest.raises(PortUnavailable) as caught:
                BrokerService(config).start()
        message = str(caught.value)
        assert f"the broker cannot bind its {what} port 127.0.0.1:{port}" in message, message
        assert f"Change broker.{key}" in message and f"--{key.replace('_', '-')} N" in message, message


def test_the_broker_daemon_reports_a_taken_port_in_one_line(tmp_path):
    """What a user sees, whichever check finds it first (the preflight, or the bind in a race with it)."""
    with taken_port() as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                str(BIN / "primerl-broker"),
                "--grpc-port",
                "0",
                "--rollout-port",
                str(port),
                "--weight-port",
                "0",
                "--spool-dir",
                str(tmp_path / "spool"),
                "--prometheus.enabled=false",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    output = result.stdout + result.stderr
    assert result.returncode in (1, 2), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"127.0.0.1:{port}" in output and "in use" in output and "rollout_port" in output, output[-3000:]


def test_a_taken_metrics_port_names_the_role_setting():
    from primerl.runtime.config_common import PrometheusConfig
    from primerl.runtime.prometheus import MetricsExporter

    with taken_port() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"127.0.0.1:{port}: .*orchestrator\.prometheus\.port in a `primerl rl`"):
            MetricsExporter("orchestrator", PrometheusConfig(port=port)).start()


# -------------------------------------------------------------------------------------------- fast: tmux
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_panes_are_titled_with_their_roles(tmp_path):
    import io

    from primerl.supervisor.launcher import Launcher, LaunchOptions

    config = _load(tmp_path, output_dir=str(tmp_path / "run"))
    launcher = Launcher(config, LaunchOptions(tmux=True), out=io.StringIO(), err=io.StringIO())
    launcher.logs_dir.mkdir(parents=True)
    roles = ["broker", "inference", "orchestrator", "trainer"]
    try:
        launcher._open_tmux(roles)
        panes = subprocess.run(
            ["tmux", "list-panes", "-t", f"{launcher.tmux_session}:roles", "-F", "#{pane_title}"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
        border = subprocess.run(
            ["tmux", "show-options", "-w", "-t", f"{launcher.tmux_session}:roles", "pane-border-status"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    finally:
        launcher._close_tmux()
    assert panes == roles
    assert "top" in border.stdout


# ------------------------------------------------------------------------------------ slow: real runs
@pytest.fixture(scope="module")
def tiny_model(tiny_model):
    """conftest's tiny model, where the env workers' interpreter is set up."""
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    return tiny_model


def _env(token: str | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PRIMERL_ENV_PYTHON": ENV_PYTHON,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PRIMERL_RUN_TOKEN", None)
    if token is not None:
        env["PRIMERL_RUN_TOKEN"] = token
    return env


def _start(config: Path, model: Path, run_dir: Path, *extra: str, token: str | None = None) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    return subprocess.Popen(
        [
            str(BIN / "primerl"),
            "rl",
            "@",
            str(config),
            "--model.name",
            str(model),
            "--output-dir",
            str(run_dir),
            *extra,
        ],
        stdout=open(run_dir.parent / f"{run_dir.name}.stdout", "w"),
        stderr=open(run_dir.parent / f"{run_dir.name}.stderr", "w"),
        env=_env(token),
        cwd=run_dir.parent,
    )


def _output(run_dir: Path) -> tuple[str, str]:
    return (
        (run_dir.parent / f"{run_dir.name}.stdout").read_text(),
        (run_dir.parent / f"{run_dir.name}.stderr").read_text(),
    )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(2)  # SIGINT: the launcher stops its roles
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "primerl"), "status", *args, "--json", "--timeout-s", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or _env(),
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_two_default_runs_side_by_side_both_finish_and_primerl_status_finds_each(tiny_model, tmp_path):
    """Two runs with every port at its default on one machine; one with an exported token. While both run,
    `primerl status RUN_DIR` reaches each (address and token from its run.json, mode 0600); both finish."""
    config = default_ports_config(tmp_path)
    exported = "token-exported-by-the-user"
    first, second = tmp_path / "first", tmp_path / "second"
    processes = [
        _start(config, tiny_model, first, "--max-steps", "2"),
        _start(config, tiny_model, second, "--max-steps", "2", token=exported),
    ]
    try:
        statuses = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(statuses) < 2:
            for run_dir, process in zip((first, second), processes):
                assert process.poll() is None, "\n".join(_output(run_dir))[-4000:]
                if run_dir not in statuses and (run_dir / RUN_FILE_NAME).exists():
                    statuses[run_dir] = _status(str(run_dir))
            assert time.monotonic() < deadline, "no run.json within the run timeout"
            time.sleep(0.2)
        for process in processes:
            process.wait(RUN_TIMEOUT_S)
    finally:
        for process in processes:
            _stop(process)
    runs = {run_dir: read_run_file(run_dir) for run_dir in (first, second)}
    for run_dir, process in zip((first, second), processes):
        stdout, stderr = _output(run_dir)
        assert process.returncode == 0, (stdout + stderr)[-6000:]
        assert "run finished: 2 steps" in stdout, stdout[-3000:]
        assert f"  status: primerl status {run_dir}" in stdout, stdout[-3000:]
        assert stat.S_IMODE((run_dir / RUN_FILE_NAME).stat().st_mode) == 0o600
        status = statuses[run_dir]
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["run_id"] == runs[run_dir].run_id
        # The token is in run.json only: no config, log or other file of the run holds it.
        token = runs[run_dir].run_token
        holders = [
            p
            for p in run_dir.rglob("*")
            if p.is_file() and p.name != RUN_FILE_NAME and token.encode() in p.read_bytes()
        ]
        assert not holders, holders
    assert runs[second].run_token == exported  # an exported token is used, not replaced
    assert runs[first].run_token != exported
    ports = [{k: json.loads((d / "broker.ready.json").read_text())[k] for k in BROKER_PORT_KEYS} for d in runs]
    assert set(ports[0].values()).isdisjoint(ports[1].values()), ports
    inference_ports = [json.loads((d / "inference.ready.json").read_text())["http_port"] for d in runs]
    assert inference_ports[0] != inference_ports[1] and 8000 not in inference_ports
    print("two default runs side by side: broker ports", ports, "inference ports", inference_ports)


@pytest.mark.slow
@pytest.mark.vllm
def test_primerl_status_with_the_wrong_token_is_refused_and_says_how(tiny_model, tmp_path):
    """The token matters: `primerl status RUN_DIR --token wrong` is refused; with the run's token it answers."""
    run_dir = tmp_path / "run"
    process = _start(default_ports_config(tmp_path), tiny_model, run_dir, "--max-steps", "200")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (run_dir / RUN_FILE_NAME).exists():
            assert process.poll() is None and time.monotonic() < deadline, "\n".join(_output(run_dir))[-4000:]
            time.sleep(0.1)
        refused = _status(str(run_dir), "--token", "wrong")
        answered = _status(str(run_dir))
        listing = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes()
            for pid in os.listdir("/proc")
            if pid.isdigit() and Path(f"/proc/{pid}/cmdline").exists()
        }
    finally:
        _stop(process)
    token = read_run_file(run_dir).run_token
    assert refused.returncode == 1 and "pass the run's token with --token" in refused.stderr, refused.stderr
    assert answered.returncode == 0, answered.stderr
    assert not [pid for pid, cmdline in listing.items() if token.encode() in cmdline]  # not in process listings


@pytest.mark.slow
@pytest.mark.vllm
def test_an_early_failure_stops_every_role_without_waiting_for_the_stop_timeout(tiny_model, tmp_path):
    """The orchestrator fails at start (an environment that does not exist) while vLLM starts and the trainer
    builds its model: every other role stops on its SIGTERM (none is killed after the 30 s stop timeout)."""
    run_dir = tmp_path / "run"
    # --no-preflight: the preflight would refuse the unknown environment before anything starts; this is about a
    # failure it cannot foresee, in a role already started.
    process = _start(
        default_ports_config(tmp_path),
        tiny_model,
        run_dir,
        "--max-steps",
        "3",
        "--orchestrator.env",
        '[{id = "no-such-env"}]',
        "--restart",
        "never",
        "--no-preflight",
    )
    try:
        process.wait(RUN_TIMEOUT_S)
    finally:
        _stop(process)
    stdout, stderr = _output(run_dir)
    assert process.returncode == 1, (stdout + stderr)[-6000:]
    assert "did not stop within" not in stderr, stderr[-4000:]
    # exit 2: an environment installed in neither env interpreter is a configuration error
    assert re.search(r"orchestrator exited with status 2( while inference was starting)?; stopped the run", stderr)
    failed_s = (run_dir / "logs" / "orchestrator.log").stat().st_mtime
    exited_s = max(p.stat().st_mtime for p in (run_dir.parent / "run.stdout", run_dir.parent / "run.stderr"))
    print(f"early failure to primerl rl's exit: {exited_s - failed_s:.1f} s")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_taken_inference_port_names_the_address_and_the_setting(tiny_model, tmp_path):
    """The bind itself (the preflight, skipped here, catches a port taken before the start; this is a port taken
    between the preflight and the bind): one line that names the address and the setting, before vLLM's engine."""
    env = {**_env(), "PRIMERL_SKIP_PREFLIGHT": "1", "TMPDIR": str(tmp_path)}
    with taken_port() as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                str(BIN / "primerl-infer"),
                "--model.name",
                str(tiny_model),
                "--model.max-model-len",
                "512",
                "--server.port",
                str(port),
                "--broker.address",
                "127.0.0.1:1",
                "--broker.connect-timeout-s",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=env,
            cwd=tmp_path,
        )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert "Traceback" not in output and "Errno 98" not in output, output[-4000:]
    assert f"cannot bind its HTTP port 127.0.0.1:{port}: the port is in use" in output, output[-4000:]
    assert "Change inference.server.port" in output, output[-4000:]

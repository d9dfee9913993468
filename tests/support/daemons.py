"""`primerl-*` daemons as child processes of a test: started with a ready file, their output in a log file,
stopped (SIGTERM, then SIGKILL past a timeout) only by the test or fixture that started them.

`DaemonProcess` is any daemon; `BrokerProcess` and `InferenceDaemon` add what `primerl-broker` and
`primerl-infer` take and tell in their ready files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
"""Where the venv's `primerl-*` entry points are."""

INFERENCE_START_TIMEOUT_S = 240.0
"""Starting vLLM's server on the tiny model takes ~20-45 s on 2 idle cores; a loaded machine takes longer."""

BROKER_START_TIMEOUT_S = 30.0


class DaemonProcess:
    """One `primerl-*` child, ready once it wrote `ready_file` (its JSON is in `ready`)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        ready_file: Path,
        start_timeout_s: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ):
        self.log_path = log_path
        self.started_s = time.monotonic()
        with open(log_path, "w") as log_file:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                args, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd
            )
        deadline = time.monotonic() + start_timeout_s
        while not ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{Path(args[0]).name} did not start:\n{self.log_tail()}")
            time.sleep(0.05)
        self.start_s = time.monotonic() - self.started_s
        self.ready: dict[str, Any] = json.loads(ready_file.read_text())

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def kill(self) -> int:
        """SIGKILL, as a crash would; the exit code."""
        self.process.kill()
        return self.process.wait(10)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM and wait; SIGKILL past `timeout_s`. The exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


class InferenceDaemon(DaemonProcess):
    """`primerl-infer` on `model_dir` (port 0, a `max_model_len`-token context), joined to the broker at
    `broker_address` with `run_token`; its logs in `tmp/{name}.log`."""

    def __init__(
        self,
        tmp: Path,
        model_dir: Path,
        broker_address: str,
        run_token: str,
        *extra: str,
        max_model_len: int = 512,
        env: dict[str, str] | None = None,
        name: str = "infer",
    ):
        ready_file = tmp / f"{name}-ready.json"
        args = [
            str(BIN / "primerl-infer"),
            "--model.name",
            str(model_dir),
            "--model.max-model-len",
            str(max_model_len),
            "--server.port",
            "0",
            "--broker.address",
            broker_address,
            "--ready-file",
            str(ready_file),
            *extra,
        ]
        super().__init__(
            args,
            tmp / f"{name}.log",
            ready_file,
            INFERENCE_START_TIMEOUT_S,
            env={"PRIMERL_RUN_TOKEN": run_token, **(env or {})},
            cwd=tmp,
        )
        self.url: str = self.ready["base_url"]


class BrokerProcess(DaemonProcess):
    """`primerl-broker` on ports chosen by the OS (heartbeats every 0.2 s), spooling to `spool_dir`."""

    def __init__(self, tmp: Path, spool_dir: Path, *extra: str):
        name = f"broker-{time.monotonic_ns()}"
        ready_file = tmp / f"{name}-ready.json"
        args = [
            str(BIN / "primerl-broker"),
            "--grpc-port",
            "0",
            "--rollout-port",
            "0",
            "--weight-port",
            "0",
            "--spool-dir",
            str(spool_dir),
            "--heartbeat-interval-s",
            "0.2",
            "--ready-file",
            str(ready_file),
            *extra,
        ]
        super().__init__(args, tmp / f"{name}.log", ready_file, BROKER_START_TIMEOUT_S)
        self.ports = self.ready

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc_port']}"

    @property
    def rollout_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['rollout_port']}"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

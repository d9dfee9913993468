"""`primerl-infer`'s process hygiene, with the real daemon (vLLM on the tiny model) and an in-process broker:
a SIGKILLed daemon takes its vLLM processes with it at once, the next daemon removes the work directory the
killed one left in $TMPDIR, and a daemon whose broker ends the run stops within 10 s with exit status 0."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.broker import BrokerHarness
from support.daemons import BIN, INFERENCE_START_TIMEOUT_S, InferenceDaemon
from support.inference import TOKEN
from support.proc_tree import descendants, running

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A $TMPDIR short enough for the daemon's work directory to live in it (Unix socket paths are short)."""
    path = Path(tempfile.mkdtemp(prefix="pi-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start_daemon(tmp: Path, model: Path, broker: BrokerHarness, tmpdir: Path, name: str) -> InferenceDaemon:
    """`primerl-infer` with `tmpdir` as its $TMPDIR, logging to tmp/{name}.log."""
    return InferenceDaemon(tmp, model, broker.grpc_address, TOKEN, env={"TMPDIR": str(tmpdir)}, name=name)


def test_killed_daemon_takes_vllm_along_and_its_work_dir_goes_at_the_next_start(
    tmp_path, tiny_model, infer_broker, short_tmpdir
):
    first = start_daemon(tmp_path, tiny_model, infer_broker, short_tmpdir, "first")
    children = descendants(first.pid)
    try:
        assert children, "the daemon runs no vLLM process"  # the engine core (forked on CPU)
        work_dirs = list(short_tmpdir.glob(f"primerl-infer-{first.pid}-*"))
        assert len(work_dirs) == 1, list(short_tmpdir.iterdir())
        first.process.kill()
        killed_s = time.monotonic()
        first.process.wait(10)
        while any(running(pid) for pid in children):
            assert time.monotonic() - killed_s < 5.0, f"vLLM processes outlived the daemon: {children}"
            time.sleep(0.01)
        gone_s = time.monotonic() - killed_s
    finally:
        for pid in children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert gone_s < 1.0, gone_s
    assert work_dirs[0].exists()  # nobody removed it: the daemon was killed
    print(f"\nSIGKILLed primerl-infer: its {len(children)} vLLM processes gone in {gone_s:.3f} s")

    second = start_daemon(tmp_path, tiny_model, infer_broker, short_tmpdir, "second")
    try:
        assert not work_dirs[0].exists(), "the next daemon did not remove the dead one's work directory"
        assert "removed work directories of dead inference daemons" in (tmp_path / "second.log").read_text()
        children = descendants(second.pid)
        infer_broker.service.registry.request_shutdown()  # the run is over
        asked_s = time.monotonic()
        code = second.process.wait(15)
        stop_s = time.monotonic() - asked_s
    finally:
        if second.process.poll() is None:
            second.kill()
    log = (tmp_path / "second.log").read_text()
    assert code == 0, log[-4000:]
    assert "the broker asked this worker to shut down" in log
    assert stop_s < 10.0, stop_s
    assert not any(running(pid) for pid in children)
    assert not list(short_tmpdir.glob(f"primerl-infer-{second.pid}-*"))  # a clean stop removes its own
    print(f"broker ended the run: primerl-infer exited 0 in {stop_s:.1f} s")


def test_a_signal_during_start_up_stops_the_daemon_at_once(tmp_path, tiny_model, infer_broker, short_tmpdir):
    """vLLM's start-up blocks the event loop for seconds; a SIGTERM then (a launcher ending the run while it
    restarts inference) must not wait for it to finish."""
    env = {**os.environ, "PRIMERL_RUN_TOKEN": TOKEN, "TMPDIR": str(short_tmpdir)}
    log_path = tmp_path / "starting.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                str(BIN / "primerl-infer"),
                "--model.name",
                str(tiny_model),
                "--model.max-model-len",
                "512",
                "--server.port",
                "0",
                "--broker.address",
                infer_broker.grpc_address,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    children: list[int] = []
    try:
        deadline = time.monotonic() + INFERENCE_START_TIMEOUT_S
        while not children:  # the engine core is being set up
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            children = descendants(process.pid)
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        sent_s = time.monotonic()
        code = process.wait(30)
        exit_s = time.monotonic() - sent_s
        while any(running(pid) for pid in children):
            assert time.monotonic() - sent_s < 5.0, children
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for pid in children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert code == 0, log_path.read_text()[-4000:]
    assert exit_s < 3.0, exit_s
    assert "stopping on signal during start-up" in log_path.read_text()
    assert not list(short_tmpdir.glob(f"primerl-infer-{process.pid}-*"))
    print(f"\nSIGTERM during start-up: primerl-infer exited 0 in {exit_s:.2f} s")

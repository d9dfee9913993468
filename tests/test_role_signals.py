"""A role daemon's stop signals (``primerl.cli.role_signals``): at once while it starts (raised, or a clean-up and
an exit), gracefully once it works (in the main thread or on an asyncio loop), and ended anyway when its clean-up
after a start-up stop hangs. Each case runs in a child process of its own
(the handler raises in the main thread; the watchdog ends the process)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

WAIT_S = 60.0

SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading, time
    from primerl.cli.role_signals import StopSignals, StoppedWhileStarting
    from primerl.runtime.log_setup import configure_logging

    log = configure_logging("test", level="info")
    case = sys.argv[1]
    if case == "serving":  # an asyncio daemon (primerl-infer): the handler moves onto the loop once it serves
        async def serve():
            stop_event = asyncio.Event()
            signals = StopSignals(log, stop_event, set_up=lambda: True, log_fields=lambda: {"policy_version": 7})
            signals.install()
            signals.install(asyncio.get_running_loop())
            print("ready", flush=True)
            await asyncio.wait_for(stop_event.wait(), 600)
            print("served to the end", flush=True)
        asyncio.run(serve())
        sys.exit(0)
    stop_event = threading.Event()
    exit_while_starting = (lambda: print("work dir removed", flush=True)) if case == "exiting" else None
    StopSignals(log, stop_event, set_up=lambda: case == "working", exit_while_starting=exit_while_starting).install()
    try:
        print("ready", flush=True)
        if case == "working":
            while not stop_event.wait(0.05):  # the main loop: finishes its step when asked to stop
                pass
            print("finished the step in hand", flush=True)
            sys.exit(0)
        threading.Event().wait(600)  # "building the model": a long wait that only a signal can end
        print("the start-up ran to its end", flush=True)
        sys.exit(3)
    except StoppedWhileStarting:
        print("stopped while starting", flush=True)
        if case == "hanging":
            time.sleep(600)  # a clean-up that never ends: the watchdog ends the process
        sys.exit(0)
""")


def run_case(case: str, tmp_path: Path) -> tuple[int, str]:
    script = tmp_path / "role.py"
    script.write_text(SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), case], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, output


def test_a_stop_while_starting_ends_the_start_up_at_once(tmp_path):
    code, output = run_case("starting", tmp_path)
    assert code == 0, output
    assert "stopping on signal during start-up: exiting now" in output and "stopped while starting" in output
    assert "ran to its end" not in output


def test_a_stop_once_working_lets_the_step_in_hand_finish(tmp_path):
    code, output = run_case("working", tmp_path)
    assert code == 0, output
    assert "finished the step in hand" in output and "stopped while starting" not in output


def test_a_stop_while_starting_with_an_exit_cleans_up_and_exits_at_once(tmp_path):
    code, output = run_case("exiting", tmp_path)
    assert code == 0, output
    assert "stopping on signal during start-up: exiting now" in output and "work dir removed" in output
    assert "stopped while starting" not in output and "ran to its end" not in output


def test_a_stop_of_a_serving_asyncio_daemon_sets_its_event_on_the_loop(tmp_path):
    code, output = run_case("serving", tmp_path)
    assert code == 0, output
    assert "served to the end" in output and "stopping on signal" in output and "7" in output


@pytest.mark.slow
def test_a_clean_up_that_hangs_after_a_start_up_stop_is_ended_by_the_watchdog(tmp_path):
    started_s = time.monotonic()
    code, output = run_case("hanging", tmp_path)
    assert code == 0, output
    assert "stopped while starting" in output
    assert "clean-up after a stop during start-up took too long; exiting now" in output
    print(f"hanging clean-up ended after {time.monotonic() - started_s:.1f} s")

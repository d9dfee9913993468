"""Restarts and process hygiene without vLLM: the restart policy, the last error line of a role's log, the
reaper that ends everything a SIGKILLed launcher started (torchrun-like grandchildren in sessions of their own
included), the launcher's restart loop over real child processes, children forked by primerl-infer dying with
it, and stale inference work directories. Every process here is started by the test and ended by it."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.proc_tree import descendants, running

from primerl.proto import telemetry
from primerl.supervisor.process_supervisor import ChildFailed, ChildProcess, Supervisor
from primerl.supervisor.restart_policy import RestartBudget, RestartPolicy, describe_exit_code
from primerl.supervisor.role_logs import last_error_in_log, last_error_line

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "reverse_text_rl.toml"
GONE_TIMEOUT_S = 5.0

# A role that ignores SIGTERM and starts a grandchild in a session of its own (as torchrun starts its ranks),
# which ignores SIGTERM too; both print their pids.
STUBBORN_ROLE = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
        start_new_session=True)
    print("rank pid", rank.pid, flush=True)
    time.sleep(600)
""")


def wait_gone(pids: list[int], timeout_s: float) -> float:
    """Seconds until none of ``pids`` runs; fails after ``timeout_s``."""
    start = time.monotonic()
    while any(running(p) for p in pids):
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"still running after {timeout_s} s: {[p for p in pids if running(p)]}")
        time.sleep(0.02)
    return time.monotonic() - start


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- restart policy -------------------------------------------------------------------------------------------


def test_restarts_back_off_doubling_up_to_the_cap_and_stop_past_the_limit():
    budget = RestartBudget(RestartPolicy(limit=4, window_s=100.0, delay_s=1.0, max_delay_s=3.0))
    decisions = [budget.decide(1, now_s=t) for t in (0.0, 1.0, 2.0, 3.0)]
    assert [(d.restart, d.number, d.delay_s) for d in decisions] == [
        (True, 1, 1.0),
        (True, 2, 2.0),
        (True, 3, 3.0),
        (True, 4, 3.0),
    ]
    refused = budget.decide(-signal.SIGKILL, now_s=4.0)
    assert not refused.restart and "restarted 4 times within 100 s (--restart-limit 4)" in refused.reason
    # Once the first restarts leave the window, the role may be restarted again, with a shorter back-off.
    again = budget.decide(1, now_s=101.5)
    assert again.restart and again.number == 3 and again.delay_s == 3.0
    assert budget.num_restarts == 5


def test_exit_0_exit_2_and_restart_never_are_not_restarted():
    budget = RestartBudget(RestartPolicy())
    assert not budget.decide(0, 0.0).restart
    assert "configuration or data error" in budget.decide(2, 0.0).reason
    assert budget.decide(-signal.SIGKILL, 0.0).restart
    assert not RestartBudget(RestartPolicy(mode="never")).decide(1, 0.0).restart
    assert describe_exit_code(-9) == "signal SIGKILL" and describe_exit_code(3) == "exit code 3"
    with pytest.raises(ValueError, match="restart limit must be >= 1"):
        RestartPolicy(limit=0)
    with pytest.raises(ValueError, match="restart mode"):
        RestartPolicy(mode="always")  # type: ignore[arg-type]


# ---- the last error line ----------------------------------------------------------------------------------------


def test_last_error_line_of_json_console_and_traceback_logs(tmp_path):
    json_log = "\n".join(
        [
            json.dumps({"event": telemetry.BATCH_SENT, "level": "info"}),
            json.dumps({"event": "all rollouts failed", "error": "prompt longer than seq_len 16", "level": "error"}),
            json.dumps({"event": telemetry.STOPPING, "level": "info"}),
        ]
    )
    assert last_error_line(json_log) == "all rollouts failed: prompt longer than seq_len 16"
    with_exception = json.dumps(
        {
            "event": "weight thread failed",
            "level": "error",
            "exception": "Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'w'",
        }
    )
    assert last_error_line(with_exception) == "weight thread failed: KeyError: 'w'"
    console = (
        "2026-11-24T15:22:09Z [info     ] step done  step=3\n"
        "2026-11-24T15:22:10Z [error    ] trainer cannot continue  [primerl.trainer] error='bad batch' "
        "role=trainer run_id=\n"
    )
    assert last_error_line(console) == "[error] trainer cannot continue error='bad batch'"
    traceback = (
        'starting\nTraceback (most recent call last):\n  File "/x.py", line 3, in <module>\n'
        "    main()\nRuntimeError: env 'no-such-env' is not installed\n"
    )
    assert last_error_line(console + traceback) == "RuntimeError: env 'no-such-env' is not installed"
    assert last_error_line("all fine\n") is None
    # Only the latest start of the role counts (the supervisor writes a "=== date argv" line before each).
    log = tmp_path / "role.log"
    log.write_text(console + "=== 2026-11-24 15:30:00 primerl-trainer @ trainer.toml\nall fine\n")
    assert last_error_in_log(log) is None
    assert last_error_in_log(tmp_path / "missing.log") is None


# ---- the reaper -------------------------------------------------------------------------------------------------


def test_a_sigkilled_launcher_leaves_nothing_running(tmp_path):
    """A supervisor with two stubborn roles (each with a rank in its own session) in a driver process; the
    driver is SIGKILLed: every descendant is gone within 5 s (SIGTERM ignored: SIGKILL after the 2 s grace)."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from primerl.supervisor.process_supervisor import ChildProcess, Supervisor
        supervisor = Supervisor()
        for name in ("trainer", "orchestrator"):
            supervisor.start(ChildProcess(name, [sys.executable, "-c", {STUBBORN_ROLE!r}],
                                          Path({str(tmp_path)!r}) / (name + ".log"), dict(os.environ)))
        print("started", flush=True)
        time.sleep(600)
    """)
    )
    process = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert process.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while len(descendants(process.pid)) < 5:  # the reaper, two roles, their two ranks
            assert time.monotonic() < deadline, "the roles did not start their ranks"
            time.sleep(0.05)
        pids = descendants(process.pid)
        process.kill()
        process.wait(5)
        gone_s = wait_gone(pids, GONE_TIMEOUT_S)
    finally:
        kill_all(pids)
        process.kill()
    print(f"SIGKILLed launcher: all 5 descendants gone in {gone_s:.2f} s")


def test_stop_and_restart_end_the_ranks_that_left_the_group(tmp_path):
    supervisor = Supervisor()
    child = supervisor.start(
        ChildProcess("trainer", [sys.executable, "-c", STUBBORN_ROLE], tmp_path / "t.log", dict(os.environ))
    )
    try:
        deadline = time.monotonic() + 30
        while "\nrank pid " not in child.log_tail():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first_rank = int(child.log_tail().split("\nrank pid ")[-1].split()[0])
        os.kill(child.pid, signal.SIGKILL)  # the leader dies; its rank (another session) lives on
        child.process.wait(5)
        assert running(first_rank) and supervisor.alive(child)
        supervisor.restart(child)
        assert not running(first_rank), "the previous start's rank survived the restart"
        assert child.num_starts == 2 and child.poll() is None
        started = time.monotonic()
        supervisor.stop(timeout_s=1.0)
        # stop() escalates to SIGKILL after its 1 s: well under the 15 s bound even on a loaded machine (a stop
        # that waited for the stubborn role would never return)
        assert not supervisor.alive(child) and time.monotonic() - started < 15.0
    finally:
        supervisor.kill_all()
        supervisor.close()


# ---- the launcher's restarts ------------------------------------------------------------------------------


def _launcher(tmp_path, policy: RestartPolicy):
    from primerl.configs.rl import RLConfig
    from primerl.runtime.config_loader import load_config
    from primerl.supervisor.launcher import Launcher, LaunchOptions

    config = load_config(RLConfig, [EXAMPLE], {"output_dir": str(tmp_path / "run")})
    out, err = io.StringIO(), io.StringIO()
    launcher = Launcher(config, LaunchOptions(restart=policy), out=out, err=err)
    launcher.run_dir.mkdir(parents=True)
    for role, role_config in config.role_configs().items():
        launcher.role_files.set(role, role_config)
    return launcher, out, err


def test_a_failing_role_is_restarted_with_back_off_then_stops_the_run(tmp_path):
    launcher, out, _ = _launcher(tmp_path, RestartPolicy(limit=2, window_s=60.0, delay_s=0.2, max_delay_s=0.3))
    script = (
        "import json, sys; print(json.dumps({'event': 'all rollouts failed', 'error': 'seq_len 16 is "
        "shorter than the prompts', 'level': 'error'})); sys.exit(3)"
    )
    child = launcher.supervisor.start(
        ChildProcess("orchestrator", [sys.executable, "-c", script], tmp_path / "orchestrator.log", dict(os.environ))
    )
    exits_s: list[float] = []
    starts_s: list[float] = []
    try:
        deadline = time.monotonic() + 30
        with pytest.raises(ChildFailed) as failure:
            while time.monotonic() < deadline:
                if child.poll() is not None and len(exits_s) < child.num_starts:
                    exits_s.append(time.monotonic())
                num_starts = child.num_starts
                launcher.restarts.look_after_children()
                if child.num_starts > num_starts:
                    starts_s.append(time.monotonic())
                time.sleep(0.01)
        assert "orchestrator exited with status 3; not restarted: it was restarted 2 times within 60 s" in str(
            failure.value
        )
        assert child.num_starts == 3 and len(starts_s) == 2
        delays = [start - exit_ for exit_, start in zip(exits_s, starts_s)]
        assert 0.18 <= delays[0] < 0.6 and 0.28 <= delays[1] < 0.7, delays
        text = out.getvalue()
        assert "restarting orchestrator after exit code 3 (restart 1 of 2 within 60 s) in 0.2 s" in text
        assert "restarting orchestrator after exit code 3 (restart 2 of 2 within 60 s) in 0.3 s" in text
        assert "orchestrator's last error: all rollouts failed: seq_len 16 is shorter than the prompts" in text
        code = launcher._fail(failure.value.child, str(failure.value))
        assert code == 1
        assert "orchestrator's last error: all rollouts failed" in launcher.err.getvalue()
        print(f"restart latency (exit seen -> started again): {', '.join(f'{d:.2f} s' for d in delays)}")
    finally:
        launcher.supervisor.kill_all()
        launcher.supervisor.close()


def test_restart_never_and_a_clean_orchestrator_exit(tmp_path):
    launcher, out, _ = _launcher(tmp_path, RestartPolicy(mode="never"))
    orchestrator = launcher.supervisor.start(
        ChildProcess("orchestrator", [sys.executable, "-c", "pass"], tmp_path / "o.log", dict(os.environ))
    )
    trainer = launcher.supervisor.start(
        ChildProcess("trainer", [sys.executable, "-c", "import sys; sys.exit(1)"], tmp_path / "t.log", dict(os.environ))
    )
    try:
        orchestrator.process.wait(10)
        trainer.process.wait(10)
        with pytest.raises(ChildFailed, match=r"^trainer exited with status 1$"):
            launcher.restarts.look_after_children()
        assert "restarting" not in out.getvalue() and orchestrator.num_starts == 1
    finally:
        launcher.supervisor.close()


# ---- primerl-infer's children and work directories ---------------------------------------------------------------


@pytest.mark.parametrize("from_thread", [False, True], ids=["main-thread", "other-thread"])
def test_children_forked_by_the_inference_daemon_die_with_it(tmp_path, from_thread):
    """As vLLM forks its engine core from primerl-infer: the fork hook makes the child die when its parent is
    SIGKILLed (PDEATHSIG when forked from the main thread, a watcher thread otherwise)."""
    script = textwrap.dedent(f"""
        import multiprocessing, threading, time
        from primerl.runtime.parent_death import install_fork_hook
        install_fork_hook()
        def start():
            process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
            process.start()
            print(process.pid, flush=True)
        if {from_thread}:
            thread = threading.Thread(target=start); thread.start(); thread.join()
        else:
            start()
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the forking thread has ended: the child must live on while its parent does
        assert running(child)
        parent.kill()
        gone_s = wait_gone([child], GONE_TIMEOUT_S)
    finally:
        kill_all([child] if child else [])
        parent.kill()
    assert gone_s < 1.0
    print(f"forked child gone {gone_s:.3f} s after its parent's SIGKILL")


def test_stale_inference_work_dirs_are_removed_at_the_next_start(tmp_path):
    from primerl.inference.service import remove_stale_work_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"primerl-infer-{dead.pid}-abcd1234"
    (stale / "vllm").mkdir(parents=True)
    live = tmp_path / f"primerl-infer-{os.getpid()}-ffff0000"  # this process's own: kept
    live.mkdir()
    other = tmp_path / "primerl-infer-notapid"
    other.mkdir()
    assert remove_stale_work_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


# ---- how the launcher starts its roles ---------------------------------------------------------------------------

LAUNCHER_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    from primerl.supervisor.process_supervisor import start_in_own_session
    marker = Path(sys.argv[1])
    # A library's at-fork handler (gRPC's restarts its poller thread in the child and aborts it: grpc/grpc#43055).
    os.register_at_fork(after_in_child=lambda: marker.write_text("ran"))
    argv = json.loads(sys.argv[2])
    child = start_in_own_session(argv, marker.parent / "child.log", dict(os.environ))
    print(child.pid, flush=True)
    time.sleep(600)
""")


def start_launcher(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, int, Path]:
    marker = tmp_path / "at-fork-ran"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_SCRIPT, str(marker), json.dumps(argv)], stdout=subprocess.PIPE, text=True
    )
    return launcher, int(launcher.stdout.readline()), marker


def test_a_role_is_started_without_running_the_launchers_at_fork_handlers_and_dies_with_the_launcher(tmp_path):
    """No ``preexec_fn``: the child is started with vfork + exec and runs none of the launcher's at-fork handlers;
    a primerl daemon arms PDEATHSIG itself (``run_role``), so a SIGKILLed launcher still takes it along."""
    ready = tmp_path / "broker-ready.json"
    argv = [
        str(Path(sys.executable).parent / "primerl-broker"),
        *("--host", "127.0.0.1", "--grpc-port", "0", "--rollout-port", "0", "--weight-port", "0"),
        *("--spool-dir", str(tmp_path / "spool"), "--prometheus.enabled", "false", "--ready-file", str(ready)),
    ]
    launcher, broker, marker = start_launcher(tmp_path, argv)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and running(broker), (tmp_path / "child.log").read_text()
            time.sleep(0.05)
        assert not marker.exists(), "the launcher's at-fork handler ran in the role's process"
        launcher.kill()
        gone_s = wait_gone([broker], GONE_TIMEOUT_S)
    finally:
        kill_all([broker])
        launcher.kill()
    print(f"primerl-broker gone {gone_s:.3f} s after its launcher's SIGKILL")
    assert "stopping on signal" in (tmp_path / "child.log").read_text()


def test_a_process_that_inherits_the_launchers_request_through_another_program_is_not_ended_by_it(tmp_path):
    """As a rank under torchrun: it finds the launcher alive but not its parent, and arms nothing (the reaper covers
    it); the program between them, not primerl, got the request."""
    rank = (
        "from primerl.runtime.parent_death import arm_from_environment as a; import time; print(a()); time.sleep(600)"
    )
    middle = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}]); time.sleep(600)"
    launcher, child, _ = start_launcher(tmp_path, [sys.executable, "-c", middle])
    try:
        deadline = time.monotonic() + 30
        while "False" not in (tmp_path / "child.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "child.log").read_text()
            time.sleep(0.05)
        grandchildren = descendants(child)
        assert grandchildren and all(running(p) for p in grandchildren)
    finally:
        kill_all([child, *descendants(child)])
        launcher.kill()


def test_a_rank_under_torchrun_goes_with_torchrun_when_torchrun_is_killed(tmp_path):
    """A rank (``TORCHELASTIC_RUN_ID`` in its environment, started by torchrun in a session of its own) arms on its
    own parent: a SIGKILLed torchrun takes its ranks along within a poll, while the launcher lives on (the chaos run
    found two ranks alive 2 s after their torchrun's kill)."""
    rank = (
        "import os; os.environ['TORCHELASTIC_RUN_ID'] = 'r'; "
        "from primerl.runtime.parent_death import arm_from_environment as a; import time; "
        "print('armed:', a(), flush=True); time.sleep(600)"
    )
    middle = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(600)"
    )
    launcher, child, _ = start_launcher(tmp_path, [sys.executable, "-c", middle])
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while "\narmed: True" not in (tmp_path / "child.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "child.log").read_text()
            time.sleep(0.05)
        ranks = descendants(child)
        assert ranks and all(running(p) for p in ranks)
        os.kill(child, signal.SIGKILL)
        gone_s = wait_gone(ranks, GONE_TIMEOUT_S)
        assert launcher.poll() is None
    finally:
        kill_all([child, *ranks])
        launcher.kill()
    print(f"rank gone {gone_s:.3f} s after its torchrun's SIGKILL")

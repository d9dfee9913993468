"""`make chaos` (scripts/chaos): the harness's own parts on real processes and real log lines, and a short seeded
chaos run in CI: the four daemons as separate processes under the systemd-like restarter, each kind SIGKILLed
once (the broker during a weight push, the trainer between a publish and its checkpoint), with every check of
the harness (steps lost / duplicated / mismatched, unplanned exits, final versions served, nothing left)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.proto import telemetry

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAOS_DIR = REPO_ROOT / "scripts" / "chaos"
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))
CI_RUN_TIMEOUT_S = 180

sys.path.insert(0, str(CHAOS_DIR.parent))
try:
    from chaos.checks import Verdict, _normal_end, _spool_checks, _stopped_by_held_disk, lineage
    from chaos.driver import RunRecord, StatusPoller, served_final
    from chaos.logs import read_incarnations
    from chaos.plan import make_plan, steps_needed
    from chaos.procs import MARKER_ENV, Exit, Unit, marked_processes
finally:
    sys.path.remove(str(CHAOS_DIR.parent))


def _line(event: str, **fields) -> str:
    return json.dumps({"event": event, "level": "info", "timestamp": "2026-01-01T00:00:00.000000Z", **fields})


def _trainer_log(path: Path, incarnations: list[list[str]]) -> Path:
    lines = []
    for number, body in enumerate(incarnations, 1):
        lines.append(f"=== 2026-01-01 00:00:0{number} primerl-trainer @ trainer.toml")
        lines += body
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_is_seeded_and_holds_every_kind_of_kill():
    assert make_plan(7, full=True) == make_plan(7, full=True)
    assert make_plan(1, full=True) != make_plan(2, full=True)
    moments = {(k.role, k.moment) for k in make_plan(3, full=True)}
    assert moments == {
        ("broker", "push"),
        ("trainer", "publish-before-checkpoint"),
        ("orchestrator", "random"),
        ("inference", "mapping"),
        ("inference", "random"),
        ("broker", "random"),
        ("trainer", "random"),
    }
    quick = make_plan(3, full=False)
    assert sorted(k.role for k in quick) == ["broker", "inference", "orchestrator", "trainer"]
    assert ("inference", "mapping") in {(k.role, k.moment) for k in quick}
    assert steps_needed(quick) >= sum(k.gap_steps for k in quick) + 2 * len(quick)


def test_plan_of_mode_separate_kills_the_relay_worker_mid_relay_first():
    from chaos.plan import RELAY_KILL_DELAY_S, KillSpec

    plain, relayed = make_plan(5, full=False), make_plan(5, full=False, relay=True)
    assert relayed[0] == KillSpec("relay", "mid-relay", gap_steps=1, delay_s=RELAY_KILL_DELAY_S)
    assert relayed[1:] == plain, "the other kills keep their seeded order"
    assert steps_needed(relayed) == steps_needed(plain) + 2


def test_plan_of_mode_rl_also_kills_the_launcher_once_and_keeps_the_other_kills_in_their_order():
    from chaos.plan import LAUNCHER

    for seed in (1, 2, 3):
        plain, with_launcher = make_plan(seed, full=True), make_plan(seed, full=True, launcher=True)
        [launcher] = [k for k in with_launcher if k.role == LAUNCHER]
        assert launcher.moment == "random" and launcher.gap_steps in (1, 2)
        assert [k for k in with_launcher if k.role != LAUNCHER] == plain
        assert make_plan(seed, full=True, launcher=True) == with_launcher  # seeded
    places = {[k.role for k in make_plan(seed, full=True, launcher=True)].index(LAUNCHER) for seed in range(1, 30)}
    assert len(places) > 2, places  # not always at the same place


def test_plan_of_mode_rl_kills_one_rank_of_the_two_rank_trainer_once():
    from chaos.plan import LAUNCHER, TRAINER_RANK
    from chaos.runs import RunSpec

    for seed in (1, 2, 3):
        with_launcher = make_plan(seed, full=True, launcher=True)
        both = make_plan(seed, full=True, launcher=True, trainer_rank=True)
        [rank] = [k for k in both if k.role == TRAINER_RANK]
        assert rank.moment == "random" and rank.gap_steps in (1, 2)
        assert [k for k in both if k.role != TRAINER_RANK] == with_launcher  # the others keep their order
        assert [k.role for k in both].count(LAUNCHER) == 1
        assert steps_needed(both) > steps_needed(with_launcher)
    spec = RunSpec.create("rl", 1, Path("/tmp/run"), Path("/tmp/model"), 10, {})
    args = spec.rl_args()
    assert spec.trainer_ranks == 2 and args[args.index("--trainer-gpu-ids") + 1] == "[1, 2]"
    assert "--trainer-gpu-ids" not in RunSpec.create("separate", 1, Path("/tmp/r"), Path("/tmp/m"), 10, {}).rl_args()


def test_the_full_plan_stalls_the_engine_once_and_gives_its_watchdog_a_short_timeout():
    from chaos.plan import ENGINE
    from chaos.runs import ENGINE_STALL_TIMEOUT_S, RunSpec

    for seed in (1, 2, 3):
        plain, stalled = make_plan(seed, full=True), make_plan(seed, full=True, stall=True)
        [stall] = [k for k in stalled if k.role == ENGINE]
        assert stall.moment == "stall" and 0 <= stall.delay_s <= 1.5
        assert [k for k in stalled if k.role != ENGINE] == plain
    args = RunSpec.create("separate", 1, Path("/tmp/r"), Path("/tmp/m"), 10, {}, stall=True).rl_args()
    assert args[args.index("--inference.engine-stall-timeout-s") + 1] == str(ENGINE_STALL_TIMEOUT_S)
    assert "--inference.engine-stall-timeout-s" not in RunSpec.create("rl", 1, Path("/r"), Path("/m"), 9, {}).rl_args()


def test_an_engine_stall_is_held_until_its_daemon_reports_it_then_resumed_and_counted_back(tmp_path):
    """The driver's side of the stall on a real stopped process: SIGSTOP at the kill, SIGCONT ``delay_s`` after
    the daemon's `inference engine stalled` line (not before), back on `inference engine recovered`; an engine
    whose stall is never reported is resumed after the bound and fails the run."""
    import signal

    import psutil
    from chaos.checks import judge
    from chaos.driver import STALL_RESUME_BOUND_S, Driver
    from chaos.logs import Event
    from chaos.plan import ENGINE, KillSpec
    from chaos.runs import RunSpec

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    class Backend:
        def stop_engine(self) -> int:
            os.kill(engine.pid, signal.SIGSTOP)
            return engine.pid

        def resume_engine(self, pid: int) -> None:
            os.kill(pid, signal.SIGCONT)

    def stopped() -> bool:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = psutil.Process(engine.pid).status()
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_SLEEPING):
                return status == psutil.STATUS_STOPPED
            time.sleep(0.01)
        return False

    try:
        spec = RunSpec.create("separate", 1, tmp_path, tmp_path, 10, {}, stall=True)
        driver = Driver(spec, [], timeout_s=10, stall_s=10, say=lambda text: None)
        driver.backend = Backend()
        kill = driver._kill(KillSpec(ENGINE, "stall", 1, delay_s=0.5), "after step 3 done")
        start = kill.at_s
        assert kill.pid == engine.pid and stopped()
        driver._tend_held(kill, start + 30.0)  # not reported yet: held
        assert kill.resumed_s is None and stopped()
        stalled = Event("inference", 1, start + 4.2, {"event": telemetry.INFERENCE_ENGINE_STALLED})
        driver._update_recovery(kill, [stalled])
        assert kill.stalled_s == pytest.approx(4.2)
        driver._tend_held(kill, start + 4.5)  # within delay_s of the report
        assert kill.resumed_s is None
        driver._tend_held(kill, start + 4.8)
        assert kill.resumed_s == pytest.approx(4.8) and not stopped()
        recovered = Event("inference", 1, start + 5.1, {"event": telemetry.INFERENCE_ENGINE_RECOVERED})
        driver._update_recovery(kill, [recovered])
        assert kill.recovered_s == pytest.approx(5.1)

        silent = driver._kill(KillSpec(ENGINE, "stall", 1, delay_s=0.5), "after step 5 done")
        driver._tend_held(silent, silent.at_s + STALL_RESUME_BOUND_S + 1)
        assert silent.resumed_s is not None and "reported no stall" in silent.note and not stopped()
        failures = judge(driver.record).failures
        assert any("never reported stalled" in failure for failure in failures), failures
    finally:
        engine.kill()
        engine.wait(10)


def test_the_full_plan_fills_the_spool_disk_once_where_a_tmpfs_can_be_mounted():
    from chaos.plan import ENGINE, SPOOL_DISK

    for seed in (1, 2, 3):
        stalled, both = make_plan(seed, full=True, stall=True), make_plan(seed, full=True, stall=True, disk=True)
        [disk] = [k for k in both if k.role == SPOOL_DISK]
        assert disk.moment == "full" and 0 <= disk.delay_s <= 1.5 and disk.gap_steps in (1, 2)
        assert [k for k in both if k.role != SPOOL_DISK] == stalled  # the others keep their order
        assert [k.role for k in both].count(ENGINE) == 1
        assert make_plan(seed, full=True, stall=True, disk=True) == both  # seeded
    assert all(k.role != SPOOL_DISK for k in make_plan(1, full=False, disk=False))


def test_a_full_spool_disk_is_held_until_the_broker_reports_it_then_freed_and_counted_back(tmp_path):
    """The driver's side of the disk fault on a real tmpfs: the spool's filesystem is full at the fault (a batch
    file no longer fits), stays full until `delay_s` after the broker's `rollout spool disk full`, is freed then,
    and the fault is back on `rollout spool has room again`; at the end the tmpfs is gone and what the spool held
    is on the run directory. A fault the broker never reports is freed after the bound and fails the run."""
    from chaos.checks import judge
    from chaos.driver import STALL_RESUME_BOUND_S, Driver
    from chaos.logs import Event
    from chaos.plan import SPOOL_DISK, KillSpec
    from chaos.runs import RunSpec, tmpfs_refusal

    if tmpfs_refusal():
        pytest.skip(f"the spool-disk fault cannot run here: {tmpfs_refusal()}")
    spec = RunSpec.create("separate", 1, tmp_path, tmp_path, 10, {}, disk=True)
    driver = Driver(spec, [], timeout_s=10, stall_s=10, say=lambda text: None)
    assert set(driver.disks) == {SPOOL_DISK}
    driver.disks[SPOOL_DISK].mount()
    try:
        assert os.path.ismount(spec.spool_dir)
        (spec.spool_dir / "COMMITTED").write_text("3\n")

        def batch_fits() -> bool:
            try:
                (spec.spool_dir / "probe.rbatch").write_bytes(b"x" * 65536)
            except OSError:
                return False
            (spec.spool_dir / "probe.rbatch").unlink()
            return True

        (spec.spool_dir / "weights").mkdir()
        (spec.spool_dir / "weights" / "v1.full").write_bytes(b"w" * 2**20)  # a snapshot the broker replaces later
        kill = driver._kill(KillSpec(SPOOL_DISK, "full", 1, delay_s=0.5), "after step 3 done")
        start = kill.at_s
        assert kill.fired and kill.filled_bytes > 20 * 2**20 and not batch_fits()
        filled = kill.filled_bytes
        (spec.spool_dir / "weights" / "v1.full").unlink()  # the broker frees space itself...
        assert batch_fits()
        driver._tend_held(kill, start + 30.0)  # ...not reported yet: held, and the freed space taken again
        assert kill.resumed_s is None and not batch_fits() and kill.filled_bytes >= filled + 2**20 - 4096
        full = Event("broker", 1, start + 0.4, {"event": telemetry.SPOOL_DISK_FULL})
        early = Event("broker", 1, start + 0.6, {"event": telemetry.SPOOL_ROOM_AGAIN})  # before the release
        driver._update_recovery(kill, [full, early])
        assert kill.stalled_s == pytest.approx(0.4) and kill.recovered_s is None
        driver._tend_held(kill, start + 0.7)  # within delay_s of the report
        assert kill.resumed_s is None
        driver._tend_held(kill, start + 1.0)
        assert kill.resumed_s == pytest.approx(1.0) and batch_fits()
        room = Event("broker", 1, start + 1.3, {"event": telemetry.SPOOL_ROOM_AGAIN})
        driver._update_recovery(kill, [room])
        assert kill.recovered_s == pytest.approx(1.3)

        silent = driver._kill(KillSpec(SPOOL_DISK, "full", 1, delay_s=0.5), "after step 5 done")
        driver._tend_held(silent, silent.at_s + STALL_RESUME_BOUND_S + 1)
        assert silent.resumed_s is not None and "reported no full" in silent.note and batch_fits()
        failures = judge(driver.record).failures
        assert any("never reported its spool's disk full" in failure for failure in failures), failures
    finally:
        driver.disks[SPOOL_DISK].release()
    assert not os.path.ismount(spec.spool_dir)
    assert (spec.spool_dir / "COMMITTED").read_text() == "3\n"
    assert not (spec.spool_dir / ".chaos-disk-filler").exists()


def test_lineage_follows_checkpoints_back_and_counts_a_rolled_back_step_as_retrained(tmp_path):
    done = lambda s: _line(telemetry.STEP_DONE, step=s, data_digest=f"d{s}")  # noqa: E731
    saved = lambda s: _line(telemetry.CHECKPOINT_SAVED, step=s)  # noqa: E731
    resumed = lambda s: _line(telemetry.RESUMED_FROM_CHECKPOINT, step=s)  # noqa: E731
    # 1: steps 1-3, checkpoint 2, killed after 3. 2: resumes at 2, trains 3-4 (checkpoint 4), killed after 5's done.
    # 3: resumes at 4, trains 5-6.
    path = _trainer_log(
        tmp_path / "trainer.log",
        [
            [done(1), saved(2), done(2), done(3)],
            [resumed(2), done(3), saved(4), done(4), done(5)],
            [resumed(4), done(5), saved(6), done(6)],
        ],
    )
    result = lineage(read_incarnations("trainer", path))
    assert result.broken == ""
    assert sorted(result.steps) == [1, 2, 3, 4, 5, 6]
    assert all(len(events) == 1 for events in result.steps.values())
    assert dict(result.retrained) == {3: 1, 5: 1}
    assert [number for number, _ in result.chain] == [3, 2, 1]


def test_lineage_reports_a_lost_step_and_a_resume_from_an_unknown_checkpoint(tmp_path):
    path = _trainer_log(
        tmp_path / "trainer.log",
        [
            [
                _line(telemetry.STEP_DONE, step=1),
                _line(telemetry.CHECKPOINT_SAVED, step=2),
            ],  # killed before step 2's "step done"
            [_line(telemetry.RESUMED_FROM_CHECKPOINT, step=2), _line(telemetry.STEP_DONE, step=3)],
        ],
    )
    result = lineage(read_incarnations("trainer", path))
    assert sorted(result.steps) == [1, 3]  # step 2 is lost: its record never written
    broken = _trainer_log(
        tmp_path / "broken.log",
        [[_line(telemetry.RESUMED_FROM_CHECKPOINT, step=4), _line(telemetry.STEP_DONE, step=5)]],
    )
    assert "no earlier incarnation" in lineage(read_incarnations("trainer", broken)).broken


def test_a_record_written_from_the_checkpoint_counts_once_and_twice_is_a_duplicate(tmp_path):
    path = _trainer_log(
        tmp_path / "trainer.log",
        [
            [
                _line(telemetry.STEP_DONE, step=1),
                _line(telemetry.CHECKPOINT_SAVED, step=2),
            ],  # killed before step 2's "step done"
            [
                _line(telemetry.RESUMED_FROM_CHECKPOINT, step=2),
                _line(telemetry.STEP_DONE, step=2, from_checkpoint=True),
                _line(telemetry.STEP_DONE, step=3),
            ],
        ],
    )
    result = lineage(read_incarnations("trainer", path))
    assert {s: len(e) for s, e in result.steps.items()} == {1: 1, 2: 1, 3: 1} and not result.retrained
    # step 2 was trained once, by the incarnation that saved its checkpoint: its one metrics row is not extra (the
    # launcher kill of `make chaos` rl seed 1 stopped a trainer between its checkpoint and its commit)
    assert dict(result.trainings) == {1: 1, 2: 1, 3: 1}
    twice = _trainer_log(
        tmp_path / "twice.log",
        [
            [
                _line(telemetry.STEP_DONE, step=1),
                _line(telemetry.CHECKPOINT_SAVED, step=2),
                _line(telemetry.STEP_DONE, step=2),
            ],
            [
                _line(telemetry.RESUMED_FROM_CHECKPOINT, step=2),
                _line(telemetry.STEP_DONE, step=2, from_checkpoint=True),
            ],
        ],
    )
    assert len(lineage(read_incarnations("trainer", twice)).steps[2]) == 2


def test_a_resumed_steps_record_written_by_an_incarnation_that_died_before_a_newer_checkpoint_counts(tmp_path):
    """1 trains 1, checkpoints 2 and dies before its record; 2 resumes at 2, writes 2's record from the checkpoint,
    trains 3 and dies on a full checkpoint disk at 4; 3 resumes at 2 again (the record exists: not written twice)
    and trains 3-4. Every step once (chaos mode rl found step 2's record missed: 2 is outside the chain)."""
    done = lambda s, **kw: _line(telemetry.STEP_DONE, step=s, data_digest=f"d{s}", **kw)  # noqa: E731
    saved = lambda s: _line(telemetry.CHECKPOINT_SAVED, step=s)  # noqa: E731
    resumed = lambda s: _line(telemetry.RESUMED_FROM_CHECKPOINT, step=s)  # noqa: E731
    path = _trainer_log(
        tmp_path / "trainer.log",
        [
            [done(1), saved(2)],
            [resumed(2), done(2, from_checkpoint=True), done(3), _line(telemetry.CHECKPOINT_DISK_FULL)],
            [resumed(2), done(3), saved(4), done(4)],
        ],
    )
    chain = lineage(read_incarnations("trainer", path))
    assert not chain.broken
    assert {step: len(events) for step, events in chain.steps.items()} == {1: 1, 2: 1, 3: 1, 4: 1}
    assert chain.retrained == {3: 1}


def test_a_step_published_then_killed_before_its_record_counts_as_a_training(tmp_path):
    published = lambda v: _line(telemetry.POLICY_PUBLISHED, policy_version=v)  # noqa: E731
    path = _trainer_log(
        tmp_path / "trainer.log",
        [
            [
                _line(telemetry.STEP_DONE, step=1),
                published(1),
                _line(telemetry.CHECKPOINT_SAVED, step=2),
                _line(telemetry.STEP_DONE, step=2),
                published(2),
                published(3),
            ],  # killed after publishing 3, before its "step done"
            [
                _line(telemetry.RESUMED_FROM_CHECKPOINT, step=2),
                published(2),
                _line(telemetry.STEP_DONE, step=3),
                published(3),
            ],
        ],
    )
    result = lineage(read_incarnations("trainer", path))
    assert sorted(result.steps) == [1, 2, 3]
    assert dict(result.retrained) == {3: 1}  # the re-publish of v2 at resume is no training
    assert result.trainings[3] == 2 and result.trainings[2] == 1


def test_an_exit_0_is_a_normal_end_only_once_the_trainer_finished(tmp_path):
    logs = {
        "trainer": read_incarnations(
            "trainer",
            _trainer_log(
                tmp_path / "t.log",
                [[json.dumps({"event": telemetry.TRAINING_FINISHED, "timestamp": "2026-01-01T00:01:00Z"})]],
            ),
        ),
        "inference": [],
        "orchestrator": [],
        "broker": [],
    }
    finished_s = logs["trainer"][0].events[0].at_s
    assert _normal_end(Exit("inference", 1, 0, finished_s + 1, False), logs)
    assert not _normal_end(Exit("inference", 1, 0, finished_s - 5, False), logs)
    assert not _normal_end(Exit("broker", 1, 1, finished_s + 1, False), logs)


def test_the_full_plan_fills_the_checkpoint_disk_once_beside_the_spool_disk():
    from chaos.plan import CHECKPOINT_DISK, SPOOL_DISK

    for seed in (1, 2, 3):
        spool_only = make_plan(seed, full=True, stall=True, disk=True)
        both = make_plan(seed, full=True, stall=True, disk=True, checkpoint_disk=True)
        [disk] = [k for k in both if k.role == CHECKPOINT_DISK]
        assert disk.moment == "full" and 0 <= disk.delay_s <= 1.5 and disk.gap_steps in (1, 2)
        assert [k for k in both if k.role != CHECKPOINT_DISK] == spool_only  # the others keep their order
        assert [k.role for k in both].count(SPOOL_DISK) == 1
    assert all(k.role != CHECKPOINT_DISK for k in make_plan(1, full=False))


def test_a_trainer_exit_on_the_checkpoint_disk_the_harness_held_full_is_the_harness_s(tmp_path):
    """The trainer's exit 1 counts as caused by the harness only when the incarnation that ended logged the
    disk-full line while the filler was there; the same exit after the release, or without the line, is unplanned."""
    from chaos.driver import Kill, RunRecord
    from chaos.plan import CHECKPOINT_DISK, KillSpec
    from chaos.runs import RunSpec

    full = _line(telemetry.CHECKPOINT_DISK_FULL, level="error")  # at 2026-01-01T00:00:00Z
    later = _line("x", timestamp="2026-01-01T00:00:10Z")  # the restarted trainer
    logs = {"trainer": read_incarnations("trainer", _trainer_log(tmp_path / "t.log", [[full], [later]]))}
    line_s = logs["trainer"][0].events[0].at_s
    record = RunRecord(RunSpec.create("separate", 1, tmp_path, tmp_path, 10, {}, checkpoint_disk=True))
    record.kills.append(Kill(KillSpec(CHECKPOINT_DISK, "full", 1), at_s=line_s - 2.0, filled_bytes=1, resumed_s=3.0))
    assert _stopped_by_held_disk(Exit("trainer", 1, 1, line_s + 0.5, False), record, logs)
    assert _stopped_by_held_disk(Exit("trainer", 1, None, line_s + 0.5, False), record, logs)  # mode rl: no status
    assert not _stopped_by_held_disk(Exit("trainer", 1, 2, line_s + 0.5, False), record, logs)  # not restartable
    assert not _stopped_by_held_disk(Exit("broker", 1, 1, line_s + 0.5, False), record, logs)
    record.kills[0].resumed_s = 1.0  # released before the trainer stopped on it: not the harness's doing
    assert not _stopped_by_held_disk(Exit("trainer", 1, 1, line_s + 0.5, False), record, logs)
    record.kills[0].resumed_s = 3.0
    quiet = {"trainer": read_incarnations("trainer", _trainer_log(tmp_path / "q.log", [[_line("x", level="error")]]))}
    assert not _stopped_by_held_disk(Exit("trainer", 1, 1, line_s + 0.5, False), record, quiet)


def test_the_full_plan_of_mode_separate_restarts_the_trainer_once_with_a_skewed_clock():
    from chaos.plan import CLOCK

    for seed in (1, 2, 3, 4):
        plain = make_plan(seed, full=True, relay=True, stall=True, disk=True, checkpoint_disk=True)
        skewed = make_plan(seed, full=True, relay=True, stall=True, disk=True, checkpoint_disk=True, clock=True)
        [clock] = [k for k in skewed if k.role == CLOCK]
        assert [k for k in skewed if k.role != CLOCK] == plain  # the others keep their order
        assert clock.moment == "skew" and 6 * 3600 <= abs(clock.skew_s) <= 12 * 3600
        assert (clock.skew_s < 0) == (seed % 2 == 1)  # odd seeds behind, even seeds ahead
        assert f"{clock.skew_s / 3600:+.1f}h" in clock.describe()
        assert make_plan(seed, full=True, relay=True, stall=True, disk=True, checkpoint_disk=True, clock=True) == skewed


def test_events_of_an_incarnation_started_with_a_skewed_clock_are_set_back_to_the_true_time(tmp_path):
    from chaos.logs import clock_skew_of

    header = "=== 2026-01-01 00:00:05 env LD_PRELOAD=/x/libfaketime.so.1 FAKETIME=-21600 DONT_FAKE_MONOTONIC=1 t"
    assert clock_skew_of(header) == -21600 and clock_skew_of("=== 2026-01-01 00:00:01 primerl-trainer") == 0
    true_line = _line(telemetry.STEP_DONE, step=1)  # 2026-01-01T00:00:00Z
    behind = _line(telemetry.STEP_DONE, step=2, timestamp="2025-12-31T18:00:10Z")  # 6 h behind: 00:00:10 true
    path = tmp_path / "trainer.log"
    path.write_text("\n".join(["=== 2026-01-01 00:00:00 primerl-trainer", true_line, header, behind, ""]))
    first, second = read_incarnations("trainer", path)
    assert second.events[0].at_s - first.events[0].at_s == pytest.approx(10.0)


def test_a_command_under_the_faketime_prefix_reads_a_skewed_wall_clock_and_a_true_monotonic_one():
    """The mechanism of the skewed-clock fault, for real: libfaketime preloaded into a Python process."""
    from chaos.runs import faketime_prefix, faketime_refusal

    if faketime_refusal():
        pytest.skip(f"the skewed-clock fault cannot run here: {faketime_refusal()}")
    probe = "import time; print(time.time(), time.monotonic())"
    before = time.time(), time.monotonic()
    out = subprocess.run(
        [*faketime_prefix(-7200), sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    wall, monotonic = float(out[0]), float(out[1])
    assert wall - before[0] == pytest.approx(-7200, abs=30)
    assert monotonic - before[1] == pytest.approx(0, abs=30)


def test_the_full_plan_of_mode_separate_cuts_the_inference_and_the_trainer_hosts_off_once_each():
    from chaos.plan import INFERENCE_NET, LONG_PARTITION_S, PARTITIONS, SHORT_PARTITION_S, TRAINER_NET

    for seed in (1, 2, 3):
        plain = make_plan(seed, full=True, relay=True, stall=True, disk=True, clock=True)
        cut = make_plan(seed, full=True, relay=True, stall=True, disk=True, clock=True, partitions=True)
        assert [k for k in cut if k.role not in PARTITIONS] == plain  # the others keep their order
        assert sorted(k.role for k in cut if k.role in PARTITIONS) == [INFERENCE_NET, TRAINER_NET]
        holds = {k.role: k.hold_s for k in cut if k.role in PARTITIONS}
        assert all(f"for {k.hold_s:.1f}s" in k.describe() and k.moment == "partition" for k in cut if k.hold_s)
        short, long = (INFERENCE_NET, TRAINER_NET) if seed % 2 else (TRAINER_NET, INFERENCE_NET)
        assert SHORT_PARTITION_S[0] <= holds[short] <= SHORT_PARTITION_S[1]
        assert LONG_PARTITION_S[0] <= holds[long] <= LONG_PARTITION_S[1]
        assert make_plan(seed, full=True, relay=True, stall=True, disk=True, clock=True, partitions=True) == cut
    liveness_window_s = 5.0  # the broker's default: heartbeat_interval_s 1 x heartbeat_liveness 5
    assert SHORT_PARTITION_S[1] < liveness_window_s < LONG_PARTITION_S[0]


def test_the_full_plan_kills_the_orchestrator_once_in_the_middle_of_a_steps_send():
    from chaos.plan import MID_SEND, MID_SEND_MAX_ACKS

    for seed in (1, 2, 3):
        plain = make_plan(seed, full=True, stall=True, disk=True)
        with_send = make_plan(seed, full=True, stall=True, disk=True, mid_send=True)
        [kill] = [k for k in with_send if k.role == MID_SEND]
        assert [k for k in with_send if k.role != MID_SEND] == plain
        assert kill.moment == "mid-send" and 1 <= kill.acks <= MID_SEND_MAX_ACKS < 4  # of a step's 4 micro-batches
        assert f"after {kill.acks} acks" in kill.describe()
    assert all(k.role != MID_SEND for k in make_plan(1, full=False))


def test_spool_must_have_committed_the_last_step(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "COMMITTED").write_text("6")
    (spool / "ab.rbatch").write_bytes(b"x")
    verdict = Verdict(None)
    _spool_checks(spool, 6, verdict)
    assert verdict.failures == [] and "1 batch files left" in verdict.findings[0]
    verdict = Verdict(None)
    _spool_checks(spool, 8, verdict)
    assert "committed step 6 (want 8)" in verdict.failures[0]


def _wait(unit: Unit, until, timeout_s: float = 20.0) -> list[Exit]:
    exits, deadline = [], time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        ended = unit.poll()
        if ended is not None:
            exits.append(ended)
        time.sleep(0.05)
    assert until(), f"unit state {unit.state}, exits {exits}"
    return exits


def test_restarter_restarts_after_a_kill_or_a_failure_and_ends_on_exit_0(tmp_path):
    marker = f"chaos-test-{os.getpid()}"
    counter = tmp_path / "count"
    # each start counts itself; the 3rd start exits 0, the 2nd exits 3, the 1st waits to be killed
    script = (
        "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) + 1 "
        "if p.exists() else 1; p.write_text(str(n)); print('start', n, flush=True); "
        "time.sleep(60) if n == 1 else sys.exit(3 if n == 2 else 0)"
    )
    env = {**os.environ, MARKER_ENV: marker}
    unit = Unit(
        "trainer", [sys.executable, "-c", script, counter], env, tmp_path / "logs" / "trainer.log", restart_sec=0.2
    )
    unit.start()
    _wait(unit, lambda: counter.exists())
    assert marked_processes(marker), "the started process carries the marker"
    killed_pid = unit.kill()
    exits = _wait(unit, lambda: unit.state == "done")
    assert [(e.pid == killed_pid, e.code, e.planned) for e in exits] == [
        (True, -9, True),
        (False, 3, False),
        (False, 0, False),
    ]
    assert len(unit.starts) == 3
    assert read_text_count(tmp_path / "logs" / "trainer.log") == 3
    assert not marked_processes(marker)


def read_text_count(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.startswith("=== "))


@pytest.mark.slow
def test_short_seeded_chaos_run_in_separate_processes_passes_every_check(tmp_path):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    env = {**os.environ, "PRIMERL_ENV_PYTHON": ENV_PYTHON, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started_s = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            str(CHAOS_DIR),
            "--seeds",
            "1",
            "--modes",
            "separate",
            "--quick",
            "--restart-sec",
            "1",
            "--run-root",
            str(tmp_path),
            "--timeout-s",
            str(CI_RUN_TIMEOUT_S - 30),
            "--stall-s",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=CI_RUN_TIMEOUT_S + 60,
        env=env,
        cwd=REPO_ROOT,
    )
    wall_s = time.monotonic() - started_s
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"chaos run failed (exit {result.returncode}):\n{report}"
    summary = (tmp_path / "separate-seed1" / "chaos_summary.txt").read_text()
    assert "PASS" in summary and "steps lost 0, duplicated 0, mismatched 0, unverified 0" in summary, summary
    assert "relay" in summary and "mid-relay" in summary, "the relay worker was not killed mid-relay"
    assert wall_s < CI_RUN_TIMEOUT_S + 60, f"the CI chaos run took {wall_s:.0f} s"


def test_a_killed_inference_worker_the_broker_marked_lost_need_not_serve_the_last_version():
    """`make chaos` counted a worker the harness killed (lost, still listed at an old version) as one that must serve
    the last version; only serving workers must, and there must be one."""

    def worker(name: str, condition: str, version: int) -> dict:
        return {"name": name, "role": "ROLE_INFERENCE", "condition": condition, "policy_version": str(version)}

    serving = worker("infer-b", "serving", 27)
    status = {"latest_policy_version": "27", "workers": [worker("infer-a", "lost", 13), serving]}
    assert served_final(status, 27)
    assert not served_final({**status, "workers": [worker("infer-a", "lost", 13)]}, 27)  # nobody serving
    assert not served_final({**status, "workers": [worker("infer-b", "serving", 26)]}, 27)
    assert not served_final({**status, "latest_policy_version": "26"}, 27)


def test_the_status_polled_in_mode_rl_says_which_workers_serve():
    """Mode rl judges the run on the statuses its poller kept (the launcher stops the broker itself): they carry each
    worker's condition as `primerl status --json` does, else ``served_final`` finds nobody serving and every run
    fails (`make chaos` in mode rl did)."""
    from types import SimpleNamespace

    from support.control_plane import running_broker
    from support.probes import wait_until

    from primerl.client.control import ControlClient
    from primerl.runtime.config_common import BrokerClientConfig

    with (
        running_broker() as broker,
        ControlClient(
            BrokerClientConfig(address=broker.address), "inference", "infer-0", address="http://h:1"
        ) as worker,
    ):
        worker.register()
        worker.start_heartbeats()
        record = RunRecord(spec=SimpleNamespace(broker_address=broker.address, token=""))
        poller = StatusPoller(record.spec, record)
        poller.start()
        try:
            wait_until(lambda: record.statuses, timeout_s=10, what="a polled status")
        finally:
            poller.halt.set()
            poller.join(timeout=10)
    [entry] = [w for w in record.statuses[-1][1]["workers"] if w["name"] == "infer-0"]
    assert entry["condition"] == "serving"

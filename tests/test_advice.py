"""Advice lines (primerl.runtime.advice): windows, thresholds, the metrics rows carry, and `primerl status`."""

from __future__ import annotations

import pytest

from primerl.proto import telemetry
from primerl.runtime.advice import DiscardWindow, WaitWindow, status_lines


def trainer_window(window: int = 4) -> WaitWindow:
    return WaitWindow(
        telemetry.ADVICE_TRAINER_WAITS,
        telemetry.ADVICE_ADD_INFERENCE,
        telemetry.ADVICE_TRAINER_WAIT_TO_COMPUTE,
        window=window,
    )


def discard_window(window: int = 3) -> DiscardWindow:
    return DiscardWindow(
        telemetry.ADVICE_MOST_ROLLOUTS_DISCARDED,
        telemetry.ADVICE_ROLLOUTS_DISCARDED,
        telemetry.ADVICE_DISCARDED_FRACTION,
        generated_key="rollout/tokens_generated",
        discarded_key="rollout/tokens_discarded",
        window=window,
    )


def test_wait_window_advises_once_per_window_when_waiting_exceeds_work():
    window = trainer_window(window=4)
    assert window.add(100.0, 1.0) is None  # the first step (start-up) is left out
    results = [window.add(3.0, 1.0) for _ in range(8)]
    advised = [r for r in results if r is not None]
    assert [i for i, r in enumerate(results) if r is not None] == [3, 7]  # once per window of 4, at its end
    assert advised[0].event == "the trainer waits for batches longer than it computes: add inference"
    assert advised[0].figures == {"waited_s": 12.0, "worked_s": 4.0, "steps": 4}
    assert window.metrics == {telemetry.ADVICE_ADD_INFERENCE: 1.0, telemetry.ADVICE_TRAINER_WAIT_TO_COMPUTE: 3.0}


def test_wait_window_stays_quiet_when_work_dominates_or_waits_are_tiny():
    window = trainer_window(window=2)
    window.add(0.0, 0.0)
    assert window.add(1.0, 2.0) is None and window.add(1.0, 2.0) is None
    assert window.metrics[telemetry.ADVICE_ADD_INFERENCE] == 0.0
    assert window.metrics[telemetry.ADVICE_TRAINER_WAIT_TO_COMPUTE] == pytest.approx(0.5)
    tiny = trainer_window(window=2)
    tiny.add(0.0, 0.0)
    assert tiny.add(0.3, 0.01) is None and tiny.add(0.3, 0.01) is None  # 0.6 s waited in all: nothing to act on
    # a later window that waits longer than it works flips the flag, and one that does not clears it
    assert window.add(5.0, 1.0) is None and window.add(5.0, 1.0) is not None
    assert window.metrics[telemetry.ADVICE_ADD_INFERENCE] == 1.0
    window.add(0.1, 5.0)
    window.add(0.1, 5.0)
    assert window.metrics[telemetry.ADVICE_ADD_INFERENCE] == 0.0


def test_discard_window_threshold_is_more_than_half():
    window = discard_window(window=3)
    rows = [{"rollout/tokens_generated": 100.0, "rollout/tokens_discarded": 50.0}] * 3
    assert [window.add(r) for r in rows] == [None, None, None]  # exactly half: not more than half
    assert window.metrics[telemetry.ADVICE_DISCARDED_FRACTION] == pytest.approx(0.5)
    rows = [{"rollout/tokens_generated": 100.0, "rollout/tokens_discarded": 60.0}] * 3
    results = [window.add(r) for r in rows]
    assert results[:2] == [None, None] and results[2] is not None
    assert results[2].event == "more than half of the rollouts were discarded"
    assert results[2].figures["tokens_discarded"] == 180 and results[2].figures["discarded_fraction"] == 0.6
    assert window.add({"train/reward": 1.0}) is None  # rows without token counts are not counted


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="at least 1 step"):
        trainer_window(window=0)


def test_status_lines_show_the_advice_in_force():
    advice = telemetry.ADVICE
    metrics = {
        telemetry.ADVICE_ADD_INFERENCE: 1.0,
        telemetry.ADVICE_TRAINER_WAIT_TO_COMPUTE: 2.5,
        telemetry.ADVICE_ADD_TRAINER: 0.0,
        telemetry.ADVICE_ORCHESTRATOR_WAIT_TO_WORK: 0.2,
    }
    assert status_lines(metrics, advice) == [
        "the trainer waits for batches longer than it computes: add inference "
        "(advice/trainer_wait_to_compute 2.50 over the last window)"
    ]
    assert status_lines({}, advice) == []


def test_primerl_status_shows_the_advice_section():
    from primerl.proto.v1 import control_pb2
    from primerl.supervisor.status_view import render_status

    status = control_pb2.RunStatus(run_id="r", last_metrics_step=12)
    status.last_metrics[telemetry.ADVICE_ADD_TRAINER] = 1.0
    status.last_metrics[telemetry.ADVICE_ORCHESTRATOR_WAIT_TO_WORK] = 1.8
    text = render_status(status)
    assert "advice:\n  the orchestrator waits for policies longer than it works: add trainer" in text
    assert "advice:" not in render_status(control_pb2.RunStatus(run_id="r"))


def test_the_orchestrator_logs_the_advice_as_a_json_line(tmp_path):
    """The orchestrator's hook (StepReporter.advise) over a window in which dispatch waited for policies
    longer than it worked and most generated tokens were discarded: two warnings, each once, with the figures, and
    the flags in every row after the window."""
    import io
    import json

    from primerl.configs.orchestrator import OrchestratorConfig
    from primerl.orchestrator.async_bound import AsyncBound
    from primerl.orchestrator.step_reporter import StepReporter
    from primerl.runtime.log_setup import configure_logging

    stream = io.StringIO()
    configure_logging("orchestrator", "run-a", fmt="json", stream=stream)
    config = OrchestratorConfig.model_validate(
        {"model": {"name": "m"}, "env": [{"id": "e"}], "max_steps": 30, "output_dir": str(tmp_path)}
    )
    reporter = StepReporter(config, AsyncBound(config.max_async_level))
    rows = []
    for _ in range(11):  # the first step is left out, then one window of 10
        metrics = {"rollout/tokens_generated": 1000.0, "rollout/tokens_discarded": 700.0}
        reporter.advise(metrics, elapsed_s=3.0, waited_s=2.0)  # dispatch held by the async bound for 2 s of 3 s
        rows.append(metrics)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    advice = [
        line
        for line in lines
        if line["event"] in (telemetry.ADVICE_ORCHESTRATOR_WAITS, telemetry.ADVICE_MOST_ROLLOUTS_DISCARDED)
    ]
    # the discard window counts from the first step (start-up does not skew token counts): it ends a step earlier
    assert [line["event"] for line in advice] == [
        "more than half of the rollouts were discarded",
        "the orchestrator waits for policies longer than it works: add trainer",
    ]
    assert advice[1]["level"] == "warning" and (advice[1]["waited_s"], advice[1]["worked_s"]) == (20.0, 10.0)
    assert advice[0]["discarded_fraction"] == 0.7 and advice[0]["role"] == "orchestrator"
    assert rows[-1][telemetry.ADVICE_ADD_TRAINER] == 1.0 and rows[-1][telemetry.ADVICE_ROLLOUTS_DISCARDED] == 1.0
    assert telemetry.ADVICE_ADD_TRAINER not in rows[0]

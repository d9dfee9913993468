"""The console through rich: on a terminal `primerl status`, `primerl eval`, `primerl sft`, `primerl rl`'s progress
line and summary and the demo report render with rich; piped they print exactly the plain lines they always did
(an interface). Plain forms are pinned line by line; rich forms are rendered into a forced terminal
(``rich_console(StringIO(), force=True)``) and must carry the same figures."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

from primerl.cli.eval_console import EvalProgress, print_summary, summary_text
from primerl.orchestrator.evaluation import EvalSummary
from primerl.proto import telemetry
from primerl.runtime.terminal import is_terminal, rich_console
from primerl.supervisor.console import RunConsole
from primerl.supervisor.run_progress import Progress
from primerl.supervisor.status_view import print_status, render_status

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain(text: str) -> str:
    return ANSI.sub("", text)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def forced() -> tuple[io.StringIO, object]:
    buffer = io.StringIO()
    return buffer, rich_console(buffer, force=True, width=160)


def test_rich_console_only_on_a_terminal():
    assert rich_console(io.StringIO()) is None and not is_terminal(io.StringIO())
    assert rich_console(FakeTerminal()) is not None
    assert rich_console(io.StringIO(), force=True) is not None


# ---- primerl status ------------------------------------------------------------------------------------------------


def _status():
    from primerl.proto.v1 import common_pb2, control_pb2

    status = control_pb2.RunStatus(
        run_id="run-7",
        max_steps=30,
        trainer_step=12,
        last_committed_step=11,
        latest_policy_version=12,
        orchestrator_step=13,
        broker_started_unix_ms=1_000,
        updated_unix_ms=3_725_000,
        rollout_batches_per_s=0.5,
        rollout_bytes_per_s=2048,
        weight_bytes_per_s=3 << 20,
        num_rollbacks=1,
    )
    status.queues.add(name="rollouts", num_items=3, num_bytes=4096, capacity_items=8, capacity_bytes=1 << 30)
    status.queues.add(name="weights", num_items=1, num_bytes=10)
    status.workers.add(
        name="infer-0",
        role=common_pb2.ROLE_INFERENCE,
        address="http://127.0.0.1:8000",
        state=control_pb2.WORKER_STATE_ALIVE,
        policy_version=11,
        num_inflight=4,
        last_heartbeat_unix_ms=3_724_500,
    )
    status.workers.add(
        name="trainer-0",
        role=common_pb2.ROLE_TRAINER,
        state=control_pb2.WORKER_STATE_ALIVE,
        trainer_step=12,
        last_heartbeat_unix_ms=3_724_000,
    )
    status.last_metrics_step = 12
    status.last_metrics["train/reward"] = 0.61234
    status.last_metrics["train/loss"] = -0.0123
    status.recent_errors.append("orchestrator: env worker restarted")
    return status


STATUS_PLAIN = "\n".join(
    [
        "run run-7    broker up 1h02m04s",
        "trainer step 12 (committed 11) / 30    policy version 12    "
        "orchestrator step 13    rolled back 1x (now from v0, lineage 0)",
        "rollouts 0.50 batches/s, 2.0 KiB/s    weights 3.0 MiB/s",
        "workers    inference: 1 serving; trainer: 1 alive",
        "",
        "QUEUE                               ITEMS  BYTES    BOUND",
        "rollouts (spooled until committed)  3      4.0 KiB  at most 8 batches / 1.0 GiB ahead of the trainer",
        "weights                             1      10 B",
        "",
        "WORKER     ROLE       STATE  ADDRESS                PROGRESS                 HEARTBEAT  METRICS",
        "infer-0    inference  alive  http://127.0.0.1:8000  policy v11, 4 in flight  0.5s ago   -",
        "trainer-0  trainer    alive  -                      step 12                  1.0s ago   -",
        "",
        "last metrics (step 12):",
        "  train/loss                       -0.0123",
        "  train/reward                     0.61234",
        "",
        "recent errors (newest last):",
        "  orchestrator: env worker restarted",
    ]
)


def test_status_plain_lines_unchanged_when_piped():
    assert render_status(_status()) == STATUS_PLAIN
    out = io.StringIO()
    print_status(_status(), out)
    assert out.getvalue() == STATUS_PLAIN + "\n"


def test_status_rich_tables_carry_the_figures():
    buffer, console = forced()
    print_status(_status(), buffer, console=console)
    raw = buffer.getvalue()
    text = plain(raw)
    assert raw != text  # styled
    assert "│" in text or "┃" in text  # tables with borders, not the plain columns
    for figure in ("run-7", "1h02m04s", "trainer step 12 (committed 11) / 30", "infer-0", "policy v11, 4 in flight"):
        assert figure in text
    for figure in ("rollouts (spooled until committed)", "0.61234", "-0.0123", "orchestrator: env worker restarted"):
        assert figure in text


# ---- primerl eval --------------------------------------------------------------------------------------------------

EVAL_ARGS = (
    "reverse-text",
    "eval",
    200,
    1,
    "runs/demo/sft/weights/step_1000",
    EvalSummary(
        num_rollouts=200,
        num_errors=0,
        reward_mean=0.53291,
        reward_std=0.1695,
        metrics={"lcs_reward": 0.53291, "exact_match": 0.05},
        mean_completion_tokens=12.755,
        truncation_rate=0.0,
    ),
    2.14,
    Path("runs/demo/eval/sft"),
)

EVAL_PLAIN = """\
primerl eval: reverse-text (eval, 200 examples x 1) on runs/demo/sft/weights/step_1000
  reward: mean 0.5329  std 0.1695  over 200 rollouts (0 failed)
  metrics: lcs_reward 0.533  exact_match 0.050
  completion tokens: mean 12.8, truncated 0.0%
  2.1 s; results in runs/demo/eval/sft"""


def test_eval_summary_plain_lines_unchanged_when_piped():
    assert summary_text(*EVAL_ARGS) == EVAL_PLAIN
    out = io.StringIO()
    print_summary(out, *EVAL_ARGS)
    assert out.getvalue() == EVAL_PLAIN + "\n"
    progress = EvalProgress(out, 200)  # not a terminal: no progress output at all
    progress.advance(100)
    progress.close()
    assert out.getvalue() == EVAL_PLAIN + "\n"


def test_eval_rich_summary_and_progress_carry_the_figures():
    buffer, console = forced()
    print_summary(buffer, *EVAL_ARGS, console=console)
    text = plain(buffer.getvalue())
    assert buffer.getvalue() != text
    for figure in ("reverse-text (eval, 200 examples x 1)", "0.5329", "0.1695", "exact_match", "0.050", "12.8"):
        assert figure in text
    buffer, console = forced()
    progress = EvalProgress(buffer, 200, console=console)
    progress.advance(150)
    progress.progress.refresh()
    progress.close()
    assert "150/200" in plain(buffer.getvalue())


# ---- primerl sft ---------------------------------------------------------------------------------------------------


def test_sft_progress_bar_shows_steps_loss_and_eta():
    from primerl.cli.sft import SFTProgressBar

    buffer, console = forced()
    bar = SFTProgressBar(console)
    for step in range(1, 11):
        bar.on_step(step, 10, 1.0 / step)
    bar.close()
    bar.close()  # idempotent
    text = plain(buffer.getvalue())
    assert "10/10" in text and "loss 0.1000" in text and "ETA" in text and "SFT" in text


# ---- primerl rl ----------------------------------------------------------------------------------------------------


def _progress() -> Progress:
    from primerl.proto.v1 import common_pb2, control_pb2

    progress = Progress()
    for step in (11, 12):
        status = control_pb2.RunStatus(
            trainer_step=step,
            latest_policy_version=step,
            max_steps=30,
            last_metrics={
                telemetry.TRAIN_REWARD: 0.512,
                telemetry.ORCHESTRATOR_STEP: 12,
                telemetry.TRAIN_LOSS: 0.0123,
                telemetry.ROLLOUT_TOKENS_PER_S: 830.0,
            },
        )
        status.workers.add(role=common_pb2.ROLE_INFERENCE, policy_version=11)
        progress.update(status)
    return progress


def test_rl_progress_line_and_summary_plain_when_piped():
    out = io.StringIO()
    console = RunConsole(out)
    progress = _progress()
    console.show_progress(progress)
    console.show_summary("primerl rl: run finished: 30 steps in 0m41s\n  reward (first -> last step): 0.475 -> 0.759")
    assert out.getvalue() == (
        progress.line() + "\n" + "primerl rl: run finished: 30 steps in 0m41s\n"
        "  reward (first -> last step): 0.475 -> 0.759\n"
    )
    assert progress.line().startswith("step 12/30  reward 0.512  loss 0.0123  gen 830 tok/s  served v11 (lag 1)")


def test_rl_progress_line_and_summary_rich_on_a_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = FakeTerminal()
    console = RunConsole(out)
    console.show_progress(_progress())
    raw = out.getvalue()
    assert raw.startswith("\r\x1b[K") and "\n" not in raw  # redrawn in place
    text = plain(raw)
    assert "step 12/30" in text and "━" in text
    for figure in ("reward 0.512", "loss 0.0123", "gen 830 tok/s", "served v11 (lag 1)", "ETA"):
        assert figure in text
    out = FakeTerminal()
    RunConsole(out).show_summary(
        "primerl rl: run finished: 30 steps in 0m41s\n  reward (first -> last step): 0.4 -> 0.7"
    )
    text = plain(out.getvalue())
    assert "primerl rl: run finished: 30 steps in 0m41s" in text and "0.4 -> 0.7" in text and "╭" in text


# ---- the demo report -----------------------------------------------------------------------------------------------


def _eval_dir(path: Path, reward: float, model: str) -> Path:
    import json

    path.mkdir(parents=True)
    summary = {
        "env_id": "reverse-text",
        "split": "eval",
        "num_examples": 200,
        "rollouts_per_example": 1,
        "sampling": {"temperature": 1.0},
        "reward_mean": reward,
        "reward_std": 0.15,
        "metrics": {"exact_match": 0.05},
        "model": model,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_demo_report_plain_when_piped_and_rich_table(tmp_path: Path):
    before = _eval_dir(tmp_path / "sft", 0.529, "sft/weights/step_1000")
    after = _eval_dir(tmp_path / "rl", 0.776, "rl/weights/step_30")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo_report.py"), str(before), str(after)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "  SFT checkpoint  0.529 ± 0.150  exact match 0.050   (sft/weights/step_1000)",
        "  after RL        0.776 ± 0.150  exact match 0.050   (rl/weights/step_30)",
        "  change          +0.247   target: >= +0.1 or >= 0.9: met",
    ]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import demo_report
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    buffer, console = forced()
    console.print(
        demo_report.report_table(
            "held-out",
            {"reward_mean": 0.529, "reward_std": 0.15, "metrics": {}, "model": "a"},
            {"reward_mean": 0.776, "reward_std": 0.15, "metrics": {"exact_match": 0.2}, "model": "b"},
            0.247,
            True,
        )
    )  # noqa: E501
    text = plain(buffer.getvalue())
    assert "0.529" in text and "0.776" in text and "+0.247" in text and "met" in text and "0.200" in text

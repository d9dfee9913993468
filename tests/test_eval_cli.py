"""`primerl eval` and `primerl sft-data`: the user's commands end to end (real env worker, real vLLM server),
plus the logic under them (model resolution, summaries, the in-flight bound)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from primerl.cli.eval import EvalInputError, resolve_model
from primerl.cli.eval import main as eval_main
from primerl.orchestrator.evaluation import run_eval_groups, summarize_groups
from primerl.orchestrator.trajectory import Rollout, RolloutGroup

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_PYTHON = os.environ.get("PRIMERL_ENV_PYTHON", str(REPO_ROOT / ".venv-envs" / "bin" / "python"))


def _rollout(
    index: int,
    reward: float | None,
    *,
    error: str | None = None,
    tokens: int = 3,
    truncated: bool = False,
    metrics: dict | None = None,
) -> Rollout:
    from primerl.orchestrator.trajectory import Turn

    turn = Turn(
        prompt_token_ids=[1],
        completion_token_ids=[2] * tokens,
        completion_logprobs=[-0.1] * tokens,
        completion_mask=[1] * tokens,
        finish_reason="stop",
        is_truncated=truncated,
        policy_version=0,
        policy_version_end=0,
    )
    return Rollout(
        rollout_index=index,
        turns=[turn],
        reward=reward,
        metrics=metrics or {},
        is_truncated=truncated,
        stop_condition=None,
        error_type="ValueError" if error else None,
        error=error,
        prompt=[],
        completion=[],
        generation_s=0.0,
    )


# ---------------------------------------------------------------------------------------------- logic
def test_summary_counts_only_finished_rollouts_and_failed_groups_as_errors():
    groups = [
        RolloutGroup(
            "env", "eval", 0, [_rollout(0, 1.0, metrics={"exact": 1.0}), _rollout(1, 0.0, tokens=5, truncated=True)]
        ),
        RolloutGroup("env", "eval", 1, [_rollout(0, 0.5, metrics={"exact": 0.0}), _rollout(1, None, error="boom")]),
    ]
    summary = summarize_groups(groups, {7: "EnvRequestTimeout: late"}, rollouts_per_group=2)
    assert summary.num_rollouts == 3 and summary.num_errors == 3
    assert summary.reward_mean == pytest.approx(0.5)
    assert summary.reward_std == pytest.approx((((0.5) ** 2 * 2) / 3) ** 0.5)
    assert summary.metrics == {"exact": pytest.approx(0.5)}
    assert summary.mean_completion_tokens == pytest.approx(11 / 3)
    assert summary.truncation_rate == pytest.approx(1 / 3)
    assert any("example 7" in e for e in summary.errors) and any("boom" in e for e in summary.errors)
    assert summary.as_metrics("eval/env")["eval/env/reward"] == pytest.approx(0.5)


class _SlowWorker:
    """Answers each example after a short delay; records how many requests were in flight at once."""

    def __init__(self, fail: set[int]):
        self.fail = fail
        self.inflight = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(8)

    def submit_rollout(self, index, **kwargs):
        with self.lock:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)

        def answer():
            threading.Event().wait(0.01)
            with self.lock:
                self.inflight -= 1
            if index in self.fail:
                raise RuntimeError(f"example {index} failed")
            return RolloutGroup(
                "env", kwargs["split"], index, [_rollout(i, index / 10) for i in range(kwargs["num_rollouts"])]
            )

        return self.pool.submit(answer)


def test_eval_groups_stay_within_the_concurrency_bound_and_keep_going_after_a_failure():
    worker = _SlowWorker(fail={3})
    seen = []
    groups, failed = run_eval_groups(
        worker,
        range(10),
        num_rollouts=2,
        base_url="http://x/v1",
        model="m",
        sampling={"temperature": 1.0},
        max_concurrent_groups=3,
        on_group=seen.append,
    )
    assert worker.peak <= 3
    assert [g.example_index for g in groups] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert list(failed) == [3] and "example 3 failed" in failed[3]
    assert sorted(g.example_index for g in seen) == [g.example_index for g in groups]
    with pytest.raises(ValueError, match="max_concurrent_groups"):
        run_eval_groups(worker, range(1), num_rollouts=1, base_url="u", model="m", sampling={}, max_concurrent_groups=0)


def test_model_resolution(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model(str(model), served=False) == str(model)
    run = tmp_path / "run"
    for step in (5, 20, 100):
        (run / "weights" / f"step_{step}").mkdir(parents=True)
        (run / "weights" / f"step_{step}" / "config.json").write_text("{}")
    (run / "weights" / "step_300").mkdir()  # being written: no config.json yet
    assert resolve_model(str(run), served=False) == str(run / "weights" / "step_100")
    (run / "checkpoints" / "step_100").mkdir(parents=True)
    with pytest.raises(EvalInputError, match="training checkpoint.*weights/step_100"):
        resolve_model(str(run / "checkpoints" / "step_100"), served=False)
    with pytest.raises(EvalInputError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"), served=False)
    with pytest.raises(EvalInputError, match="no config.json"):
        resolve_model(str(tmp_path), served=False)
    assert resolve_model("Qwen/Qwen3-0.6B", served=False) == "Qwen/Qwen3-0.6B"
    assert resolve_model("served-name", served=True) == "served-name"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-a", "{not json"], "--env-args is not JSON"),
        (["-a", "[1, 2]"], "must be a JSON object"),
        (["-n", "0"], "--num-examples must be >= 1 or -1"),
        (["-r", "0"], "--rollouts-per-example must be >= 1"),
        (["-T", "-0.5"], "--temperature must be >= 0"),
        (["--top-p", "1.5"], "--top-p must be in"),
        (["--env-python", "/nonexistent/python"], "env python /nonexistent/python does not exist"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(tmp_path, capsys, args, message):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert eval_main(["reverse-text", "-m", str(model), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("has_tools", "argv", "expected"),
    [
        (False, [], (False, None)),
        (True, [], (True, "hermes")),
        (True, ["--tool-call-parser", "llama3_json"], (True, "llama3_json")),
        (True, ["--no-enable-auto-tool-choice"], (False, None)),
        (False, ["--enable-auto-tool-choice"], (True, "hermes")),
        (False, ["--tool-call-parser", "mistral"], (True, "mistral")),
        (True, ["-b", "http://host:8000/v1"], (False, None)),  # the server's own settings apply
    ],
)
def test_tool_settings_of_the_started_server(has_tools, argv, expected):
    from primerl.cli.eval import _tool_settings, build_parser
    from primerl.cli.eval_console import Console
    from primerl.orchestrator.trajectory import EnvInfo

    args = build_parser().parse_args(["env", "-m", "m", *argv])
    info = EnvInfo(
        env_id="env",
        env_class="ToolEnv" if has_tools else "SingleTurnEnv",
        num_examples=1,
        num_eval_examples=1,
        has_eval_dataset=False,
        has_tools=has_tools,
    )
    assert _tool_settings(args, info, Console()) == expected


# ------------------------------------------------------------------------------------- through the CLI
needs_env_python = pytest.mark.skipif(
    not Path(ENV_PYTHON).exists(), reason=f"no env-worker interpreter at {ENV_PYTHON}: run `make setup`"
)


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRIMERL_ENV_PYTHON": ENV_PYTHON, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(BIN / "primerl"), *argv], capture_output=True, text=True, timeout=timeout, env=env)


@needs_env_python
def test_sft_data_writes_the_environments_prompts_with_reference_answers(tmp_path):
    out = tmp_path / "sft.jsonl"
    result = _run("sft-data", "reverse-text", "-o", str(out), "-n", "25", "-a", '{"max_len": 4}')
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 25
    for row in rows:
        question = row["prompt"][-1]["content"]
        assert row["prompt"][0]["role"] == "system" and row["completion"][0]["role"] == "assistant"
        assert row["completion"][0]["content"] == " ".join(reversed(question.split()))
        assert 3 <= len(question.split()) <= 4
    bad = _run("sft-data", "no-such-env", "-o", str(tmp_path / "x.jsonl"))
    assert bad.returncode == 1 and "no-such-env" in bad.stderr and not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow
@pytest.mark.vllm
@needs_env_python
def test_eval_serves_the_model_and_scores_every_rollout(tmp_path):
    from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "model", TinyModelSpec(seed=3))
    out = tmp_path / "eval"
    result = _run(
        "eval",
        "reverse-text",
        "-m",
        str(model),
        "-n",
        "6",
        "-r",
        "2",
        "-t",
        "8",
        "-T",
        "1.0",
        "--seed",
        "5",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sampling"]["seed"] == 5
    assert summary["split"] == "eval" and summary["num_examples"] == 6 and summary["rollouts_per_example"] == 2
    assert summary["num_rollouts"] + summary["num_errors"] == 12 and summary["num_rollouts"] >= 10
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["example_index"], r["rollout_index"]) for r in rows) == [
        (i, j) for i in range(6) for j in range(2)
    ]
    rewards = [r["reward"] for r in rows if r["error"] is None]
    assert all(0.0 <= reward <= 1.0 for reward in rewards)
    assert summary["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert all(1 <= r["num_completion_tokens"] <= 8 for r in rows if r["error"] is None)
    assert "lcs_reward" in summary["metrics"] and f"reward: mean {summary['reward_mean']:.4f}" in result.stdout
    # Only eval's own lines on the console ("starting vLLM ... (its log: ...)" and the summary); vLLM's
    # warnings and the interpreter-exit noise (AsyncLLM.__del__, leak reports) are in the log.
    console = (result.stdout + result.stderr).strip().splitlines()
    assert len(console) == 6, console
    assert not any("WARNING" in line or "Exception ignored" in line for line in console), console
    assert f"(its log: {out / 'eval.log'})" in result.stderr and "WARNING" in (out / "eval.log").read_text()


@needs_env_python
def test_an_env_id_typo_gets_the_installed_ids_closest_to_it(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = _run("eval", "revers-text", "-m", str(model))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "Did you mean 'reverse-text'" in result.stderr

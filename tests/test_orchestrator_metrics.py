"""Metrics that mean what their names say: generation throughput over a window, rewards paired
with their step in the progress line, the rollout spool's bound in `primerl status`, interleave fallbacks,
per-environment rewards, reward spread, and the per-rollout sampling seeds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from primerl.orchestrator.samples import Group, TrainingSample
from primerl.orchestrator.seeds import rollout_seed_base
from primerl.orchestrator.step_metrics import env_reward_metrics, fallback_metrics, reward_spread_metrics
from primerl.orchestrator.throughput import ThroughputWindow
from primerl.proto import telemetry
from primerl.supervisor.run_progress import Progress
from primerl.supervisor.status_view import render_status

# ---- rollout/tokens_per_s ---------------------------------------------------------------------------------------


def test_tokens_per_s_is_tokens_over_the_wall_time_they_took():
    window = ThroughputWindow(window_s=30.0)
    for second in range(1, 11):  # 10 s of generation from t=100, 500 tokens back every second
        window.add(100.0 + second - 1, 100.0 + second, 500)
    assert window.tokens_per_s(110.0) == pytest.approx(500.0)


def test_a_step_made_from_surplus_reads_the_same_rate_not_a_division_by_its_short_interval():
    """The old figure: tokens collected during the step / the step's time: 0 or thousands for a 1 ms step."""
    window = ThroughputWindow(window_s=30.0)
    for second in range(1, 41):
        window.add(second - 1.0, float(second), 200)
    rate_at_step_end = window.tokens_per_s(40.0)
    rate_after_a_surplus_step = window.tokens_per_s(40.001)  # nothing collected in between
    assert rate_at_step_end == pytest.approx(200.0)
    assert rate_after_a_surplus_step == pytest.approx(rate_at_step_end, rel=1e-3)


def test_tokens_per_s_is_not_zero_while_rollouts_longer_than_the_window_go_on():
    window = ThroughputWindow(window_s=10.0, min_groups=2)
    window.add(0.0, 60.0, 3000)  # two groups of one-minute rollouts, running side by side
    window.add(0.5, 60.5, 3000)
    rate = window.tokens_per_s(75.0)  # nothing finished in the last 10 s, generation goes on
    assert rate == pytest.approx(6000 / 75.0)  # the last two groups' tokens since their dispatch
    window.add(61.0, 120.0, 3000)
    assert window.tokens_per_s(121.0) == pytest.approx(6000 / (121.0 - 0.5))


def test_tokens_per_s_at_the_start_counts_from_the_first_dispatch():
    window = ThroughputWindow(window_s=30.0)
    assert window.tokens_per_s(5.0) == 0.0  # nothing generated yet
    window.add(10.0, 12.0, 400)
    assert window.tokens_per_s(12.0) == pytest.approx(200.0)  # 400 tokens over 2 s, not over 30 s or 0 s


def test_tokens_per_s_decays_once_generation_stopped():
    window = ThroughputWindow(window_s=10.0)
    for second in range(1, 11):
        window.add(second - 1.0, float(second), 100)
    assert window.tokens_per_s(10.0) == pytest.approx(100.0)
    assert window.tokens_per_s(15.0) == pytest.approx(50.0)  # only the last 5 s of generation in the window


def test_throughput_window_rejects_bad_bounds():
    with pytest.raises(ValueError, match="window_s"):
        ThroughputWindow(window_s=0)
    with pytest.raises(ValueError, match="min_groups"):
        ThroughputWindow(min_groups=0)


# ---- progress line: each figure with its own step -----------------------------------------------------------------


class _Status:
    def __init__(self, trainer_step: int, metrics: dict[str, float]):
        from primerl.proto.v1 import common_pb2, control_pb2

        self.message = control_pb2.RunStatus(
            trainer_step=trainer_step, latest_policy_version=trainer_step, max_steps=10, last_metrics=metrics
        )
        self.message.workers.add(role=common_pb2.ROLE_INFERENCE, policy_version=max(0, trainer_step - 1))


def test_progress_shows_the_reward_of_the_batch_trained_at_the_shown_step():
    progress = Progress()
    # the orchestrator runs one step ahead of the trainer: its batch 3 is reported while the trainer is at 2
    progress.update(
        _Status(1, {telemetry.TRAIN_REWARD: 0.20, telemetry.ORCHESTRATOR_STEP: 2, telemetry.TRAIN_LOSS: 0.5}).message
    )
    progress.update(
        _Status(2, {telemetry.TRAIN_REWARD: 0.30, telemetry.ORCHESTRATOR_STEP: 3, telemetry.TRAIN_LOSS: 0.4}).message
    )
    line = progress.line()
    assert "step 2/10" in line and "reward 0.200 " in line and "loss 0.4000" in line
    progress.update(
        _Status(3, {telemetry.TRAIN_REWARD: 0.45, telemetry.ORCHESTRATOR_STEP: 4, telemetry.TRAIN_LOSS: 0.3}).message
    )
    assert "step 3/10  reward 0.300 " in progress.line()


def test_progress_labels_a_reward_of_another_batch_with_its_step():
    progress = Progress()
    progress.update(
        _Status(2, {telemetry.TRAIN_REWARD: 0.30, telemetry.ORCHESTRATOR_STEP: 5}).message
    )  # batches 3, 4 missed
    assert "reward 0.300 (batch 5)" in progress.line()
    old = Progress()  # an orchestrator that does not report its step
    old.update(_Status(2, {telemetry.TRAIN_REWARD: 0.30}).message)
    assert "reward 0.300 (latest batch)" in old.line()


def test_progress_shows_interleave_fallbacks_once_there_are_any():
    progress = Progress()
    progress.update(
        _Status(
            1,
            {
                telemetry.TRAIN_REWARD: 0.2,
                telemetry.ORCHESTRATOR_STEP: 1,
                telemetry.ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL: 0,
            },
        ).message
    )
    assert "fallbacks" not in progress.line()
    progress.update(_Status(2, {telemetry.ROLLOUT_INTERLEAVE_FALLBACKS_TOTAL: 5}).message)
    assert "fallbacks 5 " in progress.line()


def test_progress_keeps_a_bounded_number_of_batch_rewards():
    from primerl.supervisor.run_progress import MAX_BATCHES

    progress = Progress()
    for step in range(1, MAX_BATCHES + 20):
        progress.update(
            _Status(step - 1, {telemetry.TRAIN_REWARD: step / 100, telemetry.ORCHESTRATOR_STEP: step}).message
        )
    assert len(progress.batch_rewards) == MAX_BATCHES and max(progress.batch_rewards) == MAX_BATCHES + 19


# ---- primerl status: the rollout spool ----------------------------------------------------------------------------


def test_status_does_not_show_the_rollout_spool_above_its_capacity():
    from primerl.proto.v1 import control_pb2

    status = control_pb2.RunStatus(run_id="r")
    status.queues.add(name="rollouts", num_items=10, num_bytes=4096, capacity_items=8, capacity_bytes=1 << 30)
    status.queues.add(name="other", num_items=3, num_bytes=10, capacity_items=8)
    text = render_status(status)
    assert "10/8" not in text
    rollouts = next(line for line in text.splitlines() if line.startswith("rollouts (spooled"))
    assert "10" in rollouts and "at most 8 batches / 1.0 GiB ahead of the trainer" in rollouts
    assert any(line.startswith("other") and "3/8" in line for line in text.splitlines())


# ---- fallbacks, per-env rewards, spread -----------------------------------------------------------------------------


def _group(env_id: str, rewards: list[float], samples_per_rollout: int = 1) -> Group:
    samples = [
        TrainingSample(
            token_ids=[1, 2],
            loss_mask=[False, True],
            inference_logprobs=[0.0, -1.0],
            temperatures=[1.0, 1.0],
            policy_versions=[0, 0],
            reward=reward,
            env_id=env_id,
            rollout_id=index,
        )
        for index, reward in enumerate(rewards)
        for _ in range(samples_per_rollout)
    ]
    return Group(group_id=f"{env_id}:0", example_id=0, env_id=env_id, samples=samples)


def test_env_reward_metrics_give_each_environment_its_mean_reward_and_counts():
    groups = [
        _group("math", [1.0, 0.0]),
        _group("reverse-text", [0.5, 0.25], samples_per_rollout=2),
        _group("math", [1.0, 1.0]),
    ]
    assert env_reward_metrics(groups) == {
        "env/math/reward": 0.75,
        "env/math/num_rollouts": 4.0,
        "env/math/num_samples": 4.0,
        "env/reverse-text/reward": 0.375,
        "env/reverse-text/num_rollouts": 2.0,
        "env/reverse-text/num_samples": 4.0,
    }


def test_fallback_metrics_report_the_total_and_each_reason():
    assert fallback_metrics(Counter()) == {"rollout/interleave_fallbacks": 0.0}
    assert fallback_metrics(Counter({"prefix_mismatch": 3, "no_prompt_ids": 1})) == {
        "rollout/interleave_fallbacks": 4.0,
        "rollout/interleave_fallbacks/no_prompt_ids": 1.0,
        "rollout/interleave_fallbacks/prefix_mismatch": 3.0,
    }


def test_reward_spread_stays_within_the_rewards():
    rewards = [0.0] * 8 + [1.0] * 2
    spread = reward_spread_metrics(rewards)
    assert spread[telemetry.ROLLOUT_REWARD_MIN] == 0.0 and spread[telemetry.ROLLOUT_REWARD_MAX] == 1.0
    assert spread[telemetry.ROLLOUT_REWARD_P10] == 0.0 and 0.0 <= spread[telemetry.ROLLOUT_REWARD_P90] <= 1.0
    assert np.mean(rewards) - np.std(rewards) < 0  # what the old ±std band drew
    assert reward_spread_metrics([]) == {}


# ---- sampling seeds -----------------------------------------------------------------------------------------------


def test_group_seeds_give_every_rollout_its_own_seed_and_repeat_for_the_same_run_seed():
    rollouts_per_example = 8
    seeds = [
        rollout_seed_base(7, group_id, rollouts_per_example) + index
        for group_id in range(500)
        for index in range(rollouts_per_example)
    ]
    assert len(set(seeds)) == len(seeds)  # the old seed + group_id gave group g's rollout 1 group g+1's rollout 0
    assert seeds == [rollout_seed_base(7, g, rollouts_per_example) + i for g in range(500) for i in range(8)]
    assert rollout_seed_base(8, 0, rollouts_per_example) != rollout_seed_base(7, 0, rollouts_per_example)
    assert all(0 <= seed < 2**31 for seed in seeds)
    assert rollout_seed_base(None, 3, rollouts_per_example) is None


def test_the_runner_warns_once_per_fallback_reason(tmp_path):
    import structlog

    from primerl.configs.orchestrator import OrchestratorConfig
    from primerl.orchestrator.async_bound import AsyncBound
    from primerl.orchestrator.step_reporter import StepReporter

    config = OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "env": [{"id": "e"}],
            "batch_size": 4,
            "rollouts_per_example": 2,
            "max_steps": 3,
            "output_dir": str(tmp_path),
        }
    )
    reporter = StepReporter(config, AsyncBound(config.max_async_level))
    with structlog.testing.capture_logs() as logs:
        for step_fallbacks in ({"prefix_mismatch": 2}, {"prefix_mismatch": 1, "no_prompt_ids": 1}, {}):
            reporter.log_new_fallbacks(Counter(step_fallbacks))
    warnings = [entry for entry in logs if "fall back to branching" in entry["event"]]
    assert [(w["reason"], w["num_this_step"]) for w in warnings] == [("prefix_mismatch", 2), ("no_prompt_ids", 1)]

"""Training samples from env-worker rollouts: the wire form parsed (``orchestrator.trajectory``) and turned into
samples the way the orchestrator does it (``orchestrator.samples.rollout_to_samples``): interleaved or branching,
the fallback and its reasons, malformed trajectories."""

from __future__ import annotations

from collections import Counter

import pytest

from primerl.orchestrator.samples import (
    MalformedTrajectory,
    NotInterleavable,
    SampleMeta,
    TrainingSample,
    TurnTokens,
    branching_samples,
    interleaved_sample,
    rollout_to_samples,
    trajectory_to_samples,
)
from primerl.orchestrator.trajectory import Rollout, SamplingParams, Turn, parse_rollout, sampling_from


def two_turns(extend=True):
    first = TurnTokens(
        prompt_ids=[1, 2, 3],
        completion_ids=[10, 11],
        completion_logprobs=[-0.1, -0.2],
        policy_version=4,
        temperature=0.7,
    )
    second_prompt = [1, 2, 3, 10, 11, 20, 21] if extend else [1, 2, 99, 10, 11, 20, 21]
    second = TurnTokens(
        prompt_ids=second_prompt,
        completion_ids=[30, 31, 32],
        completion_logprobs=[-0.3, -0.4, -0.5],
        policy_version=5,
        temperature=0.7,
        completion_policy_versions=[5, 5, 6],
    )
    return [first, second]


def test_interleaved_concatenates_turns_and_masks_env_tokens():
    sample = interleaved_sample(
        two_turns(), SampleMeta(reward=1.0, group_id=7, example_id=3, env_id="toy", rollout_id=2)
    )
    assert sample.token_ids == [1, 2, 3, 10, 11, 20, 21, 30, 31, 32]
    assert sample.loss_mask == [False, False, False, True, True, False, False, True, True, True]
    assert sample.inference_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5])
    assert sample.policy_versions == [4, 4, 4, 4, 4, 5, 5, 5, 5, 6]
    assert sample.temperatures == pytest.approx([0.7] * 10)
    meta = (sample.reward, sample.group_id, sample.example_id, sample.env_id, sample.rollout_id)
    assert meta == (1.0, 7, 3, "toy", 2)
    assert sample.num_completion_tokens == 5 and sample.min_policy_version == 4 and sample.max_policy_version == 6


def test_branching_gives_one_sample_per_turn():
    samples = branching_samples(two_turns(), SampleMeta(reward=0.5, rollout_id=1))
    assert [s.token_ids for s in samples] == [[1, 2, 3, 10, 11], [1, 2, 3, 10, 11, 20, 21, 30, 31, 32]]
    assert samples[1].loss_mask == [False] * 7 + [True] * 3  # the first turn's completion is context here
    assert samples[1].policy_versions == [5] * 7 + [5, 5, 6]
    assert all(s.reward == 0.5 and s.rollout_id == 1 for s in samples)


def test_interleaved_falls_back_to_branching_and_counts_the_reason():
    with pytest.raises(NotInterleavable) as info:
        interleaved_sample(two_turns(extend=False), SampleMeta(reward=0.0))
    assert info.value.reason == "prefix_mismatch" and "token 2" in str(info.value)
    counts = Counter()
    samples = trajectory_to_samples(two_turns(extend=False), "interleaved", SampleMeta(1.0), fallback_counts=counts)
    assert len(samples) == 2 and counts == {"prefix_mismatch": 1}
    assert len(trajectory_to_samples(two_turns(), "interleaved", SampleMeta(1.0), fallback_counts=counts)) == 1
    assert counts == {"prefix_mismatch": 1}
    assert len(trajectory_to_samples(two_turns(), "branching", SampleMeta(1.0), fallback_counts=None)) == 2


def test_completion_mask_zeroes_logprobs_of_tokens_not_generated():
    turn = TurnTokens(
        prompt_ids=[1],
        completion_ids=[5, 6, 7],
        completion_logprobs=[-1.0, -2.0, -3.0],
        policy_version=0,
        completion_mask=[True, False, True],
    )
    (sample,) = branching_samples([turn], SampleMeta(reward=0.0))
    assert sample.loss_mask == [False, True, False, True]
    assert sample.inference_logprobs == [0.0, -1.0, 0.0, -3.0]


def test_turn_from_the_env_worker_wire_shape():
    from types import SimpleNamespace

    wire = SimpleNamespace(
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        completion_logprobs=[-0.1, -0.2],
        completion_mask=[1, 0],
        policy_version=None,
        policy_version_end=3,
    )
    turn = TurnTokens.from_wire_turn(wire, temperature=0.8, default_policy_version=2)
    (sample,) = branching_samples([turn], SampleMeta(reward=1.0))
    assert sample.loss_mask == [False, False, True, False] and sample.policy_versions == [2, 2, 2, 2]
    assert sample.temperatures == pytest.approx([0.8] * 4)


@pytest.mark.parametrize(
    ("turns", "reason"),
    [
        ([], "no_turns"),
        ([TurnTokens(prompt_ids=[], completion_ids=[1], completion_logprobs=[-1.0], policy_version=0)], "empty_prompt"),
        (
            [TurnTokens(prompt_ids=[1], completion_ids=[1, 2], completion_logprobs=[-1.0], policy_version=0)],
            "length_mismatch",
        ),
    ],
)
def test_malformed_trajectories_raise_with_a_reason(turns, reason):
    for strategy in ("interleaved", "branching"):
        with pytest.raises(MalformedTrajectory) as info:
            trajectory_to_samples(turns, strategy, SampleMeta(reward=0.0), fallback_counts=None)
        assert info.value.reason == reason


def test_sample_checks_its_fields():
    with pytest.raises(MalformedTrajectory, match="first_token_is_loss"):
        TrainingSample([1, 2], [True, True], [0, 0], [1, 1], [0, 0])
    with pytest.raises(MalformedTrajectory, match="length_mismatch"):
        TrainingSample([1, 2], [False, True], [0], [1, 1], [0, 0])


def test_fallback_reasons_become_the_runners_metrics():
    """The runner hands its own per-step Counter to the sample conversion; the reasons become metrics."""
    from primerl.orchestrator.step_metrics import fallback_metrics

    fallbacks = Counter()
    trajectory_to_samples(two_turns(extend=False), "interleaved", SampleMeta(1.0), fallback_counts=fallbacks)
    assert fallback_metrics(fallbacks)["rollout/interleave_fallbacks/prefix_mismatch"] == 1.0


# -- from the env worker's wire form (what the daemon trains on) -----------------------------------------------


def wire_turn(prompt: list[int], completion: list[int], version: int | None = 1) -> Turn:
    return Turn(prompt, completion, [-0.5] * len(completion), [1] * len(completion), "stop", False, version, version)


def wire_rollout(turns: list[Turn], reward: float = 1.0, index: int = 0, truncated: bool = False) -> Rollout:
    return Rollout(index, turns, reward, {}, truncated, None, None, None, [], [], 0.0)


def test_a_wire_rollout_interleaves_or_branches():
    turns = [
        wire_turn([1, 2, 3], [4, 5]),
        wire_turn([1, 2, 3, 4, 5, 6, 7], [8]),
        wire_turn([1, 2, 3, 4, 5, 6, 7, 8, 9], [10]),
    ]
    rollout = wire_rollout(turns, reward=0.75, index=3, truncated=True)
    (sample,) = rollout_to_samples(rollout, "interleaved", temperature=0.9, group_id="g", example_id=5, env_id="e")
    assert sample.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # the tokens the environment added between turns (6, 7 and 9) are context: no loss, logprob 0
    assert sample.loss_mask == [False, False, False, True, True, False, False, True, False, True]
    assert sample.inference_logprobs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5]
    assert sample.temperatures == pytest.approx([0.9] * 10) and sample.policy_versions == [1] * 10
    assert (sample.reward, sample.truncated, sample.rollout_id, sample.group_id, sample.example_id, sample.env_id) == (
        0.75,
        True,
        3,
        "g",
        5,
        "e",
    )
    branches = rollout_to_samples(rollout, "branching", temperature=0.9)
    assert [s.token_ids[len(t.prompt_token_ids) :] for s, t in zip(branches, turns)] == [[4, 5], [8], [10]]
    assert [s.token_ids[: len(t.prompt_token_ids)] for s, t in zip(branches, turns)] == [
        t.prompt_token_ids for t in turns
    ]
    # a turn whose prompt rewrote the tokens so far: branching samples, and the reason counted
    rewritten = wire_rollout([turns[0], wire_turn([1, 2, 3, 9, 5, 6], [7])])
    fallbacks = Counter()
    samples = rollout_to_samples(rewritten, "interleaved", temperature=1.0, fallback_counts=fallbacks)
    assert [s.token_ids for s in samples] == [
        s.token_ids for s in rollout_to_samples(rewritten, "branching", temperature=1.0)
    ]
    assert len(samples) == 2 and fallbacks == {"prefix_mismatch": 1}


def test_a_wire_turn_without_a_policy_version_gets_the_dispatched_one():
    rollout = wire_rollout([wire_turn([1, 2], [3], version=None)])
    (sample,) = rollout_to_samples(rollout, "interleaved", temperature=1.0, default_policy_version=6)
    assert sample.policy_versions == [6, 6, 6]


def test_parse_rollout_turns_broken_payloads_into_errors() -> None:
    good = {
        "rollout_index": 0,
        "reward": 0.5,
        "metrics": {},
        "turns": [{"prompt_token_ids": [1], "completion_token_ids": [2, 3], "completion_logprobs": [-1.0, -0.5]}],
    }
    assert parse_rollout(good, "r").ok
    for turn_patch in (
        {"completion_logprobs": [-1.0]},
        {"completion_logprobs": [-1.0, float("nan")]},
        {"completion_logprobs": [-1.0, 0.5]},
        {"completion_token_ids": None},
        {"completion_mask": [1]},
    ):
        broken = {**good, "turns": [{**good["turns"][0], **turn_patch}]}
        assert parse_rollout(broken, "r").error_type == "MalformedRolloutError", turn_patch
    assert parse_rollout({**good, "turns": []}, "r").error_type == "MalformedRolloutError"
    assert parse_rollout({**good, "reward": None}, "r").error_type == "MalformedRolloutError"
    assert parse_rollout({**good, "error": {"type": "X", "message": "m"}}, "r").error == "m"


def test_sampling_from_config() -> None:
    from primerl.configs.orchestrator import SamplingConfig

    params = sampling_from(SamplingConfig(temperature=0.5, stop=["x"], max_tokens=9))
    assert params == SamplingParams(temperature=0.5, stop=("x",), max_tokens=9)
    assert params.to_wire()["stop"] == ["x"]

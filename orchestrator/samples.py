"""Training samples: what one rollout becomes before advantages, filtering and packing.

A rollout is a trajectory of model turns. Each turn brings the tokens of its prompt (everything the model saw,
earlier turns included), the tokens the model generated, their logprobs, and the policy version that generated
them. Two strategies turn a trajectory into ``TrainingSample``s (prime-rl's ``trajectory_strategy``):

- ``branching``: one sample per turn, ``prompt + completion`` of that turn; only the completion is trained.
- ``interleaved``: one sample for the whole trajectory, when each turn's prompt starts with the previous turn's
  prompt and completion exactly (the chat template only appends). Tokens the environment inserted between turns
  (tool results, user messages) are context, never loss tokens. A trajectory whose prompts do not extend raises
  ``NotInterleavable``; ``trajectory_to_samples`` then falls back to branching and counts the reason.

Per-token conventions, the ones the trainer's micro-batches use (``primerl.trainer.batch``):
``inference_logprobs[i]`` is log p(token i | tokens < i) as the inference engine sampled it, 0 where token i is not
a loss token; ``temperatures[i]`` is the sampling temperature of the turn that token i belongs to; and
``policy_versions[i]`` is the version that generated token i (a prompt token gets its turn's version). The first
token of a sample is never a loss token: nothing precedes it to predict it from.

A ``Group`` holds the rollouts of one example. With branching a rollout is several samples; they share the
rollout's ``rollout_id``, reward and truncated flag, and group statistics count each rollout once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

TrajectoryStrategy = Literal["interleaved", "branching"]

ZERO_ADVANTAGE_TOLERANCE = 1e-8
"""An advantage this close to 0 is 0: the float noise of ``reward - mean`` over equal rewards."""


class MalformedTrajectory(ValueError):
    """Env output that cannot become a sample. ``reason`` is a short metric key (``no_turns``, ``empty_prompt``,
    ``length_mismatch``, ``first_token_is_loss``, ``empty_sample``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class NotInterleavable(ValueError):
    """A turn's prompt does not extend the previous prompt and completion; ``reason`` is a metric key."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class TrainingSample:
    """One packed sequence: prompt and completion tokens with per-token training data (all of one length)."""

    token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    inference_logprobs: Sequence[float]
    temperatures: Sequence[float]
    policy_versions: Sequence[int]
    reward: float = 0.0
    advantage: float = 0.0  # filled by `advantages.compute_advantages`
    truncated: bool = False  # the rollout hit max_tokens or the context limit
    group_id: Hashable = 0
    example_id: Hashable = 0
    env_id: str = ""
    rollout_id: int = 0  # which rollout of its group; branching gives one rollout several samples
    teacher_logprobs: Sequence[float] | None = None
    # Completion tokens the model generated in this sample, fixed at creation (masking truncated samples later
    # does not change it: the length penalty still sees the rollout's real length).
    num_completion_tokens: int | None = None

    def __post_init__(self) -> None:
        lengths = {
            "token_ids": len(self.token_ids),
            "loss_mask": len(self.loss_mask),
            "inference_logprobs": len(self.inference_logprobs),
            "temperatures": len(self.temperatures),
            "policy_versions": len(self.policy_versions),
        }
        if self.teacher_logprobs is not None:
            lengths["teacher_logprobs"] = len(self.teacher_logprobs)
        if len(set(lengths.values())) != 1:
            raise MalformedTrajectory("length_mismatch", f"per-token fields differ in length: {lengths}")
        if not self.token_ids:
            raise MalformedTrajectory("empty_sample", "a sample needs at least one token")
        if self.loss_mask[0]:
            raise MalformedTrajectory("first_token_is_loss", "the first token of a sample cannot be a loss token")
        if self.num_completion_tokens is None:
            self.num_completion_tokens = int(np.count_nonzero(np.asarray(self.loss_mask, dtype=bool)))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(np.asarray(self.loss_mask, dtype=bool)))

    @property
    def min_policy_version(self) -> int:
        return int(min(self.policy_versions))

    @property
    def max_policy_version(self) -> int:
        return int(max(self.policy_versions))


@dataclass
class Group:
    """The rollouts of one example (the unit of group-relative advantages and of difficulty filtering)."""

    group_id: Hashable
    example_id: Hashable
    env_id: str
    samples: list[TrainingSample] = field(default_factory=list)
    # tokens the model generated for the rollouts behind ``samples`` (the scheduler sets it; unset: the samples')
    generated_tokens: int | None = None

    def rollouts(self) -> dict[int, list[TrainingSample]]:
        """Samples by rollout id, in order of first appearance."""
        by_rollout: dict[int, list[TrainingSample]] = {}
        for sample in self.samples:
            by_rollout.setdefault(sample.rollout_id, []).append(sample)
        return by_rollout

    @property
    def num_rollouts(self) -> int:
        return len({sample.rollout_id for sample in self.samples})

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def rollout_rewards(self) -> np.ndarray:
        """One reward per rollout (float64), in the order of ``rollouts()``."""
        return np.array([samples[0].reward for samples in self.rollouts().values()], dtype=np.float64)

    @property
    def mean_reward(self) -> float:
        rewards = self.rollout_rewards()
        return float(rewards.mean()) if rewards.size else 0.0

    @property
    def min_policy_version(self) -> int:
        return min(sample.min_policy_version for sample in self.samples)

    @property
    def max_policy_version(self) -> int:
        return max(sample.max_policy_version for sample in self.samples)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens the model generated for the group's rollouts: ``generated_tokens``, else its samples'."""
        if self.generated_tokens is not None:
            return self.generated_tokens
        return sum(sample.num_completion_tokens or 0 for sample in self.samples)

    @property
    def has_signal(self) -> bool:
        """Whether some sample has a non-zero advantage (after ``advantages.prepare_groups``): a group whose
        advantages are all zero gives no policy gradient (prime-rl's "zero-advantage group")."""
        return any(abs(sample.advantage) > ZERO_ADVANTAGE_TOLERANCE for sample in self.samples)


@dataclass
class TurnTokens:
    """One model turn as the env worker reports it."""

    prompt_ids: Sequence[int]  # everything the model saw this turn, earlier turns included
    completion_ids: Sequence[int]
    completion_logprobs: Sequence[float]
    policy_version: int  # the version serving the turn when it started; its prompt tokens get it
    temperature: float = 1.0
    # Per completion token: False for tokens the model did not generate (verifiers' completion_mask).
    completion_mask: Sequence[bool] | None = None
    # Per completion token, when an in-flight weight update changed the version mid-turn.
    completion_policy_versions: Sequence[int] | None = None

    @classmethod
    def from_wire_turn(cls, turn: Any, *, temperature: float, default_policy_version: int = 0) -> TurnTokens:
        """From a parsed env-worker turn (``orchestrator.trajectory.Turn``: ``prompt_token_ids``,
        ``completion_token_ids``, ``completion_logprobs``, ``completion_mask``, ``policy_version``). Which
        version produced each token is not known when a weight update landed mid-turn, so every token gets the
        version the turn started with (the oldest one: the conservative choice for the async bound)."""
        policy_version = getattr(turn, "policy_version", None)
        mask = getattr(turn, "completion_mask", None)
        return cls(
            prompt_ids=turn.prompt_token_ids,
            completion_ids=turn.completion_token_ids,
            completion_logprobs=turn.completion_logprobs,
            policy_version=default_policy_version if policy_version is None else int(policy_version),
            temperature=temperature,
            completion_mask=None if mask is None else [bool(m) for m in mask],
        )

    def check(self, turn_index: int) -> None:
        num_completion = len(self.completion_ids)
        for name in ("completion_logprobs", "completion_mask", "completion_policy_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != num_completion:
                raise MalformedTrajectory(
                    "length_mismatch",
                    f"turn {turn_index}: {name} has {len(values)} entries for {num_completion} completion tokens",
                )
        if not self.prompt_ids:
            raise MalformedTrajectory("empty_prompt", f"turn {turn_index} has no prompt tokens")

    def completion_loss_mask(self) -> list[bool]:
        if self.completion_mask is None:
            return [True] * len(self.completion_ids)
        return [bool(m) for m in self.completion_mask]

    def completion_versions(self) -> list[int]:
        if self.completion_policy_versions is None:
            return [int(self.policy_version)] * len(self.completion_ids)
        return [int(v) for v in self.completion_policy_versions]


@dataclass(frozen=True)
class SampleMeta:
    """What every sample of one rollout carries besides its tokens."""

    reward: float
    truncated: bool = False
    group_id: Hashable = 0
    example_id: Hashable = 0
    env_id: str = ""
    rollout_id: int = 0


@dataclass
class _Builder:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)

    def add_context(self, token_ids: Sequence[int], temperature: float, policy_version: int) -> None:
        count = len(token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([False] * count)
        self.logprobs.extend([0.0] * count)
        self.temperatures.extend([float(temperature)] * count)
        self.policy_versions.extend([int(policy_version)] * count)

    def add_completion(self, turn: TurnTokens) -> None:
        mask = turn.completion_loss_mask()
        self.token_ids.extend(int(t) for t in turn.completion_ids)
        self.loss_mask.extend(mask)
        self.logprobs.extend(float(lp) if m else 0.0 for lp, m in zip(turn.completion_logprobs, mask))
        self.temperatures.extend([float(turn.temperature)] * len(mask))
        self.policy_versions.extend(turn.completion_versions())

    def build(self, meta: SampleMeta) -> TrainingSample:
        return TrainingSample(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            inference_logprobs=self.logprobs,
            temperatures=self.temperatures,
            policy_versions=self.policy_versions,
            **vars(meta),
        )


def _check_turns(turns: Sequence[TurnTokens]) -> None:
    if not turns:
        raise MalformedTrajectory("no_turns", "the trajectory has no model turns")
    for index, turn in enumerate(turns):
        turn.check(index)


def branching_samples(turns: Sequence[TurnTokens], meta: SampleMeta) -> list[TrainingSample]:
    """One sample per turn: that turn's prompt (context) and completion (loss tokens)."""
    _check_turns(turns)
    samples = []
    for turn in turns:
        builder = _Builder()
        builder.add_context(turn.prompt_ids, turn.temperature, turn.policy_version)
        builder.add_completion(turn)
        samples.append(builder.build(meta))
    return samples


def interleaved_sample(turns: Sequence[TurnTokens], meta: SampleMeta) -> TrainingSample:
    """One sample for the whole trajectory; raises ``NotInterleavable`` when a turn's prompt does not start with
    the previous turn's prompt and completion."""
    _check_turns(turns)
    builder = _Builder()
    for index, turn in enumerate(turns):
        prompt = [int(t) for t in turn.prompt_ids]
        seen = len(builder.token_ids)
        if prompt[:seen] != builder.token_ids:
            mismatch = next(
                (i for i, (a, b) in enumerate(zip(prompt, builder.token_ids)) if a != b), min(len(prompt), seen)
            )
            raise NotInterleavable(
                "prefix_mismatch",
                f"turn {index}'s prompt ({len(prompt)} tokens) does not extend the previous {seen} tokens "
                f"(first difference at token {mismatch})",
            )
        builder.add_context(prompt[seen:], turn.temperature, turn.policy_version)
        builder.add_completion(turn)
    return builder.build(meta)


def trajectory_to_samples(
    turns: Sequence[TurnTokens],
    strategy: TrajectoryStrategy,
    meta: SampleMeta,
    *,
    fallback_counts: Counter | None = None,
) -> list[TrainingSample]:
    """Samples of one trajectory. ``interleaved`` falls back to ``branching`` for a trajectory that does not
    interleave, adding 1 to ``fallback_counts[reason]``. ``MalformedTrajectory`` propagates: the caller counts
    it and drops the rollout."""
    if strategy == "branching":
        return branching_samples(turns, meta)
    if strategy != "interleaved":
        raise ValueError(f"trajectory strategy must be 'interleaved' or 'branching', got {strategy!r}")
    try:
        return [interleaved_sample(turns, meta)]
    except NotInterleavable as exc:
        if fallback_counts is not None:
            fallback_counts[exc.reason] += 1
        return branching_samples(turns, meta)


def rollout_to_samples(
    rollout: Any,
    strategy: TrajectoryStrategy,
    *,
    temperature: float,
    default_policy_version: int = 0,
    fallback_counts: Counter | None = None,
    group_id: Hashable = 0,
    example_id: Hashable = 0,
    env_id: str = "",
) -> list[TrainingSample]:
    """The samples of one finished env-worker rollout (``orchestrator.trajectory.Rollout`` with a reward): its
    turns as ``TurnTokens.from_wire_turn`` reads them, then ``trajectory_to_samples``. What the orchestrator
    trains on; raises ``MalformedTrajectory`` like ``trajectory_to_samples``."""
    turns = [
        TurnTokens.from_wire_turn(turn, temperature=temperature, default_policy_version=default_policy_version)
        for turn in rollout.turns
    ]
    meta = SampleMeta(float(rollout.reward), rollout.is_truncated, group_id, example_id, env_id, rollout.rollout_index)
    return trajectory_to_samples(turns, strategy, meta, fallback_counts=fallback_counts)

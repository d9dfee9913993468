"""Typed rollouts as the env worker returns them (``primerl.proto.env_protocol``), and the sampling parameters
of a rollout request.

The env worker (`envs/remote/classic_worker.py`, in the environments' virtual environment) answers with JSON;
`parse_group` turns it into the dataclasses below and checks the invariants the trainer relies on. The orchestrator
turns a finished `Rollout` into training samples with `primerl.orchestrator.samples.rollout_to_samples`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Split = Literal["train", "eval"]


class MalformedRolloutError(ValueError):
    """The env worker sent a rollout that breaks the protocol's invariants."""


@dataclass(frozen=True)
class EnvInfo:
    """What `load` reports about an environment."""

    env_id: str
    env_class: str
    num_examples: int
    num_eval_examples: int
    has_eval_dataset: bool
    has_tools: bool = False
    """Its model requests carry tool definitions (a ToolEnv): the server needs auto tool choice and a parser."""


@dataclass(frozen=True)
class Example:
    """One dataset row: chat prompt, reference answer, extra info."""

    index: int
    example_id: Any
    prompt: list[dict[str, Any]]
    answer: Any
    info: dict[str, Any]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of a rollout request; mirrors `[orchestrator.sampling]` (pass `**config.model_dump()`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_tokens,
            "stop": list(self.stop),
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Turn:
    """One model call of a trajectory: the tokens it saw, the tokens it sampled and their logprobs."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    completion_mask: list[int]
    finish_reason: str | None
    is_truncated: bool
    policy_version: int | None
    policy_version_end: int | None
    completion: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Rollout:
    """One trajectory of a group. `error` set: it must not be trained on (it is counted and reported)."""

    rollout_index: int
    turns: list[Turn]
    reward: float | None
    metrics: dict[str, float | None]
    is_truncated: bool
    stop_condition: str | None
    error_type: str | None
    error: str | None
    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    generation_s: float

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(turn.completion_token_ids) for turn in self.turns)

    @property
    def policy_versions(self) -> list[int]:
        """Every policy version that produced a token of this rollout (from the inference servers' headers)."""
        versions = {v for t in self.turns for v in (t.policy_version, t.policy_version_end) if v is not None}
        return sorted(versions)


@dataclass(frozen=True)
class RolloutGroup:
    """The rollouts of one example (the group that advantages are computed over)."""

    env_id: str
    split: Split
    example_index: int
    rollouts: list[Rollout]
    # Where the group's time went, as the env worker measured it (generate_s, score_s, encode_s, total_s);
    # empty from a worker that does not report it.
    timings: dict[str, float] = field(default_factory=dict)
    # Submit to answer, measured by the orchestrator's EnvWorker client (None: not measured).
    roundtrip_s: float | None = None

    @property
    def num_errors(self) -> int:
        return sum(not r.ok for r in self.rollouts)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise MalformedRolloutError(f"{what} must be a list of integers")
    return value


def parse_turn(data: Mapping[str, Any], where: str) -> Turn:
    completion_ids = _int_list(data.get("completion_token_ids"), f"{where}: completion_token_ids")
    logprobs = data.get("completion_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(completion_ids):
        raise MalformedRolloutError(f"{where}: completion_logprobs must have one entry per completion token")
    if not all(isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= 1e-6 for lp in logprobs):
        raise MalformedRolloutError(f"{where}: completion_logprobs must be finite and <= 0")
    mask = _int_list(data.get("completion_mask", [1] * len(completion_ids)), f"{where}: completion_mask")
    if len(mask) != len(completion_ids):
        raise MalformedRolloutError(f"{where}: completion_mask must have one entry per completion token")
    return Turn(
        prompt_token_ids=_int_list(data.get("prompt_token_ids"), f"{where}: prompt_token_ids"),
        completion_token_ids=completion_ids,
        completion_logprobs=[float(lp) for lp in logprobs],
        completion_mask=mask,
        finish_reason=data.get("finish_reason"),
        is_truncated=bool(data.get("is_truncated")),
        policy_version=data.get("policy_version"),
        policy_version_end=data.get("policy_version_end"),
        completion=list(data.get("completion") or []),
    )


def parse_rollout(data: Mapping[str, Any], where: str) -> Rollout:
    """A rollout from the wire. A broken turn does not raise: the rollout comes back with an error instead."""
    error = data.get("error")
    error_type = error.get("type", "error") if isinstance(error, Mapping) else None
    message = str(error.get("message", "")) if isinstance(error, Mapping) else None
    turns: list[Turn] = []
    try:  # the turns of a failed rollout are kept too (for logs), when they are well formed
        turns = [parse_turn(turn, f"{where} turn {i}") for i, turn in enumerate(data.get("turns") or [])]
        if not turns and error is None:
            raise MalformedRolloutError(f"{where}: no turns")
    except MalformedRolloutError as exc:
        turns = []
        if error is None:
            error_type, message = "MalformedRolloutError", str(exc)
    reward = data.get("reward")
    if error_type is None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        error_type, message = "MalformedRolloutError", f"{where}: reward {reward!r} is not a finite number"
    return Rollout(
        rollout_index=int(data.get("rollout_index", -1)),
        turns=turns,
        reward=float(reward) if isinstance(reward, (int, float)) and math.isfinite(reward) else None,
        metrics=dict(data.get("metrics") or {}),
        is_truncated=bool(data.get("is_truncated")),
        stop_condition=data.get("stop_condition"),
        error_type=error_type,
        error=message,
        prompt=list(data.get("prompt") or []),
        completion=list(data.get("completion") or []),
        generation_s=float(data.get("generation_s") or 0.0),
    )


def parse_group(env_id: str, data: Mapping[str, Any]) -> RolloutGroup:
    rollouts = data.get("rollouts")
    if not isinstance(rollouts, list):
        raise MalformedRolloutError("a rollout result needs a `rollouts` list")
    split = data.get("split", "train")
    index = int(data.get("example_index", -1))
    where = f"{env_id} {split} example {index}"
    timings = data.get("timings")
    timings = (
        {
            str(k): float(v)
            for k, v in timings.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if isinstance(timings, Mapping)
        else {}
    )
    return RolloutGroup(
        env_id=env_id,
        split=split,
        example_index=index,
        rollouts=[parse_rollout(r, f"{where} rollout {i}") for i, r in enumerate(rollouts)],
        timings=timings,
    )


def sampling_from(config: Any) -> SamplingParams:
    """SamplingParams from `[orchestrator.sampling]` (a pydantic model or a mapping)."""
    values = config.model_dump() if hasattr(config, "model_dump") else dict(config)
    values["stop"] = tuple(values.get("stop") or ())
    return SamplingParams(**values)


def as_wire_sampling(sampling: SamplingParams | Mapping[str, Any] | None) -> dict[str, Any]:
    if sampling is None:
        return SamplingParams().to_wire()
    if isinstance(sampling, SamplingParams):
        return sampling.to_wire()
    return sampling_from(sampling).to_wire()


__all__ = [
    "EnvInfo",
    "Example",
    "MalformedRolloutError",
    "Rollout",
    "RolloutGroup",
    "SamplingParams",
    "Split",
    "Turn",
    "as_wire_sampling",
    "parse_group",
    "parse_rollout",
    "parse_turn",
    "sampling_from",
]

"""A verifiers v1 episode (the env server's traces) -> the orchestrator's `Rollout` of model turns, which
`primerl.orchestrator.samples.rollout_to_samples` turns into training samples like a classic env worker's.

A trace is a message graph (verifiers `graph.MessageNode`): each node adds `token_ids` to the sequence of its
path from the root; an assistant node that a model call produced (`sampled`) holds the generation-prompt scaffold
(`mask` False) then the sampled completion (`mask` True), with `logprobs` for the True positions only (compact).
One sampled node is one turn: prompt = the tokens of its path before it plus its own scaffold; completion = the
rest of its tokens. Multi-turn traces give turns whose prompts extend each other (the `interleaved` strategy
merges them into one sample); branching traces (a node with several children, sub-agents, several traces in one
episode) give turns that do not, and become one sample per turn (`branching`), as for classic environments.

The reward is the first trace's (the root agent's): the sum of its weighted `rewards`. Which policy version
produced each token is not in the trace: every turn gets the version served at dispatch and at the reply, as the
client records them (`policy_version`, `policy_version_end`).
"""

from __future__ import annotations

from typing import Any

from primerl.orchestrator.envs.v1_wire import MalformedEpisode
from primerl.orchestrator.trajectory import Rollout, Turn

TRUNCATED_STOPS = ("length", "max_tokens", "max_output_tokens", "max_total_tokens", "max_turns")
"""Stop conditions (and finish reasons) that mean the rollout was cut, not finished."""


def trace_reward(trace: dict) -> float | None:
    rewards = trace.get("rewards") or {}
    values = [r for r in rewards.values() if isinstance(r, dict)]
    if not values:
        return None
    return float(sum(float(r.get("score", 0.0)) * float(r.get("weight", 1.0)) for r in values))


def _path(nodes: list[dict], index: int) -> list[int]:
    path, seen = [], set()
    while index is not None:
        if index in seen or not 0 <= index < len(nodes):
            raise MalformedEpisode(f"node {index} has a broken parent chain")
        seen.add(index)
        path.append(index)
        index = nodes[index].get("parent")
    return path[::-1]


def trace_turns(trace: dict, *, policy_version: int | None, policy_version_end: int | None) -> list[Turn]:
    """The model turns of one trace, in node order."""
    nodes = trace.get("nodes") or []
    turns = []
    for index, node in enumerate(nodes):
        if not node.get("sampled"):
            continue
        token_ids = [int(t) for t in node.get("token_ids") or []]
        mask = [bool(m) for m in node.get("mask") or []]
        logprobs = [float(lp) for lp in node.get("logprobs") or []]
        if len(mask) != len(token_ids):
            raise MalformedEpisode(f"node {index}: {len(mask)} mask entries for {len(token_ids)} tokens")
        if len(logprobs) != sum(mask):
            raise MalformedEpisode(f"node {index}: {len(logprobs)} logprobs for {sum(mask)} sampled tokens")
        if not any(mask):
            continue  # a call that recorded no tokens (an eval client): nothing to train on
        first = mask.index(True)
        prefix = [int(t) for i in _path(nodes, index)[:-1] for t in nodes[i].get("token_ids") or []]
        sampled = iter(logprobs)
        completion_mask = mask[first:]
        turns.append(
            Turn(
                prompt_token_ids=prefix + token_ids[:first],
                completion_token_ids=token_ids[first:],
                completion_logprobs=[next(sampled) if m else 0.0 for m in completion_mask],
                completion_mask=[int(m) for m in completion_mask],
                finish_reason=None,
                is_truncated=False,
                policy_version=policy_version,
                policy_version_end=policy_version_end,
                completion=[node.get("message") or {}],
            )
        )
    return turns


def _prompt_messages(trace: dict) -> list[dict]:
    """The messages before the trace's first model turn (system, user)."""
    nodes = trace.get("nodes") or []
    first = next((i for i, node in enumerate(nodes) if node.get("sampled")), None)
    if first is None:
        return [node.get("message") or {} for node in nodes]
    return [nodes[i].get("message") or {} for i in _path(nodes, first)[:-1]]


def _errors(episode: dict) -> list[dict]:
    errors = [e for e in episode.get("errors") or [] if isinstance(e, dict)]
    for trace in episode.get("traces") or []:
        errors += [e for e in trace.get("errors") or [] if isinstance(e, dict)]
    return errors


def episode_to_rollout(
    episode: dict,
    *,
    rollout_index: int,
    policy_version: int | None,
    policy_version_end: int | None,
    generation_s: float,
) -> Rollout:
    """One run's episode as a `Rollout`; an episode whose traces failed, or that has no sampled token, is an error
    rollout (`error_type`, `error`), counted and not trained on."""
    traces = episode.get("traces") or []
    turns = [
        turn
        for trace in traces
        for turn in trace_turns(trace, policy_version=policy_version, policy_version_end=policy_version_end)
    ]
    root: dict[str, Any] = traces[0] if traces else {}
    errors = _errors(episode)
    error_type = error = None
    if errors:
        error_type, error = str(errors[-1].get("type", "Error")), str(errors[-1].get("message", ""))
    elif not traces or not all(trace.get("ok", False) for trace in traces):
        error_type, error = "EpisodeNotOk", "the episode did not complete successfully"
    elif not turns:
        error_type, error = (
            "NoTokens",
            (
                "the episode recorded no sampled tokens (the env server must call the "
                "inference server with the `train` client)"
            ),
        )
    reward = trace_reward(root) if root else None
    if error is None and reward is None:
        error_type, error = "NoReward", "the episode's root trace has no reward (its task defines no @reward?)"
    stop = root.get("stop_condition")
    metrics = {
        str(k): (None if v is None else float(v))
        for k, v in (root.get("metrics") or {}).items()
        if v is None or isinstance(v, (int, float))
    }
    for name, value in (root.get("rewards") or {}).items():
        if isinstance(value, dict) and isinstance(value.get("score"), (int, float)):
            metrics.setdefault(str(name), float(value["score"]))
    prompt = _prompt_messages(root)
    return Rollout(
        rollout_index=rollout_index,
        turns=turns,
        reward=reward,
        metrics=metrics,
        is_truncated=bool(root.get("is_timeout")) or (stop in TRUNCATED_STOPS),
        stop_condition=stop,
        error_type=error_type,
        error=error,
        prompt=prompt,
        completion=[turn.completion[0] for turn in turns],
        generation_s=generation_s,
    )

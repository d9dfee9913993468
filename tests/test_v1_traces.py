"""The v1 env server's wire as the orchestrator reads it (no server here: the deltas and traces are built the way
verifiers 0.4's `serve.delta.DeltaStreamer` and `graph.MessageNode` shape them): episode assembly, and traces
turned into turns and training samples, single-turn, multi-turn (interleaved) and branching."""

from __future__ import annotations

import pytest

from primerl.orchestrator.envs.v1_traces import episode_to_rollout, trace_turns
from primerl.orchestrator.envs.v1_wire import EpisodeAssembly, MalformedEpisode, pack, unpack
from primerl.orchestrator.samples import rollout_to_samples


def node(tokens, mask=None, logprobs=(), parent=None, sampled=False, role="user", content=""):
    return {
        "parent": parent,
        "token_ids": list(tokens),
        "mask": list(mask or [False] * len(tokens)),
        "logprobs": list(logprobs),
        "sampled": sampled,
        "message": {"role": role, "content": content},
        "semantic_parents": [],
    }


def assistant(scaffold, completion, logprobs, parent, content="x"):
    tokens = [*scaffold, *completion]
    return node(
        tokens, [False] * len(scaffold) + [True] * len(completion), logprobs, parent, True, "assistant", content
    )


def trace(nodes, reward=0.5, ok=True, errors=()):
    return {
        "id": "t1",
        "nodes": nodes,
        "calls": [],
        "errors": list(errors),
        "ok": ok,
        "stop_condition": None,
        "rewards": {"lcs_reward": {"score": reward, "weight": 1.0}},
        "metrics": {"exact_match": 0.0},
    }


def test_deltas_assemble_into_the_episode_the_reply_announces() -> None:
    assembly = EpisodeAssembly()
    first = node([1, 2])
    assembly.apply(unpack(pack({"trace": "t1", "open": {"id": "t1", "task": {}}, "nodes": [first]})))
    assembly.apply(
        {
            "trace": "t1",
            "nodes": [assistant([3], [4, 5], [-0.1, -0.2], 0)],
            "calls": [{"n": 1}],
            "set": {"ok": True, "rewards": {"r": {"score": 1.0, "weight": 1.0}}},
        }
    )
    assembly.apply({"trace": "gone", "open": {"id": "gone"}})
    assembly.apply({"trace": "gone", "discard": True})
    episode = assembly.finish({"head": {"id": "e", "errors": []}, "traces": [{"id": "t1", "nodes": 2, "calls": 1}]})
    assert episode["id"] == "e" and [t["id"] for t in episode["traces"]] == ["t1"]
    assert episode["traces"][0]["ok"] and len(episode["traces"][0]["nodes"]) == 2
    with pytest.raises(MalformedEpisode, match="assembled 2 nodes"):
        assembly.finish({"head": {}, "traces": [{"id": "t1", "nodes": 3, "calls": 1}]})
    with pytest.raises(MalformedEpisode, match="no header"):
        EpisodeAssembly().apply({"trace": "new", "nodes": []})
    with pytest.raises(ValueError, match="undecodable"):
        unpack(b"\xc1")


def test_a_single_turn_trace_is_one_sample_with_the_sampled_mask_and_logprobs() -> None:
    nodes = [node([10, 11]), node([12, 13], role="user"), assistant([14], [20, 21, 22], [-0.5, -0.25, -1.0], 1)]
    nodes[1]["parent"] = 0
    rollout = episode_to_rollout(
        {"traces": [trace(nodes)]}, rollout_index=2, policy_version=3, policy_version_end=4, generation_s=0.1
    )
    assert rollout.ok and rollout.reward == 0.5 and rollout.rollout_index == 2
    (turn,) = rollout.turns
    assert turn.prompt_token_ids == [10, 11, 12, 13, 14] and turn.completion_token_ids == [20, 21, 22]
    assert turn.completion_logprobs == [-0.5, -0.25, -1.0] and rollout.policy_versions == [3, 4]
    assert rollout.metrics == {"exact_match": 0.0, "lcs_reward": 0.5}
    assert [m["role"] for m in rollout.prompt] == ["user", "user"]
    (sample,) = rollout_to_samples(rollout, "interleaved", temperature=1.0)
    assert list(sample.token_ids) == [10, 11, 12, 13, 14, 20, 21, 22]
    assert list(sample.loss_mask) == [False] * 5 + [True] * 3
    assert list(sample.inference_logprobs)[5:] == [-0.5, -0.25, -1.0]


def test_a_multi_turn_trace_interleaves_and_a_branch_falls_back_to_one_sample_per_turn() -> None:
    nodes = [
        node([1, 2]),
        assistant([3], [4, 5], [-0.1, -0.2], 0),
        node([6, 7], parent=1),
        assistant([8], [9], [-0.3], 2),
    ]
    rollout = episode_to_rollout(
        {"traces": [trace(nodes)]}, rollout_index=0, policy_version=1, policy_version_end=1, generation_s=0.0
    )
    (sample,) = rollout_to_samples(rollout, "interleaved", temperature=1.0)
    assert list(sample.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert list(sample.loss_mask) == [False, False, False, True, True, False, False, False, True]
    # A second answer branching off the first prompt: turns that do not extend each other.
    nodes.append(assistant([3], [30], [-0.7], 0))
    branched = episode_to_rollout(
        {"traces": [trace(nodes)]}, rollout_index=0, policy_version=1, policy_version_end=1, generation_s=0.0
    )
    samples = rollout_to_samples(branched, "interleaved", temperature=1.0)
    assert len(samples) == 3 and list(samples[2].token_ids) == [1, 2, 3, 30]


def test_failed_empty_or_inconsistent_episodes_are_error_rollouts_or_refused() -> None:
    failed = episode_to_rollout(
        {"traces": [trace([node([1])], ok=False, errors=[{"type": "HarnessError", "message": "boom"}])]},
        rollout_index=0,
        policy_version=0,
        policy_version_end=0,
        generation_s=0.0,
    )
    assert not failed.ok and failed.error_type == "HarnessError" and failed.error == "boom"
    eval_like = episode_to_rollout(
        {"traces": [trace([node([1]), node([], [], [], 0, True, "assistant")])]},
        rollout_index=0,
        policy_version=0,
        policy_version_end=0,
        generation_s=0.0,
    )
    assert eval_like.error_type == "NoTokens"
    assert (
        episode_to_rollout(
            {"traces": []}, rollout_index=0, policy_version=0, policy_version_end=0, generation_s=0.0
        ).error_type
        == "EpisodeNotOk"
    )
    with pytest.raises(MalformedEpisode, match="logprobs"):
        trace_turns(trace([node([1]), assistant([2], [3, 4], [-0.1], 0)]), policy_version=0, policy_version_end=0)
    with pytest.raises(MalformedEpisode, match="parent"):
        trace_turns(trace([assistant([2], [3], [-0.1], 5)]), policy_version=0, policy_version_end=0)

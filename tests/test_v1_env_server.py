"""verifiers v1 environments through their own env server (`primerl.orchestrator.envs.v1_server`): the real
`verifiers.v1` env server in the v1 env venv (examples/reverse_text_v1) and a real primerl-infer on the tiny model.

Needs `.venv-envs-v1` with reverse-text-v1 installed (`make setup` builds it); skipped with that reason otherwise.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from difflib import SequenceMatcher
from pathlib import Path

import httpx
import pytest
from support.daemons import InferenceDaemon
from support.inference import AUTH, TOKEN, TOLERANCE, model_name

from primerl.orchestrator.envs.base import EnvRequestError, EnvWorkerDied
from primerl.orchestrator.envs.interpreters import find_v1_env_python, probe_env_python
from primerl.orchestrator.envs.v1_server import V1ServerConnection
from primerl.orchestrator.envs.v1_spec import V1EnvConfigError
from primerl.orchestrator.samples import rollout_to_samples
from primerl.orchestrator.trajectory import SamplingParams

pytestmark = pytest.mark.slow  # every test starts the v1 interpreter (~5-15 s each: verifiers.v1 imports)

ENV_ID = "reverse-text-v1"
SAMPLING = SamplingParams(temperature=1.0, max_tokens=12)


@pytest.fixture(scope="module")
def v1_python() -> str:
    python = find_v1_env_python()
    if python.source == "this_interpreter" or not Path(python.path).exists():
        pytest.skip(f"no verifiers v1 env venv ({python.path}): `make setup` creates .venv-envs-v1")
    if ENV_ID not in [env.id for env in probe_env_python(python.path).envs]:
        pytest.skip(f"{ENV_ID} is not installed in {python.path}: `make setup` installs it")
    return python.path


def lcs_ratio(reply: str, answer: str) -> float:
    """The classic reverse-text reward (examples/reverse_text), recomputed here."""
    return SequenceMatcher(None, " ".join(reply.split()).split(" "), answer.split(" "), autojunk=False).ratio()


def test_tasks_are_listed_on_the_orchestrator_side(v1_python: str) -> None:
    server = V1ServerConnection(
        v1_python, ENV_ID, {"num_examples": 50, "min_len": 3, "max_len": 4}, base_url="http://x"
    )
    tasks = server.tasks(10, 5)
    assert [task["idx"] for task in tasks] == list(range(10, 15))
    for task in tasks:
        letters = task["prompt"].split(" ")
        assert 3 <= len(letters) <= 4 and task["answer"] == " ".join(reversed(letters))
    evals = server.tasks(0, 3, taskset_args={"split": "eval"})
    assert [t["prompt"] for t in evals] != [t["prompt"] for t in server.tasks(0, 3)]


@pytest.mark.parametrize(
    "v1_config, names",
    [
        ({"agent": {"runtime": {"type": "prime"}}}, "agent.runtime"),
        ({"agent": {"harness": {"id": "bash"}}}, "agent.harness.id"),
    ],
)
def test_a_sandbox_or_an_installing_harness_is_refused_with_the_setting_to_change(
    v1_python: str, v1_config: dict, names: str
) -> None:
    server = V1ServerConnection(v1_python, ENV_ID, base_url="http://x", v1_config=v1_config, start_timeout_s=60)
    with pytest.raises(V1EnvConfigError, match=names.replace(".", r"\.")):
        server.start()
    assert not server.is_alive()
    with pytest.raises(V1EnvConfigError, match="num_examples"):
        V1ServerConnection(v1_python, ENV_ID, {"num_examples": 0}, base_url="http://x").tasks(0, 1)


def prefill(http: httpx.Client, token_ids: list[int]) -> list[float | None]:
    response = http.post(
        "/v1/completions",
        headers=AUTH,
        json={
            "model": model_name(http),
            "prompt": token_ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        },
    )
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"]
    return [None if entry is None else entry[str(token)]["logprob"] for entry, token in zip(entries, token_ids)]


@pytest.mark.vllm
def test_a_group_through_the_env_server_and_a_crash_mid_group(
    v1_python: str, infer_daemon: InferenceDaemon, infer_http: httpx.Client, tiny_model: Path
) -> None:
    versions = iter(range(100))
    server = V1ServerConnection(
        v1_python,
        ENV_ID,
        {"num_examples": 20},
        base_url=infer_daemon.url,
        api_key=TOKEN,
        renderer_model=str(tiny_model),
        policy_version_fn=lambda: next(versions),
        start_timeout_s=90,
        request_timeout_s=120,
        max_restarts=2,
    )
    model = model_name(infer_http)
    try:
        info = server.start()
        assert info.harnesses == {"agent": ENV_ID}
        task = server.tasks(3, 1)[0]
        group = server.submit_group(task, example_index=3, num_rollouts=6, model=model, sampling=SAMPLING).result(120)
        assert group.env_id == ENV_ID and group.example_index == 3 and len(group.rollouts) == 6
        worst = 0.0
        for rollout in group.rollouts:
            assert rollout.ok, (rollout.error_type, rollout.error)
            reply = rollout.completion[-1]["content"] or ""
            assert rollout.reward == pytest.approx(lcs_ratio(reply, task["answer"]))
            assert 0.0 <= rollout.reward <= 1.0 and "exact_match" in rollout.metrics
            assert rollout.policy_versions and all(v < 100 for v in rollout.policy_versions)
            (sample,) = rollout_to_samples(
                rollout, "interleaved", temperature=1.0, group_id=0, example_id=3, env_id=ENV_ID
            )
            assert 0 < sum(sample.loss_mask) <= SAMPLING.max_tokens
            reference = prefill(infer_http, list(sample.token_ids))
            for position, (loss, logprob) in enumerate(zip(sample.loss_mask, sample.inference_logprobs)):
                if loss:
                    worst = max(worst, abs(logprob - reference[position]))
        print(
            f"\nv1 group samples vs vLLM prefill: worst |logprob diff| {worst:.2e}; rewards "
            f"{[round(r.reward, 3) for r in group.rollouts]}; {group.roundtrip_s:.2f} s",
            file=sys.stderr,
        )
        assert worst <= TOLERANCE

        # The env server dies mid-group: the group fails with EnvWorkerDied (the runner reschedules it), the
        # server is restarted, the next group runs.
        pending = server.submit_group(
            task, example_index=3, num_rollouts=8, model=model, sampling=SamplingParams(temperature=1.0, max_tokens=64)
        )
        os.kill(server.pid, signal.SIGKILL)
        with pytest.raises(EnvWorkerDied, match="exited"):
            pending.result(30)
        assert server.num_pending() == 0
        server.ensure_alive()
        assert server.num_restarts == 1 and server.is_alive()
        again = asyncio.run(
            server.rollout(
                task, example_index=3, num_rollouts=2, model=model, sampling=SAMPLING, base_url=infer_daemon.url + "/v1"
            )
        )  # per group: same server here
        assert all(r.ok for r in again.rollouts)
        seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
        first, second = (
            server.submit_group(task, example_index=3, num_rollouts=2, model=model, sampling=seeded).result(60)
            for _ in range(2)
        )
        tokens = [[r.turns[0].completion_token_ids for r in g.rollouts] for g in (first, second)]
        assert tokens[0] == tokens[1] and tokens[0][0] != tokens[0][1]  # rollout i samples with seed + i

        # A stale group is cancelled in the server: its future fails with the classic client's "cancelled".
        stale = server.submit_group(
            task, example_index=3, num_rollouts=8, model=model, sampling=SamplingParams(temperature=1.0, max_tokens=64)
        )
        server.cancel(stale)
        with pytest.raises(EnvRequestError, match="cancelled"):
            stale.result(5)
        assert server.num_pending() == 0
        assert server.health()["success"] and server.is_alive()
        assert infer_daemon.process.poll() is None
    finally:
        server.close()
    assert not server.is_alive()


@pytest.mark.vllm
def test_a_multi_turn_harness_gives_samples_matching_a_prefill(
    v1_python: str, infer_daemon: InferenceDaemon, infer_http: httpx.Client, tiny_model: Path
) -> None:
    """Two chat turns per rollout. The second prompt re-renders the first answer: it extends the first turn's
    tokens (one interleaved sample) unless the untrained model's answer does not survive detokenizing and
    re-tokenizing (invalid UTF-8 pieces): then each turn is its own sample (the branching fallback)."""
    server = V1ServerConnection(
        v1_python,
        ENV_ID,
        {"num_examples": 5},
        base_url=infer_daemon.url,
        api_key=TOKEN,
        renderer_model=str(tiny_model),
        start_timeout_s=90,
        request_timeout_s=120,
        v1_config={"agent": {"harness": {"id": ENV_ID, "max_turns": 2}}},
    )
    try:
        server.start()
        group = server.submit_group(
            server.tasks(0, 1)[0], example_index=0, num_rollouts=3, model=model_name(infer_http), sampling=SAMPLING
        ).result(120)
    finally:
        server.close()
    for rollout in group.rollouts:
        assert rollout.ok, (rollout.error_type, rollout.error)
        first, second = rollout.turns
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        extends = (
            second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.completion_token_ids)]
            == first.prompt_token_ids + first.completion_token_ids
        )
        samples = rollout_to_samples(rollout, "interleaved", temperature=1.0)
        assert len(samples) == (1 if extends else 2)
        diffs = []
        for sample in samples:
            reference = prefill(infer_http, list(sample.token_ids))
            diffs += [
                abs(lp - reference[i])
                for i, (loss, lp) in enumerate(zip(sample.loss_mask, sample.inference_logprobs))
                if loss
            ]
        assert len(diffs) == len(first.completion_token_ids) + len(second.completion_token_ids)
        assert max(diffs) <= TOLERANCE

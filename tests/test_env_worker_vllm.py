"""Env workers against the real vLLM OpenAI server on the tiny model (slow): single- and multi-turn rollouts
whose tokens match the chat template, turned into training samples by the orchestrator's own path
(`primerl.orchestrator.samples.rollout_to_samples`), and a broken rubric that is counted while the worker serves on.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.env_workers import ENV_PYTHON, SKIP_REASON, make_worker
from support.probes import free_port

from primerl.orchestrator.envs.classic import ClassicEnvClient
from primerl.orchestrator.samples import rollout_to_samples
from primerl.orchestrator.trajectory import SamplingParams, Turn

pytestmark = pytest.mark.skipif(ENV_PYTHON is None, reason=SKIP_REASON)

START_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> Iterator[dict[str, Any]]:
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("vllm-env")
    model_dir = tiny_model
    port = free_port()
    env = {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(tmp),
    }
    log_path = tmp / "vllm.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--served-model-name",
                "tiny",
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "512",
                "--kv-cache-memory-bytes",
                str(256 * 2**20),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,
            start_new_session=True,
        )
    import httpx

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM server exited {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not ready in {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny", "model_dir": model_dir}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def check_turn_tokens(tokenizer: Any, turn: Turn, prompt_messages: list[dict[str, Any]]) -> None:
    """Logprobs align with the completion, and the prompt is what the chat template gives for the messages."""
    assert len(turn.completion_logprobs) == len(turn.completion_token_ids) == len(turn.completion_mask) > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in turn.completion_logprobs)
    assert set(turn.completion_mask) == {1}
    expected = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert turn.prompt_token_ids == list(expected)
    text = tokenizer.decode(turn.completion_token_ids, skip_special_tokens=True)
    # vLLM holds back a trailing incomplete UTF-8 sequence when a turn is cut at max_tokens
    assert text.rstrip("\ufffd") == turn.completion[0]["content"].rstrip("\ufffd")
    assert (turn.finish_reason == "length") == turn.is_truncated
    if turn.finish_reason == "stop":
        assert turn.completion_token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
@pytest.mark.vllm
def test_single_turn_rollouts_with_vllm(vllm_server: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server["model_dir"])
    with make_worker("reverse-text", {"num_examples": 64}) as worker:
        # No per-request seed: this bare vLLM server keeps chunked prefill on, and on CPU vLLM 0.32 crashes its
        # engine ("CPU Generator does not use offset") when a seeded request's prefill is split across steps,
        # which happens under this load (primerl-infer turns chunked prefill off on CPU, so seeds are safe there).
        sampling = SamplingParams(temperature=1.0, max_tokens=12)
        started = time.monotonic()
        groups = asyncio.run(_gather(worker, range(16), 8, vllm_server, sampling))
        elapsed = time.monotonic() - started
        rollouts = [r for g in groups for r in g.rollouts]
        assert len(rollouts) == 128 and all(r.ok for r in rollouts), [r.error for r in rollouts if not r.ok][:3]
        num_tokens = sum(r.num_completion_tokens for r in rollouts)
        print(
            f"\nsingle-turn: {len(rollouts)} rollouts, {num_tokens} completion tokens in {elapsed:.2f} s: "
            f"{len(rollouts) / elapsed:.1f} rollouts/s, {num_tokens / elapsed:.0f} tokens/s"
        )
        for group in groups:
            example = worker.examples("train", group.example_index, 1)[0]
            for rollout in group.rollouts:
                assert 0.0 <= rollout.reward <= 1.0 and rollout.metrics["exact_match"] in (0.0, 1.0)
                (turn,) = rollout.turns
                assert rollout.prompt == example.prompt
                check_turn_tokens(tokenizer, turn, example.prompt)
                (sample,) = rollout_to_samples(rollout, "interleaved", temperature=1.0)
                assert list(sample.token_ids) == turn.prompt_token_ids + turn.completion_token_ids
                assert sample.num_loss_tokens == len(turn.completion_token_ids)
        # the rollouts of a group are different samples
        assert all(len({tuple(r.turns[0].completion_token_ids) for r in g.rollouts}) > 1 for g in groups)


@pytest.mark.slow
@pytest.mark.vllm
def test_multi_turn_rollouts_with_vllm(vllm_server: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server["model_dir"])
    with make_worker("reverse-text-multiturn", {"num_examples": 64, "max_turns": 3}) as worker:
        sampling = SamplingParams(temperature=1.0, max_tokens=4)
        started = time.monotonic()
        groups = asyncio.run(_gather(worker, range(8), 8, vllm_server, sampling))
        elapsed = time.monotonic() - started
        rollouts = [r for g in groups for r in g.rollouts]
        assert all(r.ok for r in rollouts), [r.error for r in rollouts if not r.ok][:3]
        print(f"\nmulti-turn: {len(rollouts)} rollouts, {sum(len(r.turns) for r in rollouts)} turns in {elapsed:.2f} s")
        num_interleaved = 0
        for rollout in rollouts:
            assert 0.0 <= rollout.reward <= 1.0 and 1 <= len(rollout.turns) <= 3
            messages = list(rollout.prompt)
            for k, turn in enumerate(rollout.turns):
                check_turn_tokens(tokenizer, turn, messages)
                if k > 0:
                    previous = rollout.turns[k - 1]
                    so_far = previous.prompt_token_ids + previous.completion_token_ids
                    # The template re-renders the previous answer from its text: the prompt extends the tokens
                    # so far exactly when the sampled tokens re-encode to themselves (random tokens may not).
                    stable = tokenizer.encode(
                        tokenizer.decode(previous.completion_token_ids, skip_special_tokens=True)
                    ) == [
                        t for t in previous.completion_token_ids if t != tokenizer.convert_tokens_to_ids("<|im_end|>")
                    ]
                    if stable:
                        assert turn.prompt_token_ids[: len(so_far)] == so_far
                if k + 1 < len(rollout.turns):
                    messages = messages + turn.completion + [rollout.completion[2 * k + 1]]
            samples = rollout_to_samples(rollout, "interleaved", temperature=1.0)
            if len(samples) == 1 and len(rollout.turns) > 1:
                num_interleaved += 1
                (sample,) = samples
                last = rollout.turns[-1]
                assert list(sample.token_ids) == last.prompt_token_ids + last.completion_token_ids
                assert sample.num_loss_tokens == sum(len(t.completion_token_ids) for t in rollout.turns)
                assert len(sample.inference_logprobs) == len(sample.token_ids)
            branches = rollout_to_samples(rollout, "branching", temperature=1.0)
            assert [list(s.token_ids[len(t.prompt_token_ids) :]) for s, t in zip(branches, rollout.turns)] == [
                t.completion_token_ids for t in rollout.turns
            ]
        assert num_interleaved > 0, "no trajectory could be interleaved"


@pytest.mark.slow
@pytest.mark.vllm
def test_broken_rubric_with_vllm_is_counted_and_the_worker_keeps_serving(vllm_server: dict[str, Any]) -> None:
    with make_worker("broken_rubric_env", {"num_examples": 8}) as worker:
        group = worker.submit_rollout(
            0, num_rollouts=4, sampling=SamplingParams(max_tokens=8), **_server(vllm_server)
        ).result(120)
        assert group.num_errors == 4 and {r.error_type for r in group.rollouts} == {"ScoringError"}
        assert all(r.turns for r in group.rollouts)  # the tokens are there; only the score is broken
        assert worker.is_alive() and worker.ping()["env_id"] == "broken_rubric_env"


def _server(vllm_server: dict[str, Any]) -> dict[str, Any]:
    return {"base_url": vllm_server["base_url"], "model": vllm_server["model"]}


async def _gather(
    worker: ClassicEnvClient, indices: Any, group_size: int, vllm_server: dict[str, Any], sampling: SamplingParams
) -> list[Any]:
    return list(
        await asyncio.gather(
            *(worker.rollout(i, num_rollouts=group_size, sampling=sampling, **_server(vllm_server)) for i in indices)
        )
    )

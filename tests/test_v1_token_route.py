"""primerl-infer's token route for verifiers v1 environments (`primerl.inference.token_generate`): the real daemon on
the tiny model answers `POST /inference/v1/generate` behind the run token, with the policy-version headers and the
per-request seed, in the logprob shape renderers (verifiers 0.4's training client) parses; renderers' own
`generate` (run in the v1 env venv) accepts the answer, and its logprobs equal a vLLM prefill of the same tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.daemons import InferenceDaemon
from support.inference import AUTH, PROMPT, TOKEN, TOLERANCE, VERSION, VERSION_END, model_name, tokenize

from primerl.inference.http_middleware import DropSeedMiddleware, _pop_seed
from primerl.inference.token_generate import TOKEN_ROUTE, label_generate_answer
from primerl.orchestrator.envs.interpreters import find_v1_env_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RENDERERS_CLIENT = r"""
import asyncio, json, sys
from openai import AsyncOpenAI
from renderers import create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate

base_url, token, model_dir, model = sys.argv[1:5]

async def main():
    renderer = create_renderer(load_tokenizer(model_dir), None)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=token)
    results = []
    for seed in (7, 7, 8):
        result = await generate(client=client, renderer=renderer, model=model,
                                messages=[{"role": "user", "content": "reverse: a b c"}],
                                sampling_params={"max_tokens": 12, "temperature": 1.0, "seed": seed,
                                                 "ignore_eos": True})
        results.append({k: result[k] for k in ("prompt_ids", "completion_ids", "completion_logprobs")})
    await client.close()
    print(json.dumps(results))

asyncio.run(main())
"""


def v1_python() -> str:
    python = find_v1_env_python()
    if python.source == "this_interpreter" or not Path(python.path).exists():
        pytest.skip(f"no verifiers v1 env venv ({python.path}): `make setup` creates .venv-envs-v1")
    return python.path


def prefill_logprobs(http: httpx.Client, token_ids: list[int], start: int) -> list[float]:
    """vLLM's prompt logprobs of `token_ids[start:]` given what precedes each (one prefill)."""
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
    return [entries[i][str(token_ids[i])]["logprob"] for i in range(start, len(token_ids))]


def test_label_generate_answer_adds_the_token_field() -> None:
    answer = {
        "choices": [
            {
                "logprobs": {
                    "content": [{"token_id": 67, "logprob": -0.5, "top_logprobs": [{"token_id": 67, "logprob": -0.5}]}]
                }
            }
        ]
    }
    assert label_generate_answer(answer)
    entry = answer["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:67" and entry["token_id"] == 67
    assert entry["top_logprobs"][0]["token"] == "token_id:67"
    assert not label_generate_answer(answer)  # already labelled
    assert not label_generate_answer({"error": "x"}) and not label_generate_answer([1])


def test_the_seed_rule_covers_the_token_routes_sampling_params() -> None:
    assert TOKEN_ROUTE in DropSeedMiddleware.GENERATION_PATHS
    request = {"token_ids": [1], "sampling_params": {"seed": 3, "max_tokens": 2}}
    assert _pop_seed(request) and request == {"token_ids": [1], "sampling_params": {"max_tokens": 2}}
    assert not _pop_seed(request) and not _pop_seed([1])
    top_level = {"prompt": "x", "seed": 1}
    assert _pop_seed(top_level) and "seed" not in top_level


def test_token_route_serves_labelled_logprobs_behind_the_token(
    infer_daemon: InferenceDaemon, infer_http: httpx.Client
) -> None:
    prompt_ids = tokenize(infer_http, PROMPT)
    body = {
        "model": model_name(infer_http),
        "token_ids": prompt_ids,
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "logprobs": 1, "seed": 3, "ignore_eos": True},
    }
    assert infer_http.post(TOKEN_ROUTE, json=body).status_code == 401
    first = infer_http.post(TOKEN_ROUTE, headers=AUTH, json=body)
    assert first.status_code == 200, first.text
    assert first.headers[VERSION] == first.headers[VERSION_END] == "0"
    choice = first.json()["choices"][0]
    assert len(choice["token_ids"]) == 6
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    again = infer_http.post(TOKEN_ROUTE, headers=AUTH, json=body).json()["choices"][0]
    assert again["token_ids"] == choice["token_ids"]  # the per-request seed reached the sampler
    # The other scale-out routes stay removed.
    assert infer_http.post("/render", headers=AUTH, json={}).status_code == 404
    assert infer_http.post("/inference/v1/abort_requests", headers=AUTH, json={}).status_code == 404
    bad = infer_http.post(TOKEN_ROUTE, headers=AUTH, json={"model": model_name(infer_http), "token_ids": []})
    assert 400 <= bad.status_code < 500 and infer_daemon.process.poll() is None


def test_renderers_generate_accepts_the_answer_and_logprobs_match_a_prefill(
    infer_daemon: InferenceDaemon, infer_http: httpx.Client, tiny_model: Path
) -> None:
    python = v1_python()
    done = subprocess.run(
        [python, "-c", RENDERERS_CLIENT, infer_daemon.url, TOKEN, str(tiny_model), model_name(infer_http)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results[0]["completion_ids"] == results[1]["completion_ids"]  # same seed, same tokens
    worst = 0.0
    for result in results:
        assert len(result["completion_ids"]) == 12 == len(result["completion_logprobs"])
        tokens = result["prompt_ids"] + result["completion_ids"]
        reference = prefill_logprobs(infer_http, tokens, len(result["prompt_ids"]))
        worst = max(worst, *(abs(a - b) for a, b in zip(result["completion_logprobs"], reference)))
    print(f"\nrenderers generate vs vLLM prefill: worst |logprob diff| {worst:.2e}", file=sys.stderr)
    assert worst <= TOLERANCE

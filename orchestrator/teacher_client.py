"""One teacher request: the teacher's logprob of every token of a training sample, from an OpenAI-compatible
server that implements vLLM's ``prompt_logprobs`` (``primerl-infer`` with role teacher, or any vLLM server).

    POST {endpoint}/completions   (endpoint ends in /v1)
    {"model": ..., "prompt": [token ids of the sample], "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1}
    -> choices[0].prompt_logprobs: [null, {"<id of token 1>": {"logprob": ..., ...}}, ...]  (one entry per token)

``teacher_logprobs_from_answer`` turns the answer into the sample's ``teacher_logprobs``: entry i is the
teacher's log p(token i | tokens < i) where ``loss_mask[i]``, 0.0 at position 0 and at every other position.
An answer whose length, token ids or values do not fit the sample raises ``TeacherMismatch``.

Errors are typed (``TeacherError``; ``kind`` is the failure kind the orchestrator counts as
``rollout/errors/<kind>``), and say whether they can heal (``retryable``):

===================== ========= =======================================================================
kind                  retryable cause
===================== ========= =======================================================================
teacher_unreachable   yes       connection refused, reset or closed; HTTP 502/503 (or no endpoint listed
                                for ``timeout_s``: not retried, the wait was the retry)
teacher_timeout       yes       no answer within ``timeout_s``
teacher_refused       408/429/  any other HTTP error status (a 400 such as a too-long prompt is final)
                      500/504
teacher_mismatch      no        the answer does not fit the sample (length, token ids, non-finite values)
===================== ========= =======================================================================
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

TEACHER_BACKOFF_S = (0.5, 5.0)
"""First and longest pause of requests to a teacher endpoint that did not answer (doubling in between)."""
RETRYABLE_STATUS = frozenset({408, 429, 500, 504})
"""HTTP statuses (besides 502/503: unreachable) after which a teacher request is sent again."""
UNREACHABLE_STATUS = frozenset({502, 503})
MAX_ERROR_CHARS = 300


class TeacherError(RuntimeError):
    """A teacher request failed; ``kind`` names the failure (module docstring), ``retryable`` whether it can heal."""

    kind = "teacher_error"
    retryable = False


class TeacherUnreachable(TeacherError):
    kind = "teacher_unreachable"
    retryable = True


class TeacherTimeout(TeacherError):
    kind = "teacher_timeout"
    retryable = True


class TeacherRefused(TeacherError):
    kind = "teacher_refused"

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code
        self.retryable = status_code in RETRYABLE_STATUS


class TeacherMismatch(TeacherError):
    kind = "teacher_mismatch"


def endpoint_url(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` (with or without a trailing slash) -> ``.../v1``."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def teacher_request(token_ids: Sequence[int], model: str) -> dict[str, Any]:
    """The body that asks for the prompt logprobs of exactly ``token_ids``."""
    return {
        "model": model,
        "prompt": [int(t) for t in token_ids],
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 1.0,
    }


def _entry_logprob(entry: Any, token_id: int, position: int) -> float:
    if not isinstance(entry, dict):
        raise TeacherMismatch(f"prompt_logprobs[{position}] is {entry!r}, not a {{token_id: logprob}} map")
    value = entry.get(str(token_id), entry.get(token_id))  # type: ignore[call-overload]
    if value is None:
        raise TeacherMismatch(
            f"prompt_logprobs[{position}] holds tokens {sorted(entry)[:4]}, not the sample's token "
            f"{token_id}: the teacher scored other tokens (another tokenizer?)"
        )
    logprob = value.get("logprob") if isinstance(value, dict) else value
    try:
        logprob = float(logprob)
    except (TypeError, ValueError):
        raise TeacherMismatch(f"prompt_logprobs[{position}] logprob is {logprob!r}, not a number") from None
    if not math.isfinite(logprob):
        raise TeacherMismatch(f"prompt_logprobs[{position}] logprob is {logprob}: not finite")
    return logprob


def teacher_logprobs_from_answer(answer: Any, token_ids: Sequence[int], loss_mask: Sequence[bool]) -> list[float]:
    """The sample's ``teacher_logprobs`` from a ``/v1/completions`` answer (module docstring); ``TeacherMismatch``
    when the answer does not fit the sample."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise TeacherMismatch(f"the teacher's answer has no choices: {str(answer)[:MAX_ERROR_CHARS]}") from None
    prompt_logprobs = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(prompt_logprobs, list):
        raise TeacherMismatch(
            "the teacher's answer has no prompt_logprobs list: the teacher must be a vLLM server "
            "(primerl-infer) that supports prompt_logprobs"
        )
    if len(prompt_logprobs) != len(token_ids):
        raise TeacherMismatch(
            f"the teacher returned {len(prompt_logprobs)} prompt logprobs for a sample of {len(token_ids)} tokens"
        )
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and [int(t) for t in echoed] != [int(t) for t in token_ids]:
        raise TeacherMismatch("the teacher scored other token ids than the sample's (prompt_token_ids differ)")
    logprobs = [0.0] * len(token_ids)
    for position in range(1, len(token_ids)):
        if loss_mask[position]:
            logprobs[position] = _entry_logprob(prompt_logprobs[position], int(token_ids[position]), position)
    return logprobs


@dataclass(eq=False)
class TeacherEndpoint:
    """One teacher server and its request state (guarded by ``TeacherEndpoints``' lock)."""

    key: str  # the broker's worker id, or the base_url entry
    url: str  # ending in /v1
    model: str | None = None  # the served name, once known
    num_inflight: int = 0
    retry_at_s: float = 0.0
    backoff_s: float = 0.0
    down: bool = False  # an outage was logged and has not ended
    listed: bool = True


@dataclass
class TeacherEndpoints:
    """The teacher endpoints requests are spread over: the one with the fewest requests in flight among those not
    backing off (one that did not answer is paused ``TEACHER_BACKOFF_S``, doubling)."""

    endpoints: dict[str, TeacherEndpoint] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, urls: dict[str, str]) -> None:
        """The endpoints now listed (key -> url); one that left gets no more requests."""
        with self.lock:
            kept = {}
            for key, url in urls.items():
                endpoint = self.endpoints.get(key)
                if endpoint is None or endpoint.url != endpoint_url(url):
                    endpoint = TeacherEndpoint(key, endpoint_url(url))
                kept[key] = endpoint
            for key, endpoint in self.endpoints.items():
                if key not in kept:
                    endpoint.listed = False
            self.endpoints = kept

    def acquire(self, avoid: TeacherEndpoint | None = None) -> tuple[TeacherEndpoint | None, float]:
        """(endpoint, seconds to wait before using it); (None, 0) when none is listed. ``avoid`` (the endpoint that
        just failed) is taken only when it is the only one."""
        now_s = time.monotonic()
        with self.lock:
            candidates = [e for e in self.endpoints.values() if e is not avoid] or list(self.endpoints.values())
            if not candidates:
                return None, 0.0
            endpoint = min(candidates, key=lambda e: (max(e.retry_at_s, now_s), e.num_inflight))
            endpoint.num_inflight += 1
            return endpoint, max(0.0, endpoint.retry_at_s - now_s)

    def release(self, endpoint: TeacherEndpoint, error: TeacherError | None) -> tuple[bool, bool]:
        """The request on ``endpoint`` ended; returns (an outage began, an outage ended) for the log."""
        now_s = time.monotonic()
        with self.lock:
            endpoint.num_inflight -= 1
            if error is None:
                ended = endpoint.down
                endpoint.down = False
                endpoint.retry_at_s = endpoint.backoff_s = 0.0
                return False, ended
            if not error.retryable:
                return False, False
            if now_s >= endpoint.retry_at_s:  # one back-off step per probe, not per failure of a burst
                endpoint.backoff_s = min(max(TEACHER_BACKOFF_S[0], 2 * endpoint.backoff_s), TEACHER_BACKOFF_S[1])
                endpoint.retry_at_s = now_s + endpoint.backoff_s
            began = isinstance(error, TeacherUnreachable) and not endpoint.down
            endpoint.down = endpoint.down or began
            return began, False

    def unused(self, endpoint: TeacherEndpoint) -> None:
        """An endpoint taken by ``acquire`` was not used after all."""
        with self.lock:
            endpoint.num_inflight -= 1

    def num_inflight(self) -> int:
        with self.lock:
            return sum(e.num_inflight for e in self.endpoints.values())


class TeacherHttp:
    """The HTTP side: one pooled ``httpx.Client`` shared by the scoring threads (it is thread-safe)."""

    def __init__(self, *, api_key: str | None, timeout_s: float, max_connections: int):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self.client.request(method, url, json=body)
        except httpx.TimeoutException as exc:
            raise TeacherTimeout(f"teacher at {url} did not answer in time ({type(exc).__name__})") from None
        except (httpx.TransportError, OSError) as exc:  # refused, reset, closed mid-answer
            raise TeacherUnreachable(f"teacher at {url} could not be reached: {type(exc).__name__}: {exc}") from None
        except (httpx.HTTPError, httpx.InvalidURL, RuntimeError) as exc:  # e.g. a bad URL, the client closed
            raise TeacherError(f"teacher request to {url} failed: {type(exc).__name__}: {exc}") from None
        if response.status_code in UNREACHABLE_STATUS:
            raise TeacherUnreachable(
                f"teacher at {url} answered HTTP {response.status_code} (Service Unavailable): "
                f"{response.text[:MAX_ERROR_CHARS]}"
            )
        if response.status_code != 200:
            raise TeacherRefused(
                f"teacher at {url} answered HTTP {response.status_code}: {response.text[:MAX_ERROR_CHARS]}",
                response.status_code,
            )
        try:
            return response.json()
        except ValueError:
            raise TeacherMismatch(f"teacher at {url} answered no JSON: {response.text[:MAX_ERROR_CHARS]}") from None

    def served_model(self, endpoint: TeacherEndpoint) -> str:
        """The first model the endpoint lists (``GET /v1/models``), when ``teacher.model`` is unset."""
        answer = self._call("GET", f"{endpoint.url}/models")
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise TeacherMismatch(
                f"teacher at {endpoint.url} lists no model: {str(answer)[:MAX_ERROR_CHARS]}; set "
                "[orchestrator.teacher] model"
            ) from None

    def score(
        self, endpoint: TeacherEndpoint, model: str, token_ids: Sequence[int], loss_mask: Sequence[bool]
    ) -> list[float]:
        answer = self._call("POST", f"{endpoint.url}/completions", teacher_request(token_ids, model))
        return teacher_logprobs_from_answer(answer, token_ids, loss_mask)

    def close(self) -> None:
        self.client.close()


__all__ = [
    "RETRYABLE_STATUS",
    "TEACHER_BACKOFF_S",
    "TeacherEndpoint",
    "TeacherEndpoints",
    "TeacherError",
    "TeacherHttp",
    "TeacherMismatch",
    "TeacherRefused",
    "TeacherTimeout",
    "TeacherUnreachable",
    "endpoint_url",
    "teacher_logprobs_from_answer",
    "teacher_request",
]

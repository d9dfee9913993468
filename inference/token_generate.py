"""vLLM's token route, `POST /inference/v1/generate` (token ids in, token ids + logprobs out), as primerl-infer
serves it for verifiers v1 environments (verifiers 0.4's training client, through the `renderers` package).

vLLM registers the route only with `--enable-scale-out` (vllm 0.32), which also registers `/render`,
`/derender` and `/inference/v1/abort_requests`; the server keeps only `TOKEN_ROUTE` of those (its
`SERVED_PATHS`). On CPU the flag changes nothing else: the route's serving state is built either way.

The one incompatibility, fixed here rather than in either library: vLLM answers logprob entries in its default
`output_mode="tokens"` as ``{"token_id": 67, "logprob": -0.1, "top_logprobs": [{"token_id": 67, ...}]}``, while
`renderers.client` (0.1.x) requires ``"token": "token_id:67"`` on every entry and fails the whole rollout with
`MalformedGenerateResponseError` otherwise. `TokenLogprobsMiddleware` adds the ``token`` field (keeping
``token_id``) to every entry of a non-streaming JSON answer of that route; other routes and streaming answers
pass through untouched. Run-token auth, policy-version headers and the per-request seed rule
(`primerl.inference.http_middleware`) apply to this route like to the others.
"""

from __future__ import annotations

import json
from typing import Any

TOKEN_ROUTE = "/inference/v1/generate"
"""The token-in/token-out route verifiers v1 environments call (at the server root, not under /v1)."""

SCALE_OUT_FLAG = "--enable-scale-out"
"""The `vllm serve` flag that registers `TOKEN_ROUTE` (and the scale-out routes primerl-infer removes)."""

MAX_ANSWER_BYTES = 256 << 20
"""Answers larger than this pass through unrewritten (a logprob answer of a few thousand tokens is ~1 MB)."""


def token_label(token_id: int) -> str:
    """The ``token`` string renderers expects for a token id: ``token_id:<id>``."""
    return f"token_id:{token_id}"


def label_logprob_entry(entry: Any) -> Any:
    """One logprob entry with ``token`` added (``token_id`` kept); its top candidates likewise."""
    if not isinstance(entry, dict):
        return entry
    token_id = entry.get("token_id")
    if isinstance(token_id, int) and not isinstance(token_id, bool) and "token" not in entry:
        entry["token"] = token_label(token_id)
    top = entry.get("top_logprobs")
    if isinstance(top, list):
        entry["top_logprobs"] = [label_logprob_entry(candidate) for candidate in top]
    return entry


def label_generate_answer(answer: Any) -> bool:
    """Add ``token`` labels to every choice's logprob entries of a generate answer, in place; True when it
    changed anything."""
    changed = False
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return False
    for choice in answer["choices"]:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(content, list):
            continue
        for entry in content:
            had = isinstance(entry, dict) and "token" in entry
            label_logprob_entry(entry)
            changed |= isinstance(entry, dict) and not had and "token" in entry
    return changed


class TokenLogprobsMiddleware:
    """Pure ASGI: rewrites the non-streaming JSON answers of `TOKEN_ROUTE` with `label_generate_answer` (see the
    module docstring). Holds the response start until the body is complete, then fixes content-length."""

    def __init__(self, app: Any, max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.app = app
        self.max_answer_bytes = max_answer_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] != TOKEN_ROUTE:
            return await self.app(scope, receive, send)
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []
        size = 0
        passthrough = False

        async def send_labelled(message: dict[str, Any]) -> None:
            nonlocal start, size, passthrough
            if passthrough:
                return await send(message)
            if message["type"] == "http.response.start":
                content_type = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"")
                if not content_type.startswith(b"application/json"):
                    passthrough = True  # a streamed answer (text/event-stream): untouched
                    return await send(message)
                start = message
                return None
            if message["type"] != "http.response.body" or start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_answer_bytes:  # too big to hold: send what we have, unrewritten
                passthrough = True
                await send(start)
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"".join(chunks),
                        "more_body": message.get("more_body", False),
                    }
                )
                return None
            if message.get("more_body", False):
                return None
            await self._send_labelled(start, b"".join(chunks), send)

        await self.app(scope, receive, send_labelled)

    @staticmethod
    async def _send_labelled(start: dict[str, Any], body: bytes, send: Any) -> None:
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if label_generate_answer(answer):
            body = json.dumps(answer, separators=(",", ":")).encode()
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

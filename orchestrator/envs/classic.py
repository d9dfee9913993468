"""`ClassicEnvClient`: the orchestrator's side of a classic verifiers environment (verifiers 0.3,
`load_environment`). It starts `remote/classic_worker.py` with the environments' interpreter and talks to it over
JSON lines (the protocol: `primerl.proto.env_protocol`). Imports no verifiers.

    client = ClassicEnvClient("/path/.venv-envs/bin/python", "reverse-text", {"num_examples": 2000})
    info = client.start()                 # spawn, ping, load: EnvInfo
    examples = client.examples("eval", 0, 8)
    group = await client.rollout(0, num_rollouts=8, base_url="http://host:8000/v1", model="m",
                                 sampling=SamplingParams(temperature=1.0, max_tokens=64))
    client.close()

Several requests may be in flight at once (`submit_rollouts` hands many groups over in one write, each a
`concurrent.futures.Future`). Every request has a deadline; one that passes it fails with `EnvRequestTimeout` and
is cancelled in the worker. If the process dies, every pending request fails with `EnvWorkerDied`, whose message
holds the exit code and the last lines of the worker's stderr; `ensure_alive()` starts it again, up to
`max_restarts` times.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primerl.orchestrator.envs.base import (
    EnvRequestError,
    EnvRequestTimeout,
    EnvWorkerDied,
    EnvWorkerError,
    OneExampleCalls,
    RolloutRequest,
)
from primerl.orchestrator.envs.supervision import ChildProcess, PendingRequests, SupervisedChild
from primerl.orchestrator.trajectory import (
    EnvInfo,
    Example,
    RolloutGroup,
    Split,
    as_wire_sampling,
    parse_group,
)
from primerl.proto import telemetry
from primerl.proto.env_protocol import (
    OP_CANCEL,
    OP_EXAMPLES,
    OP_LOAD,
    OP_PING,
    OP_ROLLOUT,
    OP_SHUTDOWN,
    PROTOCOL_VERSION,
    request_line,
)
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.env")

WORKER_SCRIPT = Path(__file__).parent / "remote" / "classic_worker.py"
WATCHDOG_INTERVAL_S = 0.5


@dataclass
class _Pending:
    op: str
    future: concurrent.futures.Future
    deadline: float


class ClassicEnvClient(SupervisedChild, OneExampleCalls):
    """One classic env-worker process serving one environment (`env_id` with its `args`)."""

    def __init__(
        self,
        env_python: str | os.PathLike[str],
        env_id: str,
        args: Mapping[str, Any] | None = None,
        *,
        worker_script: str | os.PathLike[str] = WORKER_SCRIPT,
        start_timeout_s: float = 120.0,
        request_timeout_s: float = 1800.0,
        extra_env: Mapping[str, str] | None = None,
        max_restarts: int = 3,
        stderr_tail_lines: int = 40,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if start_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("start_timeout_s and request_timeout_s must be > 0")
        self.env_python = str(env_python)
        self.env_id = env_id
        self.args = dict(args or {})
        self.worker_script = str(worker_script)
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.extra_env = dict(extra_env or {})
        self.max_restarts = max_restarts
        self.cwd = str(cwd) if cwd is not None else None
        self.num_restarts = 0
        self.info: EnvInfo | None = None
        self._child = ChildProcess(
            f"env-{env_id}", stderr_tail_lines=stderr_tail_lines, on_stderr_line=self._log_stderr
        )
        self._pending: PendingRequests[int, _Pending] = PendingRequests()
        self._write_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        self._dead_reason: str | None = None

    # lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> EnvInfo:
        """Start the process, check the protocol version and load the environment."""
        if self._child.running():
            raise EnvWorkerError(f"env worker of {self.env_id!r} is already running")
        if not Path(self.env_python).exists():
            raise EnvWorkerDied(f"env python {self.env_python} does not exist: build the env venv (make setup)")
        self._closed.clear()
        self._dead_reason = None
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        process = self._child.spawn([self.env_python, self.worker_script], env=env, cwd=self.cwd)
        self._child.start_thread(self._read_stdout, "out")
        self._child.start_thread(self._watchdog, "watch")
        pong = self._call(OP_PING, {}, self.start_timeout_s)
        if pong.get("protocol_version") != PROTOCOL_VERSION:
            self.close()
            raise EnvWorkerError(
                f"env worker speaks protocol {pong.get('protocol_version')}, expected {PROTOCOL_VERSION}"
            )
        log.info("env worker started", env_id=self.env_id, pid=process.pid, python=self.env_python)
        return self.load()

    def load(self) -> EnvInfo:
        result = self._call(OP_LOAD, {"env_id": self.env_id, "args": self.args}, self.start_timeout_s)
        self.info = EnvInfo(**{k: result[k] for k in EnvInfo.__dataclass_fields__ if k in result})
        return self.info

    def is_alive(self) -> bool:
        return self._child.running() and self._dead_reason is None

    @property
    def pid(self) -> int | None:
        return self._child.pid

    @property
    def exit_code(self) -> int | None:
        """The process's exit code once it ended (None while it runs, or before ``start``)."""
        return self._child.exit_code

    def restart(self) -> EnvInfo:
        """Stop the process (pending requests fail with EnvWorkerDied) and start a new one. Logs
        ``restarting env worker`` with the old process's exit code (None: it was still running)."""
        old_pid, exit_code, reason = self.pid, self.exit_code, self._dead_reason
        self.close()
        self.num_restarts += 1
        log.warning(
            telemetry.RESTARTING_ENV_WORKER,
            env_id=self.env_id,
            num_restarts=self.num_restarts,
            max_restarts=self.max_restarts,
            pid=old_pid,
            exit_code=exit_code,
            reason=(reason or "").split("\n", 1)[0][:300],
        )
        return self.start()

    def ensure_alive(self) -> EnvInfo:
        """Restart a dead worker; raises EnvWorkerDied once `max_restarts` restarts are used up."""
        if self.is_alive() and self.info is not None:
            return self.info
        if self.num_restarts >= self.max_restarts:
            raise EnvWorkerDied(
                f"env worker of {self.env_id!r} died {self.num_restarts + 1} times; giving up. "
                f"Last: {self._dead_reason}"
            )
        return self.restart()

    def close(self, timeout_s: float = 10.0) -> int | None:
        """Ask the worker to exit, then terminate and kill it if needed (its own process group only). Returns its
        exit code."""
        if self._child.process is None:
            return None
        self._closed.set()
        polite = self._ask_to_exit if self._dead_reason is None else None
        code = self._child.stop(timeout_s, polite)
        self._pending.fail_all(EnvWorkerDied(f"env worker of {self.env_id!r} was closed"))
        return code

    def _ask_to_exit(self, process: subprocess.Popen[bytes]) -> None:
        try:
            self._send((next(self._ids), OP_SHUTDOWN, {}))
            if process.stdin is not None:
                process.stdin.close()
        except (EnvWorkerDied, OSError, ValueError):
            pass  # it is dying already: the signals that follow end it

    # requests ----------------------------------------------------------------------------------------------------
    def ping(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self._call(OP_PING, {}, timeout_s)

    def examples(self, split: Split = "train", start: int = 0, count: int = 1) -> list[Example]:
        result = self._call(OP_EXAMPLES, {"split": split, "start": start, "count": count}, self.request_timeout_s)
        return [Example(**example) for example in result["examples"]]

    def submit_groups(
        self, example_indices: Sequence[int], request: RolloutRequest
    ) -> list[concurrent.futures.Future[RolloutGroup]]:
        """`submit_rollout` for several examples at once: one group (request) each, all written to the worker in
        one write. The futures come back in the order of `example_indices`; each group's `roundtrip_s` is the
        time from this call to its answer."""
        timeout_s = request.timeout_s or self.request_timeout_s
        common = {
            "split": request.split,
            "num_rollouts": request.num_rollouts,
            "base_url": request.base_url,
            "api_key": request.api_key,
            "model": request.model,
            "sampling": as_wire_sampling(request.sampling),
            # the model calls time out a little after the request's deadline: the deadline (and cancel) come first
            "max_concurrent": request.max_concurrent or request.num_rollouts,
            "http_timeout_s": timeout_s + 5.0,
        }
        submitted_s = time.monotonic()
        raws = self._submit_many(OP_ROLLOUT, [{"example_index": i, **common} for i in example_indices], timeout_s)
        groups = []
        for raw in raws:
            group: concurrent.futures.Future[RolloutGroup] = concurrent.futures.Future()
            group.request_id = raw.request_id  # type: ignore[attr-defined]

            def convert(done: concurrent.futures.Future, group: concurrent.futures.Future = group) -> None:
                if group.cancelled():
                    return
                try:
                    result = parse_group(self.env_id, done.result())
                    group.set_result(dataclasses.replace(result, roundtrip_s=time.monotonic() - submitted_s))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter, not swallowed
                    group.set_exception(exc)

            raw.add_done_callback(convert)
            groups.append(group)
        return groups

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancel a submitted request in the worker (its future then fails with EnvRequestError "cancelled")."""
        request_id = getattr(future, "request_id", None)
        if request_id is not None and self.is_alive():
            try:
                self._send((next(self._ids), OP_CANCEL, {"target_id": request_id}))
            except EnvWorkerDied:
                pass

    def num_pending(self) -> int:
        return len(self._pending)

    # plumbing ----------------------------------------------------------------------------------------------------
    def _call(self, op: str, params: dict[str, Any], timeout_s: float) -> Any:
        future = self._submit_many(op, [params], timeout_s)[0]
        try:
            return future.result(timeout=timeout_s + 5.0)  # the watchdog fails it at the deadline already
        except concurrent.futures.TimeoutError:
            raise EnvRequestTimeout(
                f"{op} got no answer from the env worker of {self.env_id!r} in {timeout_s} s"
            ) from None

    def _submit_many(
        self, op: str, params_list: Sequence[dict[str, Any]], timeout_s: float
    ) -> list[concurrent.futures.Future]:
        """One request per params, written with one write; a failed write fails all of them (EnvWorkerDied)."""
        if self._dead_reason is not None or self._child.process is None:
            raise EnvWorkerDied(self._dead_reason or f"env worker of {self.env_id!r} is not started")
        futures, messages = [], []
        deadline = time.monotonic() + timeout_s
        for params in params_list:
            request_id = next(self._ids)
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.request_id = request_id  # type: ignore[attr-defined]
            self._pending.add(request_id, _Pending(op, future, deadline))
            futures.append(future)
            messages.append((request_id, op, params))
        try:
            self._send(*messages)
        except EnvWorkerDied as exc:
            for future in futures:
                self._pending.pop(future.request_id)
                future.set_exception(exc)
        return futures

    def _send(self, *requests: tuple[int, str, dict[str, Any]]) -> None:
        """Write ``(request id, op, params)`` requests to the worker in one write."""
        process = self._child.process
        data = "".join(request_line(*request) for request in requests).encode()
        try:
            with self._write_lock:
                assert process is not None and process.stdin is not None
                process.stdin.write(data)
                process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise EnvWorkerDied(self._death_message(f"writing to it failed ({exc})")) from exc

    def _read_stdout(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            try:
                message = json.loads(raw)
                request_id = message.get("id")
            except (ValueError, AttributeError):
                log.error(
                    "env worker sent a line that is not a protocol message",
                    env_id=self.env_id,
                    line=raw[:200].decode(errors="replace"),
                )
                continue
            pending = self._pending.pop(request_id) if request_id is not None else None
            if pending is None:
                if not message.get("ok", True):
                    log.warning("env worker reported an error", env_id=self.env_id, error=message.get("error"))
                continue
            if pending.future.done():
                continue
            if message.get("ok"):
                pending.future.set_result(message.get("result"))
            else:
                error = message.get("error") or {}
                pending.future.set_exception(EnvRequestError(str(error.get("type")), str(error.get("message"))))
        # EOF: the process is gone (or closing). Let the stderr reader catch its last words first.
        try:
            process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        if process is not self._child.process:
            return  # restarted meanwhile: close() failed this process's requests; the new one is not ours to fail
        self._child.join_stderr()
        if not self._closed.is_set():
            self._dead_reason = self._death_message("its stdout closed")
            log.error("env worker died", env_id=self.env_id, exit_code=process.returncode, reason=self._dead_reason)
        self._pending.fail_all(EnvWorkerDied(self._dead_reason or f"env worker of {self.env_id!r} was closed"))

    def _log_stderr(self, line: str) -> None:
        log.debug("env worker stderr", env_id=self.env_id, line=line)

    def _watchdog(self, process: subprocess.Popen[bytes]) -> None:
        while not self._closed.wait(WATCHDOG_INTERVAL_S):
            for rid, pending in self._pending.pop_expired():
                pending.future.set_exception(
                    EnvRequestTimeout(
                        f"{pending.op} request {rid} to the env worker of {self.env_id!r} passed its deadline"
                    )
                )
                if pending.op == OP_ROLLOUT and process.poll() is None:
                    try:
                        self._send((next(self._ids), OP_CANCEL, {"target_id": rid}))
                    except EnvWorkerDied:
                        pass
            if process.poll() is not None:
                return

    def _death_message(self, what: str) -> str:
        tail = self.stderr_tail() or "(no stderr)"
        return (
            f"env worker of {self.env_id!r} ({self.env_python}) is dead: {what}; exit code "
            f"{self._child.exit_code}. Last stderr:\n{tail}"
        )


__all__ = ["ClassicEnvClient", "WORKER_SCRIPT"]

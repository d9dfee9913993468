"""`V1ServerConnection`: the orchestrator's connection to one verifiers v1 env server. It starts and supervises
verifiers' own env server in the v1 env interpreter (`remote/v1_bootstrap.py serve`, verifiers 0.4) and drives it
over ZeroMQ + msgpack (`v1_wire`). Imports no verifiers; `v1.V1EnvClient` wraps it into an `EnvClient`.

    server = V1ServerConnection("/path/.venv-envs-v1/bin/python", "reverse-text-v1", {"num_examples": 2000},
                                base_url="http://host:8000", api_key=run_token, renderer_model="/path/model",
                                policy_version_fn=lambda: endpoints.policy_version)
    info = server.start()                              # spawn, load, bind, health: V1EnvInfo
    tasks = server.tasks(0, 8)                        # task data, listed from the taskset here (the server loads none)
    group = await server.rollout(tasks[0], example_index=0, num_rollouts=8, model="m", sampling=SamplingParams())
    server.close()

A group is N concurrent `run`s of the same task; each answer is one episode (deltas, then a reply) that
`v1_traces.episode_to_rollout` turns into a `Rollout` (token ids, sampled mask, logprobs, reward), so
`samples.rollout_to_samples` makes training samples of it like of a classic group. The env server calls the
inference server's token route itself (`/inference/v1/generate`, `primerl.inference.token_generate`) with the
run token, read from `API_KEY_VAR` in its environment. A run that fails in the server (its reply says so) is an
error rollout; if the server process dies, every pending group fails with `EnvWorkerDied` (the runner reschedules
the group) and `ensure_alive()` starts it again, up to `max_restarts` times. Configuration the environment cannot
run with here (a sandbox runtime, a built-in harness that installs its program at the first rollout) fails
`start()` with `V1EnvConfigError`, whose message names the setting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from primerl.orchestrator.envs.base import EnvRequestError, EnvRequestTimeout, EnvWorkerDied, EnvWorkerError
from primerl.orchestrator.envs.supervision import ChildProcess, PendingRequests, SupervisedChild
from primerl.orchestrator.envs.v1_spec import (
    API_KEY_VAR,
    BOOTSTRAP_SCRIPT,
    V1EnvInfo,
    V1EnvSpec,
    sampling_payload,
)
from primerl.orchestrator.envs.v1_traces import episode_to_rollout
from primerl.orchestrator.envs.v1_wire import (
    KIND_DELTA,
    KIND_REPLY,
    METHOD_CANCEL,
    METHOD_HEALTH,
    METHOD_RUN,
    EpisodeAssembly,
    MalformedEpisode,
    pack,
    unpack,
)
from primerl.orchestrator.trajectory import Rollout, RolloutGroup, SamplingParams
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.v1_env")

POLL_INTERVAL_MS = 20
WATCHDOG_INTERVAL_S = 0.5


@dataclass
class _Run:
    group: _Group
    rollout_index: int
    assembly: EpisodeAssembly = field(default_factory=EpisodeAssembly)

    @property
    def future(self) -> concurrent.futures.Future:
        return self.group.future

    @property
    def deadline(self) -> float:
        return self.group.deadline


@dataclass
class _Group:
    example_index: int
    num_rollouts: int
    future: concurrent.futures.Future
    deadline: float
    policy_version: int | None
    started_s: float
    request_ids: list[bytes] = field(default_factory=list)
    version_fn: Callable[[], int | None] | None = None  # the policy version at the reply
    rollouts: dict[int, Rollout] = field(default_factory=dict)


class V1ServerConnection(SupervisedChild):
    """One verifiers v1 env server process serving one environment (`env_id`, its taskset `args`)."""

    def __init__(
        self,
        env_python: str | os.PathLike[str],
        env_id: str,
        args: Mapping[str, Any] | None = None,
        *,
        base_url: str,
        api_key: str | None = None,
        renderer_model: str | None = None,
        v1_config: Mapping[str, Any] | None = None,
        policy_version_fn: Callable[[], int] | None = None,
        start_timeout_s: float = 120.0,
        request_timeout_s: float = 1800.0,
        max_restarts: int = 3,
        max_workers: int = 1,
        extra_env: Mapping[str, str] | None = None,
        stderr_tail_lines: int = 40,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if start_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("start_timeout_s and request_timeout_s must be > 0")
        self.spec = V1EnvSpec(
            str(env_python),
            env_id,
            dict(args or {}),
            dict(v1_config or {}),
            api_key,
            dict(extra_env or {}),
            str(cwd) if cwd is not None else None,
        )
        self.env_python = self.spec.env_python
        self.env_id = env_id
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.renderer_model = renderer_model
        self.policy_version_fn = policy_version_fn
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_restarts = max_restarts
        self.max_workers = max_workers
        self.num_restarts = 0
        self.info: V1EnvInfo | None = None
        self._child = ChildProcess(f"v1env-{env_id}", stderr_tail_lines=stderr_tail_lines)
        self._events: queue.Queue[dict] = queue.Queue()
        self._outbox: queue.Queue[list[bytes]] = queue.Queue()
        self._runs: PendingRequests[bytes, _Run] = PendingRequests()
        self._ids = itertools.count(1)
        self._closed = threading.Event()

    def tasks(self, start: int = 0, count: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
        """The taskset's task data (`V1EnvSpec.tasks`)."""
        return self.spec.tasks(start, count, **kwargs)

    # lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> V1EnvInfo:
        """Start the env server and wait until it has loaded the environment, bound and answered `health`."""
        if self._child.running():
            raise EnvWorkerError(f"v1 env server of {self.env_id!r} is already running")
        self.spec.check_python()
        self._closed.clear()
        self._events = queue.Queue()
        spec = {"env_config": self.spec.env_config(), "address": "tcp://127.0.0.1:0", "max_workers": self.max_workers}
        process = self._child.spawn(
            [self.env_python, str(BOOTSTRAP_SCRIPT), "serve"], env=self.spec.environ(), cwd=self.spec.cwd
        )
        assert process.stdin is not None
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()
        self._child.start_thread(self._read_stdout, "out")
        try:
            ready = self._wait_ready(process)
        except BaseException:
            self._closed.set()
            self._child.stop(0.0)
            raise
        self.info = V1EnvInfo(self.env_id, ready["address"], dict(ready.get("harnesses") or {}))
        address = ready["address"]
        self._child.start_thread(lambda process: self._io_loop(process, address), "io")
        self._child.start_thread(self._watchdog, "watch")
        self.health(timeout_s=min(30.0, self.start_timeout_s))
        log.info(
            "v1 env server ready",
            env_id=self.env_id,
            address=ready["address"],
            pid=process.pid,
            harnesses=self.info.harnesses,
        )
        return self.info

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> dict[str, Any]:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                if process.poll() is not None:
                    time.sleep(0.2)  # let the readers drain the last lines
                    if not self._events.empty():
                        continue
                    raise EnvWorkerDied(self._death_message(f"exited {process.returncode} while starting"))
                if time.monotonic() > deadline:
                    raise EnvWorkerDied(self._death_message(f"was not ready within {self.start_timeout_s:g} s"))
                continue
            self.spec.raise_error_event(event, self.stderr_tail())
            if event.get("event") == "ready" and isinstance(event.get("address"), str):
                return event

    def is_alive(self) -> bool:
        return self._child.running()

    @property
    def pid(self) -> int | None:
        return self._child.pid

    def ensure_alive(self) -> V1EnvInfo:
        """Restart the server if it died (up to `max_restarts` times in all); its info."""
        if self.is_alive() and self.info is not None:
            return self.info
        if self.num_restarts >= self.max_restarts:
            raise EnvWorkerDied(
                self._death_message(
                    f"died and was restarted {self.num_restarts} times already (max_restarts = {self.max_restarts})"
                )
            )
        self.num_restarts += 1
        log.warning(
            "restarting the v1 env server",
            env_id=self.env_id,
            restart=self.num_restarts,
            exit_code=self._child.exit_code,
        )
        self.close()
        return self.start()

    def close(self, timeout_s: float = 10.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); pending groups fail with EnvWorkerDied."""
        self._closed.set()
        code = self._child.stop(timeout_s)
        self._runs.fail_all(EnvWorkerDied(f"v1 env server of {self.env_id!r} was closed"))
        return code

    # requests ----------------------------------------------------------------------------------------------------
    def health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        request_id = self._new_id()
        group = _Group(-1, 0, future, time.monotonic() + timeout_s, None, time.monotonic(), [request_id])
        self._runs.add(request_id, _Run(group, -1))
        self._outbox.put([request_id, METHOD_HEALTH, pack({})])
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise EnvRequestTimeout(
                f"v1 env server of {self.env_id!r} did not answer health in {timeout_s} s"
            ) from None

    def submit_group(
        self,
        task_data: Mapping[str, Any],
        *,
        example_index: int,
        num_rollouts: int,
        model: str,
        sampling: SamplingParams,
        timeout_s: float | None = None,
        base_url: str | None = None,
        policy_version_fn: Callable[[], int | None] | None = None,
    ) -> concurrent.futures.Future:
        """Start `num_rollouts` concurrent runs of one task; a future of the `RolloutGroup`. `base_url` picks
        another inference server than the constructor's for this group (the env server builds a client per run);
        `policy_version_fn` (default: the constructor's) gives the versions at dispatch and at each reply."""
        if num_rollouts < 1:
            raise ValueError(f"num_rollouts must be >= 1, got {num_rollouts}")
        if not self.is_alive():
            raise EnvWorkerDied(self._death_message("is not running"))
        version_fn = policy_version_fn or self.policy_version_fn
        version = version_fn() if version_fn else None
        future: concurrent.futures.Future = concurrent.futures.Future()
        group = _Group(
            example_index,
            num_rollouts,
            future,
            time.monotonic() + (timeout_s or self.request_timeout_s),
            version,
            time.monotonic(),
            version_fn=version_fn,
        )
        inference_url = base_url.rstrip("/").removesuffix("/v1") if base_url else self.base_url
        client = {
            "type": "train",
            "base_url": inference_url + "/v1",
            "api_key_var": API_KEY_VAR,
            "headers": {},
            "renderer_model_name": self.renderer_model,
        }
        request = {
            "task_data": dict(task_data),
            "client": client,
            "model": model,
            "sampling": sampling_payload(sampling),
        }
        payloads = [pack(request)] * num_rollouts
        if sampling.seed is not None:  # rollout i samples with seed + i, as the classic env worker does (seeds.py)
            payloads = [
                pack({**request, "sampling": {**request["sampling"], "seed": sampling.seed + index}})
                for index in range(num_rollouts)
            ]
        for index in range(num_rollouts):
            request_id = self._new_id()
            group.request_ids.append(request_id)
            self._runs.add(request_id, _Run(group, index))
        for request_id, payload in zip(group.request_ids, payloads):
            self._outbox.put([request_id, METHOD_RUN, payload])
        return future

    async def rollout(self, task_data: Mapping[str, Any], **kwargs: Any) -> RolloutGroup:
        return await asyncio.wrap_future(self.submit_group(task_data, **kwargs))

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Cancel a group's runs in the server; the future fails with `EnvRequestError('cancelled', ...)`."""
        self._cancel_runs(future)
        if not future.done():
            future.set_exception(EnvRequestError("cancelled", "the group was cancelled"))

    def _cancel_runs(self, future: concurrent.futures.Future) -> None:
        for request_id, _ in self._runs.pop_where(lambda run: run.group.future is future):
            self._send_cancel(request_id)

    def _send_cancel(self, request_id: bytes) -> None:
        self._outbox.put([self._new_id(), METHOD_CANCEL, pack({"request_id": request_id.decode()})])

    def num_pending(self) -> int:
        return len(self._runs)

    def _new_id(self) -> bytes:
        return f"{os.getpid()}-{id(self):x}-{next(self._ids)}".encode()

    # IO ----------------------------------------------------------------------------------------------------------
    def _io_loop(self, process: subprocess.Popen[bytes], address: str) -> None:
        """Owns the DEALER socket: sends what `_outbox` holds, hands answers to `_on_answer`, expires deadlines."""
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        try:
            while not self._closed.is_set() and process.poll() is None:
                while True:
                    try:
                        socket.send_multipart(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if socket.poll(POLL_INTERVAL_MS):
                    while socket.poll(0):
                        self._on_answer(socket.recv_multipart())
                self._expire()
        except Exception as exc:  # the IO thread is dead: fail every pending group loudly, once
            log.exception("v1 env client IO thread failed", env_id=self.env_id)
            self._runs.fail_all(EnvWorkerDied(f"v1 env client of {self.env_id!r} failed: {exc!r}"))
        finally:
            socket.close(0)
            context.term()

    def _on_answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("v1 env server sent a malformed answer", env_id=self.env_id, num_frames=len(frames))
            return
        request_id, kind, data = frames
        run = self._runs.get(request_id)
        if run is None:
            return  # a cancelled or expired run's late answer
        try:
            payload = unpack(data)
            if kind == KIND_DELTA:
                run.assembly.apply(payload)
                return
            if kind != KIND_REPLY:
                raise MalformedEpisode(f"unknown answer kind {kind!r}")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._finish_run(request_id, run, None, f"MalformedEpisode: {exc}")
            return
        self._finish_run(request_id, run, payload, None)

    def _finish_run(self, request_id: bytes, run: _Run, reply: Any, failure: str | None) -> None:
        if self._runs.pop(request_id) is None:
            return
        group = run.group
        if group.num_rollouts == 0:  # health
            if not group.future.done():
                group.future.set_result(reply if isinstance(reply, dict) else {})
            return
        elapsed_s = time.monotonic() - group.started_s
        end_version = group.version_fn() if group.version_fn else None
        if failure is None and isinstance(reply, dict) and not reply.get("success", True):
            failure = str(reply.get("error") or "the env server reported a failed run")
        if failure is None:
            try:
                rollout = episode_to_rollout(
                    run.assembly.finish(reply),
                    rollout_index=run.rollout_index,
                    policy_version=group.policy_version,
                    policy_version_end=end_version,
                    generation_s=elapsed_s,
                )
            except (MalformedEpisode, ValueError, KeyError, TypeError) as exc:
                failure = f"MalformedEpisode: {exc}"
        if failure is not None:
            error_type, _, message = failure.partition(": ")
            rollout = Rollout(
                rollout_index=run.rollout_index,
                turns=[],
                reward=None,
                metrics={},
                is_truncated=False,
                stop_condition=None,
                error_type=error_type if message else "RunFailed",
                error=message or failure,
                prompt=[],
                completion=[],
                generation_s=elapsed_s,
            )
        group.rollouts[run.rollout_index] = rollout
        if len(group.rollouts) == group.num_rollouts and not group.future.done():
            group.future.set_result(
                RolloutGroup(
                    env_id=self.env_id,
                    split="train",
                    example_index=group.example_index,
                    rollouts=[group.rollouts[i] for i in range(group.num_rollouts)],
                    timings={"total_s": elapsed_s},
                    roundtrip_s=elapsed_s,
                )
            )

    def _expire(self) -> None:
        """Fail the groups past their deadline and cancel their runs in the server (all of a group's runs)."""
        expired = self._runs.pop_expired()
        for request_id, _ in expired:
            self._send_cancel(request_id)
        for group in {id(run.group): run.group for _, run in expired}.values():
            self._cancel_runs(group.future)  # runs of the group that are not expired yet, if any
            if not group.future.done():
                group.future.set_exception(
                    EnvRequestTimeout(
                        f"v1 env {self.env_id!r}: no answer within the request's deadline (cancelled in the server)"
                    )
                )

    def _read_stdout(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode("utf-8", "replace").strip()
            try:
                event = json.loads(line)
            except ValueError:
                self._child.note(line)
                continue
            if isinstance(event, dict) and "event" in event:
                self._events.put(event)

    def _watchdog(self, process: subprocess.Popen[bytes]) -> None:
        while not self._closed.wait(WATCHDOG_INTERVAL_S):
            if process.poll() is not None:
                self._child.join_stderr()  # the last lines
                message = self._death_message(f"exited with code {process.returncode}")
                log.error(
                    "v1 env server died", env_id=self.env_id, exit_code=process.returncode, pending=self.num_pending()
                )
                self._runs.fail_all(EnvWorkerDied(message))
                return

    def _death_message(self, what: str) -> str:
        tail = self._child.stderr_tail(last=10)
        message = f"v1 env server of {self.env_id!r} ({self.env_python}) {what}"
        return f"{message}; its last output:\n{tail}" if tail else message

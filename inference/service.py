"""The inference daemon: one vLLM HTTP server (`server.InferenceServer`) that joins primerl's mesh.

    service = InferenceService(config)
    address = await service.start()     # engine + HTTP up, registered with the broker, subscribed to weights
    code = await service.serve_until(stop_event)
    await service.stop(grace_s=10)

Threads: the caller's asyncio loop runs uvicorn and vLLM's ``AsyncLLM``; ``ControlClient``'s heartbeat thread
registers (again after a broker restart) and reports the served ``policy_version``, while the HTTP server keeps
serving through a broker outage; the weight thread (``update_thread.WeightUpdateThread``) owns the
``WeightSubscriber`` and applies updates (its docstring says how); a failure that leaves the engine in an unknown
state ends it, and the daemon reports it and exits 1.

A teacher (``config.role == "teacher"``, online distillation) is the same server with a fixed model: it registers
as ``ROLE_TEACHER`` (capability ``role=teacher``) and heartbeats like an inference worker, but has no weight
thread and no ``PolicyUpdater``: it never subscribes to the weight plane, serves no adapters, and its served
policy version stays 0 (its heartbeats carry none). Its HTTP server checks the run token the same way.

Gray failures: an ``EngineWatchdog`` (``engine_watchdog``) probes the engine core; unanswered for
``engine_stall_timeout_s`` it logs ``inference engine stalled``, ``/health`` answers
503 and every heartbeat says ``serving: false`` (the orchestrator then sends this worker nothing) until the engine
answers again (``inference engine recovered``). A weight update being applied does not count as a stall for up
to ``update_thread.UPDATE_BUSY_FACTOR`` times the longest of the last updates (at least one stall timeout; before
any update, and at most, 10 stall timeouts: ``engine_watchdog.BUSY_LIMIT_FACTOR``).

Metrics: vLLM's ``GET /metrics`` on the API port also carries primerl's ``primerl_inference_*`` families
(``primerl.inference.metrics``: served policy version, updates applied and refused, last update ms, generation
pause per update); its URL goes to the broker as the ``metrics_url`` capability.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.configs.inference import InferenceConfig
from primerl.inference.engine_ops import AsyncEngineOps, engine_max_lora_rank
from primerl.inference.engine_watchdog import EngineWatchdog
from primerl.inference.metrics import inference_families
from primerl.inference.server import InferenceServer, ServerAddress
from primerl.inference.update_thread import WeightUpdateThread
from primerl.proto import telemetry
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.process_ids import pid_alive

if TYPE_CHECKING:
    from primerl.client.control import ControlClient
    from primerl.inference.policy_updates import PolicyUpdater

log = get_logger("primerl.inference")

_MAX_WORK_DIR_BYTES = 60

WORK_DIR_PREFIX = "primerl-infer-"


def remove_stale_work_dirs(base: str | os.PathLike[str]) -> list[Path]:
    """Remove the work directories (``primerl-infer-<pid>-*``) under ``base`` whose daemon is dead (one killed
    before its `stop`); returns them. A directory whose pid is alive (maybe reused) is left alone."""
    removed = []
    for path in Path(base).glob(f"{WORK_DIR_PREFIX}*"):
        pid = path.name[len(WORK_DIR_PREFIX) :].split("-", 1)[0]
        if not path.is_dir() or not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        log.info("removed work directories of dead inference daemons", paths=[str(p) for p in removed])
    return removed


def _make_work_dir() -> Path:
    """A private directory for vLLM's IPC sockets and the LoRA adapters (removed at stop), named with this
    daemon's pid: the next daemon to start removes it if this one is killed. Unix socket paths are short, so it
    lives in the temp dir only when that path is short too."""
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) > _MAX_WORK_DIR_BYTES - 33:  # "/primerl-infer-<pid>-<8>/vllm"
        base = "/tmp"
    remove_stale_work_dirs(base)
    return Path(tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{os.getpid()}-", dir=base))


class InferenceService:
    """See the module docstring."""

    def __init__(
        self, config: InferenceConfig, *, work_dir: str | os.PathLike[str] | None = None, name: str | None = None
    ):
        self.config = config
        self.is_teacher = config.role == "teacher"
        self.name = name or f"{'teacher' if self.is_teacher else 'infer'}-{socket.gethostname()}-{os.getpid()}"
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir is not None else _make_work_dir()
        self.server = InferenceServer(config, version_fn=lambda: self.policy_version, work_dir=self.work_dir / "vllm")
        self.updater: PolicyUpdater | None = None
        self.ops: AsyncEngineOps | None = None
        self.control: ControlClient | None = None
        self.address: ServerAddress | None = None
        self.stopped_by_broker = False  # serve_until returned because the broker ended the run
        self.metrics = inference_families()
        self._stop = threading.Event()
        self._weights: WeightUpdateThread | None = None  # a teacher has none
        self._loop: asyncio.AbstractEventLoop | None = None
        # Joining: the version current at the broker when this worker registered, and when it registered.
        self._join_target: int | None = None
        self._registered_s = 0.0
        # Gray failures: the engine watchdog's task, and why the engine cannot serve now (None: it can).
        self.watchdog: EngineWatchdog | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._watchdog_stop: asyncio.Event | None = None
        self.stalled_reason: str | None = None

    @property
    def policy_version(self) -> int:
        return 0 if self.updater is None else self.updater.policy_version

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, health_timeout_s: float = 60.0) -> ServerAddress:
        """Start the engine and HTTP server, register with the broker, start heartbeats and the weight thread (a
        teacher: no weight thread).

        Raises (after stopping what started) when the engine cannot start or the broker cannot be reached
        within `config.broker.connect_timeout_s`."""
        from primerl.client.control import ControlClient
        from primerl.inference.policy_updates import PolicyUpdater

        self._loop = asyncio.get_running_loop()
        try:
            self.address = await self.server.start()
            await self.server.wait_healthy(health_timeout_s)
            engine = self.server.engine
            if not self.is_teacher:  # a teacher's weights never change: nothing to apply updates with
                self.ops = AsyncEngineOps(engine, self._loop)
                # The digest is checked here too (the broker forwards chunks before it has checked it), over the
                # digest the subscriber computed as the chunks arrived: no pass of its own over the payload.
                self.updater = PolicyUpdater(
                    self.ops, self.work_dir / "policy", max_lora_rank=engine_max_lora_rank(engine.vllm_config)
                )
                # Reads the weight manifest (and the worker's host copy) now rather than during the first update.
                await asyncio.to_thread(self.updater.prepare)
            self.metrics.policy_version.set(self.policy_version)
            self.metrics.engine_stalled.set(0)
            capabilities = {
                "role": self.config.role,
                "lora": str(self.config.enable_lora).lower(),
                "max_lora_rank": str(engine_max_lora_rank(engine.vllm_config) or 0),
                "dtype": str(engine.model_config.dtype).removeprefix("torch."),
                "model": self.server.served_model_name,
                "pause_mode": self.server.pause_mode,
                "metrics_url": f"{self.address.advertised_url}/metrics",
            }
            # Registered: the URL other machines dial (server.advertise_host), not the one this machine would.
            self.control = ControlClient(
                self.config.broker,
                self.config.role,
                self.name,
                address=self.address.advertised_url,
                capabilities=capabilities,
                rpc_timeout_s=5.0,
            )
            await asyncio.to_thread(self.control.wait_ready)
            registration = await asyncio.to_thread(self.control.register)
            bind_context(run_id=registration.run_id, policy_version=self.policy_version)
            if not self.is_teacher:  # a teacher serves its own model: it has no policy version to catch up to
                self._registered_s, self._join_target = time.monotonic(), registration.latest_policy_version
                self._check_caught_up()
            self._start_watchdog(engine)
            self.control.start_heartbeats(self._progress)
            if self.updater is not None and self.ops is not None:
                self._weights = WeightUpdateThread(
                    self.config,
                    self.control,
                    self.updater,
                    self.ops,
                    self.server,
                    self.metrics,
                    stop=self._stop,
                    on_applied=self._check_caught_up,
                )
                self._weights.start()
        except BaseException:
            await self.stop(grace_s=2.0)
            raise
        log.info(
            "teacher ready" if self.is_teacher else "inference worker ready",
            url=self.address.advertised_url,
            worker_id=self.control.worker_id,
            **({"model": capabilities["model"]} if self.is_teacher else {}),
            metrics_url=capabilities["metrics_url"],
            start_s=round(self.server.start_s or 0.0, 1),
        )
        return self.address

    async def serve_until(self, stop_event: asyncio.Event, check_interval_s: float = 0.5) -> int:
        """Serve until `stop_event` is set (0), the broker asks this worker to shut down (0), or the engine, the
        HTTP server or the weight thread fails (1)."""
        while True:
            with_timeout = asyncio.wait_for(stop_event.wait(), check_interval_s)
            try:
                await with_timeout
                return 0
            except asyncio.TimeoutError:
                pass
            weights = self._weights
            problem = (weights.fatal_error if weights is not None else None) or self.server.check_running()
            if problem is None and self.control is not None and self.control.broker_lost.is_set():
                problem = self.control.broker_lost_error
            if problem is None and weights is not None and not weights.is_alive():
                problem = "the weight-update thread stopped"
            if problem is not None:
                log.error("inference worker cannot go on; stopping", error=problem)
                if self.control is not None:
                    self.control.report_error(problem)
                return 1
            if self.control is not None and self.control.shutdown_requested.is_set():
                log.info("stopping: the broker asked this worker to shut down", policy_version=self.policy_version)
                self.stopped_by_broker = True
                return 0

    async def stop(self, grace_s: float = 10.0) -> None:
        """Deregister, stop the weight thread and heartbeats, stop HTTP and the engine. Bounded: about
        `grace_s` + 15 s at worst (broker unreachable, requests that do not finish)."""
        self._stop.set()
        await self._stop_watchdog()
        if self.ops is not None:
            self.ops.cancel_pending()  # an update being applied stops waiting on the engine now
        if self.control is not None:
            await asyncio.to_thread(self.control.deregister, "stopped")
        if self._weights is not None:
            # An update being applied needs the event loop, which is free while this thread waits.
            await asyncio.to_thread(self._weights.join, 10.0)
            if self._weights.is_alive():
                log.warning("the weight thread did not stop within 10 s")
        if self.control is not None:
            await asyncio.to_thread(self.control.close, 5.0)
        await self.server.stop(grace_s)
        if self.updater is not None:
            self.updater.close()  # the shared payload file
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        # the version bound to the log context at start may be stale here (updates bind it in their own task)
        log.info(
            "teacher stopped" if self.is_teacher else "inference worker stopped", policy_version=self.policy_version
        )

    def _progress(self) -> dict[str, Any]:
        # A teacher reports no policy version: it serves no policy (the broker and `primerl status` show it frozen).
        progress: dict[str, Any] = {} if self.is_teacher else {"policy_version": self.policy_version}
        engine = self.server.engine
        if engine is not None:
            progress["num_inflight"] = engine.get_num_unfinished_requests()
        reason = self.stalled_reason
        if reason is not None:  # state, sent with every heartbeat while it holds (the broker keeps the latest)
            progress["not_serving"] = reason
        return progress

    # ---- gray failures (event loop) ------------------------------------------------------------------------------
    def _start_watchdog(self, engine: Any) -> None:
        timeout_s = self.config.engine_stall_timeout_s
        if not timeout_s:
            log.info("engine watchdog off (engine_stall_timeout_s = 0)")
            return
        self.watchdog = EngineWatchdog(
            engine.is_sleeping,
            stall_timeout_s=timeout_s,
            on_change=self._engine_stall_changed,
            busy=self._is_busy,
            busy_limit=self._busy_limit_s,
        )
        self.server.stalled_fn = lambda: self.stalled_reason
        self._watchdog_stop = asyncio.Event()
        self._watchdog_task = asyncio.get_running_loop().create_task(
            self.watchdog.run(self._watchdog_stop), name="engine-watchdog"
        )

    def _is_busy(self) -> float | None:
        return None if self._weights is None else self._weights.update_began_s

    def _busy_limit_s(self) -> float | None:
        if self._weights is None or self.watchdog is None:
            return None
        return self._weights.busy_limit_s(self.watchdog.stall_timeout_s)

    async def _stop_watchdog(self) -> None:
        if self._watchdog_task is None or self._watchdog_stop is None:
            return
        self._watchdog_stop.set()
        try:
            await asyncio.wait_for(self._watchdog_task, 5.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._watchdog_task.cancel()
        except Exception:
            log.exception("the engine watchdog failed")
        self._watchdog_task = None

    def _engine_stall_changed(self, stalled: bool, seconds: float) -> None:
        """The watchdog's transitions: out of rotation (heartbeats, /health) while stalled, back when it answers."""
        assert self.watchdog is not None
        engine = self.server.engine
        num_inflight = engine.get_num_unfinished_requests() if engine is not None else 0
        if stalled:
            self.stalled_reason = (
                f"{telemetry.INFERENCE_ENGINE_STALLED}: the engine core did not answer a probe for {seconds:.1f} s "
                f"(engine_stall_timeout_s = {self.watchdog.stall_timeout_s:g}); {num_inflight} requests in flight"
            )
            self.metrics.engine_stalled.set(1)
            self.metrics.engine_stalls.inc()
            log.warning(
                telemetry.INFERENCE_ENGINE_STALLED,
                unanswered_s=round(seconds, 1),
                engine_stall_timeout_s=self.watchdog.stall_timeout_s,
                num_inflight=num_inflight,
                hint="out of rotation until the engine answers again; if it never does, restart this worker",
            )
        else:
            self.stalled_reason = None
            self.metrics.engine_stalled.set(0)
            log.info(telemetry.INFERENCE_ENGINE_RECOVERED, stalled_s=round(seconds, 1), num_inflight=num_inflight)

    def _check_caught_up(self) -> None:
        """Once: this worker serves the version that was current when it registered (log ``inference worker
        caught up`` with ``join_to_serving_s``, and the ``primerl_inference_join_to_serving_seconds`` gauge). The
        orchestrator sends it rollouts from then on."""
        if self._join_target is None or self.policy_version < self._join_target:
            return
        seconds = time.monotonic() - self._registered_s
        self.metrics.join_to_serving_s.set(seconds)
        log.info(
            telemetry.INFERENCE_WORKER_CAUGHT_UP,
            policy_version=self.policy_version,
            current_version=self._join_target,
            join_to_serving_s=round(seconds, 3),
        )
        self._join_target = None

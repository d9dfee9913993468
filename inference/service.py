"""The inference daemon: one vLLM HTTP server (`server.InferenceServer`) that joins primerl's mesh.

    service = InferenceService(config)
    address = await service.start()     # engine + HTTP up, registered with the broker, subscribed to weights
    code = await service.serve_until(stop_event)
    await service.stop(grace_s=10)

Threads: the caller's asyncio loop runs uvicorn and vLLM's ``AsyncLLM``; ``ControlClient``'s heartbeat thread
registers (again after a broker restart) and reports the served ``policy_version``, while the HTTP server keeps
serving through a broker outage; the weight thread owns the ``WeightSubscriber`` (ZMQ sockets are single-threaded)
and applies updates with ``PolicyUpdater``, whose engine calls are handed to the event loop and waited for with a
timeout. After a re-registration it subscribes under the new id and says HELLO with the version it serves.

An update: ``PolicyUpdater.preload`` (checks, waits for the staged load) -> pause generation -> ``apply`` -> point
the served policy name at the new adapter (LoRA) -> resume; then WEIGHT_ACK with ``apply_ms`` (from the update's
arrival to the resume). Pause to resume is the update's generation pause (``update_pause_ms``, logged with
``weight update live``). ``pause_mode`` is "keep" on GPUs (in-flight requests continue on the new weights) and
"wait" on CPU (they finish first: keep-mode pauses crash the CPU engine on requests with a per-request seed). A
refused update (``UpdateRefused``) is acknowledged with its error and the previous version keeps serving; any other
failure leaves the engine in an unknown state: the daemon reports it and exits 1.

A teacher (``config.role == "teacher"``, online distillation) is the same server with a fixed model: it registers
as ``ROLE_TEACHER`` (capability ``role=teacher``) and heartbeats like an inference worker, but has no weight
thread and no ``PolicyUpdater``: it never subscribes to the weight plane, serves no adapters, and its served
policy version stays 0 (its heartbeats carry none). Its HTTP server checks the run token the same way.

Gray failures: an ``EngineWatchdog`` (``engine_watchdog``) probes the engine core; unanswered for
``engine_stall_timeout_s`` it logs ``inference engine stalled``, ``/health`` answers
503 and every heartbeat says ``serving: false`` (the orchestrator then sends this worker nothing) until the engine
answers again (``inference engine recovered``). A weight update being applied does not count as a stall for up
to ``UPDATE_BUSY_FACTOR`` times the longest of the last updates (at least one stall timeout; before any update,
and at most, 10 stall timeouts: ``engine_watchdog.BUSY_LIMIT_FACTOR``).

Metrics: vLLM's ``GET /metrics`` on the API port also carries primerl's ``primerl_inference_*`` families
(``primerl.inference.metrics``: served policy version, updates applied and refused, last update ms, generation
pause per update); its URL goes to the broker as the ``metrics_url`` capability.
"""

from __future__ import annotations

import asyncio
import collections
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.configs.inference import InferenceConfig
from primerl.inference.engine_ops import AsyncEngineOps, EngineCallCancelled, EngineCallTimeout
from primerl.inference.engine_watchdog import EngineWatchdog
from primerl.inference.metrics import inference_families
from primerl.inference.server import InferenceServer, ServerAddress
from primerl.proto import telemetry
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.process_ids import pid_alive

if TYPE_CHECKING:
    from primerl.client.control import ControlClient
    from primerl.client.weights import WeightSubscriber
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.proto.v1 import data_pb2

log = get_logger("primerl.inference")

DRAIN_TIMEOUT_S = 120.0
"""Longest wait for in-flight requests to finish before an update in "wait" pause mode; the update is then
refused (the broker sends it again)."""
_REFUSED = object()
"""What `InferenceService._in_engine` returns for an update it refused."""
UPDATE_BUSY_FACTOR = 4.0
UPDATE_BUSY_HISTORY = 16
"""An update holding the engine counts as a stall past ``UPDATE_BUSY_FACTOR`` x the longest of the last
``UPDATE_BUSY_HISTORY`` updates (at least one stall timeout): an engine stopped in the middle of an update is found
within a few update times, not after 10 stall timeouts (44 s at a 4 s timeout in the chaos run)."""
RECEIVE_POLL_S = 0.5
MAX_REMEMBERED_REFUSALS = 16
BROKER_ERROR_BACKOFF_S = 5.0
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
        self.server = InferenceServer(config, version_fn=self._policy_version, work_dir=self.work_dir / "vllm")
        self.updater: PolicyUpdater | None = None
        self.ops: AsyncEngineOps | None = None
        self.control: ControlClient | None = None
        self.address: ServerAddress | None = None
        self.fatal_error: str | None = None
        self.stopped_by_broker = False  # serve_until returned because the broker ended the run
        self.num_updates_applied = 0
        self.num_updates_refused = 0
        self.metrics = inference_families()
        self._served_adapter_name: str | None = None
        self._refused: collections.OrderedDict[tuple[int, str], Any] = collections.OrderedDict()
        self._stop = threading.Event()
        self._weights_thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Joining: the version current at the broker when this worker registered, and when it registered.
        self._join_target: int | None = None
        self._registered_s = 0.0
        # Gray failures: the engine watchdog's task, and why the engine cannot serve now (None: it can).
        self.watchdog: EngineWatchdog | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._watchdog_stop: asyncio.Event | None = None
        self.stalled_reason: str | None = None
        # when the weight thread began applying the update under way (it holds the engine core: not a stall)
        self._update_began_s: float | None = None
        self._update_seconds: collections.deque[float] = collections.deque(maxlen=UPDATE_BUSY_HISTORY)

    def _policy_version(self) -> int:
        return 0 if self.updater is None else self.updater.policy_version

    @property
    def policy_version(self) -> int:
        return self._policy_version()

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, health_timeout_s: float = 60.0) -> ServerAddress:
        """Start the engine and HTTP server, register with the broker, start heartbeats and the weight thread (a
        teacher: no weight thread).

        Raises (after stopping what started) when the engine cannot start or the broker cannot be reached
        within `config.broker.connect_timeout_s`."""
        from primerl.client.control import ControlClient
        from primerl.inference.policy_updates import PolicyUpdater, engine_max_lora_rank

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
            if not self.is_teacher:
                self._weights_thread = threading.Thread(target=self._weights_loop, name="weights", daemon=True)
                self._weights_thread.start()
        except BaseException:
            await self.stop(grace_s=2.0)
            raise
        if self.is_teacher:
            log.info(
                "teacher ready",
                url=self.address.advertised_url,
                worker_id=self.control.worker_id,
                model=capabilities["model"],
                metrics_url=capabilities["metrics_url"],
                start_s=round(self.server.start_s or 0.0, 1),
            )
        else:
            log.info(
                "inference worker ready",
                url=self.address.advertised_url,
                worker_id=self.control.worker_id,
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
            problem = self.fatal_error or self.server.check_running()
            if problem is None and self.control is not None and self.control.broker_lost.is_set():
                problem = self.control.broker_lost_error
            if problem is None and self._weights_thread is not None and not self._weights_thread.is_alive():
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
        if self._weights_thread is not None:
            # Wakes within RECEIVE_POLL_S, or 5 s when blocked sending to an absent broker; an update being
            # applied needs the event loop, which is free while this thread waits.
            await asyncio.to_thread(self._weights_thread.join, 10.0)
            if self._weights_thread.is_alive():
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
        return self._update_began_s

    def _busy_limit_s(self) -> float | None:
        """How long an update may hold the engine before its silence counts: a few times the longest of the
        last updates, at least one stall timeout; None before the first (the watchdog's own bound)."""
        if not self._update_seconds or self.watchdog is None:
            return None
        return max(self.watchdog.stall_timeout_s, UPDATE_BUSY_FACTOR * max(self._update_seconds))

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

    # ---- weight updates (weight thread) -------------------------------------------------------------------------
    def _weights_loop(self) -> None:
        from primerl.client.outage import BrokerOutageExceeded
        from primerl.client.weights import WeightPlaneError, WeightSubscriber

        subscriber: WeightSubscriber | None = None
        unreachable_logged = False
        try:
            while not self._stop.is_set():
                assert self.control is not None
                worker_id, registration = self.control.worker_id, self.control.registration
                if worker_id is None or registration is None:  # re-registering
                    self._stop.wait(0.2)
                    continue
                if (
                    subscriber is None
                    or subscriber.worker_id != worker_id
                    or subscriber.endpoint != registration.weight_endpoint
                ):
                    if subscriber is not None:
                        log.info(
                            "registered again: resubscribing to weights",
                            worker_id=worker_id,
                            policy_version=self.policy_version,
                        )
                        subscriber.close()
                    # Chunked updates are written straight into the updater's shared payload files: the engine's
                    # worker reads them there, with no further copy, and loads a FULL update as its chunks arrive.
                    subscriber = WeightSubscriber(
                        registration.weight_endpoint,
                        self.config.broker.run_token,
                        worker_id,
                        payload_sink=self.updater,
                        outage_s=self.config.broker.outage_s,
                        limits=self.control.limits.frames,
                        curve=self.control.curve,
                        relay_host=self.config.weight_relay_host,
                    )
                    try:
                        subscriber.hello(self.policy_version, lineage=self.updater.lineage)
                    except TimeoutError:
                        pass  # the broker is away: receive() says HELLO again every few seconds
                try:
                    update = subscriber.receive(RECEIVE_POLL_S)
                    unreachable_logged = False
                except TimeoutError as exc:  # could not send HELLO or ACK: the broker is away
                    if not unreachable_logged:
                        log.warning("weight plane unreachable; retrying", error=str(exc))
                        unreachable_logged = True
                    continue
                except BrokerOutageExceeded as exc:  # past broker.outage_s: one clear line, then exit non-zero
                    self.fatal_error = str(exc)
                    return
                except WeightPlaneError as exc:  # e.g. UNAUTHENTICATED: will not heal by itself
                    log.error("the broker's weight plane refused this worker", error=str(exc))
                    self.control.report_error(f"weight plane: {exc}")
                    subscriber.close()
                    subscriber = None
                    self._stop.wait(BROKER_ERROR_BACKOFF_S)
                    continue
                if update is not None:
                    # the engine core is held by the update: no stall (engine watchdog)
                    self._update_began_s = began_s = time.monotonic()
                    try:
                        self._handle_update(subscriber, *update)
                    finally:
                        self._update_began_s = None
                        self._update_seconds.append(time.monotonic() - began_s)
        except EngineCallCancelled:  # stopping while an update was being applied: it is not served; nothing to say
            log.info("weight update abandoned: the worker is stopping")
        except Exception as exc:  # a fault in this thread makes the worker useless: report and exit
            log.exception("weight thread failed")
            self.fatal_error = f"weight thread failed: {exc!r}"
        finally:
            if subscriber is not None:
                subscriber.close()

    def _handle_update(
        self, subscriber: WeightSubscriber, header: data_pb2.WeightUpdateHeader, payload: memoryview
    ) -> None:
        from primerl.proto.v1 import common_pb2, data_pb2

        assert self.updater is not None and self.ops is not None and self.control is not None
        received_s = time.monotonic()
        version, kind = int(header.policy_version), data_pb2.WeightUpdateKind.Name(header.kind)
        if self._answered_at_once(subscriber, header):
            return
        log.info(telemetry.WEIGHT_UPDATE_RECEIVED, policy_version=version, kind=kind, payload_bytes=payload.nbytes)
        digest = subscriber.received_digest
        # Checks (the digest computed as the chunks arrived) and the load beside the served weights, which began with
        # the first chunk: generation goes on meanwhile.
        updater = self.updater
        preloaded = self._in_engine(lambda: updater.preload(header, payload, payload_digest=digest), subscriber, header)
        if preloaded is _REFUSED:
            return
        pause_start_s = time.monotonic()
        try:
            self.ops.pause(self.server.pause_mode, DRAIN_TIMEOUT_S)
        except EngineCallTimeout:
            self.ops.resume()
            self.updater.discard()
            self._refuse(
                subscriber,
                version,
                common_pb2.ErrorDetail(
                    code=common_pb2.ERROR_CODE_INTERNAL,
                    message=f"requests in flight did not finish within {DRAIN_TIMEOUT_S:g} s; send the update again",
                ),
            )
            return
        engine_wait_ms = (time.monotonic() - pause_start_s) * 1000.0
        try:
            engine_ms = self._in_engine(
                lambda: updater.apply(header, payload, payload_digest=digest), subscriber, header
            )
            if engine_ms is _REFUSED:
                return
            self.ops.run(self._route_policy_name())
        finally:
            self.ops.resume()
            pause_ms = (time.monotonic() - pause_start_s) * 1000.0
        apply_ms = (time.monotonic() - received_s) * 1000.0
        bind_context(policy_version=version)
        log.info(
            telemetry.WEIGHT_UPDATE_LIVE,
            policy_version=version,
            kind=kind,
            apply_ms=round(apply_ms, 1),
            engine_ms=round(engine_ms, 1),
            update_pause_ms=round(pause_ms, 1),
            engine_wait_ms=round(engine_wait_ms, 1),  # of the pause: waiting for the engine to pause (CPU: requests
            # in flight finish first), generation going on; the rest is the switch itself
        )
        # Served now. Off the pause: the replaced weights are freed and, read in place from a trainer's segment, the
        # host copy takes its own bytes before the acknowledgement, which lets the trainer write that segment again.
        settle_ms = self.updater.settle()
        subscriber.ack(version, applied=True, apply_ms=round(apply_ms), lineage=self.updater.lineage)
        self.num_updates_applied += 1
        self.metrics.updates_applied.inc()
        self.metrics.policy_version.set(version)
        self.metrics.last_update_ms.set(apply_ms)
        self.metrics.update_pause_ms.observe(pause_ms)
        phases_ms = {"wait_engine": engine_wait_ms, **self.updater.last_phases_ms, "settle": settle_ms}
        for phase, value in phases_ms.items():
            self.metrics.last_update_phase_ms.labels(phase=phase).set(value)
        self._check_caught_up()

    def _answered_at_once(self, subscriber: WeightSubscriber, header: data_pb2.WeightUpdateHeader) -> bool:
        """Acknowledge, without loading it, an update this worker holds or refused before (True)."""
        assert self.updater is not None
        version = int(header.policy_version)
        if self.updater.holds(header):
            # Sent again (a refusal made the broker resend its snapshot), or an older lineage's: say what is served.
            # A newer lineage's FULL at or below the served version is not held: a rollback (PolicyUpdater.holds).
            self.updater.discard()
            subscriber.ack(self.updater.policy_version, lineage=self.updater.lineage)
            return True
        refusal = self._refused.get((version, header.digest))
        if refusal is not None:
            # The broker resends its latest snapshot after a refusal until the trainer publishes a good one:
            # answer without pausing the engine or checking the same bytes again.
            self.updater.discard()
            subscriber.ack(version, applied=False, error=refusal)
            return True
        return False

    def _in_engine(
        self, call: Callable[[], Any], subscriber: WeightSubscriber, header: data_pb2.WeightUpdateHeader
    ) -> Any:
        """``call()`` (the updater's preload or apply) and its result; `_REFUSED` once an `UpdateRefused` it raised
        was acknowledged. Any other failure is reported (`_fail_update`) and raised."""
        from primerl.inference.update_checks import UpdateRefused
        from primerl.proto.v1 import data_pb2

        version = int(header.policy_version)
        try:
            return call()
        except UpdateRefused as exc:
            self._refuse_update(subscriber, version, header, exc)
            return _REFUSED
        except EngineCallCancelled:
            raise
        except Exception as exc:
            self._fail_update(subscriber, version, data_pb2.WeightUpdateKind.Name(header.kind), exc)
            raise

    def _refuse_update(
        self, subscriber: WeightSubscriber, version: int, header: data_pb2.WeightUpdateHeader, refusal: Any
    ) -> None:
        """Acknowledge an `UpdateRefused`; remember it unless it may pass later (OUT_OF_ORDER)."""
        from primerl.proto.v1 import common_pb2

        self._refuse(subscriber, version, refusal.detail())
        if refusal.code != common_pb2.ERROR_CODE_OUT_OF_ORDER:  # the same bytes will always be refused
            self._refused[(version, header.digest)] = refusal.detail()
            while len(self._refused) > MAX_REMEMBERED_REFUSALS:
                self._refused.popitem(last=False)

    def _fail_update(self, subscriber: WeightSubscriber, version: int, kind: str, exc: Exception) -> None:
        """An update failed in the engine: what it serves is unknown. Reported; the weight thread then ends."""
        from primerl.proto.v1 import common_pb2

        self.fatal_error = f"applying {kind} v{version} failed; the served weights are unknown: {exc!r}"
        log.exception("weight update failed", policy_version=version, kind=kind)
        subscriber.ack(
            version,
            applied=False,
            error=common_pb2.ErrorDetail(code=common_pb2.ERROR_CODE_INTERNAL, message=self.fatal_error),
        )

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

    def _refuse(self, subscriber: WeightSubscriber, version: int, detail: Any) -> None:
        from primerl.proto.v1 import common_pb2

        self.num_updates_refused += 1
        self.metrics.updates_refused.inc()
        code = common_pb2.ErrorCode.Name(detail.code)
        log.warning(
            "weight update refused; still serving the previous version",
            policy_version=version,
            code=code,
            error=detail.message,
            served_version=self.policy_version,
        )
        self.control.report_error(f"refused weight update v{version}: {code}: {detail.message}")
        subscriber.ack(version, applied=False, error=detail)

    async def _route_policy_name(self) -> None:
        """Make requests for the served policy name use the current adapter (vLLM looks request.model up in
        `OpenAIServingModels.lora_requests`; /v1/models lists it), or drop it when full weights are served."""
        assert self.updater is not None
        lora_requests = self.server.serving_models.lora_requests
        current = self.updater.lora_request()
        if self._served_adapter_name is not None and (
            current is None or current.lora_name != self._served_adapter_name
        ):
            lora_requests.pop(self._served_adapter_name, None)
            self._served_adapter_name = None
        if current is not None:
            lora_requests[current.lora_name] = current
            self._served_adapter_name = current.lora_name

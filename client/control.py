"""What a worker (trainer rank, orchestrator, inference worker, ``primerl status``) uses to talk to the broker.

``ControlClient`` registers, heartbeats in a background thread, reports metrics and commits steps. Every RPC
has a deadline. The heartbeat thread never crashes the worker: when the broker forgets the worker (NOT_FOUND,
e.g. after a broker restart) it registers again; when the broker is unreachable it retries with capped
exponential backoff (0.1 s doubling to 5 s, each wait drawn at random below it) for as long as the client runs.

Riding through a broker outage (a restart, a lost network). A worker's calls (``register``, ``report_metrics``,
``commit_step``, ``list_workers``, ``get_run_status``) wait through an outage of up to ``config.outage_s``:
they retry while the broker is unreachable or stopping, register again when it forgot the worker, and log
``waiting for the broker`` every few seconds (``primerl.client.outage``). Past the budget they raise
``BrokerOutageExceeded``. The heartbeat thread measures outages the same way: when one lasts longer than the
budget it sets ``broker_lost`` (with ``broker_lost_error``); a worker that only waits (an inference worker, a
trainer waiting for data) calls ``check_broker()`` in its loop and stops with that one error. ``primerl status``
(role ``client``) does not ride through: it fails at once.

Errors reach callers as ``BrokerError`` (``client.broker_errors``, with the gRPC ``code``); ``BrokerUnavailable``
when the broker cannot be reached in time (those can heal: retry later); ``IncarnationSuperseded`` when a newer
trainer incarnation took over the run (never heals: the heartbeat thread stops, and ``check_broker()`` raises it).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from primerl.client.broker_errors import (
    BrokerError,
    BrokerLost,
    BrokerUnavailable,
    IncarnationSuperseded,
    NameHeld,
    broker_error,
)
from primerl.client.channel import BACKOFF_INITIAL_S, BACKOFF_MAX_S, create_channel, jittered
from primerl.client.outage import BrokerOutageExceeded, OutageWatch, retry_through_outage
from primerl.proto import telemetry
from primerl.proto.data_plane_limits import BrokerLimits
from primerl.proto.roles import role_from_name
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc
from primerl.runtime.addresses import dialable_endpoint
from primerl.runtime.config_common import BrokerClientConfig
from primerl.runtime.log_setup import get_logger

DEFAULT_RPC_TIMEOUT_S = 10.0
MAX_QUEUED_ERRORS = 8
# What a heartbeat's progress_fn may return (see HeartbeatRequest).
PROGRESS_FIELDS = frozenset(
    {"trainer_step", "policy_version", "orchestrator_step", "num_inflight", "recent_errors", "not_serving"}
)

_log = get_logger("primerl.broker.client")

ProgressFn = Callable[[], Mapping[str, Any]]


# ------------------------------------------------------------------------------------------------ client
class RunStatusStream:
    """Iterator over streamed ``RunStatus`` messages; ``cancel()`` ends it (from any thread)."""

    def __init__(self, call, address: str):
        self._call = call
        self._address = address
        self._cancelled = False

    def __iter__(self) -> RunStatusStream:
        return self

    def __next__(self) -> control_pb2.RunStatus:
        try:
            return next(self._call)
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise broker_error(err, "WatchRunStatus", self._address) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class ControlClient:
    """A worker's connection to the broker's control plane."""

    def __init__(
        self,
        config: BrokerClientConfig,
        role: int | str,
        name: str,
        address: str = "",
        capabilities: Mapping[str, str] | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ):
        self.config = config
        self.role = role_from_name(role)
        self.name = name
        self.address = address
        self.capabilities = dict(capabilities or {})
        self.rank = rank
        self.world_size = world_size
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = create_channel(
            config.address,
            run_token=config.run_token,
            tls_ca_path=config.tls_ca_path,
            tls_cert_path=config.tls_cert_path,
            tls_key_path=config.tls_key_path,
            tls_server_name=config.tls_server_name,
        )
        # The data-plane clients' CURVE credentials, read now so that a wrong file fails at start.
        self.curve = config.curve_client()
        self._stub = control_pb2_grpc.BrokerStub(self._channel)
        self._lock = threading.Lock()  # guards registration state
        self._worker_id: str | None = None
        self.registration: control_pb2.RegisterResponse | None = None
        # Trainer rank 0: the policy lineage the broker gave this incarnation at its first registration (0: none
        # yet); every re-registration names it, so the incarnation keeps it across broker restarts.
        self.policy_lineage = 0
        self.instance_id = uuid.uuid4().hex  # in each Register: a retried one gets its registration back
        self.last_heartbeat: control_pb2.HeartbeatResponse | None = None
        self._interval_ms = 0  # the heartbeat interval the broker asked for last (0: none yet)
        self.num_registrations = 0
        self.shutdown_requested = threading.Event()
        self._errors: collections.deque[str] = collections.deque(maxlen=MAX_QUEUED_ERRORS)
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        # Outages: workers ride through them (module docstring); ``primerl status`` fails at once.
        self.rides_through = self.role != common_pb2.ROLE_CLIENT
        self.outage_s = config.outage_s
        self.broker_lost = threading.Event()
        # Set by the heartbeat thread when the broker refused this worker as a superseded trainer incarnation.
        self.superseded: IncarnationSuperseded | None = None
        self.broker_lost_error = ""
        self._heartbeat_outage = OutageWatch("heartbeats", self.outage_s, worker=name)

    # ----------------------------------------------------------------------------------- properties
    @property
    def worker_id(self) -> str | None:
        with self._lock:
            return self._worker_id

    @property
    def broker_unreachable(self) -> bool:
        """Whether the heartbeat thread is in an outage of the broker right now."""
        return self._heartbeat_outage.in_outage

    @property
    def limits(self) -> BrokerLimits:
        """The broker's data-plane limits from the last registration (a broker's defaults before one): size the
        ZeroMQ clients from them (``limits.frames``, ``limits.weight_chunk_bytes``)."""
        return BrokerLimits.from_registration(self.registration)

    @property
    def heartbeat_interval_s(self) -> float:
        """What the broker asked for: at registration, then in each heartbeat's answer (it grows with the fleet)."""
        return self._interval_ms / 1000 if self._interval_ms else 1.0

    # -------------------------------------------------------------------------------------- calling
    def _call(self, what: str, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=timeout_s or self.rpc_timeout_s)
        except grpc.RpcError as err:
            raise broker_error(err, what, self.config.address) from None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the channel connects (default ``config.connect_timeout_s``); else ``BrokerUnavailable``."""
        timeout_s = self.config.connect_timeout_s if timeout_s is None else timeout_s
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            tls = (
                "with TLS and a client certificate"
                if self.config.tls_cert_path
                else "with TLS"
                if self.config.tls_ca_path
                else "without TLS"
            )
            raise BrokerUnavailable(
                f"cannot reach the broker at {self.config.address} within {timeout_s:g} s ({tls}): is it running, "
                "and is the address right? A broker with TLS (broker.tls_cert_path) needs broker.tls_ca_path here, "
                "one that requires client certificates (broker.tls_client_ca_path) also broker.tls_cert_path and "
                "tls_key_path signed by that CA",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    def register(self) -> control_pb2.RegisterResponse:
        """Register (again); the new worker id replaces the old one. A worker waits through a broker outage and
        through ALREADY_EXISTS (the registration of its own previous incarnation, until the broker expires it),
        both within ``outage_s``; other refusals raise ``BrokerError``."""
        if not self.rides_through:
            return self._register_once()

        def attempt() -> control_pb2.RegisterResponse:
            try:
                return self._register_once()
            except BrokerError as err:
                if err.code == grpc.StatusCode.ALREADY_EXISTS:
                    raise NameHeld(str(err), err.code) from None
                raise

        watch = OutageWatch("Register", self.outage_s, worker=self.name)
        try:
            return retry_through_outage(attempt, watch, (BrokerUnavailable, NameHeld), stop_event=self._stop)
        except BrokerOutageExceeded as err:
            if isinstance(watch.last_error, NameHeld):
                raise BrokerError(
                    f"cannot register as {self.name!r} within broker.outage_s = {self.outage_s:g} s: "
                    f"{watch.last_error}",
                    grpc.StatusCode.ALREADY_EXISTS,
                ) from None
            raise BrokerLost(str(err), grpc.StatusCode.UNAVAILABLE) from None

    def _register_once(self, *, only_if_unregistered: bool = False) -> control_pb2.RegisterResponse:
        """One Register call. ``only_if_unregistered``: unless another thread registered meanwhile (the check and
        the call happen under the same lock, so the heartbeat thread and a worker call never both register)."""
        request = control_pb2.RegisterRequest(
            role=self.role,
            name=self.name,
            address=self.address,
            capabilities=self.capabilities,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            instance_id=self.instance_id,
        )
        with self._lock:
            if only_if_unregistered and self._worker_id is not None and self.registration is not None:
                return self.registration
            request.policy_lineage = self.policy_lineage
            response = self._call("Register", self._stub.Register, request)
            if not self.policy_lineage:
                self.policy_lineage = response.policy_lineage
            # A broker bound to a wildcard hands out wildcard endpoints: dial its planes where we reached it.
            response.rollout_endpoint = dialable_endpoint(response.rollout_endpoint, self.config.address)
            response.weight_endpoint = dialable_endpoint(response.weight_endpoint, self.config.address)
            self._worker_id = response.worker_id
            self.registration, self._interval_ms = response, response.heartbeat_interval_ms
            self.num_registrations += 1
        _log.info(
            telemetry.REGISTERED_WITH_THE_BROKER, worker=self.name, worker_id=response.worker_id, run=response.run_id
        )
        return response

    def _require_id(self) -> str:
        """This worker's id; a worker that was registered before and lost its id (the broker forgot it, the
        heartbeat thread is registering again) registers now instead of failing."""
        worker_id = self.worker_id
        if worker_id is None:
            if not self.num_registrations:
                raise BrokerError("not registered with the broker: call register() first", grpc.StatusCode.NOT_FOUND)
            worker_id = self._register_once(only_if_unregistered=True).worker_id
        return worker_id

    def _reregister_if(self, stale_id: str) -> None:
        """Register again unless another thread already did since ``stale_id`` was refused."""
        with self._lock:
            if self._worker_id != stale_id:
                return
            self._worker_id = None
        self.register()

    def _as_worker(self, what: str, method, make_request: Callable[[str], Any]):
        """Call with the worker id; after NOT_FOUND (broker forgot us) register again and retry once; through
        an outage of up to ``outage_s`` (module docstring)."""
        return self._riding_through(what, lambda: self._as_worker_once(what, method, make_request))

    def _riding_through(self, what: str, call: Callable[[], Any]):
        if not self.rides_through:
            return call()
        watch = OutageWatch(what, self.outage_s, worker=self.name)
        try:
            return retry_through_outage(call, watch, (BrokerUnavailable,), stop_event=self._stop)
        except BrokerOutageExceeded as err:
            raise BrokerLost(str(err), grpc.StatusCode.UNAVAILABLE) from None

    def _as_worker_once(self, what: str, method, make_request: Callable[[str], Any]):
        worker_id = self._require_id()
        try:
            return self._call(what, method, make_request(worker_id))
        except BrokerError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise
            _log.warning("broker forgot this worker; registering again", worker=self.name, call=what)
            self._reregister_if(worker_id)
            return self._call(what, method, make_request(self._require_id()))

    def heartbeat(self, progress: Mapping[str, Any] | None = None) -> control_pb2.HeartbeatResponse:
        """One heartbeat with ``progress`` (trainer_step, policy_version, orchestrator_step, num_inflight,
        recent_errors, not_serving) and the errors queued by ``report_error``. NOT_FOUND raises (the thread
        re-registers)."""
        return self._heartbeat_as(self._require_id(), progress or {})

    def _heartbeat_as(self, worker_id: str, progress: Mapping[str, Any]) -> control_pb2.HeartbeatResponse:
        queued = list(self._errors)
        request = self._heartbeat_request(worker_id, progress, queued)
        response = self._call("Heartbeat", self._stub.Heartbeat, request)
        for _ in queued:  # sent: drop them (errors queued meanwhile stay for the next heartbeat)
            if self._errors:
                self._errors.popleft()
        self.last_heartbeat = response
        self._interval_ms = response.heartbeat_interval_ms or self._interval_ms
        if response.shutdown_requested and not self.shutdown_requested.is_set():
            _log.warning("the broker asked this worker to shut down", worker=self.name)
            self.shutdown_requested.set()
        return response

    def _heartbeat_request(
        self, worker_id: str, progress: Mapping[str, Any], queued_errors: list[str]
    ) -> control_pb2.HeartbeatRequest:
        unknown = set(progress) - PROGRESS_FIELDS
        if unknown:
            raise ValueError(f"progress_fn returned unknown fields {sorted(unknown)}")
        request = control_pb2.HeartbeatRequest(worker_id=worker_id, num_inflight=int(progress.get("num_inflight", 0)))
        for key in ("trainer_step", "policy_version", "orchestrator_step"):
            if progress.get(key) is not None:
                setattr(request, key, int(progress[key]))
        errors = queued_errors + [str(e) for e in progress.get("recent_errors", ())]
        request.recent_errors.extend(errors[-MAX_QUEUED_ERRORS:])
        request.not_serving = str(progress.get("not_serving") or "")
        return request

    def report_error(self, message: str) -> None:
        """Queue an error to send with the next heartbeat (the broker shows it in status; bounded)."""
        self._errors.append(message)

    def report_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._as_worker(
            "ReportMetrics",
            self._stub.ReportMetrics,
            lambda worker_id: control_pb2.ReportMetricsRequest(worker_id=worker_id, step=step, metrics=dict(metrics)),
        )

    def report_rollouts(self, step: int, records: list[str]) -> None:
        """A few sample rollouts of ``step`` (JSON objects) for the broker's run history (the dashboard)."""
        self._as_worker(
            "ReportRollouts",
            self._stub.ReportRollouts,
            lambda worker_id: control_pb2.ReportRolloutsRequest(worker_id=worker_id, step=step, records=records),
        )

    def commit_step(self, step: int) -> control_pb2.CommitStepResponse:
        return self._as_worker(
            "CommitStep",
            self._stub.CommitStep,
            lambda worker_id: control_pb2.CommitStepRequest(worker_id=worker_id, step=step),
        )

    def get_run_status(self, timeout_s: float | None = None) -> control_pb2.RunStatus:
        return self._riding_through(
            "GetRunStatus",
            lambda: self._call("GetRunStatus", self._stub.GetRunStatus, control_pb2.GetRunStatusRequest(), timeout_s),
        )

    def get_run_history(
        self, metrics_since: int = 0, events_since: int = 0, rollouts_since: int = 0, timeout_s: float | None = None
    ) -> control_pb2.RunHistory:
        """The broker's run history after these indices (``broker/run_history.py``)."""
        request = control_pb2.GetRunHistoryRequest(
            metrics_since=metrics_since, events_since=events_since, rollouts_since=rollouts_since
        )
        return self._riding_through(
            "GetRunHistory", lambda: self._call("GetRunHistory", self._stub.GetRunHistory, request, timeout_s)
        )

    def list_workers(
        self, role: int | str = common_pb2.ROLE_UNSPECIFIED, include_gone: bool = False
    ) -> list[control_pb2.WorkerInfo]:
        request = control_pb2.ListWorkersRequest(role=role_from_name(role), include_gone=include_gone)
        return list(
            self._riding_through(
                "ListWorkers", lambda: self._call("ListWorkers", self._stub.ListWorkers, request)
            ).workers
        )

    def check_broker(self) -> None:
        """Raise ``BrokerOutageExceeded`` once the heartbeat thread has seen the broker unreachable for longer
        than ``outage_s`` (call it in a worker's waiting loops)."""
        if self.broker_lost.is_set():
            raise BrokerLost(self.broker_lost_error, grpc.StatusCode.UNAVAILABLE)
        if self.superseded is not None:
            raise self.superseded

    def watch_run_status(self, min_interval_ms: int = 0, timeout_s: float | None = None) -> RunStatusStream:
        """Stream of statuses: the current one, then one per change. ``timeout_s``: total duration (None: until
        ``cancel()``, the broker stopping, or the connection dying — keepalive notices within ~30 s)."""
        call = self._stub.WatchRunStatus(
            control_pb2.WatchRunStatusRequest(min_interval_ms=min_interval_ms), timeout=timeout_s
        )
        return RunStatusStream(call, self.config.address)

    def deregister(self, reason: str = "") -> bool:
        """Best effort at shutdown: True when the broker recorded it, False when unreachable or unknown.

        Heartbeats stop first: a heartbeat after deregistration would register the worker again."""
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(self.rpc_timeout_s + 1)
        with self._lock:
            worker_id, self._worker_id = self._worker_id, None
        if worker_id is None:
            return False
        try:
            self._call(
                "Deregister", self._stub.Deregister, control_pb2.DeregisterRequest(worker_id=worker_id, reason=reason)
            )
            return True
        except BrokerError as err:
            _log.warning("deregistration failed", worker=self.name, error=str(err))
            return False

    # ------------------------------------------------------------------------------------ heartbeats
    def start_heartbeats(self, progress_fn: ProgressFn | None = None) -> None:
        """Heartbeat in a background thread until ``close()``; registers first if needed, and again whenever
        the broker forgets this worker. Never raises into the worker; failures are logged."""
        if self._heartbeat_thread is not None:
            raise RuntimeError("heartbeats already started")
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, args=(progress_fn,), name=f"heartbeat-{self.name}", daemon=True
        )
        self._heartbeat_thread.start()

    def _heartbeat_loop(self, progress_fn: ProgressFn | None) -> None:
        backoff_s = BACKOFF_INITIAL_S
        unreachable_logged = False
        while not self._stop.is_set():
            worker_id = None
            wait_s = None  # None: back off
            try:
                worker_id = self.worker_id
                if worker_id is None:
                    worker_id = self._register_once(only_if_unregistered=True).worker_id
                self._heartbeat_as(worker_id, self._progress(progress_fn))
                if unreachable_logged:
                    _log.info("broker reachable again", worker=self.name)
                backoff_s, unreachable_logged = BACKOFF_INITIAL_S, False
                self._heartbeat_outage.ok()
                wait_s = self.heartbeat_interval_s  # as the broker asked at registration
            except BrokerUnavailable as err:
                if not unreachable_logged:
                    _log.warning("broker unreachable; retrying with backoff", worker=self.name, error=str(err))
                    unreachable_logged = True
                try:
                    self._heartbeat_outage.failed(err)
                except BrokerOutageExceeded as exceeded:
                    if not self.broker_lost.is_set():
                        self.broker_lost_error = str(exceeded)
                        self.broker_lost.set()
            except IncarnationSuperseded as err:  # for good: no more heartbeats; check_broker() raises it
                _log.error("a newer trainer incarnation superseded this one", worker=self.name, error=str(err))
                self.superseded = err
                return
            except BrokerError as err:
                if err.code == grpc.StatusCode.NOT_FOUND and worker_id is not None:
                    _log.warning("broker forgot this worker; registering again", worker=self.name, error=str(err))
                    with self._lock:
                        if self._worker_id == worker_id:  # unless another call registered again meanwhile
                            self._worker_id = None
                else:  # e.g. ALREADY_EXISTS until an orphaned registration expires, UNAUTHENTICATED
                    _log.error("heartbeat refused", worker=self.name, error=str(err))
            except Exception:  # the worker must keep running; the failure is logged with its traceback
                _log.exception("heartbeat failed", worker=self.name)
            if wait_s is None:  # jittered: a fleet that lost its broker together must not come back together
                wait_s, backoff_s = jittered(backoff_s), min(backoff_s * 2, BACKOFF_MAX_S)
            self._stop.wait(wait_s)

    def _progress(self, progress_fn: ProgressFn | None) -> Mapping[str, Any]:
        if progress_fn is None:
            return {}
        try:
            return progress_fn()
        except Exception as err:  # still heartbeat: the process is alive; tell the broker what broke
            _log.exception("progress_fn failed", worker=self.name)
            return {"recent_errors": [f"progress_fn failed: {err!r}"]}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop heartbeats (bounded join) and close the channel. Does not deregister (call ``deregister``)."""
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout_s)
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc) -> None:
        if self.worker_id is not None:
            self.deregister("closed")
        self.close()

"""The broker's gRPC layer: the ``Broker`` service over a ``WorkerRegistry``, auth, health and reflection.

``BrokerServicer`` answers the ``primerl.v1.Broker`` calls from the registry (built by ``broker/service.py`` with its
commit, step-window, persistence and policy collaborators) and owns the health servicer; ``create_grpc_server``
binds it with health and reflection (TLS, mutual TLS, run token), not started; ``HeartbeatMonitor`` expires workers
whose heartbeats stopped. ``BrokerServicer.shutdown`` turns health NOT_SERVING and makes register and heartbeat
answer UNAVAILABLE (a stopping broker may be restarting: workers retry).

Auth: with a run token, every call except the health service must carry ``authorization: Bearer <token>``
(compared in constant time) or it fails with UNAUTHENTICATED. Health stays open so that load balancers and
orchestrators (systemd, Kubernetes probes) can probe the broker without the secret; it reveals only
SERVING / NOT_SERVING. Reflection requires the token: it describes the whole API.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.registry import WorkerRegistry
from primerl.broker.registry_errors import RegistryError, WorkerNotFound
from primerl.broker.run_history import RunHistory
from primerl.broker.run_status import DataPlaneStatus, format_workers
from primerl.broker.status_cache import SharedStatus
from primerl.proto import framing, telemetry
from primerl.proto.data_plane_limits import BrokerLimits
from primerl.proto.v1 import common_pb2, control_pb2, control_pb2_grpc
from primerl.runtime.log_setup import get_logger
from primerl.runtime.periodic import Periodic

SERVICE_NAME = control_pb2.DESCRIPTOR.services_by_name["Broker"].full_name  # "primerl.v1.Broker"
HEALTH_METHOD_PREFIX = f"/{health.SERVICE_NAME}/"
AUTH_METADATA_KEY = "authorization"
MIN_WATCH_INTERVAL_S = 0.1
"""A status stream sends at most one status per this long, whatever ``min_interval_ms`` it asked for."""

# Keepalive: clients ping every 20 s (see primerl.client.control); the server must allow it or it sends GOAWAY.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second broker on the same port must fail, not share it
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 4 * 2**20),
]

_log = get_logger("primerl.broker.control")
_refusal_log = RateLimitedLog(_log)


# ------------------------------------------------------------------------------------------------- auth
class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <run_token>`` (health checks excepted)."""

    def __init__(self, run_token: str, open_method_prefixes: tuple[str, ...] = (HEALTH_METHOD_PREFIX,)):
        if not run_token:
            raise ValueError("TokenAuthInterceptor needs a non-empty run token")
        self._expected = f"Bearer {run_token}".encode()
        self._open_prefixes = open_method_prefixes

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self._open_prefixes):
            return continuation(handler_call_details)
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                presented = value if isinstance(value, str) else value.decode("utf-8", "replace")
                break
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(handler_call_details)
        message = (
            "missing run token: send metadata `authorization: Bearer <token>` (broker client `run_token`, "
            "or PRIMERL_RUN_TOKEN for `primerl status`)"
            if not presented
            else "wrong run token: it does not match the broker's `run_token`"
        )
        return _refusal(continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED, message)


def _refusal(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as ``handler`` that aborts every call with ``code``.

    Its request deserializer never parses the body (it keeps nothing), so an unauthenticated call is refused
    with ``code`` whatever bytes it carries, before any protobuf parser sees them."""

    def abort(request_or_iterator, context):
        _refusal_log.warning(
            ("refused", code.name), "control plane refused a call", code=code.name, reason=message, peer=context.peer()
        )
        context.abort(code, message)

    if handler is None:  # unknown method: do not reveal that, refuse like any other unauthenticated call
        return grpc.unary_unary_rpc_method_handler(abort, request_deserializer=_ignore_body)
    factory = _HANDLER_FACTORIES[handler.request_streaming, handler.response_streaming]
    return factory(abort, request_deserializer=_ignore_body, response_serializer=handler.response_serializer)


# (request streaming, response streaming) -> the gRPC handler of that kind
_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
_UNREAD = object()  # gRPC treats a deserializer's None as a failure: return a placeholder instead


def _ignore_body(_body: bytes) -> object:
    return _UNREAD


class _BadBody:
    """What a request deserializer returns for bytes that do not parse (instead of raising, which makes
    gRPC log a traceback per call and answer INTERNAL)."""

    def __init__(self, error: Exception):
        self.error = error


def _safe_deserializer(deserialize):
    if deserialize is None:
        return None

    def parse(body: bytes):
        try:
            return deserialize(body)
        except Exception as exc:  # DecodeError, RecursionError, ...: a peer's bytes, never a broker fault
            return _BadBody(exc)

    return parse


def _refuse_bad_body(context, method: str, bad: _BadBody):
    message = f"request body of {method.rsplit('/', 1)[-1]} is not a valid protobuf message: {type(bad.error).__name__}"
    _refusal_log.warning(
        ("bad body", method),
        "control plane refused a malformed request",
        method=method,
        error=str(bad.error)[:200],
        peer=context.peer(),
    )
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


class RequestBodyGuard(grpc.ServerInterceptor):
    """Every method's request deserializer made total: a body that does not parse is refused with
    INVALID_ARGUMENT and one rate-limited log line, instead of INTERNAL and a traceback per call."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method or ""
        if handler.request_streaming:
            behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary

            def checked(request_iterator, context, behavior=behavior):
                def requests():
                    for request in request_iterator:
                        if isinstance(request, _BadBody):
                            _refuse_bad_body(context, method, request)
                        yield request

                return behavior(requests(), context)

        else:
            behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

            def checked(request, context, behavior=behavior):
                if isinstance(request, _BadBody):
                    _refuse_bad_body(context, method, request)
                return behavior(request, context)

        factory = _HANDLER_FACTORIES[handler.request_streaming, handler.response_streaming]
        return factory(
            checked,
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


# --------------------------------------------------------------------------------------------- servicer
class BrokerServicer(control_pb2_grpc.BrokerServicer):
    """Implements ``primerl.v1.Broker`` over a ``WorkerRegistry``; also owns the health servicer."""

    def __init__(
        self,
        registry: WorkerRegistry,
        data_plane_status_fn: Callable[[], DataPlaneStatus] | None = None,
        *,
        max_concurrent_watches: int = 8,
        watch_poll_s: float = 0.5,
        data_plane_limits: BrokerLimits | None = None,
        rollout_producer_limits: BrokerLimits | None = None,
        history: RunHistory | None = None,
    ):
        """``data_plane_limits``: sent with every RegisterResponse, the clients size themselves from them (None: the
        clients' defaults); ``rollout_producer_limits``: sent instead to orchestrators, whose frames are rollout
        micro-batches and so keep to the rollout socket's smaller cap (None: ``data_plane_limits``)."""
        self.registry = registry
        self._data_plane_limits = data_plane_limits.to_proto() if data_plane_limits is not None else None
        self._rollout_producer_limits = (
            rollout_producer_limits.to_proto() if rollout_producer_limits is not None else self._data_plane_limits
        )
        self._data_plane_status_fn = data_plane_status_fn
        # What the dashboard draws (GetRunHistory), fed by the calls below (None: one of the default bound).
        self.history = history if history is not None else RunHistory()
        self._watch_slots = threading.BoundedSemaphore(max_concurrent_watches)
        self._max_concurrent_watches = max_concurrent_watches
        self._watch_poll_s = watch_poll_s
        # Every watch stream reads this one status (``status_cache``): one assembly per interval, not per watcher.
        self._shared_status = SharedStatus(self.run_status, lambda: self.registry.version)
        self._stopping = threading.Event()
        self.health = health.HealthServicer()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def shutdown(self) -> None:
        """Health -> NOT_SERVING, register and heartbeat answer UNAVAILABLE (workers retry: a stopping broker may be
        restarting, so it never sets ``shutdown_requested``), status watch streams end."""
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.registry.close()

    def data_plane_status(self) -> DataPlaneStatus:
        if self._data_plane_status_fn is None:
            return DataPlaneStatus()
        try:
            return self._data_plane_status_fn()
        except Exception:  # status must keep working when one data-plane part is broken
            _log.exception("data-plane status failed; showing the control plane only")
            return DataPlaneStatus()

    def run_status(self) -> control_pb2.RunStatus:
        return self.registry.run_status(self.data_plane_status())

    # ------------------------------------------------------------------------------------ the RPCs
    def Register(self, request, context):
        response = _guarded(context, self.registry.register, request)
        limits = (
            self._rollout_producer_limits if request.role == common_pb2.ROLE_ORCHESTRATOR else self._data_plane_limits
        )
        if limits is not None:
            response.limits.CopyFrom(limits)
        role = framing.role_name(request.role).removeprefix("ROLE_").lower()
        self.history.add_event("joined", request.name, f"{role} registered from {request.hostname or '?'}")
        _log.info(
            "worker registered",
            worker=request.name,
            role=framing.role_name(request.role),
            worker_id=response.worker_id,
            address=request.address,
            peer=context.peer(),
        )
        return response

    def Heartbeat(self, request, context):
        response = _guarded(context, self.registry.heartbeat, request)
        if request.recent_errors:
            name = self._worker_name(request.worker_id)
            for message in request.recent_errors:
                self.history.add_event("error", name, message, self.registry.last_committed_step)
        return response

    def Deregister(self, request, context):
        name = self._worker_name(request.worker_id)
        finished = _guarded(context, self.registry.deregister, request.worker_id, request.reason)
        _log.info("worker deregistered", worker_id=request.worker_id, reason=request.reason)
        self.history.add_event("left", name, request.reason or "deregistered", self.registry.last_committed_step)
        if finished:
            self.history.add_event(
                "finished", "broker", "run finished: workers are told to stop", self.registry.last_committed_step
            )
            _log.info(
                "run finished: workers are told to stop",
                max_steps=self.registry.max_steps,
                last_committed_step=self.registry.last_committed_step,
                stop_in_s=self.registry.end_of_run_grace_s,
            )
        return control_pb2.DeregisterResponse()

    def GetRunStatus(self, request, context):
        return _guarded(context, self.run_status)

    def ListWorkers(self, request, context):
        workers = _guarded(context, self.registry.list_workers, request.role, request.include_gone)
        return control_pb2.ListWorkersResponse(workers=workers)

    def ReportMetrics(self, request, context):
        metrics = dict(request.metrics)
        _guarded(context, self.registry.report_metrics, request.worker_id, request.step, metrics)
        worker = self.registry.get_worker(request.worker_id)
        self.history.add_metrics(worker.role if worker is not None else 0, request.step, metrics)
        return control_pb2.ReportMetricsResponse()

    def ReportRollouts(self, request, context):
        _guarded(context, self._live_worker, request.worker_id)
        _guarded(context, self.history.add_rollouts, request.step, list(request.records))
        return control_pb2.ReportRolloutsResponse()

    def GetRunHistory(self, request, context):
        part = self.history.since(request.metrics_since, request.events_since, request.rollouts_since)
        return _guarded(context, part.to_proto)

    def _live_worker(self, worker_id: str) -> None:
        if not self.registry.is_alive(worker_id):
            raise WorkerNotFound(f"unknown worker {worker_id!r}: register first")

    def _worker_name(self, worker_id: str) -> str:
        worker = self.registry.get_worker(worker_id)
        return worker.name if worker is not None else worker_id

    def CommitStep(self, request, context):
        last_committed, num_released, already = _guarded(
            context, self.registry.commit_step, request.worker_id, request.step
        )
        if already:  # a retry (its answer was lost, or the broker restarted): succeeds, changes nothing
            _log.info("step already committed", step=request.step, last_committed_step=last_committed)
        else:
            _log.info(telemetry.STEP_COMMITTED, step=last_committed, num_batches_released=num_released)
        return control_pb2.CommitStepResponse(last_committed_step=last_committed, num_batches_released=num_released)

    def WatchRunStatus(self, request, context):
        """The current status at once, then one per change, at most one per ``min_interval_ms``.

        Every wait is bounded by ``watch_poll_s``, so the stream notices a cancelled client or a stopping
        server within that time even when nothing wakes it.
        """
        if not self._watch_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_concurrent_watches} status watchers are already connected; retry later or poll "
                "GetRunStatus",
            )
        try:
            context.add_callback(self.registry.wake_waiters)
            min_interval_s = max(request.min_interval_ms / 1000, MIN_WATCH_INTERVAL_S)
            snapshot = self._snapshot_of(self.registry.version)
            yield snapshot.status
            last_key, last_sent = snapshot.key, time.monotonic()
            while self._streaming(context):
                to_wait_s = last_sent + min_interval_s - time.monotonic()
                if to_wait_s > 0:
                    self._stopping.wait(min(to_wait_s, self._watch_poll_s))
                    continue
                version = self.registry.wait_for_change(snapshot.version, self._watch_poll_s)
                if not self._streaming(context):
                    break
                # Also sent after a quiet poll when the data plane (queues, rates) changed.
                snapshot = self._snapshot_of(version)
                if snapshot.key == last_key:
                    continue
                yield snapshot.status
                last_key, last_sent = snapshot.key, time.monotonic()
        finally:
            self._watch_slots.release()

    def _snapshot_of(self, version: int):
        """The shared status built from ``version`` or a later one (one that is younger than its floor and older
        than ``version`` is rebuilt after the floor)."""
        snapshot = self._shared_status.get(version)
        if snapshot.version < version:
            self._stopping.wait(self._shared_status.min_age_s)
            snapshot = self._shared_status.get(version)
        return snapshot

    def _streaming(self, context) -> bool:
        return context.is_active() and not self._stopping.is_set() and not self.registry.closed


def _guarded(context, fn, *args):
    """Run a registry call; its typed errors become gRPC statuses, anything else INTERNAL (logged)."""
    try:
        return fn(*args)
    except RegistryError as err:
        context.abort(grpc.StatusCode[err.status_code], str(err))
    except Exception as err:
        _log.exception("control-plane call failed", call=fn.__name__)
        context.abort(grpc.StatusCode.INTERNAL, f"broker error in {fn.__name__}: {err}")


# ----------------------------------------------------------------------------------------------- server
def create_grpc_server(
    servicer: BrokerServicer,
    host: str,
    port: int,
    *,
    tls_cert_path: str | Path | None = None,
    tls_key_path: str | Path | None = None,
    tls_client_ca_path: str | Path | None = None,
    run_token: str | None = None,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """A gRPC server with the Broker, health and reflection services, bound but not started.

    Port 0 binds a free port; the bound port is returned. Raises ``OSError`` when the address cannot be bound
    and ``ValueError`` for an incomplete TLS set-up or an unreadable file. ``tls_client_ca_path``: every client
    must present a certificate signed by this CA (mutual TLS).
    """
    if (tls_cert_path is None) != (tls_key_path is None):
        raise ValueError("TLS needs both tls_cert_path and tls_key_path, or neither")
    if tls_client_ca_path is not None and tls_cert_path is None:
        raise ValueError("tls_client_ca_path (client certificates) needs tls_cert_path and tls_key_path")
    credentials = None
    if tls_cert_path is not None:
        from primerl.runtime.wire_security import read_pem

        client_ca = read_pem(tls_client_ca_path, "broker.tls_client_ca_path") if tls_client_ca_path else None
        credentials = grpc.ssl_server_credentials(
            [(read_pem(tls_key_path, "broker.tls_key_path"), read_pem(tls_cert_path, "broker.tls_cert_path"))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )
    # Auth first (it answers before any body is parsed), then the guard that makes parsing total.
    interceptors = ([TokenAuthInterceptor(run_token)] if run_token else []) + [RequestBodyGuard()]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="broker-grpc"),
        interceptors=interceptors,
        options=SERVER_OPTIONS,
    )
    control_pb2_grpc.add_BrokerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if credentials is not None:
            bound_port = server.add_secure_port(address, credentials)
        else:
            bound_port = server.add_insecure_port(address)
    except RuntimeError as err:
        bound_port = 0
        reason = str(err)
    else:
        reason = ""
    if not bound_port:
        server.stop(None)
        raise OSError(
            f"cannot bind the broker's gRPC server to {address}: the port is in use or the host is not an "
            f"address of this machine{f' ({reason})' if reason else ''}"
        )
    return server, bound_port


# ------------------------------------------------------------------------------------------- liveness
class HeartbeatMonitor(Periodic):
    """Background thread that calls ``registry.expire()`` every half heartbeat interval and logs lost workers.

    A silent worker is therefore marked LOST (and watchers notified) at most ``liveness * interval +
    interval / 2`` after its last heartbeat; reads of the registry apply expiry exactly in any case.
    """

    def __init__(
        self, registry: WorkerRegistry, heartbeat_interval_s: float | None = None, history: RunHistory | None = None
    ):
        self.registry = registry
        self.history = history
        self._num_rollbacks: int | None = None  # as seen at the last check (None: not yet; a restart is no rollback)
        super().__init__(
            "broker-heartbeat-monitor",
            (heartbeat_interval_s or registry.heartbeat_interval_s) / 2,
            self.check_once,
            log=_log,
            failed_event="heartbeat check failed",
            slow_stop_event="heartbeat monitor did not stop in time",
        )

    def check_once(self) -> list[control_pb2.WorkerInfo]:
        lost = self.registry.expire()
        if lost:
            _log.warning("workers lost: no heartbeat", workers=format_workers(lost), timeout_s=self.registry.timeout_s)
            step = self.registry.last_committed_step
            for worker in lost if self.history is not None else ():
                self.history.add_event("lost", worker.name, f"no heartbeat for {self.registry.timeout_s:g} s", step)
        if self.history is not None:
            self._note_rollbacks()
        return lost

    def _note_rollbacks(self) -> None:
        """A rollback (a trainer resumed below the newest published version) as an event of the run history."""
        latest = self.registry.policy.latest()
        if self._num_rollbacks is not None and latest.num_rollbacks > self._num_rollbacks:
            self.history.add_event(
                "rollback",
                "broker",
                f"policy rolled back to version {latest.lineage_base_version} (lineage {latest.lineage})",
                self.registry.last_committed_step,
            )
        self._num_rollbacks = latest.num_rollbacks

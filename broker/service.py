"""The broker process: the gRPC control plane and the two ZeroMQ data planes, wired together.

    service = BrokerService(config)
    endpoints = service.start()      # binds everything (port 0 picks free ports); returns the bound ports
                                      # and the Prometheus URL (``primerl.broker.metrics``)
    service.serve_until(stop_event)   # blocks; SIGTERM/SIGINT handling is the caller's (cli/broker.py)
    service.stop(grace_s=5.0)

The pieces keep their own threads: gRPC's pool, one IO thread per ZeroMQ plane, the heartbeat monitor, the run-state
saver. Each ZeroMQ plane has a context of its own (a context has one ZAP handler: each plane's connection gate, which
also checks CURVE keys). They meet here only through callbacks and one shared core: a commit
releases spooled batches; the weight fan-out (``weight_fanout``) owns the policy versions (the latest, and each
inference worker's), which the weight plane drives and the registry reads; a worker's weight ack counts as its traffic;
status reads every plane's counters.

Run state (``broker/run_state.py``): the registry's run facts live in ``<spool_dir>/run_state.json``, loaded
at start (after the spool has locked the directory) and written before every commit answers, at the end of
the run, at most every second otherwise, and once more at stop. So ``primerl status`` after a restart shows
the committed step, steps, policy version, metrics and run id it showed before.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import zmq

from primerl.broker.control_service import BrokerServicer, HeartbeatMonitor, create_grpc_server
from primerl.broker.memory import pin_mmap_threshold
from primerl.broker.metrics import BrokerCollector
from primerl.broker.metrics_discovery import DISCOVERY_PATH, discovery_route, target_groups
from primerl.broker.registry import WorkerRegistry
from primerl.broker.rollout_plane import RolloutPlane
from primerl.broker.rollout_queue import RolloutQueue
from primerl.broker.run_history import SAVE_INTERVAL_S, RunHistory, RunHistoryFile
from primerl.broker.run_state import RunState, RunStateFile, RunStateSaver
from primerl.broker.run_status import DataPlaneStatus, QueueDepth
from primerl.broker.spool import RolloutSpool
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_intake import IntakeBounds
from primerl.broker.weight_plane import WeightPlane
from primerl.broker.weight_store import WeightStore
from primerl.configs.broker import BrokerConfig
from primerl.proto.data_plane_limits import BrokerLimits
from primerl.proto.v1 import control_pb2
from primerl.runtime.addresses import url_host
from primerl.runtime.config_common import is_loopback_host
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.prometheus import MetricsExporter, Route, TlsFiles, start_exporter
from primerl.runtime.wire_security import CurveServer
from primerl.runtime.zmq_sockets import tcp_endpoint

log = get_logger("primerl.broker")

# After the trainer finished the run, heartbeats tell the other workers to stop from this many seconds on: time for
# the last policy to reach the inference workers, and for a supervisor that ends the run itself (``primerl rl``
# stops the roles once it has seen the trainer exit) to do so first. Past it, the roles stop within ~10 s.
END_OF_RUN_GRACE_S = 10.0
# Past the grace, inference and teacher workers are kept this much longer while an orchestrator is still at work:
# its eval at the last step runs after the trainer took that step. An orchestrator that has left (or is lost) ends it.
ORCHESTRATOR_FINISH_S = 600.0
WEIGHTS_SUBDIR = "weights"  # <spool_dir>/weights: the durable weight chain (``broker/weight_durable.py``)


@dataclass(frozen=True)
class BrokerEndpoints:
    grpc_port: int
    rollout_port: int
    weight_port: int
    run_id: str
    metrics_url: str | None = None  # Prometheus /metrics; None when prometheus.enabled = false

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class PortUnavailable(OSError):
    """A port of the broker cannot be bound (in use, or ``host`` is no address of this machine); the message
    names the address and the setting to change."""


@contextlib.contextmanager
def _naming_the_setting(setting: str, what: str, host: str, port: int) -> Iterator[None]:
    """Turn a bind failure of one plane into ``PortUnavailable`` that says which setting to change."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # gRPC: OSError; the ZeroMQ planes: RuntimeError from a ZMQError
        code = getattr(exc.__cause__, "errno", None) or getattr(exc, "errno", None)
        if code == errno.EADDRINUSE:
            reason = "the port is in use (by another run's broker?)"
        elif code == errno.EADDRNOTAVAIL:
            reason = f"{host} is not an address of this machine"
        elif isinstance(exc, OSError) and code is None:  # gRPC does not say which
            reason = "the port is in use or the host is not an address of this machine"
        else:
            reason = str(exc.__cause__ or exc)
        raise PortUnavailable(
            f"the broker cannot bind its {what} port {host}:{port}: {reason}. Change broker.{setting} "
            f"(primerl-broker --{setting.replace('_', '-')} N; 0 picks a free port; under `primerl rl`, unset means "
            "a free one) or broker.host"
        ) from exc


class BrokerService:
    def __init__(self, config: BrokerConfig):
        self.config = config
        self.run_id = config.run_id or f"run-{uuid.uuid4().hex[:8]}"
        # One payload frame of at most max_message_bytes (libzmq's MAXMSGSIZE is per frame); weight updates travel
        # as chunks of weight_chunk_bytes (at most that). Every worker learns them when it registers.
        self.data_plane_limits = BrokerLimits.for_max_message_bytes(
            config.max_message_bytes,
            max_payload_frames=config.max_payload_frames,
            max_transfer_bytes=config.resolved_max_transfer_bytes,
            weight_chunk_bytes=config.weight_chunk_bytes,
        )
        self.limits, self.chunk_bytes = self.data_plane_limits.frames, self.data_plane_limits.weight_chunk_bytes
        # The rollout socket's own, smaller cap (a rollout micro-batch is one frame; weights travel in chunks):
        # what orchestrators are told at registration, and what the rollout plane decodes with.
        self.rollout_producer_limits = BrokerLimits.for_max_message_bytes(
            config.resolved_max_rollout_message_bytes,
            max_payload_frames=config.max_payload_frames,
            max_transfer_bytes=config.resolved_max_transfer_bytes,
        )
        self._context: zmq.Context | None = None  # the rollout plane's
        self._weight_context: zmq.Context | None = None  # one per plane: each context has one ZAP handler
        self._queue: RolloutQueue | None = None
        self.rollout_plane: RolloutPlane | None = None
        self.weight_plane: WeightPlane | None = None
        self.weight_store = WeightStore()
        self.weight_fanout = WeightFanout(
            self.weight_store,
            fanout=config.weight_fanout,
            relay_timeout_s=config.weight_relay_timeout_s,
            relay_max_hops=config.weight_relay_max_hops,
            max_workers=config.max_workers,
        )
        self.registry = WorkerRegistry(
            self.run_id,
            config.heartbeat_interval_s,
            config.heartbeat_liveness,
            max_steps=config.max_steps,
            on_commit=self._release_through,
            step_window=self._step_window,
            persist=self._persist_run_state,
            end_of_run_grace_s=END_OF_RUN_GRACE_S,
            orchestrator_finish_s=ORCHESTRATOR_FINISH_S,
            policy=self.weight_fanout,
            max_workers=config.max_workers,
            heartbeat_budget_per_s=config.heartbeat_budget_per_s,
        )
        self.run_state_file: RunStateFile | None = None
        self._saver: RunStateSaver | None = None
        self.history = RunHistory(config.history_max_bytes)  # the dashboard's (broker/run_history.py)
        self._history_saver: RunStateSaver | None = None
        self.servicer = BrokerServicer(
            self.registry,
            self.data_plane_status,
            data_plane_limits=self.data_plane_limits,
            rollout_producer_limits=self.rollout_producer_limits,
            history=self.history,
        )
        self._server = None
        self._monitor = HeartbeatMonitor(self.registry, history=self.history)
        self._stopped = threading.Event()
        self.endpoints: BrokerEndpoints | None = None
        self.exporter: MetricsExporter | None = None

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> BrokerEndpoints:
        """Bind and start every plane; on any failure, stop what started and re-raise (``ValueError`` when the
        Prometheus port cannot be bound, ``PortUnavailable``, an ``OSError``, for the other ports: both name the
        setting to change)."""
        config = self.config
        pin_mmap_threshold()  # freed message buffers go back to the OS (broker/memory.py)
        try:
            self.exporter = start_exporter(
                "broker", config.prometheus, self._metrics_tls(), {DISCOVERY_PATH: self._discovery_route()}
            )
            if self.exporter is not None:
                self.exporter.register(BrokerCollector(self))
            curve = self._curve_server()
            self._context = zmq.Context()
            self._weight_context = zmq.Context()
            self._open_state()
            rollout_port = self._start_rollout_plane(curve)
            weight_port = self._start_weight_plane(curve)
            # What workers dial: advertise_host, else host; a wildcard is replaced by each worker with the host it
            # dialed the broker at (primerl.runtime.addresses), so nothing here assumes loopback.
            endpoint_host = url_host(config.endpoint_host)
            self.registry.set_endpoints(
                tcp_endpoint(endpoint_host, rollout_port), tcp_endpoint(endpoint_host, weight_port)
            )
            with _naming_the_setting("grpc_port", "gRPC", config.host, config.grpc_port):
                self._server, grpc_port = create_grpc_server(
                    self.servicer,
                    config.host,
                    config.grpc_port,
                    run_token=config.run_token,
                    tls_cert_path=config.tls_cert_path,
                    tls_key_path=config.tls_key_path,
                    tls_client_ca_path=config.tls_client_ca_path,
                )
            self._server.start()
            self._monitor.start()
        except BaseException:
            self.stop(grace_s=0)
            raise
        self._warn_about_auth()
        metrics_url = self.exporter.url if self.exporter is not None else None
        self.endpoints = BrokerEndpoints(grpc_port, rollout_port, weight_port, self.run_id, metrics_url)
        log.info(
            "broker serving",
            host=config.host,
            endpoint_host=config.endpoint_host,
            spool_dir=str(config.spool_dir),
            auth=bool(config.run_token),
            tls=config.tls_cert_path is not None,
            client_certificates=config.tls_client_ca_path is not None,
            curve=curve is not None,
            **self.endpoints.as_dict(),
        )
        return self.endpoints

    def _open_state(self) -> None:
        """The spool and its rollout queue, the run state and the run history (read back, then saved as they change)."""
        config = self.config
        self._queue = RolloutQueue(
            RolloutSpool(config.spool_dir, cache_max_bytes=config.read_cache_bytes),
            config.max_queue_batches,
            config.max_queue_bytes,
            max_step_lead=config.max_step_lead,
        )
        self.run_state_file = RunStateFile(config.spool_dir)  # the spool holds the directory's lock now
        self._restore_run_state()
        self._saver = RunStateSaver(
            self.registry.run_state,
            self.run_state_file,
            on_error=lambda message: self.registry.record_error("broker", message),
        )
        self._saver.start()
        history_file = RunHistoryFile(config.spool_dir)
        history_file.load_into(self.history)
        self._history_saver = RunStateSaver(self.history.snapshot, history_file, interval_s=SAVE_INTERVAL_S)
        self._history_saver.start()

    def _start_rollout_plane(self, curve: CurveServer | None) -> int:
        config = self.config
        assert self._queue is not None
        self.rollout_plane = RolloutPlane(
            self._queue,
            self._context,
            config.host,
            config.rollout_port,
            limits=self.rollout_producer_limits.frames,
            auth_token=config.run_token,
            on_error=self._on_data_plane_error,
            rcv_hwm=config.rollout_hwm,
            max_connections=config.max_rollout_connections,
            curve=curve,
        )
        with _naming_the_setting("rollout_port", "ZeroMQ rollout", config.host, config.rollout_port):
            return self.rollout_plane.start()

    def _start_weight_plane(self, curve: CurveServer | None) -> int:
        config = self.config
        self.weight_plane = WeightPlane(
            self.weight_fanout,
            self._weight_context,
            config.host,
            config.weight_port,
            limits=self.limits,
            auth_token=config.run_token,
            chunk_bytes=self.chunk_bytes,
            on_applied=self._on_weights_applied,
            hwm=config.weight_hwm,
            intake_bounds=IntakeBounds(
                transfer_stall_timeout_s=config.transfer_stall_timeout_s,
                evictable_after_s=config.transfer_evict_after_s,
                max_open_transfer_bytes=config.resolved_max_open_transfer_bytes,
                max_open_transfers_per_publisher=config.max_open_transfers_per_publisher,
                max_version_lead=config.max_step_lead,
            ),
            # The latest weight chain survives a restart too (``weight_durable``; the spool's lock covers it).
            durable_dir=config.spool_dir / WEIGHTS_SUBDIR,
            max_connections=config.max_weight_connections,
            curve=curve,
            is_registered=self.registry.is_alive,
        )
        with _naming_the_setting("weight_port", "ZeroMQ weight", config.host, config.weight_port):
            return self.weight_plane.start()

    def _curve_server(self) -> CurveServer | None:
        """The CURVE keys of the ZeroMQ planes (``ValueError`` naming the setting when a file is wrong)."""
        config = self.config
        if config.curve_secret_key_path is None or config.curve_authorized_keys_dir is None:
            return None
        curve = CurveServer.load(config.curve_secret_key_path, config.curve_authorized_keys_dir)
        log.info(
            "CURVE on the ZeroMQ planes",
            num_authorized_keys=len(curve.authorized_keys),
            authorized_keys_dir=str(config.curve_authorized_keys_dir),
        )
        return curve

    def _metrics_tls(self) -> TlsFiles | None:
        """With TLS on the gRPC port, the metrics port (and its service discovery) is HTTPS with the same files."""
        config = self.config
        if config.tls_cert_path is None or config.tls_key_path is None:
            return None
        return TlsFiles(config.tls_cert_path, config.tls_key_path, config.tls_client_ca_path)

    def _discovery_route(self) -> Route:
        """``/discovery``: Prometheus' HTTP service discovery of the run's metrics targets (``metrics_discovery``)."""
        return discovery_route(
            self.config.run_token,
            self.registry.list_workers,
            self.run_id,
            lambda: self.exporter.url if self.exporter is not None else None,
        )

    def num_discovery_targets(self, workers: Iterable[control_pb2.WorkerInfo]) -> int:
        """How many targets ``/discovery`` lists for ``workers`` (a metric of the broker's own)."""
        return len(target_groups(workers, self.run_id, self.exporter.url if self.exporter is not None else None))

    def _warn_about_auth(self) -> None:
        """A broker without a run token binds loopback only (``BrokerConfig`` refuses anything else unless
        ``allow_remote_without_token`` is set); either way it says what that means."""
        config = self.config
        if config.run_token:
            return
        if is_loopback_host(config.host):
            log.warning(
                "no run_token: any process on this machine can send to and read from the broker; "
                "set run_token (or PRIMERL_RUN_TOKEN) to require it",
                host=config.host,
            )
        else:
            log.warning(
                "no run_token on a non-loopback address (allow_remote_without_token = true): anyone who "
                "can reach these ports can feed rollouts, publish weights and read the run",
                host=config.host,
            )

    def serve_until(self, stop_event: threading.Event, check_interval_s: float = 0.5) -> int:
        """Block until ``stop_event`` is set; returns 1 if a data plane's IO thread died, else 0."""
        while not stop_event.wait(check_interval_s):
            for name, alive in (
                ("rollout plane", self.rollout_plane.running),
                ("weight plane", self.weight_plane.running),
            ):
                if not alive:
                    log.error("a data plane stopped unexpectedly; shutting down", plane=name)
                    return 1
        return 0

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting work, let in-flight RPCs finish within ``grace_s``, close every socket."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.servicer.shutdown()
        self._monitor.stop()
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1)
        for plane in (self.rollout_plane, self.weight_plane):
            if plane is not None:
                plane.stop()
        if self._saver is not None:
            self._saver.stop()  # the last write, while the spool still holds the directory's lock
        if self._history_saver is not None:
            self._history_saver.stop()
        if self._queue is not None:
            self._queue.close()
        for context in (self._context, self._weight_context):
            if context is not None:
                context.destroy(linger=0)
        if self.exporter is not None:
            self.exporter.stop()
        log.info("broker stopped")

    # -- run state -----------------------------------------------------------------------------------

    def _restore_run_state(self) -> None:
        """Take back what an earlier broker on this spool knew of the run (its id too, unless the config names
        another run: then that state is not this run's, and only the spool's commit marker carries over)."""
        state = self.run_state_file.load()
        committed = self._queue.spool.committed_step or 0
        if state is not None and self.config.run_id is not None and state.run_id != self.config.run_id:
            log.warning(
                "run state of another run ignored",
                path=str(self.run_state_file.path),
                stored_run_id=state.run_id,
                configured_run_id=self.config.run_id,
            )
            state = None
        if state is None and not committed:
            return
        self.registry.restore(state or RunState(run_id=self.run_id), committed_step=committed)
        if state is not None and state.run_id != self.run_id:
            self.run_id = state.run_id
            bind_context(run_id=self.run_id)
        _, restored = self.registry.run_state()
        log.info(
            "run state restored",
            last_committed_step=restored.last_committed_step,
            trainer_step=restored.trainer_step,
            orchestrator_step=restored.orchestrator_step,
            policy_version=restored.latest_policy_version,
            last_metrics_step=restored.last_metrics_step,
            num_metrics=len(restored.last_metrics),
            finished=restored.finished,
        )
        if state is not None and state.finished and not restored.finished:
            log.warning(
                "the run state says the run finished, but max_steps is higher now: the run goes on",
                finished_step=state.finished_step,
                max_steps=self.config.max_steps,
            )

    def _persist_run_state(self, revision: int, state: RunState) -> None:
        if self.run_state_file is not None:
            self.run_state_file.write(state, revision)

    # -- wiring --------------------------------------------------------------------------------------

    def _release_through(self, step: int) -> int:
        if self.rollout_plane is None:
            return 0
        return self.rollout_plane.release_through(step)

    def _step_window(self, step: int) -> str:
        """Commits far beyond the run's position are refused, like rollout requests (``max_step_lead``)."""
        if self._queue is None:
            return ""
        return self._queue.step_window(step)

    def _on_weights_applied(self, worker_id: str, version: int) -> None:
        self.registry.record_weight_ack(worker_id)

    def _on_data_plane_error(self, code: int, message: str, peer: str) -> None:
        self.registry.record_error(f"rollouts ({peer})", message)

    def data_plane_status(self) -> DataPlaneStatus:
        queues = []
        batches_per_s = bytes_per_s = weight_bytes_per_s = 0.0
        if self.rollout_plane is not None:
            rollout = self.rollout_plane.status()
            queue = rollout.queue
            queues.append(
                QueueDepth("rollouts", queue.num_batches, queue.num_bytes, queue.max_batches, queue.max_bytes)
            )
            batches_per_s, bytes_per_s = rollout.batches_in_per_s, rollout.bytes_in_per_s
        if self.weight_plane is not None:
            weights = self.weight_plane.status()
            store = weights.store
            queues.append(
                QueueDepth("weights", (store.snapshot_version is not None) + store.num_deltas, store.num_bytes)
            )
            weight_bytes_per_s = weights.bytes_out_per_s
        return DataPlaneStatus(
            queues=queues,
            rollout_batches_per_s=batches_per_s,
            rollout_bytes_per_s=bytes_per_s,
            weight_bytes_per_s=weight_bytes_per_s,
        )

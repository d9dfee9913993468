"""The broker's worker registry and run status: the core of the control plane, with no sockets.

Every worker registers, heartbeats and reports progress here (through ``control_service.BrokerServicer``). The policy
versions are the weight fan-out's (``weight_fanout``), which tells the registry when the latest one changes
(``WeightFanout.watch``); a worker the registry marks LOST, or that deregisters, leaves the fan-out. ``run_status``
assembles it all, with the data plane's queues and rates, into one ``RunStatus`` (``run_status``). The records are
``worker_record.WorkerRecord``, kept with their indexes by ``worker_table.WorkerTable``, the refusals
``registry_errors``, the trainers' lineages ``policy_lineage``.

Liveness follows the Paranoid Pirate pattern: a worker silent for ``liveness`` times its interval is marked LOST (and
stays listed so status shows it); any traffic from a worker resets its liveness. The interval is
``heartbeat_interval_s``, or longer once the fleet is large: the broker asks for at most ``heartbeat_budget_per_s``
heartbeats a second in all (each worker learns its interval from every answer), as Consul stretches its anti-entropy
interval with the cluster, so its heartbeat load stays bounded whatever the fleet. Expiry is applied on every call
(so answers are exact) and by a periodic ``expire()`` (``HeartbeatMonitor``), which logs and notifies watchers within
half an interval of the bound. A heartbeat's ``not_serving`` reason is the worker's state, not an error.

Thread-safe: one lock guards all state; ``wait_for_change`` waits on a condition of that lock
(``watched_state.WatchedState``, with the recent errors). Commits are serialized by a second lock so that the
``on_commit`` callback (the rollout queue's release) runs *outside* the state lock: the data plane may call back into
the registry without deadlocking.

Run state (``run_state``): the run's facts are numbered by a revision that moves only when one of them changes;
``run_state()`` snapshots them, ``restore()`` takes them back after a broker restart. A commit, a new policy lineage
and the end of the run call ``persist`` before they answer; everything else is written by a periodic saver. The steps
and the end of the run (``request_shutdown``): ``run_progress.RunProgress``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping

from primerl.broker.policy_lineage import PolicyLineages
from primerl.broker.registry_errors import (
    BrokerStopping,
    CommitFailed,
    CommitResult,
    StepOutOfOrder,
    WorkerNotFound,
)
from primerl.broker.run_end import ends_the_run, tells_to_stop
from primerl.broker.run_metrics import LastMetrics
from primerl.broker.run_progress import RunProgress
from primerl.broker.run_state import RunState
from primerl.broker.run_status import DataPlaneStatus, assemble_run_status, role_name
from primerl.broker.watched_state import MAX_ERROR_CHARS, WatchedState
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_store import WeightStore
from primerl.broker.worker_record import (
    ALIVE,
    LEFT,
    MAX_ERRORS_PER_HEARTBEAT,
    MAX_LIVE_WORKERS,
    MAX_METRIC_NAMES,
    WorkerRecord,
    check_metrics_report,
    check_register_request,
)
from primerl.broker.worker_table import WorkerTable
from primerl.proto.v1 import common_pb2, control_pb2

MAX_LOST_UNREPORTED = 1024  # workers marked LOST and not yet handed to the heartbeat monitor, at most


class WorkerRegistry(WatchedState):
    """Registered workers, their liveness and progress, and the run status built from them."""

    def __init__(
        self,
        run_id: str,
        heartbeat_interval_s: float,
        liveness: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall_clock: Callable[[], float] = time.time,
        max_steps: int | None = None,
        on_commit: Callable[[int], int] | None = None,
        rollout_endpoint: str = "",
        weight_endpoint: str = "",
        max_recent_errors: int = 32,
        max_gone_workers: int = 256,
        max_workers: int = MAX_LIVE_WORKERS,
        heartbeat_budget_per_s: float = 0.0,
        step_window: Callable[[int], str] | None = None,
        persist: Callable[[int, RunState], object] | None = None,
        end_of_run_grace_s: float = 0.0,
        policy: WeightFanout | None = None,
        orchestrator_finish_s: float = 0.0,
    ):
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        if liveness < 1:
            raise ValueError(f"liveness must be >= 1, got {liveness}")
        if end_of_run_grace_s < 0 or orchestrator_finish_s < 0:
            raise ValueError(
                f"end_of_run_grace_s and orchestrator_finish_s must be >= 0, got {end_of_run_grace_s}, "
                f"{orchestrator_finish_s}"
            )
        super().__init__(max_recent_errors)
        self.end_of_run_grace_s = end_of_run_grace_s
        self.orchestrator_finish_s = orchestrator_finish_s
        self.run_id = run_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.liveness = liveness
        self.max_steps = max_steps
        self._clock = clock
        self._wall_clock = wall_clock
        self._on_commit = on_commit
        self._rollout_endpoint = rollout_endpoint
        self._weight_endpoint = weight_endpoint
        if max_workers < 1 or heartbeat_budget_per_s < 0:
            raise ValueError(
                f"need max_workers >= 1, heartbeat_budget_per_s >= 0: {max_workers}, {heartbeat_budget_per_s}"
            )
        self.heartbeat_budget_per_s = heartbeat_budget_per_s
        # step -> why it is too far from the run's position ("" when fine); e.g. the rollout queue's window.
        self._step_window = step_window
        # workers marked LOST since the last ``expire()``, whoever marked them (a read expires too): the heartbeat
        # monitor logs each of them once
        self._lost_unreported: list[control_pb2.WorkerInfo] = []
        # (revision, state) -> writes it durably (``RunStateFile.write``); raises OSError when it cannot.
        self._persist = persist
        # The owner of the policy versions (latest, per worker); None: one over an empty store of its own.
        self.policy = policy if policy is not None else WeightFanout(WeightStore())
        self.policy.watch(self._on_policy_changed)
        self._lineages = PolicyLineages(self.policy)

        self._commit_lock = threading.Lock()
        self._metrics = LastMetrics()
        self._progress = RunProgress()
        # a forgotten worker's progress stays in the run's steps (they never go back)
        self._workers = WorkerTable(
            liveness, max_workers=max_workers, max_gone_workers=max_gone_workers, on_forget=self._progress.keep_steps_of
        )
        # ``closed`` (WatchedState): the broker process is stopping: register and heartbeat answer BrokerStopping.
        self._state_revision = 0  # moves whenever a field of run_state() changes
        self.started_unix_ms = self._unix_ms()

    # ----------------------------------------------------------------------------------- properties
    @property
    def max_workers(self) -> int:
        return self._workers.max_workers

    @property
    def num_expiry_sweeps(self) -> int:
        return self._workers.num_expiry_sweeps

    @property
    def timeout_s(self) -> float:
        """Silence after which a worker is marked LOST."""
        return self.liveness * self.heartbeat_interval_s

    def asked_interval_s(self, joining: int = 0) -> float:
        """The heartbeat interval a worker is asked for now: ``heartbeat_interval_s``, or longer once the live fleet
        (and ``joining`` more) would send more than ``heartbeat_budget_per_s`` heartbeats a second (0: no budget).
        Call under the lock."""
        if not self.heartbeat_budget_per_s:
            return self.heartbeat_interval_s
        return max(self.heartbeat_interval_s, (self._workers.num_alive + joining) / self.heartbeat_budget_per_s)

    @property
    def last_committed_step(self) -> int:
        with self._lock:
            return self._progress.last_committed_step

    @property
    def shutdown_requested(self) -> bool:
        """The run is over (``request_shutdown``, or restored as finished): heartbeats tell workers to stop
        (once the grace of ``request_shutdown`` has passed)."""
        with self._lock:
            return self._progress.finished

    # ------------------------------------------------------------------------------------ run state
    def run_state(self) -> tuple[int, RunState]:
        """``(revision, state)``: the run's facts as ``run_state.json`` keeps them; the revision moves with
        every change of them (``RunStateFile.write`` keeps the newest)."""
        with self._lock:
            self._expire_locked(self._clock())
            return self._state_revision, self._run_state_locked()

    def _run_state_locked(self) -> RunState:
        return RunState(
            run_id=self.run_id,
            last_committed_step=self._progress.last_committed_step,
            trainer_step=self._progress.trainer_step(self._workers),
            orchestrator_step=self._progress.orchestrator_step(self._workers),
            latest_policy_version=self.policy.latest().version,
            policy_lineage=self._lineages.floor(),
            last_metrics=dict(self._metrics.values),
            last_metrics_step=self._metrics.step,
            finished=self._progress.finished,
            finished_step=self._progress.finished_step,
        )

    def restore(self, state: RunState, *, committed_step: int = 0) -> None:
        """Take back the run state of an earlier broker (before any worker registers). ``committed_step``:
        the spool's own commit marker; the higher of the two wins (both are written before a commit answers).
        The latest policy version goes to the fan-out (``restore_latest``), which answers it until it holds one.
        ``finished`` is kept only while it still holds (``RunProgress.restore``)."""
        with self._lock:
            self.run_id = state.run_id
            # The grace is counted again from the restart: a supervisor may still be ending the run itself.
            self._progress.restore(
                state,
                committed_step=committed_step,
                max_steps=self.max_steps,
                stop_workers_at=self._clock() + self.end_of_run_grace_s,
            )
            self.policy.restore_latest(state.latest_policy_version)
            self._lineages.restore(state.policy_lineage)
            self._metrics.restore(state.last_metrics, state.last_metrics_step)
            self._state_revision += 1
            self._bump_locked()

    def _persist_now(self) -> None:
        """Write the run state before answering (a commit, the end of the run); ``OSError`` when it cannot."""
        if self._persist is not None:
            self._persist(*self.run_state())

    # --------------------------------------------------------------------------------- worker calls
    def register(self, request: control_pb2.RegisterRequest) -> control_pb2.RegisterResponse:
        """Add a worker. A name may be reused once its previous holder is LOST or LEFT (that record is dropped).
        ``BrokerStopping`` after ``close()``. The same client asking again while its record is alive (its
        ``instance_id``: the first answer was lost or late) gets that registration back."""
        name = check_register_request(request)
        with self._lock:
            self._refuse_if_closed_locked()
            self._lineages.refuse_superseded(request)  # before the name: B may hold the name A comes back with
            now = self._clock()
            self._expire_locked(now)
            again = self._workers.live_holder(name, request.instance_id)
            if again is not None:
                again.last_seen = now
                return self._registration_locked(again.worker_id, again.interval_s, again.policy_lineage)
            self._workers.make_room(name, self.timeout_s)
            # Only a registration that succeeds takes a lineage: a refused one (a name still held) changes nothing.
            policy_lineage, lineage_changed = self._lineages.assign(request)
            if lineage_changed:
                self._state_revision += 1
            worker_id = uuid.uuid4().hex
            interval_s = self.asked_interval_s(joining=1)  # the fleet it is about to join
            record = WorkerRecord.registered(request, name, worker_id, now, self._unix_ms(), policy_lineage, interval_s)
            self._workers.add(record, now)
            self._bump_locked()
        if lineage_changed:
            self._persist_lineage(policy_lineage)
        with self._lock:
            return self._registration_locked(worker_id, interval_s, policy_lineage)

    def _registration_locked(
        self, worker_id: str, interval_s: float, policy_lineage: int
    ) -> control_pb2.RegisterResponse:
        return control_pb2.RegisterResponse(
            worker_id=worker_id,
            run_id=self.run_id,
            heartbeat_interval_ms=max(1, round(interval_s * 1000)),
            liveness=self.liveness,
            rollout_endpoint=self._rollout_endpoint,
            weight_endpoint=self._weight_endpoint,
            latest_policy_version=self.policy.latest().version,
            policy_lineage=policy_lineage,
        )

    def _persist_lineage(self, lineage: int) -> None:
        """A new or larger lineage is written to the run state before the answer, so a restarted broker never hands
        it out again. When the write fails (a full spool disk) it is handed out all the same: the trainer's commits
        are what free the spool. The recent errors say so and the saver retries; a broker restarted before then
        resumes above the weight store's lineage, and the trainer's re-registration names its lineage again."""
        try:
            self._persist_now()
        except OSError as err:
            message = f"policy lineage {lineage} handed out but not saved yet ({err}); the run state saver retries"
            self.record_error("broker", message)

    def heartbeat(self, request: control_pb2.HeartbeatRequest) -> control_pb2.HeartbeatResponse:
        """Reset the worker's liveness and store its progress. Unknown or expired id: ``WorkerNotFound``;
        after ``close()``: ``BrokerStopping``. ``shutdown_requested`` only after ``request_shutdown()``."""
        with self._lock:
            self._refuse_if_closed_locked()
            worker = self._live_worker_locked(request.worker_id)
            worker.interval_s = self.asked_interval_s()
            self._workers.note_deadline(worker.last_seen + self.liveness * worker.interval_s)  # it may have shrunk
            if worker.take_heartbeat(request, self._unix_ms()):
                self._state_revision += 1
            change = worker.note_serving(request.not_serving[:MAX_ERROR_CHARS])
            for message in ([change] if change else []) + list(request.recent_errors)[-MAX_ERRORS_PER_HEARTBEAT:]:
                self._add_error_locked(worker.name, message)
            self._bump_locked()
            latest = self.policy.latest()
            return control_pb2.HeartbeatResponse(
                latest_policy_version=latest.version,
                last_committed_step=self._progress.last_committed_step,
                shutdown_requested=tells_to_stop(
                    worker,
                    self._workers,
                    self._progress,
                    self._clock(),
                    timeout_s=self.timeout_s,
                    orchestrator_finish_s=self.orchestrator_finish_s,
                ),
                policy_lineage=latest.lineage,
                lineage_base_version=latest.lineage_base_version,
                heartbeat_interval_ms=max(1, round(worker.interval_s * 1000)),
            )

    def deregister(self, worker_id: str, reason: str = "") -> bool:
        """Mark the worker LEFT (kept in status). Deregistering twice is harmless.

        Returns True when this ends the run: trainer rank 0 leaving with ``TRAINING_FINISHED_REASON`` once the
        run's trainer step reached ``max_steps`` (then ``request_shutdown`` has run, and the state is written)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                raise WorkerNotFound(f"no worker with id {worker_id!r} is registered")
            if worker.state != LEFT:
                self._workers.mark_gone(worker, LEFT)
                self._leave_fanout_locked(worker, "deregistered")
                self._bump_locked()
            run_step = max(self._progress.trainer_step(self._workers), self._progress.last_committed_step)
            finishes = ends_the_run(worker, reason, run_step, self.max_steps, self._progress.finished)
        if finishes:
            self.request_shutdown(grace_s=self.end_of_run_grace_s)
        return finishes

    def report_metrics(self, worker_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Merge the metrics into ``last_metrics`` (later reports win) and advance the reporter's step.
        Non-finite values are refused."""
        check_metrics_report(metrics)
        with self._lock:
            worker = self._live_worker_locked(worker_id)
            self._metrics.merge(worker.name, step, metrics)
            worker.reached(step)
            self._state_revision += 1
            self._bump_locked()

    def commit_step(self, worker_id: str, step: int) -> CommitResult:
        """Record that ``step`` is durably checkpointed and release its spooled batches.

        Returns ``CommitResult(last_committed_step, num_batches_released, already_committed)``. Idempotent: a
        step at or below the last committed one (a retry whose answer was lost, or one sent again to a restarted
        broker that had kept the commit) succeeds with nothing released and the last committed step unchanged.
        Safe because a step is committed only after its checkpoint is durable, and the rollout queue never hands
        out a committed step's batches again: no step can be trained twice through a repeated commit.

        The run state is written (``persist``) before the answer; if that fails the commit answers
        ``CommitFailed`` and the trainer's retry writes it again. ``on_commit`` runs outside the state lock.
        """
        with self._commit_lock:
            with self._lock:
                worker = self._live_worker_locked(worker_id)
                if worker.role != common_pb2.ROLE_TRAINER:
                    raise StepOutOfOrder(
                        f"only trainer workers commit steps; {worker.name!r} is {role_name(worker.role)}"
                    )
                self._lineages.refuse_superseded_commit(worker.name, worker.policy_lineage, step)
                last_committed = self._progress.last_committed_step
            if step <= last_committed:
                self._persist_committed(step)
                return CommitResult(last_committed, 0, already_committed=True)
            too_far = self._step_window(step) if self._step_window is not None else ""
            if too_far:
                raise StepOutOfOrder(f"commit refused: {too_far}")
            num_released = 0
            if self._on_commit is not None:
                try:
                    num_released = int(self._on_commit(step))
                except Exception as err:  # the callback's failure is the caller's answer, not a broker crash
                    raise CommitFailed(f"releasing the rollout batches of step {step} failed: {err}") from err
            with self._lock:
                self._progress.last_committed_step = max(self._progress.last_committed_step, step)
                self._state_revision += 1
                self._bump_locked()
            self._persist_committed(step)
            return CommitResult(step, num_released)

    def _persist_committed(self, step: int) -> None:
        try:
            self._persist_now()
        except OSError as err:
            raise CommitFailed(
                f"step {step} is committed but the run state could not be written ({err}); retry the commit"
            ) from err

    # ------------------------------------------------------------------------------ data-plane calls
    def record_weight_ack(self, worker_id: str) -> bool:
        """The weight plane heard ``worker_id`` acknowledge (or declare) a policy version: counts as traffic from
        it, and wakes status watchers (the version itself is the fan-out's).

        Never raises (it runs on the weight plane's IO thread): returns False when the id is not a live worker.
        """
        with self._lock:
            try:
                self._live_worker_locked(worker_id)
            except WorkerNotFound:
                return False
            self._bump_locked()
            return True

    def _on_policy_changed(self) -> None:
        """The fan-out's latest policy changed (``WeightFanout.watch``): the run state has a new revision."""
        with self._lock:
            self._state_revision += 1
            self._bump_locked()

    def set_endpoints(self, rollout_endpoint: str, weight_endpoint: str) -> None:
        """ZMQ endpoints handed to registering workers (known once the data plane has bound its ports)."""
        with self._lock:
            self._rollout_endpoint = rollout_endpoint
            self._weight_endpoint = weight_endpoint

    def get_worker(self, worker_id: str) -> control_pb2.WorkerInfo | None:
        """The worker's info (any state), or None. The data plane uses it to check a peer is registered."""
        with self._lock:
            self._expire_locked(self._clock())
            worker = self._workers.get(worker_id)
            return self._info_locked(worker) if worker is not None else None

    def is_alive(self, worker_id: str, role: int | None = None) -> bool:
        with self._lock:
            self._expire_locked(self._clock())
            worker = self._workers.get(worker_id)
            return worker is not None and worker.state == ALIVE and (role is None or worker.role == role)

    # ------------------------------------------------------------------------------------ liveness
    def expire(self, now: float | None = None) -> list[control_pb2.WorkerInfo]:
        """Mark workers silent for longer than ``timeout_s`` LOST; returns the ones marked since the last call, here
        or by a read (``list_workers``, ``run_status``... expire first, so that they never list a silent worker as
        alive), each once."""
        with self._lock:
            self._expire_locked(self._clock() if now is None else now)
            lost, self._lost_unreported = self._lost_unreported, []
            return lost

    # --------------------------------------------------------------------------------------- reads
    def list_workers(
        self, role: int = common_pb2.ROLE_UNSPECIFIED, include_gone: bool = False
    ) -> list[control_pb2.WorkerInfo]:
        """Workers in registration order; ``ROLE_UNSPECIFIED`` lists every role; LOST/LEFT only if asked."""
        with self._lock:
            self._expire_locked(self._clock())
            versions = self.policy.worker_versions()
            records = [
                worker.snapshot()
                for worker in self._workers
                if (role == common_pb2.ROLE_UNSPECIFIED or worker.role == role)
                and (include_gone or worker.state == ALIVE)
            ]
        return [record.info(versions.get(record.worker_id)) for record in records]  # built outside the lock

    def run_status(self, data_plane: DataPlaneStatus | None = None) -> control_pb2.RunStatus:
        """The whole status. The lock is held only to copy the records (~0.5 us each); the ``WorkerInfo`` messages
        (~5 us each) are built after it is released, so that a thousand workers' status does not stall their
        heartbeats."""
        with self._lock:
            self._expire_locked(self._clock())
            versions = self.policy.worker_versions()
            records = [worker.snapshot() for worker in self._workers]
            run_state, latest = self._run_state_locked(), self.policy.latest()
            recent_errors, updated_unix_ms = list(self._recent_errors), self._unix_ms()
        return assemble_run_status(
            run_state,
            latest,
            [record.info(versions.get(record.worker_id)) for record in records],
            data_plane or DataPlaneStatus(),
            started_unix_ms=self.started_unix_ms,
            updated_unix_ms=updated_unix_ms,
            recent_errors=recent_errors,
            max_steps=self.max_steps or 0,
            max_metric_names=MAX_METRIC_NAMES,
        )

    # -------------------------------------------------------------------------------------- the end
    def close(self) -> None:
        """The broker process is stopping: watchers wake up; register and heartbeat fail with ``BrokerStopping``
        (UNAVAILABLE), so that workers retry and ride through a restart. It never asks workers to stop."""
        self._close()

    def request_shutdown(self, grace_s: float = 0.0) -> None:
        """The run is over: every heartbeat from ``grace_s`` on answers ``shutdown_requested`` and its worker
        stops. The run state says ``finished`` (written here: a broker restarted after it still tells late workers
        to stop); a failed write goes to the recent errors and the periodic saver retries it."""
        with self._lock:
            if self._progress.finish(self._progress.trainer_step(self._workers), self._clock() + max(0.0, grace_s)):
                self._state_revision += 1
            self._bump_locked()
        try:
            self._persist_now()
        except OSError as err:
            self.record_error("broker", f"the run is finished but the run state could not be written: {err}")

    # ------------------------------------------------------------------------------------- internals
    def _unix_ms(self) -> int:
        return int(self._wall_clock() * 1000)

    def _refuse_if_closed_locked(self) -> None:
        if self._closed:
            raise BrokerStopping("the broker is stopping (a restart or a service stop): retry until it is back")

    def _info_locked(self, worker: WorkerRecord) -> control_pb2.WorkerInfo:
        return worker.info(self.policy.worker_version(worker.worker_id))

    def _leave_fanout_locked(self, worker: WorkerRecord, why: str) -> None:
        """A LOST or departed inference worker gets no more weight pushes (it registers again under a new id)."""
        if worker.role == common_pb2.ROLE_INFERENCE:
            self.policy.leave(worker.worker_id, reason=f"the registry marked it {why}")

    def _live_worker_locked(self, worker_id: str) -> WorkerRecord:
        """The ALIVE worker with this id, its liveness reset; else ``WorkerNotFound``."""
        now = self._clock()
        self._expire_locked(now)
        worker = self._workers.get(worker_id)
        if worker is None:
            raise WorkerNotFound(f"no worker with id {worker_id!r} is registered: register again")
        if worker.state != ALIVE:
            why = "deregistered" if worker.state == LEFT else f"lost (no heartbeat for {self.timeout_s:g} s)"
            raise WorkerNotFound(f"worker {worker.name!r} ({worker_id}) was {why}: register again")
        worker.last_seen = now
        return worker

    def _expire_locked(self, now: float) -> None:
        """Mark the live workers silent past their deadline LOST (``WorkerTable.expire``: O(1) until one passed),
        each with a recent error, out of the weight fan-out, and queued for the heartbeat monitor's log."""
        lost = []
        for worker in self._workers.expire(now):
            silent_s = now - worker.last_seen
            self._add_error_locked("broker", f"worker {worker.name} lost: no heartbeat for {silent_s:.1f} s")
            self._leave_fanout_locked(worker, "lost")
            lost.append(self._info_locked(worker))
        if lost:
            # bounded: without a heartbeat monitor calling ``expire()`` (a registry in a test) nobody drains it
            self._lost_unreported = (self._lost_unreported + lost)[-MAX_LOST_UNREPORTED:]
            self._bump_locked()

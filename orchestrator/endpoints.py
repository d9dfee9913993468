"""The inference workers the orchestrator sends rollouts to, read from the broker's worker list in a thread of
their own, so that the main loop never blocks on the broker (it keeps collecting rollouts through an outage).

    watcher = EndpointWatcher(lambda: control.list_workers(common_pb2.ROLE_INFERENCE), outage_s=120)
    watcher.start()
    generation, workers = watcher.snapshot()   # {worker_id: (base_url, policy_version)}; cheap, no IO
    watcher.set_fast(True)                     # re-read every `fast_interval_s` (dispatch waits for a version)
    watcher.check()                            # raises the thread's error (BrokerOutageExceeded ...) in the caller
    watcher.stop()

Invariants:
- The worker list is re-read every ``interval_s`` (``fast_interval_s`` while ``set_fast(True)``); each success
  replaces the snapshot and bumps ``generation``. Workers without an address are left out.
- A worker listed with ``serving = "false"`` (its engine stalled: ``inference.engine_watchdog``) is left out of
  the snapshot, so that it *leaves* below and its groups go elsewhere; the watcher logs ``inference worker out of
  rotation`` (with the broker's reason) and, once it is listed serving again, ``inference worker back in rotation``
  (it then joins again, serving at once when it holds the current version).
- While the broker is unreachable (``BrokerUnavailable``) the last snapshot stays, the thread retries
  (``retry_through_outage``) and logs ``waiting for the broker`` every 5 s; past ``outage_s`` the thread stops
  with ``BrokerOutageExceeded``, which ``check`` raises in the caller's thread. Any other error of the list
  call stops the thread the same way (logged once).

``InferenceWorkers`` turns successive snapshots into the endpoints rollouts go to, and says who joined and left:

- a worker id not seen before *joins* (log ``inference worker joined``: worker id, name, url, version). It gets
  no rollouts until it serves the policy version that was current when it joined (``ready``; log ``inference
  worker serving`` with ``join_to_serving_s``, from its registration to the first list showing it there);
- a worker id gone from the list (LOST or deregistered at the broker) *leaves* (log ``inference worker left``);
  ``update`` returns it so that its groups in flight are dispatched again elsewhere;
- a new id at the URL of an id that vanished in the same list is that server registered again (after a broker
  restart): the same endpoint, neither joined nor left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from primerl.client.outage import OutageStopped, OutageWatch, retry_through_outage
from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.endpoints")

ENDPOINT_BACKOFF_S = (0.5, 5.0)  # first and longest pause of dispatch to an endpoint that did not answer


class WorkerEndpoint(NamedTuple):
    """One inference worker as the broker lists it."""

    base_url: str  # ending in /v1
    policy_version: int
    name: str = ""
    registered_unix_ms: int = 0


Snapshot = dict[str, WorkerEndpoint]


@dataclass(eq=False)
class InferenceEndpoint:
    """An inference worker rollouts are sent to (from the broker's worker list), and its dispatch state."""

    worker_id: str
    base_url: str
    policy_version: int
    num_inflight: int = 0
    # While it does not answer (connection refused/reset: restarting?): no dispatch before retry_at_s.
    retry_at_s: float = 0.0
    backoff_s: float = 0.0
    name: str = ""
    registered_unix_ms: int = 0
    # A worker that joined serves no rollouts before it serves ``target_version`` (the current one when it joined).
    ready: bool = True
    target_version: int = 0
    last_answer_s: float = 0.0  # when one of its rollouts last came back (monotonic): ``RolloutScheduler.retry_silent``

    def unreachable(self, now_s: float) -> None:
        """A rollout on it failed because it could not be reached: pause dispatch to it (doubling, capped)."""
        if now_s >= self.retry_at_s:  # one back-off step per probe, not per failure of a burst
            self.backoff_s = min(max(ENDPOINT_BACKOFF_S[0], 2 * self.backoff_s), ENDPOINT_BACKOFF_S[1])
            self.retry_at_s = now_s + self.backoff_s

    def answered(self, now_s: float) -> None:
        self.retry_at_s = self.backoff_s = 0.0
        self.last_answer_s = now_s

    def may_take(self, now_s: float) -> bool:
        """Whether a group may go to it now: not backing off, and after a back-off one group at a time (a probe)
        until one of its rollouts succeeds."""
        return self.retry_at_s <= now_s and not (self.backoff_s and self.num_inflight)

    def describe(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "name": self.name,
            "url": self.base_url,
            "policy_version": self.policy_version,
        }


class EndpointWatcher:
    def __init__(
        self,
        list_workers: Callable[[], Sequence[Any]],
        *,
        outage_s: float,
        healable: tuple[type[BaseException], ...],
        interval_s: float = 1.0,
        fast_interval_s: float = 0.05,
        name: str = "endpoint-watcher",
        what: str = "inference workers",
    ):
        self._list_workers = list_workers
        self._healable = healable
        self.interval_s = interval_s
        self.fast_interval_s = fast_interval_s
        self.what = what  # in log lines: "inference workers", "teacher workers"
        self._watch = OutageWatch(f"the list of {what} (ListWorkers)", outage_s, worker="orchestrator")
        self._lock = threading.Lock()
        self._snapshot: Snapshot = {}
        self._generation = 0
        self.out_of_rotation: dict[str, str] = {}  # worker id -> name, of the listed workers that cannot serve now
        self.num_out_of_rotation = 0  # times a worker was taken out since the start
        self._error: BaseException | None = None
        self._fast = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def snapshot(self) -> tuple[int, Snapshot]:
        with self._lock:
            return self._generation, self._snapshot

    def set_fast(self, fast: bool) -> None:
        if fast and not self._fast:
            self._wake.set()
        self._fast = fast

    def check(self) -> None:
        with self._lock:
            error = self._error
        if error is not None:
            raise error

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                infos = retry_through_outage(self._list_workers, self._watch, self._healable, stop_event=self._stop)
            except OutageStopped:
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the main loop by check()
                log.error(f"reading the {self.what} failed; the orchestrator stops", error=str(exc))
                with self._lock:
                    self._error = exc
                return
            snapshot: Snapshot = {}
            not_serving: dict[str, str] = {}
            for info in infos:
                if info.address and info.capabilities.get(telemetry.SERVING_CAPABILITY) == "false":
                    not_serving[info.worker_id] = info.name
                elif info.address:
                    version = info.policy_version if info.HasField("policy_version") else 0
                    snapshot[info.worker_id] = WorkerEndpoint(
                        info.address.rstrip("/") + "/v1", version, info.name, info.registered_unix_ms
                    )
            self._note_rotation(not_serving, snapshot)
            with self._lock:
                self._snapshot = snapshot
                self._generation += 1
            self._wake.wait(self.fast_interval_s if self._fast else self.interval_s)
            self._wake.clear()

    def _note_rotation(self, not_serving: dict[str, str], snapshot: Snapshot) -> None:
        """Log the workers taken out of rotation (listed, not serving) and those back (listed serving again)."""
        worker = "teacher worker" if "teacher" in self.what else "inference worker"
        for worker_id, name in not_serving.items():
            if worker_id not in self.out_of_rotation:
                self.num_out_of_rotation += 1
                log.warning(
                    f"{worker} out of rotation",
                    worker_id=worker_id,
                    name=name,
                    reason="its heartbeats say serving: false (engine stalled); its rollouts go to other workers",
                )
        for worker_id, name in self.out_of_rotation.items():
            if worker_id not in not_serving and worker_id in snapshot:
                log.info(f"{worker} back in rotation", worker_id=worker_id, name=name, url=snapshot[worker_id].base_url)
        self.out_of_rotation = not_serving


class InferenceWorkers:
    """The endpoints rollouts may go to, kept from the watcher's snapshots (module docstring). Counts since the
    last ``take_counts``: ``num_joined``, ``num_left``, ``join_to_serving_s`` (one value per worker that caught
    up; only workers that registered after this object was made, i.e. during this orchestrator's run)."""

    def __init__(self, *, clock_unix_s: Callable[[], float] = time.time):
        self._clock_unix_s = clock_unix_s
        self._started_unix_ms = int(clock_unix_s() * 1000)
        self.endpoints: dict[str, InferenceEndpoint] = {}
        self.num_joined = 0
        self.num_left = 0
        self.join_to_serving_s: list[float] = []

    def update(self, workers: Mapping[str, tuple], current_version: int) -> list[InferenceEndpoint]:
        """Take a new snapshot (values: ``WorkerEndpoint`` or ``(base_url, policy_version)``); returns the endpoints
        that left."""
        infos = {worker_id: WorkerEndpoint(*value) for worker_id, value in workers.items()}
        vanished = {e.base_url: e for worker_id, e in self.endpoints.items() if worker_id not in infos}
        alive: dict[str, InferenceEndpoint] = {}
        for worker_id, info in infos.items():
            endpoint = self.endpoints.get(worker_id)
            if endpoint is None and info.base_url in vanished:  # registered again under a new id: same server
                endpoint = vanished.pop(info.base_url)
                log.info(
                    "inference worker registered again",
                    old_worker_id=endpoint.worker_id,
                    worker_id=worker_id,
                    url=info.base_url,
                )
                endpoint.worker_id = worker_id
            if endpoint is None:
                endpoint = InferenceEndpoint(
                    worker_id,
                    info.base_url,
                    info.policy_version,
                    name=info.name,
                    registered_unix_ms=info.registered_unix_ms,
                    ready=info.policy_version >= current_version,
                    target_version=current_version,
                )
                self.num_joined += 1
                log.info(
                    telemetry.INFERENCE_WORKER_JOINED,
                    **endpoint.describe(),
                    current_version=current_version,
                    serving=endpoint.ready,
                )
                if endpoint.ready:
                    self._now_serving(endpoint)
            endpoint.policy_version = info.policy_version
            alive[worker_id] = endpoint
        for endpoint in vanished.values():
            self.num_left += 1
            log.info(
                telemetry.INFERENCE_WORKER_LEFT, **endpoint.describe(), num_inflight_rollouts=endpoint.num_inflight
            )
        if not alive and self.endpoints:
            log.warning(telemetry.NO_INFERENCE_WORKER_ALIVE)
        self.endpoints = alive
        for endpoint in alive.values():  # (a rollback may have moved the current version below the target)
            if not endpoint.ready and endpoint.policy_version >= min(endpoint.target_version, current_version):
                endpoint.ready = True
                self._now_serving(endpoint)
        return list(vanished.values())

    def _now_serving(self, endpoint: InferenceEndpoint) -> None:
        """A worker that joined serves the current version: log how long that took since it registered."""
        fields: dict[str, Any] = {}
        if endpoint.registered_unix_ms and endpoint.registered_unix_ms >= self._started_unix_ms:
            seconds = max(0.0, self._clock_unix_s() - endpoint.registered_unix_ms / 1000)
            self.join_to_serving_s.append(seconds)
            fields["join_to_serving_s"] = round(seconds, 2)
        log.info(telemetry.INFERENCE_WORKER_SERVING, **endpoint.describe(), **fields)

    @property
    def joining(self) -> bool:
        """Some worker joined and does not serve the current version yet."""
        return any(not e.ready for e in self.endpoints.values())

    def ready(self) -> list[InferenceEndpoint]:
        return [e for e in self.endpoints.values() if e.ready]

    def take_counts(self) -> dict[str, float]:
        """``inference/*`` metrics since the last call: workers listed and serving, joined, left, and the longest
        time a worker took from registering to serving the current version (absent when none caught up)."""
        metrics = {
            telemetry.INFERENCE_WORKERS: float(len(self.endpoints)),
            telemetry.INFERENCE_WORKERS_SERVING: float(len(self.ready())),
            telemetry.INFERENCE_WORKERS_JOINED: float(self.num_joined),
            telemetry.INFERENCE_WORKERS_LEFT: float(self.num_left),
        }
        if self.join_to_serving_s:
            metrics[telemetry.INFERENCE_JOIN_TO_SERVING_S] = max(self.join_to_serving_s)
        self.num_joined = self.num_left = 0
        self.join_to_serving_s = []
        return metrics


__all__ = [
    "ENDPOINT_BACKOFF_S",
    "EndpointWatcher",
    "InferenceEndpoint",
    "InferenceWorkers",
    "Snapshot",
    "WorkerEndpoint",
]

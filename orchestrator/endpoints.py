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
- While the broker is unreachable (``BrokerUnavailable``) the last snapshot stays, the thread retries
  (``retry_through_outage``) and logs ``waiting for the broker`` every 5 s; past ``outage_s`` the thread stops
  with ``BrokerOutageExceeded``, which ``check`` raises in the caller's thread. Any other error of the list
  call stops the thread the same way (logged once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from primerl.client.outage import OutageStopped, OutageWatch, retry_through_outage
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.endpoints")

Snapshot = dict[str, tuple[str, int]]


class EndpointWatcher:
    def __init__(self, list_workers: Callable[[], Sequence[Any]], *, outage_s: float,
                 healable: tuple[type[BaseException], ...], interval_s: float = 1.0, fast_interval_s: float = 0.05,
                 name: str = "endpoint-watcher"):
        self._list_workers = list_workers
        self._healable = healable
        self.interval_s = interval_s
        self.fast_interval_s = fast_interval_s
        self._watch = OutageWatch("the list of inference workers (ListWorkers)", outage_s, worker="orchestrator")
        self._lock = threading.Lock()
        self._snapshot: Snapshot = {}
        self._generation = 0
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
                log.error("reading the inference workers failed; the orchestrator stops", error=str(exc))
                with self._lock:
                    self._error = exc
                return
            snapshot: Snapshot = {}
            for info in infos:
                if info.address:
                    version = info.policy_version if info.HasField("policy_version") else 0
                    snapshot[info.worker_id] = (info.address.rstrip("/") + "/v1", version)
            with self._lock:
                self._snapshot = snapshot
                self._generation += 1
            self._wake.wait(self.fast_interval_s if self._fast else self.interval_s)
            self._wake.clear()


__all__ = ["EndpointWatcher", "Snapshot"]

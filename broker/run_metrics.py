"""The run's last metrics as status shows them: later reports win, and the names are bounded per worker and in all
(a report that would pass a bound is refused with ``LimitReached``, never evicted silently). Not thread-safe: the
registry calls it under its lock."""

from __future__ import annotations

from collections.abc import Mapping

from primerl.broker.registry_errors import LimitReached
from primerl.broker.worker_record import MAX_LIVE_WORKERS, MAX_METRIC_NAMES, MAX_METRIC_NAMES_PER_WORKER


class LastMetrics:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.step = 0
        self._names_by_worker: dict[str, set[str]] = {}

    def merge(self, worker_name: str, step: int, metrics: Mapping[str, float]) -> None:
        """Take ``worker_name``'s report of ``step`` (checked already: ``check_metrics_report``)."""
        own = self._names_by_worker.setdefault(worker_name, set())
        new_names = [name for name in metrics if name not in self.values]
        unseen_by_worker = [name for name in metrics if name not in own]
        if len(own) + len(unseen_by_worker) > MAX_METRIC_NAMES_PER_WORKER:
            raise LimitReached(
                f"worker {worker_name!r} would report {len(own) + len(unseen_by_worker)} distinct metric "
                f"names; the broker keeps at most {MAX_METRIC_NAMES_PER_WORKER} per worker"
            )
        if len(self.values) + len(new_names) > MAX_METRIC_NAMES:
            raise LimitReached(
                f"the run would have {len(self.values) + len(new_names)} distinct metric names; "
                f"the broker keeps at most {MAX_METRIC_NAMES}"
            )
        if len(self._names_by_worker) > 4 * MAX_LIVE_WORKERS:
            self._names_by_worker = {worker_name: own}
        own.update(unseen_by_worker)
        self.values.update(metrics)
        self.step = step

    def restore(self, values: Mapping[str, float], step: int) -> None:
        """Take back an earlier broker's last metrics (its run state)."""
        self.values, self.step = dict(values), step

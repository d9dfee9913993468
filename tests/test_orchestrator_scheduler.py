"""The orchestrator's rollout scheduling driven directly, with fake env workers and a fake endpoint watcher (no
processes, no sockets): dispatch within the bounds, collect into a batch, reschedule the groups of a dead worker,
count failed rollouts, cancel stale groups."""

from __future__ import annotations

import concurrent.futures
import threading

from primerl.orchestrator.config import OrchestratorConfig
from primerl.orchestrator.env_client import EnvWorkerDied
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.rollout_failures import RolloutFailures
from primerl.orchestrator.rollout_scheduler import RolloutScheduler
from primerl.orchestrator.seeds import rollout_seed_base
from primerl.orchestrator.trajectory import Rollout, RolloutGroup, Turn


def rollout(index: int, reward: float, *, error: str | None = None) -> Rollout:
    turn = Turn([1, 2], [3, 4], [-0.5, -0.5], [1, 1], "stop", False, 0, 0)
    return Rollout(index, [] if error else [turn], None if error else reward, {}, False, None,
                   "ModelError" if error else None, error, [], [], 0.1)


class FakeWorker:
    """Answers every rollout request at once (rewards 0 and 1 alternate), or as ``answer`` says."""

    def __init__(self, answer=None) -> None:
        self.answer = answer or (lambda index, n: RolloutGroup("e", "train", index,
                                                               [rollout(i, float(i % 2)) for i in range(n)]))
        self.requests: list[tuple[list[int], dict]] = []
        self.cancelled: list[concurrent.futures.Future] = []
        self.num_restarts, self.max_restarts = 0, 3

    def submit_rollouts(self, example_indices, *, num_rollouts, **kwargs):
        self.requests.append((list(example_indices), kwargs))
        futures = []
        for index in example_indices:
            future: concurrent.futures.Future = concurrent.futures.Future()
            result = self.answer(index, num_rollouts)
            future.set_exception(result) if isinstance(result, BaseException) else future.set_result(result)
            futures.append(future)
        return futures

    def cancel(self, future) -> None:
        self.cancelled.append(future)

    def is_alive(self) -> bool:
        return True


class FakeWatcher:
    def __init__(self, workers) -> None:
        self.workers, self.generation = workers, 1

    def check(self) -> None:
        pass

    def set_fast(self, fast: bool) -> None:
        pass

    def snapshot(self):
        return self.generation, self.workers


def make_scheduler(worker: FakeWorker, *, max_async_level: int = 1, seed: int | None = 5) -> RolloutScheduler:
    config = OrchestratorConfig.model_validate({
        "model": {"name": "m"}, "env": [{"id": "e"}], "batch_size": 4, "rollouts_per_example": 2, "max_steps": 9,
        "max_inflight": 4, "max_async_level": max_async_level, "sampling": {"seed": seed}})
    scheduler = RolloutScheduler(config, stop_event=threading.Event())
    scheduler.workers["e"] = worker
    scheduler.sampler = EnvSampler({"e": 10}, {"e": 1.0}, seed=0)
    scheduler.failures = RolloutFailures(config.batch_size)
    return scheduler


def test_dispatch_and_collect_make_a_batch():
    worker = FakeWorker()
    scheduler = make_scheduler(worker, seed=None)
    inflight = []
    scheduler.on_inflight = inflight.append
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    (indices, kwargs), = worker.requests  # both groups (max_inflight 4 / 2 per group) in one write
    assert len(indices) == 2 and kwargs["base_url"] == "http://w1/v1" and inflight == [4]
    assert scheduler.endpoints["w1"].num_inflight == 4
    scheduler.collect(timeout_s=1.0)
    assert not scheduler.inflight and scheduler.endpoints["w1"].num_inflight == 0 and inflight[-1] == 0
    batch = scheduler.assembler.take(min_policy_version=0)
    assert batch is not None and len(batch.groups) == 2 and scheduler.counters["rollouts"] == 4
    assert {s.example_id for s in batch.samples} == set(indices)


def test_each_group_gets_its_own_seed():
    worker = FakeWorker()
    scheduler = make_scheduler(worker, seed=5)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)  # one write per seed
    assert [kwargs["sampling"]["seed"] for _, kwargs in worker.requests] == [rollout_seed_base(5, g, 2) for g in (0, 1)]


def test_no_dispatch_while_the_served_policy_is_too_old():
    worker = FakeWorker()
    scheduler = make_scheduler(worker, max_async_level=0)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=3)  # step 3 needs version >= 2
    assert not worker.requests and scheduler.waiting_for_version and scheduler.counters["dispatch_waits"] == 1


def test_groups_of_a_dead_worker_are_dispatched_again_first():
    dead = [True]

    def answer(index, n):
        return EnvWorkerDied("gone") if dead[0] else RolloutGroup("e", "train", index,
                                                                  [rollout(i, float(i % 2)) for i in range(n)])

    worker = FakeWorker(answer)
    scheduler = make_scheduler(worker)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    first = sorted(index for indices, _ in worker.requests for index in indices)
    dead[0] = False
    scheduler.collect(timeout_s=1.0)
    assert scheduler.counters["rescheduled"] == 4 and not scheduler.inflight
    scheduler.dispatch(step=1)
    again = sorted(index for indices, _ in worker.requests[2:] for index in indices)
    assert again == first  # the same examples, before any new draw


def test_failed_rollouts_are_counted_by_kind_and_back_off_an_unreachable_endpoint():
    worker = FakeWorker(lambda index, n: RolloutGroup("e", "train", index, [
        rollout(i, 0.0, error="connection refused: All connection attempts failed") for i in range(n)]))
    scheduler = make_scheduler(worker)
    errors = []
    scheduler.on_error = lambda: errors.append(1)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    scheduler.collect(timeout_s=1.0)
    assert scheduler.counters["rollout_errors"] == 4 and scheduler.counters["errors/ModelError"] == 4
    assert len(errors) == 4 and scheduler.assembler.take(min_policy_version=0) is None
    assert scheduler.endpoints["w1"].retry_at_s > 0  # no dispatch to it for a while: it may be restarting


def test_stale_groups_are_cancelled():
    worker = FakeWorker(lambda index, n: concurrent.futures.Future())  # never answered

    def submit(example_indices, *, num_rollouts, **kwargs):
        worker.requests.append((list(example_indices), kwargs))
        return [concurrent.futures.Future() for _ in example_indices]

    worker.submit_rollouts = submit
    scheduler = make_scheduler(worker, max_async_level=0)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    assert len(scheduler.inflight) == 2
    scheduler.cancel_stale(step=2)  # made by version 0, step 2 needs version 1
    assert not scheduler.inflight and len(worker.cancelled) == 2
    assert scheduler.counters["stale_groups_cancelled"] == 2

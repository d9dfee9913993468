"""The orchestrator's rollout scheduling driven directly, with fake env workers and a fake endpoint watcher (no
processes, no sockets): dispatch within the bounds, collect into a batch, reschedule the groups of a dead worker,
count failed rollouts, cancel stale groups."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.endpoints import InferenceWorkers, WorkerEndpoint
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.envs.base import EnvWorkerDied
from primerl.orchestrator.rollout_failures import RolloutFailures
from primerl.orchestrator.rollout_scheduler import MAX_GROUP_RETRIES, RolloutScheduler
from primerl.orchestrator.seeds import rollout_seed_base
from primerl.orchestrator.silent_workers import SILENCE_MIN_S
from primerl.orchestrator.trajectory import Rollout, RolloutGroup, Turn
from primerl.orchestrator.types import SchedulerEvents


def rollout(index: int, reward: float, *, error: str | None = None) -> Rollout:
    turn = Turn([1, 2], [3, 4], [-0.5, -0.5], [1, 1], "stop", False, 0, 0)
    return Rollout(
        index,
        [] if error else [turn],
        None if error else reward,
        {},
        False,
        None,
        "ModelError" if error else None,
        error,
        [],
        [],
        0.1,
    )


class FakeWorker:
    """Answers every rollout request at once (rewards 0 and 1 alternate), or as ``answer`` says."""

    def __init__(self, answer=None) -> None:
        self.answer = answer or (
            lambda index, n: RolloutGroup("e", "train", index, [rollout(i, float(i % 2)) for i in range(n)])
        )
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


def make_scheduler(
    worker: FakeWorker,
    *,
    max_async_level: int = 1,
    seed: int | None = 5,
    events: SchedulerEvents | None = None,
    **overrides,
) -> RolloutScheduler:
    config = OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "env": [{"id": "e"}],
            "batch_size": 4,
            "rollouts_per_example": 2,
            "max_steps": 9,
            "max_inflight": 4,
            "max_async_level": max_async_level,
            "sampling": {"seed": seed},
            **overrides,
        }
    )
    return RolloutScheduler(
        config,
        stop_event=threading.Event(),
        env_clients={"e": worker},
        sampler=EnvSampler({"e": 10}, {"e": 1.0}, seed=0),
        failures=RolloutFailures(config.batch_size),
        events=events,
    )


def test_dispatch_and_collect_make_a_batch():
    worker = FakeWorker()
    inflight = []
    scheduler = make_scheduler(worker, seed=None, events=SchedulerEvents(inflight_changed=inflight.append))
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    ((indices, kwargs),) = worker.requests  # both groups (max_inflight 4 / 2 per group) in one write
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
        return (
            EnvWorkerDied("gone")
            if dead[0]
            else RolloutGroup("e", "train", index, [rollout(i, float(i % 2)) for i in range(n)])
        )

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


def test_failed_rollouts_are_counted_by_kind():
    worker = FakeWorker(
        lambda index, n: RolloutGroup(
            "e",
            "train",
            index,
            [rollout(i, 0.0, error="This model's maximum context length is 16 tokens") for i in range(n)],
        )
    )
    errors = []
    scheduler = make_scheduler(worker, events=SchedulerEvents(rollout_failed=lambda: errors.append(1)))
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    scheduler.collect(timeout_s=1.0)
    assert scheduler.counters["rollout_errors"] == 4 and scheduler.counters["errors/ModelError"] == 4
    assert len(errors) == 4 and scheduler.assembler.take(min_policy_version=0) is None
    assert scheduler.counters["retried"] == 0 and scheduler.endpoints["w1"].retry_at_s == 0


def test_unreachable_rollouts_are_retried_backing_off_the_endpoint_then_counted_past_the_retries():
    worker = FakeWorker(
        lambda index, n: RolloutGroup(
            "e",
            "train",
            index,
            [rollout(i, 0.0, error="connection refused: All connection attempts failed") for i in range(n)],
        )
    )
    errors = []
    scheduler = make_scheduler(worker, events=SchedulerEvents(rollout_failed=lambda: errors.append(1)))
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    scheduler.dispatch(step=1)
    first = sorted(index for indices, _ in worker.requests for index in indices)
    scheduler.collect(timeout_s=1.0)
    # not failures: dispatched again (the whole groups), counted apart, and the endpoint backs off
    assert scheduler.counters["retried"] == 4 and scheduler.counters["rollout_errors"] == 0 and not errors
    assert scheduler.failures.unreachable_since is not None and not scheduler.failures.counts
    endpoint = scheduler.endpoints["w1"]
    assert endpoint.retry_at_s > 0
    num_sent = len(worker.requests)
    scheduler.dispatch(step=1)
    assert len(worker.requests) == num_sent  # backing off: nothing sent
    endpoint.retry_at_s = 0.0  # the back-off is over: one probe group at a time, the retried ones first
    scheduler.dispatch(step=1)
    assert len(scheduler.inflight) == 1 and worker.requests[-1][0][0] in first
    for _ in range(4 * MAX_GROUP_RETRIES):
        if scheduler.counters["rollout_errors"]:
            break
        scheduler.collect(timeout_s=1.0)
        endpoint.retry_at_s = 0.0
        scheduler.dispatch(step=1)
        assert len(scheduler.inflight) <= 1
    # a group that was dispatched 1 + MAX_GROUP_RETRIES times: its rollouts count as failures now
    assert scheduler.counters["rollout_errors"] == 2 and scheduler.counters["errors/ModelError"] == 2
    sent = collections.Counter(index for indices, _ in worker.requests for index in indices)
    assert MAX_GROUP_RETRIES + 1 in sent.values() and len(errors) == 2
    assert scheduler.counters["retried"] == 2 * (sum(sent.values()) - 1 - len(scheduler.inflight))


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


# -- inference workers joining and leaving -----------------------------------------------------------------------


def never_answering_worker() -> FakeWorker:
    worker = FakeWorker()

    def submit(example_indices, *, num_rollouts, **kwargs):
        worker.requests.append((list(example_indices), kwargs))
        return [concurrent.futures.Future() for _ in example_indices]

    worker.submit_rollouts = submit
    return worker


class Heartbeat:
    def __init__(self, latest_policy_version: int) -> None:
        self.latest_policy_version, self.policy_lineage, self.lineage_base_version = latest_policy_version, 0, 0


def test_a_worker_at_an_old_version_holds_up_no_other():
    worker = never_answering_worker()
    scheduler = make_scheduler(worker, max_async_level=0)
    scheduler.refresh_endpoints(FakeWatcher({"old": ("http://old/v1", 0), "new": ("http://new/v1", 2)}))
    scheduler.dispatch(step=3)  # step 3 needs version >= 2: only "new" may take it
    assert not scheduler.waiting_for_version
    assert {kwargs["base_url"] for _, kwargs in worker.requests} == {"http://new/v1"}
    assert all(entry.dispatched_version == 2 for entry in scheduler.inflight.values())
    assert scheduler.endpoints["old"].num_inflight == 0 and scheduler.endpoints["new"].num_inflight == 4


def test_a_joining_worker_gets_rollouts_once_it_serves_the_current_version():
    worker = never_answering_worker()
    scheduler = make_scheduler(worker, max_async_level=4)
    now_s = [1000.0]
    scheduler.inference = InferenceWorkers(clock_unix_s=lambda: now_s[0])
    scheduler.observe_lineage(Heartbeat(latest_policy_version=3))
    watcher = FakeWatcher({"w1": ("http://w1/v1", 3)})
    scheduler.refresh_endpoints(watcher)
    # w2 registers mid-run, still at version 0 (the bound alone would allow it: 0 >= 3 - 4)
    registered_ms = 1_001_000
    now_s[0] = 1001.5
    watcher.workers = {**watcher.workers, "w2": WorkerEndpoint("http://w2/v1", 0, "infer-2", registered_ms)}
    watcher.generation += 1
    scheduler.refresh_endpoints(watcher)
    assert not scheduler.endpoints["w2"].ready and scheduler.inference.joining
    scheduler.dispatch(step=4)
    assert {kwargs["base_url"] for _, kwargs in worker.requests} == {"http://w1/v1"}
    scheduler.cancel_all()
    scheduler.endpoints["w1"].num_inflight = 0
    watcher.workers = {**watcher.workers, "w2": WorkerEndpoint("http://w2/v1", 3, "infer-2", registered_ms)}
    now_s[0] = 1004.0
    watcher.generation += 1
    scheduler.refresh_endpoints(watcher)
    assert scheduler.endpoints["w2"].ready and not scheduler.inference.joining
    scheduler.dispatch(step=4)
    assert "http://w2/v1" in {kwargs["base_url"] for _, kwargs in worker.requests[1:]}
    metrics = scheduler.inference.take_counts()
    assert metrics["inference/workers_joined"] == 2 and metrics["inference/workers"] == 2
    assert metrics["inference/join_to_serving_s"] == 3.0
    assert scheduler.inference.take_counts()["inference/workers_joined"] == 0


def test_the_groups_of_a_worker_that_left_are_cancelled_and_retried_on_another():
    worker = never_answering_worker()
    scheduler = make_scheduler(worker)
    watcher = FakeWatcher({"w1": ("http://w1/v1", 0), "w2": ("http://w2/v1", 0)})
    scheduler.refresh_endpoints(watcher)
    scheduler.dispatch(step=1)  # one group each (fewest in flight first)
    on_w1 = [
        (future, entry.example_index)
        for future, entry in scheduler.inflight.items()
        if entry.endpoint.worker_id == "w1"
    ]
    assert len(on_w1) == 1 and scheduler.endpoints["w2"].num_inflight == 2
    watcher.workers = {"w2": ("http://w2/v1", 0)}  # w1 is LOST or deregistered: gone from the list
    watcher.generation += 1
    scheduler.refresh_endpoints(watcher)
    assert worker.cancelled == [on_w1[0][0]] and len(scheduler.inflight) == 1
    assert scheduler.counters["retried"] == 2 and scheduler.counters["rollout_errors"] == 0
    scheduler.dispatch(step=1)
    indices, kwargs = worker.requests[-1]
    assert indices == [on_w1[0][1]] and kwargs["base_url"] == "http://w2/v1"  # the same example, elsewhere
    assert scheduler.inference.take_counts()["inference/workers_left"] == 1


def test_a_worker_registered_again_under_a_new_id_keeps_its_groups():
    worker = never_answering_worker()
    scheduler = make_scheduler(worker)
    watcher = FakeWatcher({"w1": ("http://w1/v1", 0)})
    scheduler.refresh_endpoints(watcher)
    scheduler.dispatch(step=1)
    watcher.workers = {"w1-again": ("http://w1/v1", 0)}  # a broker restart: the same server, a new id
    watcher.generation += 1
    scheduler.refresh_endpoints(watcher)
    assert not worker.cancelled and len(scheduler.inflight) == 2 and scheduler.counters["retried"] == 0
    assert scheduler.endpoints["w1-again"].num_inflight == 4
    counts = scheduler.inference.take_counts()
    assert counts["inference/workers_left"] == 0 and counts["inference/workers_joined"] == 1


class CutWorker(FakeWorker):
    """Answers at once, except the requests sent to the inference workers at ``cut_urls``: those never come back
    (a connection cut without breaking)."""

    def __init__(self, *cut_urls: str) -> None:
        super().__init__()
        self.cut_urls = set(cut_urls)
        self.stuck: list[concurrent.futures.Future] = []

    def submit_rollouts(self, example_indices, *, num_rollouts, **kwargs):
        if kwargs["base_url"] not in self.cut_urls:
            return super().submit_rollouts(example_indices, num_rollouts=num_rollouts, **kwargs)
        self.requests.append((list(example_indices), kwargs))
        futures = [concurrent.futures.Future() for _ in example_indices]
        self.stuck += futures
        return futures


def run_rounds(scheduler: RolloutScheduler, seconds: float, until=lambda: False) -> None:
    """The runner's loop (batches taken as they fill) for ``seconds`` of real time or until ``until()``."""
    deadline, step = time.monotonic() + seconds, 1
    while time.monotonic() < deadline and not until():
        scheduler.dispatch(step)
        scheduler.collect(timeout_s=0.01)
        scheduler.retry_silent()
        if scheduler.take_batch(step) is not None:
            step += 1


def test_the_groups_of_a_silent_worker_are_retried_on_one_that_answers():
    worker = CutWorker("http://w2/v1")
    scheduler = make_scheduler(worker, max_async_level=1000, worker_silence_timeout_s=0.3)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0), "w2": ("http://w2/v1", 0)}))
    started = time.monotonic()
    run_rounds(scheduler, 10.0, until=lambda: scheduler.counters["silent_workers"] > 0)
    assert scheduler.counters["silent_workers"] == 1 and time.monotonic() - started >= 0.3  # not before its time
    w2 = scheduler.endpoints["w2"]
    assert worker.stuck and worker.cancelled == worker.stuck and w2.num_inflight == 0
    stuck_examples = [i for indices, kwargs in worker.requests if kwargs["base_url"] == "http://w2/v1" for i in indices]
    assert scheduler.counters["retried"] == 2 * len(stuck_examples) and scheduler.counters["rollout_errors"] == 0
    assert not w2.may_take(time.monotonic())  # backed off, then one group at a time until it answers
    num_requests = len(worker.requests)
    scheduler.dispatch(step=1)
    indices, kwargs = worker.requests[num_requests]  # the first group dispatched: the one w2 held, on w1
    assert indices == stuck_examples[:1] and kwargs["base_url"] == "http://w1/v1"
    assert scheduler.worker_metrics()["inference/workers_silent"] == 1


def test_no_worker_is_silent_while_none_answers_or_with_the_deadline_off():
    worker = CutWorker("http://w1/v1", "http://w2/v1")  # the whole run is stuck: moving groups would not help
    scheduler = make_scheduler(worker, max_async_level=1000, worker_silence_timeout_s=0.2)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0), "w2": ("http://w2/v1", 0)}))
    run_rounds(scheduler, 0.6)
    assert scheduler.counters["silent_workers"] == 0 and worker.cancelled == []
    off = make_scheduler(CutWorker("http://w2/v1"), max_async_level=1000, worker_silence_timeout_s=0)
    off.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0), "w2": ("http://w2/v1", 0)}))
    run_rounds(off, 0.3)
    assert off.silence.timeout_s() is None and off.counters["silent_workers"] == 0


def test_the_silence_deadline_unset_follows_the_slowest_recent_groups():
    scheduler = make_scheduler(FakeWorker(), max_async_level=1000)
    scheduler.refresh_endpoints(FakeWatcher({"w1": ("http://w1/v1", 0)}))
    assert scheduler.silence.timeout_s() is None  # no group came back yet: nothing to judge by
    run_rounds(scheduler, 10.0, until=lambda: scheduler.counters["groups_done"] >= 8)
    assert scheduler.silence.timeout_s() == SILENCE_MIN_S  # groups that took ~0 s: the floor

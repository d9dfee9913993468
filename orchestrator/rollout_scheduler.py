"""The orchestrator's rollout scheduling, without sockets: which groups are in flight on which environment and
inference endpoint, and what their results become.

The runner builds the collaborators (env clients by env id, the sampler, the failure tracker, the inference
workers, the async bound, the teacher stage) and hands them to ``RolloutScheduler``. Each round of its main loop:
``refresh_endpoints`` takes the latest worker list, ``observe_lineage`` the broker's policy lineage and latest
version, ``dispatch`` plans groups of ``rollouts_per_example`` rollouts up to the in-flight cap
(``InflightLimit.limit()``: ``max_inflight``, else twice ``batch_size``) on the workers whose served version is
recent enough for the step (``max_async_level``, judged per worker) by what the batches need (``dispatch_plan``);
``collect`` turns finished groups into samples (``group_results``), sends them through the teacher
stage when there is one, computes their advantages and hands them to the batch assembler
(``filtering.BatchAssembler``); ``cancel_stale`` cancels groups that became too stale; ``take_batch`` takes the
step's batch (``step_batches``).

Waste: every generated completion token is counted (``tokens_generated/<env>``) and, when its rollout is not
trained, as discarded by reason: ``failed`` (failed or malformed rollouts, groups dispatched again),
``cancelled`` (groups cancelled in flight: stale or their worker left; estimated at the environment's mean
tokens per rollout, as a cancelled group's tokens never come back), and in the assembler ``filtered``, ``stale``
and ``surplus`` (``step_metrics.token_metrics``). Once ``take_batch`` returns the step's batch, ``take_report``
returns what was counted (``types.StepReport``).

Inference workers join and leave at any time (``endpoints.InferenceWorkers``): the groups of one that leaves are
cancelled and dispatched again elsewhere; a group whose inference worker could not be reached
(``rollout_failures.is_unreachable``) is dispatched again as a whole, up to ``MAX_GROUP_RETRIES`` times, counted in
``rollout/retried`` (not an error) and logged (``rollout group retried``); the worker is backed off.

Faults: a dead environment is restarted (``ensure_alive``, at most its ``max_restarts`` times) and its groups in
flight are dispatched again first (``rollout/rescheduled``). Failed rollouts are counted by kind
(``rollout_failures``: ``rollout/errors``, ``rollout/errors/<kind>``). A group the teacher could not score counts
like a failed rollout group (``rollout/errors/teacher_<kind>``); only a scored group ends a streak of failures.
Groups being scored hold up dispatch only while they are as many as the groups kept in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.advantages import prepare_groups
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.concurrency import FixedConcurrency
from primerl.orchestrator.dispatch_plan import InflightGroup, env_deficits, plan_round
from primerl.orchestrator.endpoints import EndpointWatcher, InferenceEndpoint, InferenceWorkers
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.envs.base import EnvClient, EnvRequestError, EnvWorkerDied
from primerl.orchestrator.filtering import AssembledBatch, BatchAssembler, DifficultyFilter
from primerl.orchestrator.group_results import GroupResults
from primerl.orchestrator.lineage import PolicyLineage, cap_versions
from primerl.orchestrator.rollout_failures import RolloutFailures, is_unreachable, kind_name
from primerl.orchestrator.samples import Group
from primerl.orchestrator.silent_workers import SilenceDeadline, silent_workers
from primerl.orchestrator.step_batches import StepBatches
from primerl.orchestrator.step_metrics import StepTimers
from primerl.orchestrator.throughput import ThroughputWindow
from primerl.orchestrator.types import InflightLimit, SchedulerEvents, StepReport
from primerl.proto import telemetry
from primerl.proto.v1 import control_pb2
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:  # the teacher's HTTP client stays out of the scheduler's imports
    from primerl.orchestrator.teacher_stage import TeacherStage

log = get_logger("primerl.orchestrator")

MAX_GROUP_RETRIES = 8
"""Times a group is dispatched again because its inference worker could not be reached (then its failures count)."""


class RolloutScheduler:
    """Rollout groups in flight and what becomes of them (module docstring). Its collaborators come in whole:
    ``env_clients`` (env id -> client), ``sampler``, ``failures``, ``inference`` (the workers rollouts go to),
    ``bound`` (the async bound), ``teacher`` (a ``TeacherStage`` or None), ``events`` and ``inflight_limit`` (the
    cap on rollouts in flight; unset: ``max_inflight``, else twice ``batch_size``)."""

    def __init__(
        self,
        config: OrchestratorConfig,
        *,
        stop_event: threading.Event,
        env_clients: Mapping[str, EnvClient],
        sampler: EnvSampler,
        failures: RolloutFailures,
        inference: InferenceWorkers | None = None,
        bound: AsyncBound | None = None,
        teacher: TeacherStage | None = None,
        events: SchedulerEvents | None = None,
        inflight_limit: InflightLimit | None = None,
    ):
        self.config = config
        self.stop_event = stop_event
        self.env_clients = env_clients
        self.sampler = sampler
        self.failures = failures
        self.inference = inference if inference is not None else InferenceWorkers()
        self.bound = bound if bound is not None else AsyncBound(config.max_async_level)
        self.teacher = teacher
        self.events = events if events is not None else SchedulerEvents()
        self.inflight_limit = inflight_limit if inflight_limit is not None else FixedConcurrency(config)
        self.lineage = PolicyLineage()
        self.assembler = BatchAssembler(
            config.batch_size,
            difficulty_filter=DifficultyFilter.from_config(config.buffer),
            shares=sampler.shares(),
            group_size=config.rollouts_per_example,
            constant_batch_size=config.constant_trainer_batch_size,
        )
        self.results = GroupResults(config, failures, self.events, self.lineage, with_teacher=teacher is not None)
        self.step_batches = StepBatches(self.assembler, self.bound)
        self.inflight: dict[concurrent.futures.Future, InflightGroup] = {}
        self.latest_policy_version: int | None = None  # the broker's, from its heartbeat answers
        self.next_group_id = 0
        self.waiting_for_version = False
        self._endpoints_generation = -1
        # (env_id, example, num_retries) of groups to dispatch again before new draws
        self._rescheduled: collections.deque[tuple[str, int, int]] = collections.deque()
        # rollout/tokens_per_s: generated tokens over a trailing window of wall time (never per step: a step's
        # batch may be all surplus, its interval near zero); it always covers at least one batch's groups
        self.throughput = ThroughputWindow(min_groups=max(1, config.batch_size // config.rollouts_per_example))
        self.counters: collections.Counter = collections.Counter()  # of the step under way (``take_report``)
        self.fallbacks: collections.Counter = collections.Counter()  # interleaved -> branching, by reason
        self.timers = StepTimers()
        self.silence = SilenceDeadline(config.worker_silence_timeout_s)

    # -- the run's state and the step's results ------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a restart resumes from: the sampler's positions and the next group id."""
        return {"sampler": self.sampler.state(), "next_group_id": self.next_group_id}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state()`` of an earlier run (the orchestrator's state file)."""
        self.sampler.restore(state["sampler"])
        self.next_group_id = state["next_group_id"]

    def take_batch(self, step: int) -> AssembledBatch | None:
        """The step's batch once enough groups recent enough for it are assembled, else None (``StepBatches``)."""
        return self.step_batches.take(step, self.inflight.values())

    def take_report(self) -> StepReport:
        """What was counted since the last report; the next step's counts start afresh."""
        report = StepReport(
            counters=self.counters,
            fallbacks=self.fallbacks,
            timers=self.timers,
            tokens_per_s=self.throughput.tokens_per_s(time.monotonic()),
            worker_metrics=self.worker_metrics(),
        )
        self.counters, self.fallbacks, self.timers = collections.Counter(), collections.Counter(), StepTimers()
        return report

    @property
    def endpoints(self) -> dict[str, InferenceEndpoint]:
        """The inference workers listed by the broker, by worker id."""
        return self.inference.endpoints

    def current_version(self) -> int:
        """The run's current policy version as far as the orchestrator knows: the broker's latest, or the highest
        version the workers serve before the first heartbeat answer."""
        if self.latest_policy_version is not None:
            return self.latest_policy_version
        return max((e.policy_version for e in self.inference.ready()), default=0)

    def refresh_endpoints(self, watcher: EndpointWatcher) -> None:
        """Take the endpoint watcher's latest worker list (no IO here; its thread reads the broker): workers that
        joined wait for the current version, the groups of workers that left are dispatched again."""
        watcher.check()  # BrokerOutageExceeded (or another error of the list call) stops the run here
        # fast while dispatch waits: for a newer policy, a worker catching up, or the first worker (start-up)
        watcher.set_fast(self.waiting_for_version or self.inference.joining or not self.inference.ready())
        generation, workers = watcher.snapshot()
        if generation == self._endpoints_generation:
            return
        self._endpoints_generation = generation
        for endpoint in self.inference.update(workers, self.current_version()):
            self._retry_groups_on(endpoint, "its inference worker is no longer listed by the broker")

    def _retry_groups_on(self, endpoint: InferenceEndpoint, reason: str) -> None:
        """Cancel the worker's groups in flight (it left, or went silent) and dispatch them again elsewhere."""
        groups = [(future, entry) for future, entry in self.inflight.items() if entry.endpoint is endpoint]
        for future, entry in groups:
            del self.inflight[future]
            endpoint.num_inflight -= self.config.rollouts_per_example
            self.env_clients[entry.env_id].cancel(future)
            self.results.count_cancelled(self.counters, entry)
            self._retry(entry, reason)
        self._inflight_changed()

    def _retry(self, entry: InflightGroup, reason: str) -> bool:
        """Dispatch the group again (its inference worker could not be reached, or left); False once it was retried
        ``MAX_GROUP_RETRIES`` times (its failures then count as usual)."""
        if entry.num_retries >= MAX_GROUP_RETRIES:
            return False
        self._rescheduled.append((entry.env_id, entry.example_index, entry.num_retries + 1))
        self.counters["retried"] += self.config.rollouts_per_example
        self.failures.retried(reason)
        log.info(
            telemetry.ROLLOUT_GROUP_RETRIED,
            env_id=entry.env_id,
            example_index=entry.example_index,
            worker_id=entry.endpoint.worker_id,
            url=entry.endpoint.base_url,
            attempt=entry.num_retries + 1,
            reason=reason.split("\n", 1)[0][:200],
        )
        return True

    def dispatch(self, step: int) -> None:
        """Draw and submit groups up to ``max_inflight`` rollouts (module docstring); timed as ``dispatch_s``."""
        with self.timers.timed("dispatch_s"):
            self._dispatch(step)

    def _dispatch(self, step: int) -> None:
        config = self.config
        if not self.endpoints:
            return
        # per worker: one still at an old version (e.g. one that just joined) holds up no other
        usable = [e for e in self.inference.ready() if self.bound.may_dispatch(step, e.policy_version)]
        self.waiting_for_version = not usable
        if self.waiting_for_version:
            self.counters["dispatch_waits"] += 1
            return
        now_s = time.monotonic()
        max_inflight = max(1, int(self.inflight_limit.limit()))
        groups_wanted = math.ceil(max_inflight / config.rollouts_per_example)
        if (
            self.teacher is not None and len(self.teacher) >= groups_wanted
        ):  # the teacher is behind: let it catch up (bounded by its timeouts)
            self.counters["teacher_waits"] += 1
            return
        # Groups are planned one by one, then handed to each environment in one write per (env, endpoint, seed).
        planned = plan_round(
            groups_wanted - len(self.inflight),
            usable=usable,
            deficits_for=lambda policy_version: self._deficits(step, policy_version, max_inflight),
            shares=self.assembler.shares,
            rescheduled=self._rescheduled,
            sampler=self.sampler,
            seed=config.sampling.seed,
            group_size=config.rollouts_per_example,
            first_group_id=self.next_group_id,
            lineage_epoch=self.lineage.epoch,
            now_s=now_s,
        )
        self.next_group_id += sum(len(entries) for entries in planned.values())
        for (env_id, _, seed), entries in planned.items():
            endpoint = entries[0].endpoint
            self.ensure_worker(env_id)
            try:
                futures = self.env_clients[env_id].submit_rollouts(
                    [entry.example_index for entry in entries],
                    num_rollouts=config.rollouts_per_example,
                    base_url=endpoint.base_url,
                    model=config.model.name,
                    api_key=config.broker.run_token or "EMPTY",
                    sampling=config.sampling.model_dump() | {"seed": seed},
                )
            except EnvWorkerDied as exc:  # it died since the check above: the next dispatch restarts it
                for entry in entries:
                    entry.endpoint.num_inflight -= config.rollouts_per_example
                    self._reschedule(entry, exc, restart=False)
                continue
            for future, entry in zip(futures, entries):
                self.inflight[future] = entry
        self._inflight_changed()

    def _deficits(self, step: int, policy_version: int, max_inflight: int) -> dict[str, float]:
        coming = collections.Counter(entry.env_id for entry in self.inflight.values())
        if self.teacher is not None:
            coming.update(group.env_id for group in self.teacher.groups())
        return env_deficits(self.assembler, self.bound, step, policy_version, max_inflight, coming)

    def _inflight_changed(self) -> None:
        self.events.inflight_changed(len(self.inflight) * self.config.rollouts_per_example)

    def ensure_worker(self, env_id: str) -> None:
        """Restart a dead environment (``EnvWorkerDied`` once its restarts are used up)."""
        worker = self.env_clients[env_id]
        while not worker.is_alive():
            try:
                worker.ensure_alive()
            except EnvWorkerDied:  # the new process died at start: try again while restarts are left
                if worker.num_restarts >= worker.max_restarts:
                    raise

    def _reschedule(self, entry: InflightGroup, exc: BaseException, *, restart: bool = True) -> None:
        """A group lost with its env worker: restart the worker, dispatch the same example again."""
        if restart:
            self.ensure_worker(entry.env_id)
        self._rescheduled.append((entry.env_id, entry.example_index, entry.num_retries))
        self.counters["rescheduled"] += self.config.rollouts_per_example
        log.info(
            telemetry.ROLLOUT_GROUP_RESCHEDULED,
            env_id=entry.env_id,
            example_index=entry.example_index,
            reason=str(exc).split("\n", 1)[0][:200],
        )

    def collect(self, timeout_s: float) -> None:
        scoring = self.teacher.futures() if self.teacher is not None else []
        if not self.inflight and not scoring:
            with self.timers.timed("collect_wait_s"):
                self.stop_event.wait(timeout_s)
            return
        with self.timers.timed("collect_wait_s"):
            done, _ = concurrent.futures.wait(
                [*self.inflight, *scoring], timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )
        for future in done:
            if self.teacher is not None and self.teacher.holds(future):
                self._scored(future)
                continue
            entry = self.inflight.pop(future)
            entry.endpoint.num_inflight -= self.config.rollouts_per_example
            try:
                rollout_group = future.result()
            except EnvWorkerDied as exc:  # the worker is restarted and the group dispatched again
                self._reschedule(entry, exc)
                continue
            except Exception as exc:  # an env worker failure: counted, reported, the group is dropped
                failure_kind = exc.error_type if isinstance(exc, EnvRequestError) else type(exc).__name__
                if is_unreachable(failure_kind, str(exc)) and self._retry_unreachable(entry, f"{failure_kind}: {exc}"):
                    continue
                self.results.count_error(
                    self.counters,
                    "env_errors",
                    failure_kind,
                    f"{entry.env_id}: {exc}",
                    entry.endpoint,
                    self.config.rollouts_per_example,
                )
                continue
            self.timers.add_group(rollout_group)
            tokens_before = self.counters["completion_tokens"]
            with self.timers.timed("to_samples_s"):
                group_id = f"{entry.env_id}:{entry.example_index}:{self.next_group_id}"
                group = self.results.to_group(
                    rollout_group, entry, group_id, self.counters, self.fallbacks, self._retry_unreachable
                )
            self.throughput.add(entry.started_s, time.monotonic(), self.counters["completion_tokens"] - tokens_before)
            if group is None:
                continue
            group_s = time.monotonic() - entry.started_s
            self.counters["generation_s"] += group_s
            self.silence.group_done(group_s)
            if self.teacher is not None:  # advantages and the assembler once the teacher scored it
                self.teacher.submit(group)
                continue
            self._add_group(group)
        if done:
            self._inflight_changed()

    def _add_group(self, group: Group) -> None:
        with self.timers.timed("advantages_s"):
            prepare_groups([group], self.config)
        self.assembler.add([group])
        self.counters["groups_done"] += 1

    def _scored(self, future: concurrent.futures.Future) -> None:
        """A group's teacher scoring ended: the scored group goes on, or its rollouts count as failed
        (``TeacherError.kind``)."""
        assert self.teacher is not None
        scored = self.teacher.finish(future)
        if scored.error is not None:
            self.counters["teacher_errors"] += 1
            self.counters[f"errors/{kind_name(scored.error.kind)}"] += scored.num_rollouts
            self.events.rollout_failed()
            self.failures.failed(scored.error.kind, f"{scored.group.env_id}: {scored.error}", scored.num_rollouts)
            self.counters[f"tokens_discarded/failed/{scored.group.env_id}"] += scored.group.num_completion_tokens
            return
        self.failures.succeeded(scored.num_rollouts)
        self._add_group(scored.group)

    def _retry_unreachable(self, entry: InflightGroup, reason: str) -> bool:
        """The group's inference worker could not be reached: back off from it and dispatch the group again."""
        if not self._retry(entry, reason):
            return False
        entry.endpoint.unreachable(time.monotonic())
        return True

    def observe_lineage(self, heartbeat: control_pb2.HeartbeatResponse | None) -> None:
        """The broker's heartbeat answer: its latest policy version (what a joining worker must serve), and a
        rollback (a newer policy lineage): samples made with the rolled-back weights count as the lineage's base
        version from now on (``primerl.orchestrator.lineage``)."""
        if heartbeat is None:
            return
        self.latest_policy_version = heartbeat.latest_policy_version
        base = self.lineage.observe(heartbeat.policy_lineage, heartbeat.lineage_base_version)
        if base is None:
            return
        waiting = [*self.assembler.pending_groups(), *(self.teacher.groups() if self.teacher is not None else [])]
        num_waiting = cap_versions((s for group in waiting for s in group.samples), base)
        num_inflight = 0
        for entry in self.inflight.values():
            if entry.dispatched_version > base:
                entry.dispatched_version = base
                num_inflight += 1
        log.warning(
            "policy rolled back: samples made with the rolled-back weights count as the base version",
            lineage=heartbeat.policy_lineage,
            base_version=base,
            waiting_samples_capped=num_waiting,
            inflight_groups_capped=num_inflight,
        )

    def cancel_stale(self, step: int) -> None:
        stale = self.bound.stale_groups({f: e.dispatched_version for f, e in self.inflight.items()}, step)
        for future in stale:
            entry = self.inflight.pop(future)
            entry.endpoint.num_inflight -= self.config.rollouts_per_example
            self.env_clients[entry.env_id].cancel(future)
            self.results.count_cancelled(self.counters, entry)
            self.counters["stale_groups_cancelled"] += 1
            self.counters[f"stale_groups_cancelled/{entry.env_id}"] += 1  # a slow env's groups outliving the bound
        if stale:
            self._inflight_changed()

    def retry_silent(self, now_s: float | None = None) -> None:
        """Dispatch again the groups of inference workers that went silent (``silent_workers``, past the deadline of
        ``silence``): they are cancelled and dispatched again (``rollout group retried``); the worker is backed off
        and then probed one group at a time, as a worker that could not be reached. Bounds a request stuck on a
        connection that never breaks (a cut cable) by far less than ``rollout_timeout_s``."""
        timeout_s = self.silence.timeout_s()
        if timeout_s is None or not self.inflight:
            return
        now_s = time.monotonic() if now_s is None else now_s
        for endpoint, silent_s in silent_workers(self.inflight.values(), self.endpoints.values(), now_s, timeout_s):
            self.counters["silent_workers"] += 1
            log.warning(  # before the groups' own `rollout group retried` lines, which it explains
                telemetry.INFERENCE_WORKER_SILENT,
                worker_id=endpoint.worker_id,
                url=endpoint.base_url,
                silent_s=round(silent_s, 1),
                worker_silence_timeout_s=round(timeout_s, 1),
                groups=sum(1 for e in self.inflight.values() if e.endpoint is endpoint),
            )
            self._retry_groups_on(endpoint, f"no rollout came back from the worker for {silent_s:.1f} s")
            endpoint.unreachable(now_s)

    def worker_metrics(self) -> dict[str, float]:
        """This step's ``rollout/retried`` (rollouts dispatched again after their inference worker could not be
        reached or left), the ``inference/*`` membership metrics (``InferenceWorkers.take_counts``) and, with a
        teacher, ``teacher/*`` (``TeacherStage.take_metrics``; ``teacher/dispatch_waits``: dispatch rounds skipped
        because as many groups as are kept in flight waited for the teacher)."""
        teacher = (
            {**self.teacher.take_metrics(), telemetry.TEACHER_DISPATCH_WAITS: float(self.counters["teacher_waits"])}
            if self.teacher is not None
            else {}
        )
        return {
            telemetry.ROLLOUT_RETRIED: float(self.counters["retried"]),
            telemetry.INFERENCE_WORKERS_SILENT: float(self.counters["silent_workers"]),
            **self.inference.take_counts(),
            **teacher,
        }

    def cancel_all(self) -> None:
        """Cancel every group in flight and every teacher scoring (on stop)."""
        for future, entry in list(self.inflight.items()):
            self.env_clients[entry.env_id].cancel(future)
        self.inflight.clear()
        if self.teacher is not None:
            self.teacher.close()

"""The orchestrator scores the student's own rollouts with a teacher (online distillation): every sample of a
finished rollout group gets ``teacher_logprobs`` from the teacher's prompt logprobs of exactly its tokens
(``primerl.orchestrator.teacher_client``). Branching samples (one per turn) are each scored on their own
sequence, so a multi-turn rollout is scored turn by turn; an interleaved sample in one request.

    scorer = TeacherScorer(config.teacher, run_token=config.broker.run_token)
    scorer.set_endpoints({"w1": "http://10.0.0.5:8000"})   # base_url entries, or the broker's teacher workers
    future = scorer.submit(group.samples)                   # a Future of one teacher_logprobs list per sample
    ...                                                     # the main loop waits on it with its rollout futures
    scorer.take_metrics()                                   # teacher/* of the step
    scorer.close()                                          # fails every scoring under way at once

Invariants:
- Requests run on ``max_inflight`` daemon threads (so at most that many in flight, over all endpoints), each
  to the endpoint with the fewest requests in flight among those not backing off. The main loop never blocks on
  them: it waits on the groups' futures together with the rollouts' (``RolloutScheduler.collect``).
- A request that fails with an error that can heal (``TeacherError.retryable``: unreachable, timeout, 408/429/
  500/504) is sent again up to ``max_retries`` times, to another endpoint when there is one, after the failed
  endpoint's back-off otherwise. Then (or at once for an error that cannot heal) the group's future fails with
  that ``TeacherError``, its other requests are cancelled, and the scheduler counts the group's rollouts as
  failed (``RolloutFailures``, ``rollout/errors/<kind>``).
- ``teacher unreachable`` is logged once per endpoint outage (warning), ``teacher back`` when it answers again.
- Metrics since the last ``take_metrics``: ``teacher/requests`` (requests that ended, answered or not),
  ``teacher/request_s`` (their mean seconds), ``teacher/retried`` (requests sent again), ``teacher/errors``
  (requests that failed, retried or not), ``teacher/inflight`` (in flight now).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from primerl.configs.orchestrator import TeacherConfig
from primerl.orchestrator.teacher_client import (
    TeacherEndpoint,
    TeacherEndpoints,
    TeacherError,
    TeacherHttp,
    TeacherUnreachable,
)
from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.teacher")


class ScoringCancelled(TeacherError):
    """The scorer is closing: the request was not sent (again)."""

    kind = "teacher_cancelled"


class TeacherScorer:
    """Teacher requests for rollout groups (module docstring)."""

    def __init__(self, config: TeacherConfig, *, run_token: str | None = None):
        api_key = run_token
        if config.api_key_var is not None:
            api_key = os.environ.get(config.api_key_var)
            if not api_key:
                raise ValueError(
                    f"teacher.api_key_var = {config.api_key_var!r}, but that environment variable is "
                    "unset or empty: export it, or remove teacher.api_key_var"
                )
        self.config = config
        self.endpoints = TeacherEndpoints()
        if config.base_url:
            self.endpoints.set({url: url for url in config.base_url})
        self.http = TeacherHttp(api_key=api_key, timeout_s=config.timeout_s, max_connections=config.max_inflight)
        # daemon threads (not a ThreadPoolExecutor, whose threads the interpreter joins at exit): a request that
        # hangs until timeout_s never holds up a stop
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._groups: set[concurrent.futures.Future] = set()  # group futures not done yet
        self._closing = threading.Event()
        self._said_waiting = False
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()
        self._models_lock = threading.Lock()

    def set_endpoints(self, urls: dict[str, str]) -> None:
        """The teacher endpoints now listed (key -> base url); ignored when ``base_url`` is configured."""
        if not self.config.base_url:
            self.endpoints.set(urls)

    def submit(self, samples: Sequence[Any]) -> concurrent.futures.Future:
        """A future of ``[teacher_logprobs of each sample]`` (in order), or of the group's first ``TeacherError``."""
        group_future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closing.is_set():
            group_future.set_exception(ScoringCancelled("teacher scoring cancelled: the scorer is closed"))
            return group_future
        self._start_threads()
        results: list[list[float] | None] = [None] * len(samples)
        remaining = [len(samples)]
        lock = threading.Lock()
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in samples]

        def done(index: int, future: concurrent.futures.Future) -> None:
            with lock:
                if group_future.done():
                    return
                error = None if future.cancelled() else future.exception()
                if future.cancelled() or error is not None:
                    _settle(group_future, error=error or ScoringCancelled("teacher scoring cancelled"))
                else:
                    results[index] = future.result()
                    remaining[0] -= 1
                    if not remaining[0]:
                        _settle(group_future, result=results)
                    return
            for other in futures:  # outside the lock: a cancel runs this callback again, at once
                other.cancel()

        with self._lock:
            self._groups.add(group_future)
        group_future.add_done_callback(self._forget)
        if not samples:
            _settle(group_future, result=[])
        for index, (future, sample) in enumerate(zip(futures, samples)):
            future.add_done_callback(lambda f, i=index: done(i, f))
            self._tasks.put((future, sample.token_ids, sample.loss_mask))
        return group_future

    def _forget(self, group_future: concurrent.futures.Future) -> None:
        with self._lock:
            self._groups.discard(group_future)

    def _start_threads(self) -> None:
        if self._threads:
            return
        for index in range(self.config.max_inflight):
            self._threads.append(threading.Thread(target=self._work, name=f"teacher-{index}", daemon=True))
            self._threads[-1].start()

    def _work(self) -> None:
        """A scoring thread: one sample request after another until ``close``."""
        while (task := self._tasks.get()) is not None:
            future, token_ids, loss_mask = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                _settle(future, result=self._score(token_ids, loss_mask))
            except BaseException as exc:  # noqa: BLE001 - handed to the main loop by the group's future
                _settle(future, error=exc)

    def _model(self, endpoint: TeacherEndpoint) -> str:
        if self.config.model is not None:
            return self.config.model
        with self._models_lock:  # asked once per endpoint, not by every request that starts at once
            if endpoint.model is None:
                endpoint.model = self.http.served_model(endpoint)
            return endpoint.model

    def _score(self, token_ids: Sequence[int], loss_mask: Sequence[bool]) -> list[float]:
        """One sample's teacher logprobs, with retries (on a pool thread)."""
        failed: TeacherEndpoint | None = None
        error: TeacherError
        for attempt in range(self.config.max_retries + 1):
            self._wait_listed()
            endpoint, wait_s = self.endpoints.acquire(avoid=failed)
            if self._closing.wait(wait_s) if wait_s else self._closing.is_set():
                if endpoint is not None:
                    self.endpoints.unused(endpoint)
                raise ScoringCancelled("teacher scoring cancelled")
            if endpoint is None:  # waited timeout_s already: not retried
                error = TeacherUnreachable(
                    f"no teacher endpoint was listed for {self.config.timeout_s:g} s "
                    '(teacher.timeout_s): start a primerl-infer with role = "teacher" (it '
                    "registers with the broker), or set teacher.base_url"
                )
                error.retryable = False
                self._ended(None, error, 0.0)
                raise error
            started_s = time.monotonic()
            try:
                logprobs = self.http.score(endpoint, self._model(endpoint), token_ids, loss_mask)
            except TeacherError as exc:
                error = exc
            else:
                self._ended(endpoint, None, time.monotonic() - started_s)
                return logprobs
            self._ended(endpoint, error, time.monotonic() - started_s)
            if not error.retryable or attempt == self.config.max_retries or self._closing.is_set():
                raise error
            with self._lock:
                self._counts["retried"] += 1
            failed = endpoint
        raise AssertionError("unreachable")

    def _wait_listed(self) -> None:
        """While no teacher is listed (the broker's teacher may still be starting), wait up to ``timeout_s``."""
        deadline_s = time.monotonic() + self.config.timeout_s
        while not self.endpoints.endpoints and time.monotonic() < deadline_s and not self._closing.wait(0.05):
            if not self._said_waiting:
                self._said_waiting = True
                log.info("waiting for a teacher to be listed", timeout_s=self.config.timeout_s)
        if self.endpoints.endpoints:
            self._said_waiting = False

    def _ended(self, endpoint: TeacherEndpoint | None, error: TeacherError | None, seconds: float) -> None:
        if self._closing.is_set():  # a request cut short by close: nothing to count or say
            return
        with self._lock:
            self._counts["requests"] += 1
            self._counts["request_s"] += seconds
            self._counts["errors"] += int(error is not None)
        if endpoint is None:
            return
        began, ended = self.endpoints.release(endpoint, error)
        if began:
            log.warning(
                telemetry.TEACHER_UNREACHABLE,
                url=endpoint.url,
                error=str(error)[:300],
                hint="retrying; its groups fail once their retries are used up",
            )
        if ended:
            log.info("teacher back", url=endpoint.url)

    def take_metrics(self) -> dict[str, float]:
        """``teacher/*`` since the last call (module docstring)."""
        with self._lock:
            counts, self._counts = self._counts, collections.Counter()
        requests = counts["requests"]
        return {
            telemetry.TEACHER_REQUESTS: float(requests),
            telemetry.TEACHER_REQUEST_S: counts["request_s"] / requests if requests else 0.0,
            telemetry.TEACHER_RETRIED: float(counts["retried"]),
            telemetry.TEACHER_ERRORS: float(counts["errors"]),
            telemetry.TEACHER_INFLIGHT: float(self.endpoints.num_inflight()),
        }

    def close(self) -> None:
        """Fail every scoring under way (``ScoringCancelled``) at once, end retry waits and the threads; a request
        still on the wire is dropped (its thread is a daemon)."""
        self._closing.set()
        with self._lock:
            groups, self._groups = list(self._groups), set()
        for group_future in groups:
            _settle(group_future, error=ScoringCancelled("teacher scoring cancelled"))
        for _ in self._threads:
            self._tasks.put(None)
        self.http.close()


def _settle(future: concurrent.futures.Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's result or error unless it is settled already (``close`` and a thread may race)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


__all__ = ["ScoringCancelled", "TeacherScorer"]

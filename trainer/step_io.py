"""The trainer's IO threads, so that its compute loop only computes (house rule 4).

    fetch thread ── StepPrefetcher: fetch + decode the micro-batches of step N+1 ──► queue (1 step) ──┐
    compute loop ◄──────────────────────────────────────────────────────────────────────────────────┘
         forward/backward of step N+1 ── wait: job "weights" of step N done ── optimizer step N+1
         └─ submit(step N): "weights" (publish, checkpoint write) then "finish" (commit, metrics) ──► IO thread

Invariants:

- **Order.** The IO thread runs jobs one at a time in submission order. A step's checkpoint job comes before its
  commit job, so a step is committed to the broker only after its checkpoint is durable (exactly once).
- **A failure stops the line.** Once a job raises, no later job runs (a commit never follows a failed
  checkpoint); the error surfaces in the compute loop as ``TrainerIOError`` (the cause chained) at its next
  ``check``, ``wait`` or ``submit``, or at ``close``. Nothing is swallowed.
- **Weights are read only while they stand still.** Jobs that read the model or optimizer (publish, checkpoint)
  finish before the compute loop's next optimizer step: the loop calls ``Ticket.wait`` on them just before it
  (forward and backward of the next step may overlap with them: they only read the weights).
- **Bounded.** The fetch queue holds one step; the IO queue ``max_pending`` jobs (``submit`` blocks when full);
  every wait has a timeout; ``close`` drains in order within a bound.

While a step's micro-batches do not come, ``StepDataWait`` (the fetch's ``on_wait``) logs ``waiting for the
step's micro-batches`` every ``DATA_WAIT_LOG_S`` and ends the wait when the broker is lost (``BrokerLost``) or
says the run is over (``FetchStopped``).
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from primerl.client.rollouts import FetchStopped
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.trainer.step_io")

POLL_S = 0.2
"""How often blocked waits look at the stop event and the other thread's health."""
DATA_WAIT_LOG_S = 10.0
"""How often the fetch thread says what it waits for while a step's micro-batches do not come."""


class TrainerIOError(RuntimeError):
    """A job of the trainer's IO thread failed (publish, checkpoint, commit or metrics); ``__cause__`` is why."""


@dataclass
class PrefetchedStep:
    step: int
    micro_batches: list
    fetch_s: float  # receiving the step's micro-batches (mostly waiting for the orchestrator)
    decode_s: float  # frames -> MicroBatch tensors
    data_digest: str = ""  # ``describe(raw)``: e.g. primerl.proto.step_digest of what was received


class StepPrefetcher:
    """Fetches and decodes steps ``first_step..last_step`` in order on its own thread, one step ahead.

    ``fetch(step, halt_event)`` returns the step's raw micro-batches (it must give up with ``FetchStopped`` soon
    after ``halt_event`` is set); ``decode(raw)`` turns them into ``MicroBatch``es. Only this thread touches what
    ``fetch`` uses (e.g. the ZMQ socket of the rollout consumer) until ``close`` has joined it. ``describe(raw)``,
    when given, is computed on this thread too (``PrefetchedStep.data_digest``).
    """

    def __init__(
        self,
        fetch: Callable[[int, threading.Event], list],
        decode: Callable[[list], list],
        first_step: int,
        last_step: int,
        *,
        name: str = "trainer-fetch",
        describe: Callable[[list], str] | None = None,
    ):
        self._fetch = fetch
        self._decode = decode
        self._describe = describe
        self._halt = threading.Event()
        self._queue: queue.Queue[tuple[int, PrefetchedStep | BaseException]] = queue.Queue(maxsize=1)
        self._steps = range(first_step, last_step + 1)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in self._steps:
            try:
                started_s = time.perf_counter()
                raw = self._fetch(step, self._halt)
                fetched_s = time.perf_counter()
                item: PrefetchedStep | BaseException = PrefetchedStep(
                    step,
                    self._decode(raw),
                    fetched_s - started_s,
                    time.perf_counter() - fetched_s,
                    self._describe(raw) if self._describe is not None else "",
                )
            except BaseException as exc:  # handed to the compute loop, which raises it
                item = exc
            while not self._halt.is_set():
                try:
                    self._queue.put((step, item), timeout=POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException) or self._halt.is_set():
                return

    def get(self, step: int, timeout_s: float, stop_event: threading.Event | None = None) -> PrefetchedStep:
        """Step ``step``'s micro-batches, waiting at most ``timeout_s``. Raises what the fetch raised,
        ``FetchStopped`` when ``stop_event`` is set, ``TimeoutError`` after ``timeout_s``."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            if stop_event is not None and stop_event.is_set():
                raise FetchStopped(f"step {step}: stopped while waiting for micro-batches")
            try:
                fetched_step, item = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(f"step {step}: the fetch thread ended without the step's data") from None
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"step {step}: no micro-batches within {timeout_s:g} s") from None
        if isinstance(item, BaseException):
            raise item
        assert fetched_step == step, f"prefetched step {fetched_step}, expected {step}"
        return item

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop fetching (a fetch under way gives up) and join the thread, within ``timeout_s``."""
        self._halt.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("fetch thread did not stop in time", timeout_s=timeout_s)


class Ticket:
    """A submitted IO job: ``wait`` until it ran (raising ``TrainerIOError`` if it or an earlier job failed)."""

    def __init__(self, label: str, job: Callable[[], Any], owner: StepIOThread):
        self.label = label
        self.job = job
        self.result: Any = None
        self.ran_s = 0.0
        self._done = threading.Event()
        self._owner = owner

    def wait(self, timeout_s: float) -> Any:
        deadline_s = time.monotonic() + timeout_s
        while not self._done.wait(POLL_S):
            self._owner.check()
            if not self._owner.alive():
                raise TrainerIOError(f"IO thread ended before job {self.label!r} ran")
            if time.monotonic() > deadline_s:
                raise TrainerIOError(f"IO job {self.label!r} not done within {timeout_s:g} s")
        self._owner.check()
        return self.result


class StepIOThread:
    """One ordered IO thread (module docstring). ``submit`` jobs; ``check`` raises a failure; ``close`` drains."""

    def __init__(self, *, max_pending: int = 4, name: str = "trainer-io"):
        self._queue: queue.Queue[Ticket | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._failed_label = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if self._error is None:  # after a failure nothing else runs: no commit without its checkpoint
                started_s = time.perf_counter()
                try:
                    ticket.result = ticket.job()
                except BaseException as exc:
                    self._failed_label = ticket.label
                    self._error = exc
                    # A full disk (``checkpoint.CheckpointDiskFull``) says all in its message: no traceback, whose
                    # locals (the model's tensors) can take minutes to render.
                    disk_full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    log.error(
                        "trainer IO job failed; no later job runs",
                        job=ticket.label,
                        error=f"{type(exc).__name__}: {exc}",
                        exc_info=not disk_full,
                    )
                ticket.ran_s = time.perf_counter() - started_s
            ticket._done.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def check(self) -> None:
        """Raise ``TrainerIOError`` (from the job's error) if a job has failed."""
        if self._error is not None:
            raise TrainerIOError(
                f"trainer IO job {self._failed_label!r} failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def submit(self, label: str, job: Callable[[], Any], timeout_s: float = 600.0) -> Ticket:
        """Queue ``job`` after every job submitted before; blocks (bounded) while ``max_pending`` are queued."""
        self.check()
        if self._closed:
            raise RuntimeError("submit after close")
        ticket = Ticket(label, job, self)
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                self._queue.put(ticket, timeout=POLL_S)
                return ticket
            except queue.Full:
                self.check()
                if time.monotonic() > deadline_s:
                    raise TrainerIOError(f"IO queue still full after {timeout_s:g} s (job {label!r})") from None

    def close(self, timeout_s: float = 300.0, *, raise_error: bool = True) -> None:
        """Run every queued job (in order), stop the thread; then raise the first failure, if any and asked."""
        if not self._closed:
            self._closed = True
            deadline_s = time.monotonic() + timeout_s
            while self._thread.is_alive():
                try:
                    self._queue.put(None, timeout=POLL_S)
                    break
                except queue.Full:
                    if time.monotonic() > deadline_s:
                        break
            self._thread.join(max(0.0, deadline_s - time.monotonic()))
            if self._thread.is_alive():
                log.error("IO thread did not drain in time; queued jobs are lost", timeout_s=timeout_s)
        if raise_error:
            self.check()


class StepDataWait:
    """``on_wait`` of one step's fetch: say what is awaited every ``DATA_WAIT_LOG_S``; stop when the broker is
    lost (``BrokerLost``) or says the run is over (``FetchStopped``)."""

    def __init__(self, step: int, control):
        self.step = step
        self.control = control
        self.started_s = time.monotonic()
        self.next_log_s = self.started_s + DATA_WAIT_LOG_S

    def __call__(self, num_received: int, num_expected: int | None) -> None:
        self.control.check_broker()
        if self.control.shutdown_requested.is_set():
            raise FetchStopped(f"step {self.step}: the broker says the run is over")
        now_s = time.monotonic()
        if now_s >= self.next_log_s:
            self.next_log_s = now_s + DATA_WAIT_LOG_S
            log.info(
                "waiting for the step's micro-batches",
                step=self.step,
                received=num_received,
                expected=num_expected,
                waited_s=round(now_s - self.started_s, 1),
                broker="unreachable" if self.control.broker_unreachable else "reachable",
            )

"""How many rollouts the orchestrator keeps in flight: a collaborator of the scheduler with ``limit() -> int``.

- ``FixedConcurrency``: ``max_inflight``, else 2 x ``batch_size`` (what the scheduler has always kept;
  ``oversampling_factor`` is superseded, as in prime-rl).
- ``AdaptiveConcurrency`` (``[orchestrator.concurrency]``, prime-rl's table): a thread reads each ready inference
  worker's vLLM ``/metrics`` every ``poll_interval_s`` and ``KvTargetController`` steers that worker's share of
  rollouts toward ``kv_target`` of its KV cache (``vllm:kv_cache_usage_perc``, 0-1). ``limit()`` is the sum of the
  shares, clamped to ``[min_inflight, max_inflight]``.

The control law per worker and poll (``KvTargetController.observe``), ``kv`` the worker's KV use, ``n`` its
rollouts in flight, ``L`` its share:

- **back off** when ``kv >= kv_backoff`` or its preemption counter (``vllm:num_preemptions_total``) rose since the
  last poll: ``L = max(min, 0.8 * min(L, n))`` (rollouts already running finish; none is cancelled), and no growth
  for ``COOLDOWN_POLLS`` polls; while the rollouts in flight drain down to ``L`` a high KV use cuts no further (it
  is the load already cut), only new preemptions do;
- **trim** when ``kv_target < kv < kv_backoff``: ``L = n * kv_target / kv`` when that is below ``L`` (what the
  worker would hold at the target), at most once per ``COOLDOWN_POLLS``;
- **grow** when ``kv < kv_target``, the share binds (``n >= 0.9 L``) and the KV use has settled (no request
  waiting in the worker's queue, ``vllm:num_requests_waiting``, and a rise of at most ``SETTLED_RISE`` since the
  last poll: KV use lags the rollouts admitted): ``L *= min(g, kv_target / kv)`` with the growth
  ``g = 1 + 0.25 (1 - kv / kv_target)`` tapering to 1 at the target (prime-rl #3556), by one group of
  ``rollouts_per_example`` at least, and only while one more group fits: with ``p`` the highest KV use per rollout
  in flight over the last ``PER_ROLLOUT_POLLS`` polls (a rollout's KV grows until it finishes, so the highest
  reading is what a rollout takes at its end), ``(n + group) p <= kv_target``, and ``L <= kv_target / p``;
- **hold** otherwise.

The scheduler dispatches whole groups, so ``limit()`` is rounded down to whole groups: with groups large against
the KV cache (a group of 4 was 16 % of an 80 MiB cache on the 100M model), a limit between two multiples put one
group more in flight than the target allowed, which the back-off then cut, over and over.

A worker whose ``/metrics`` cannot be read keeps its last share; a worker that left drops out of the sum. The
metrics go to each step's row: ``concurrency/limit`` (now), ``concurrency/kv_usage_max`` (the highest KV use of any
worker since the previous row) and ``concurrency/preemptions`` (since the previous row).
"""

from __future__ import annotations

import collections
import math
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from primerl.configs.orchestrator import ConcurrencyConfig, OrchestratorConfig
from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.concurrency")

KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
"""vLLM's gauge of KV-cache use per engine, 0-1 (1 = full)."""
PREEMPTIONS_METRIC = "vllm:num_preemptions_total"
"""vLLM's counter of preempted requests per engine (the scheduler ran out of KV blocks)."""

WAITING_METRIC = "vllm:num_requests_waiting"
"""vLLM's gauge of requests queued, not yet running: their KV use has yet to show."""

SETTLED_RISE = 0.02
"""KV use that rose more than this since the previous poll is still materialising: no growth on it."""
GROWTH_MAX = 0.25
"""Largest growth of a share per poll (at 0 KV use), tapering linearly to none at the target."""
BINDING_FRACTION = 0.9
"""A share binds (may grow) when the worker's rollouts in flight reach this fraction of it."""
BACKOFF_FRACTION = 0.8
"""A back-off lowers the share to this fraction of the rollouts in flight."""
COOLDOWN_POLLS = 3
PER_ROLLOUT_POLLS = 30
"""Polls over which a worker's highest KV use per rollout in flight is kept (longer than a rollout lives)."""
"""Polls after a back-off without growth, and between trims: each change shows in the KV use before the next."""
METRICS_TIMEOUT_S = 2.0

CONCURRENCY_LIMIT = telemetry.CONCURRENCY_LIMIT
CONCURRENCY_KV_USAGE_MAX = telemetry.CONCURRENCY_KV_USAGE_MAX
CONCURRENCY_PREEMPTIONS = telemetry.CONCURRENCY_PREEMPTIONS


class FixedConcurrency:
    """Today's fixed number in flight: ``max_inflight``, else 2 x ``batch_size``."""

    def __init__(self, config: OrchestratorConfig):
        self._limit = config.num_inflight_rollouts

    def limit(self) -> int:
        return self._limit

    def metrics(self) -> dict[str, float]:
        return {CONCURRENCY_LIMIT: float(self._limit)}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class KvSample:
    """One read of a worker's ``/metrics``: KV use (max over its engines, 0-1) and preemptions so far (sum)."""

    kv_usage: float
    preemptions_total: float
    waiting: float = 0.0  # requests queued in the worker, not yet running (their KV is still to come)


_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_vllm_metrics(text: str) -> KvSample | None:
    """The KV sample of a Prometheus text page; None when it has no ``vllm:kv_cache_usage_perc`` (not a vLLM
    server, or its stats logging is off)."""
    kv: list[float] = []
    preemptions = waiting = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _SAMPLE_LINE.match(line)
        if match is None:
            continue
        name, value = match.group(1), match.group(3)
        try:
            number = float(value)
        except ValueError:
            continue
        if name == KV_USAGE_METRIC:
            kv.append(number)
        elif name == PREEMPTIONS_METRIC:
            preemptions += number
        elif name == WAITING_METRIC:
            waiting += number
    if not kv:
        return None
    return KvSample(kv_usage=max(kv), preemptions_total=preemptions, waiting=waiting)


@dataclass
class _WorkerState:
    share: float
    kv_usage: float = 0.0
    preemptions_total: float | None = None
    cooldown: int = 0
    preempted: float = 0.0  # preemptions seen since the last ``take_metrics``
    kv_peak: float = 0.0  # highest KV use seen since the last ``take_metrics``
    last_kv: float | None = None
    draining: bool = False  # after a back-off, until the rollouts in flight are down to the share
    kv_per_rollout: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=PER_ROLLOUT_POLLS)
    )  # recent readings of KV use / rollouts in flight


class KvTargetController:
    """The control law of the module docstring, without IO: ``observe`` each poll's samples, read ``limit``."""

    def __init__(self, config: ConcurrencyConfig, *, initial_total: int, group_size: int = 1):
        """``group_size``: rollouts the scheduler dispatches together (``rollouts_per_example``)."""
        self.config = config
        self.group_size = max(1, group_size)
        self.initial_total = self._clamp(config.initial_inflight or initial_total)
        self.workers: dict[str, _WorkerState] = {}
        self.last_decisions: dict[str, str] = {}

    def _clamp(self, value: float) -> int:
        upper = self.config.max_inflight if self.config.max_inflight is not None else math.inf
        return int(max(self.config.min_inflight, min(upper, math.floor(value))))

    def forget(self, present: Sequence[str]) -> None:
        """Workers no longer present drop out of the sum."""
        for worker_id in set(self.workers) - set(present):
            del self.workers[worker_id]

    def observe(self, worker_id: str, sample: KvSample, num_inflight: int, num_workers: int) -> str:
        """One poll of one worker; returns the decision (``grow``, ``trim``, ``backoff``, ``hold``)."""
        config = self.config
        state = self.workers.get(worker_id)
        if state is None:  # a new worker starts with an even part of the starting total
            state = self.workers[worker_id] = _WorkerState(share=max(1.0, self.initial_total / max(1, num_workers)))
        new_preemptions = 0.0
        if state.preemptions_total is not None and sample.preemptions_total > state.preemptions_total:
            new_preemptions = sample.preemptions_total - state.preemptions_total
        state.preemptions_total = sample.preemptions_total
        state.kv_usage = sample.kv_usage
        state.kv_peak = max(state.kv_peak, sample.kv_usage)
        state.preempted += new_preemptions
        state.cooldown = max(0, state.cooldown - 1)
        kv, n = sample.kv_usage, num_inflight
        floor = config.min_inflight / max(1, num_workers)
        decision = "hold"
        rising = state.last_kv is not None and kv - state.last_kv > SETTLED_RISE
        state.last_kv = kv
        if n > 0:
            state.kv_per_rollout.append(kv / n)
        per_rollout = max(state.kv_per_rollout, default=0.0)
        if state.draining and n <= state.share:
            state.draining = False
        if (kv >= config.kv_backoff or new_preemptions > 0) and not (state.draining and new_preemptions == 0):
            state.share = max(floor, 1.0, BACKOFF_FRACTION * min(state.share, n))
            state.cooldown = COOLDOWN_POLLS
            state.draining = n > state.share  # the rollouts over the new share finish first: no cut on cut
            decision = "backoff"
        elif state.draining:
            pass
        elif kv > config.kv_target:
            if state.cooldown == 0 and n > 0:
                trimmed = n * config.kv_target / kv
                if trimmed < state.share:
                    state.share = max(floor, 1.0, trimmed)
                    state.cooldown = COOLDOWN_POLLS
                    decision = "trim"
        elif (
            state.cooldown == 0
            and n >= BINDING_FRACTION * state.share
            and not rising
            and sample.waiting == 0
            and (n + self.group_size) * per_rollout <= config.kv_target  # one more group still fits
        ):
            growth = 1.0 + GROWTH_MAX * (1.0 - kv / config.kv_target)
            if kv > 0:
                growth = min(growth, config.kv_target / kv)
            grown = max(state.share + self.group_size, state.share * growth)
            if per_rollout > 0:
                grown = min(grown, config.kv_target / per_rollout)
            state.share = max(state.share, grown)
            decision = "grow"
        if config.max_inflight is not None:
            state.share = min(state.share, float(config.max_inflight))
        self.last_decisions[worker_id] = decision
        return decision

    def limit(self) -> int:
        """The sum of the shares, clamped, and rounded down to whole groups (when that leaves one at least)."""
        if not self.workers:
            return self.initial_total
        total = self._clamp(sum(state.share for state in self.workers.values()))
        whole = total - total % self.group_size
        return whole if whole >= self.group_size else total

    def take_metrics(self) -> dict[str, float]:
        """``concurrency/*`` of the step: the limit now, the highest KV use of any worker and the preemptions since
        the last call."""
        preempted = sum(state.preempted for state in self.workers.values())
        kv_max = max((state.kv_peak for state in self.workers.values()), default=0.0)
        for state in self.workers.values():
            state.preempted = state.kv_peak = 0.0
        return {
            CONCURRENCY_LIMIT: float(self.limit()),
            CONCURRENCY_KV_USAGE_MAX: kv_max,
            CONCURRENCY_PREEMPTIONS: preempted,
        }


def metrics_url(base_url: str) -> str:
    """A worker's ``/metrics`` from its OpenAI base URL (``http://host:port/v1``)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/metrics"


def read_kv_sample(base_url: str, *, token: str | None, timeout_s: float = METRICS_TIMEOUT_S) -> KvSample | None:
    """GET the worker's ``/metrics`` (run token as Bearer, like every route of primerl-infer but /health)."""
    request = urllib.request.Request(metrics_url(base_url))
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (http URL from the broker)
        return parse_vllm_metrics(response.read().decode("utf-8", "replace"))


@dataclass(frozen=True)
class WorkerLoad:
    """What the poller needs of one inference worker: its id, its OpenAI base URL, its rollouts in flight."""

    worker_id: str
    base_url: str
    num_inflight: int


class AdaptiveConcurrency:
    """``KvTargetController`` fed by a thread that reads each ready worker's ``/metrics`` (module docstring).

    ``workers`` returns the ready inference workers with their rollouts in flight (called from the thread; the
    scheduler's integer counters are read without a lock, a poll later at most)."""

    def __init__(
        self,
        config: OrchestratorConfig,
        workers: Callable[[], Sequence[WorkerLoad]],
        *,
        token: str | None = None,
        read: Callable[[str], KvSample | None] | None = None,
    ):
        assert config.concurrency is not None
        self.settings = config.concurrency
        self.controller = KvTargetController(
            self.settings, initial_total=config.num_inflight_rollouts, group_size=config.rollouts_per_example
        )
        self._workers = workers
        self._read = read or (lambda url: read_kv_sample(url, token=token))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unreadable_logged: set[str] = set()
        self._no_kv_logged: set[str] = set()
        self._last_limit = self.controller.limit()

    def start(self) -> AdaptiveConcurrency:
        self._thread = threading.Thread(target=self._loop, name="concurrency", daemon=True)
        self._thread.start()
        log.info(
            "adaptive concurrency",
            kv_target=self.settings.kv_target,
            kv_backoff=self.settings.kv_backoff,
            initial_inflight=self._last_limit,
            max_inflight=self.settings.max_inflight,
        )
        return self

    def limit(self) -> int:
        with self._lock:
            return self.controller.limit()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return self.controller.take_metrics()

    def poll_once(self) -> None:
        """Read every ready worker once and steer (the thread's round; tests call it directly)."""
        workers = list(self._workers())
        samples: list[tuple[WorkerLoad, KvSample]] = []
        for worker in workers:
            try:
                sample = self._read(worker.base_url)
            except (OSError, urllib.error.URLError, ValueError) as exc:
                if worker.worker_id not in self._unreadable_logged:
                    self._unreadable_logged.add(worker.worker_id)
                    log.warning(
                        "cannot read an inference worker's /metrics; its share of rollouts stays as it is",
                        worker_id=worker.worker_id,
                        url=metrics_url(worker.base_url),
                        error=str(exc)[:200],
                    )
                continue
            if sample is None:
                if worker.worker_id not in self._no_kv_logged:
                    self._no_kv_logged.add(worker.worker_id)
                    log.warning(
                        f"an inference worker's /metrics has no {KV_USAGE_METRIC}: its share of rollouts stays as "
                        "it is (is vLLM's stats logging off?)",
                        worker_id=worker.worker_id,
                    )
                continue
            samples.append((worker, sample))
        with self._lock:
            self.controller.forget([w.worker_id for w in workers])
            for worker, sample in samples:
                self.controller.observe(worker.worker_id, sample, worker.num_inflight, len(workers))
            limit = self.controller.limit()
        if limit != self._last_limit:
            log.debug("concurrency limit", limit=limit, previous=self._last_limit)
            self._last_limit = limit

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.poll_interval_s):
            try:
                self.poll_once()
            except Exception as exc:  # never take the orchestrator down: the limit stays where it was
                log.warning("adaptive concurrency poll failed; the limit stays", error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=METRICS_TIMEOUT_S + 1.0)


def build_concurrency(
    config: OrchestratorConfig, workers: Callable[[], Sequence[WorkerLoad]], *, token: str | None
) -> FixedConcurrency | AdaptiveConcurrency:
    """``FixedConcurrency`` without ``[orchestrator.concurrency]``, else a started ``AdaptiveConcurrency``."""
    if config.oversampling_factor != 1.0:  # prime-rl configs still write it: loads, and says it has no effect
        log.info(
            "oversampling_factor is superseded (prime-rl removed it) and has no effect: the rollouts in flight are "
            "max_inflight, or steered by [orchestrator.concurrency]",
            oversampling_factor=config.oversampling_factor,
            inflight=config.num_inflight_rollouts if config.concurrency is None else "adaptive",
        )
    if config.concurrency is None:
        return FixedConcurrency(config)
    return AdaptiveConcurrency(config, workers, token=token).start()


__all__ = [
    "AdaptiveConcurrency",
    "FixedConcurrency",
    "KvSample",
    "KvTargetController",
    "WorkerLoad",
    "build_concurrency",
    "metrics_url",
    "parse_vllm_metrics",
]

"""The orchestrator daemon: keep rollouts in flight, turn finished groups into training batches, ship them.

    env workers (verifiers, own interpreter) ◄── rollout requests ── OrchestratorRunner ── batches ──► broker
           └── HTTP (OpenAI API) ──► inference workers listed by the broker

Each step: groups of ``rollouts_per_example`` rollouts are dispatched to the env workers (examples drawn by
environment weight), up to ``max_inflight`` rollouts at once, spread over the live inference workers, but only
while the served policy is recent enough for the step (``max_async_level``). Finished groups get advantages,
pass the difficulty filter and accumulate until ``batch_size`` rollouts; the batch is packed into
micro-batches per trainer rank and sent to the broker. In-flight groups that became too stale are cancelled.
State (step, sampler positions, RNG) is saved after every step to ``{output_dir}/orchestrator_state.json``.

Threads: the main loop dispatches, collects, computes advantages and packs; a send thread
(``primerl.orchestrator.batch_sender``) ships each packed step to the broker, in step order, and saves the state
once that step's batches are durable, so collection goes on while the broker applies back-pressure (at most one
step waits for the send thread besides the one being sent). While dispatch waits for a newer policy version, the
served versions are re-read every ``VERSION_WAIT_S`` instead of every ``WORKER_REFRESH_S``.

Per-phase timers (issue 12), in every training row: ``perf/step_s`` (= ``rollout/generation_time``),
``perf/dispatch_s``, ``perf/collect_wait_s`` (the main loop idle, waiting for rollouts), ``perf/to_samples_s``,
``perf/advantages_s``, ``perf/packing_s`` (sums over the step); ``perf/send_wait_s`` (the main loop blocked on
the send queue) and ``perf/send_s`` (the latest completed send); per rollout group, means over the groups that
finished during the step: ``perf/env_roundtrip_s`` (submit to answer), ``perf/inference_wait_s`` (the group's
model calls, as the env worker timed them), ``perf/env_score_s``, ``perf/env_encode_s`` and
``perf/env_overhead_s`` (round trip minus the worker's own time: the pipe, JSON, queueing).

Faults (issue 14):
- An env worker that dies is restarted (``EnvWorker.ensure_alive``, at most ``ENV_WORKER_MAX_RESTARTS`` times,
  log ``restarting env worker`` with its exit code); its in-flight groups are dispatched again first
  (``rollout/rescheduled`` counts their rollouts). Past the limit the orchestrator stops with the worker's error.
- Failed rollouts are counted by kind (``primerl.orchestrator.rollout_failures``): each kind logged once
  (``rollout failed``) and sent to the broker's status, counted in ``rollout/errors`` and
  ``rollout/errors/<kind>``; ``batch_size`` failures in a row stop the orchestrator with one clear error.
- Broker outages: the worker list is read in its own thread (``primerl.orchestrator.endpoints``) and steps are
  sent through outages (``primerl.orchestrator.step_send``), both within ``broker.outage_s``, logging
  ``waiting for the broker`` every 5 s; meanwhile the main loop keeps collecting rollouts (it blocks only once
  two steps wait to be sent, or to report a step's metrics). Past the budget: ``BrokerOutageExceeded``.
- ``control.shutdown_requested`` (the broker ended the run) or SIGTERM: the loop stops, steps already handed
  to the send thread get a short grace, and ``run`` returns 0.
- Once every micro-batch of a step is durable, one ``step sent`` line per rank names its ``data_digest``.

Metrics of the batch (issue 15): ``train/reward``, ``rollout/reward_std`` and where the rollout rewards lie
(``rollout/reward_min``, ``_max``, ``_p10``, ``_p90``); ``rollout/tokens_per_s`` is generation throughput, the
completion tokens of the groups that finished over a trailing window of wall time
(``primerl.orchestrator.throughput``), not a per-step figure; ``rollout/completion_tokens`` counts those
collected during the step. ``rollout/interleave_fallbacks`` (and ``/<reason>``; ``_total`` over the run):
trajectories of the step that could not be interleaved and were trained as branching samples (a warning the first
time per reason). With several environments: ``env/<id>/reward``, ``env/<id>/num_rollouts``, ``_num_samples``.
The broker also gets ``orchestrator/step`` with each batch's metrics (the progress line pairs rewards by step).
Sampling seeds: with ``[orchestrator.sampling] seed``, group g's rollout i gets ``group_seed(seed, g, n) + i``.

Metrics: one row per step (and one per eval) in ``{output_dir}/metrics.jsonl``, W&B with ``[wandb]``
(``primerl.runtime.metrics_sink``), and a Prometheus endpoint (``[orchestrator.prometheus]``, its URL sent to
the broker as ``metrics_url``) with the rows' ``primerl_step`` / ``primerl_metric`` families and live
``primerl_orchestrator_step``, ``primerl_orchestrator_inflight_rollouts``,
``primerl_orchestrator_rollout_errors_total``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from primerl.orchestrator.advantages import prepare_groups
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.lineage import PolicyLineage, cap_versions
from primerl.orchestrator.batch_sender import BatchSender, SendInterrupted
from primerl.orchestrator.config import OrchestratorConfig
from primerl.orchestrator.endpoints import EndpointWatcher
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.env_client import EnvRequestError, EnvWorkerDied
from primerl.orchestrator.filtering import BatchAssembler, DifficultyFilter
from primerl.orchestrator.packing import pack_samples, to_broker_batches
from primerl.orchestrator.rollout_failures import RolloutFailures, kind_name
from primerl.orchestrator.samples import Group, MalformedTrajectory, rollout_to_samples
from primerl.orchestrator.seeds import rollout_seed_base
from primerl.orchestrator.throughput import ThroughputWindow
from primerl.orchestrator.step_send import RESEND_INTERVAL_S, log_step_data, rank_digests, send_step
from primerl.client.outage import OutageStopped, OutageWatch, retry_through_outage
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.metrics_sink import MetricsSink
from primerl.runtime.prometheus import MetricsExporter, start_exporter

log = get_logger("primerl.orchestrator")

WORKER_REFRESH_S = 1.0
VERSION_WAIT_S = 0.05  # re-read the served versions this often while dispatch waits for a newer policy
COLLECT_WAIT_S = 0.5  # the longest the main loop waits for a rollout group before looking at the rest again
STOP_FLUSH_S = 30.0  # on stop, how long steps already handed to the send thread may take to be sent
SHUTDOWN_FLUSH_S = 2.0  # the same when the broker ended the run (the role must be gone within 10 s)
ENV_WORKER_MAX_RESTARTS = 3  # restarts of each env worker before the orchestrator gives up
INFERENCE_OUTAGE_S = 300.0  # how long rollouts may fail because no inference worker answers (one restarting)
ENDPOINT_BACKOFF_S = (0.5, 5.0)  # first and longest pause of dispatch to an endpoint that did not answer


@dataclass
class InferenceEndpoint:
    worker_id: str
    base_url: str
    policy_version: int
    num_inflight: int = 0
    # While it does not answer (connection refused/reset: restarting?): no dispatch before retry_at_s.
    retry_at_s: float = 0.0
    backoff_s: float = 0.0

    def unreachable(self, now_s: float) -> None:
        """A rollout on it failed because it could not be reached: pause dispatch to it (doubling, capped)."""
        if now_s >= self.retry_at_s:  # one back-off step per probe, not per failure of a burst
            self.backoff_s = min(max(ENDPOINT_BACKOFF_S[0], 2 * self.backoff_s), ENDPOINT_BACKOFF_S[1])
            self.retry_at_s = now_s + self.backoff_s

    def answered(self) -> None:
        self.retry_at_s = self.backoff_s = 0.0


@dataclass
class _Inflight:
    env_id: str
    example_index: int
    endpoint: InferenceEndpoint
    dispatched_version: int
    started_s: float = field(default_factory=time.monotonic)
    lineage_epoch: int = 0  # ``PolicyLineage.epoch`` at dispatch: rollbacks after it cap the samples' versions


class OrchestratorRunner:
    def __init__(self, config: OrchestratorConfig, *, env_python: str, stop_event: threading.Event | None = None):
        if config.max_steps is None:
            raise ValueError("the orchestrator needs max_steps (top-level `max_steps` or `orchestrator.max_steps`)")
        self.config = config
        self.env_python = env_python
        self.stop_event = stop_event or threading.Event()
        self.state_path = config.output_dir / "orchestrator_state.json"
        self.bound = AsyncBound(config.max_async_level)
        self.lineage = PolicyLineage()
        self.assembler = BatchAssembler(config.batch_size, difficulty_filter=DifficultyFilter.from_config(config.buffer))
        self.inflight: dict[concurrent.futures.Future, _Inflight] = {}
        self.endpoints: dict[str, InferenceEndpoint] = {}
        self.counters: collections.Counter = collections.Counter()
        self.workers: dict[str, Any] = {}
        self.control = None
        self.producer = None
        self.exporter: MetricsExporter | None = None
        self.sink: MetricsSink | None = None
        self._next_group_id = 0
        self._waiting_for_version = False
        self.sender: BatchSender | None = None
        self.endpoint_watcher: EndpointWatcher | None = None
        self._endpoints_generation = -1
        self._rescheduled: collections.deque[tuple[str, int]] = collections.deque()  # (env_id, example)
        self._send_stop = threading.Event()  # ends the send thread's waits when the orchestrator stops
        self._broker_lost = False  # stopped by BrokerOutageExceeded: no goodbye to the broker
        self._stop_reason = ""
        self.failures: RolloutFailures | None = None
        # rollout/tokens_per_s: generated tokens over a trailing window of wall time (never per step: a step's
        # batch may be all surplus, its interval near zero); it always covers at least one batch's groups
        self.throughput = ThroughputWindow(min_groups=max(1, config.batch_size // config.rollouts_per_example))
        self.fallbacks: collections.Counter = collections.Counter()  # interleaved -> branching, by reason, this step
        self._fallback_reasons_logged: set[str] = set()
        self._num_fallbacks_total = 0

    # -- set-up --------------------------------------------------------------------------------------

    def _open_metrics(self) -> None:
        """The Prometheus endpoint and the metrics sink (first: a bad [wandb] or port fails at once)."""
        config = self.config
        self.exporter = start_exporter("orchestrator", config.prometheus)
        if self.exporter is not None:
            self.step_gauge = self.exporter.gauge("primerl_orchestrator_step", "Latest step whose batch was sent.")
            self.inflight_gauge = self.exporter.gauge("primerl_orchestrator_inflight_rollouts",
                                                      "Rollouts in flight against the inference workers.")
            self.errors_counter = self.exporter.counter("primerl_orchestrator_rollout_errors", "Failed rollouts "
                                                        "and rollout groups (the sum of rollout/errors).")
        self.sink = MetricsSink("orchestrator", config.output_dir, config.wandb, config, exporter=self.exporter)

    def _connect(self) -> None:
        from primerl.client.control import BrokerUnavailable, ControlClient
        from primerl.client.rollouts import RolloutProducer
        from primerl.orchestrator.env_client import EnvWorker
        from primerl.proto.v1 import common_pb2

        config = self.config
        capabilities = {"metrics_url": self.exporter.url} if self.exporter is not None else {}
        self.control = ControlClient(config.broker, "orchestrator", "orchestrator", capabilities=capabilities)
        self.control.wait_ready(config.broker.connect_timeout_s)
        registration = self.control.register()
        self.progress = {"orchestrator_step": 0, "num_inflight": 0}
        self.control.start_heartbeats(lambda: dict(self.progress))
        self.producer = RolloutProducer(registration.rollout_endpoint, auth_token=config.broker.run_token,
                                        sender="orchestrator", resend_interval_s=RESEND_INTERVAL_S,
                                        limits=self.control.limits.frames)
        self.sender = BatchSender(self._send_step)
        self._broker_unavailable = (BrokerUnavailable,)
        self.endpoint_watcher = EndpointWatcher(lambda: self.control.list_workers(common_pb2.ROLE_INFERENCE),
                                                outage_s=config.broker.outage_s, healable=self._broker_unavailable,
                                                interval_s=WORKER_REFRESH_S, fast_interval_s=VERSION_WAIT_S)
        self.endpoint_watcher.start()
        self.failures = RolloutFailures(
            config.batch_size, report=self.control.report_error,
            hint_values={"seq_len": config.seq_len, "model": config.model.name,
                         "rollout_timeout_s": config.rollout_timeout_s}, inference_outage_s=INFERENCE_OUTAGE_S)
        sizes, weights = {}, {}
        for env in config.env:
            if env.id in self.workers:
                raise ValueError(f"environment {env.id!r} is listed twice in orchestrator.env")
            worker = EnvWorker(self.env_python, env.id, env.args, request_timeout_s=config.rollout_timeout_s,
                               max_restarts=ENV_WORKER_MAX_RESTARTS)
            info = worker.start()
            self.workers[env.id] = worker
            sizes[env.id], weights[env.id] = info.num_examples, env.weight
            if info.num_examples == 0:
                raise ValueError(f"environment {env.id!r} has no training examples")
            log.info("environment loaded", env_id=env.id, env_class=info.env_class, num_examples=info.num_examples)
        self.sampler = EnvSampler(sizes, weights, seed=config.sampling.seed or 0)
        self.eval_workers: dict[str, Any] = {}
        if config.eval is not None:
            for env in config.eval.env:
                worker = EnvWorker(self.env_python, env.id, env.args, request_timeout_s=config.rollout_timeout_s,
                                   max_restarts=ENV_WORKER_MAX_RESTARTS)
                info = worker.start()
                self.eval_workers[env.id] = worker
                log.info("eval environment loaded", env_id=env.id, num_eval_examples=info.num_eval_examples,
                         has_eval_dataset=info.has_eval_dataset)

    def _restore(self) -> int:
        if not self.state_path.exists():
            return 1
        state = json.loads(self.state_path.read_text())
        self.sampler.restore(state["sampler"])
        self._next_group_id = state["next_group_id"]
        log.info("resumed orchestrator state", step=state["step"])
        return int(state["step"]) + 1

    def _state(self, step: int) -> dict[str, Any]:
        return {"step": step, "sampler": self.sampler.state(), "next_group_id": self._next_group_id}

    def _save_state(self, state: dict[str, Any]) -> None:
        temporary = self.state_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state))
        temporary.replace(self.state_path)

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        from primerl.client.outage import BrokerOutageExceeded

        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._open_metrics()
            self._connect()
            start_step = self._restore()
            if self.exporter is not None:
                self.step_gauge.set(start_step - 1)
            for step in range(start_step, self.config.max_steps + 1):
                bind_context(step=step)
                try:
                    produced = self._produce_step(step)
                except SendInterrupted:
                    produced = False
                if not produced:
                    log.info("stopping", step=step, reason=self._stop_reason)
                    self._stop_flush()
                    return 0
            self._flush_sender(self.config.rollout_timeout_s + self.config.broker.outage_s)
            log.info("all steps produced", max_steps=self.config.max_steps)
            return 0
        except BrokerOutageExceeded:
            self._broker_lost = True
            raise
        except BaseException as exc:
            self._report_fatal(exc)
            raise
        finally:
            self.close()

    def _should_stop(self) -> bool:
        """SIGTERM (``stop_event``), or the broker ended the run (``control.shutdown_requested``)."""
        if self.stop_event.is_set():
            self._stop_reason = self._stop_reason or "stop requested (signal)"
            return True
        if self.control is not None and self.control.shutdown_requested.is_set():
            self._stop_reason = self._stop_reason or "the broker asked the orchestrator to shut down"
            return True
        return False

    def _stop_flush(self) -> None:
        """On stop: give the steps already handed to the send thread a grace (short when the broker ended the run:
        it takes no more batches), then end the send thread's waits."""
        shutdown = self.control is not None and self.control.shutdown_requested.is_set()
        grace_s = SHUTDOWN_FLUSH_S if shutdown else min(STOP_FLUSH_S, self.config.rollout_timeout_s)
        try:
            self._flush_sender(grace_s)
        except (TimeoutError, OutageStopped) as exc:
            log.warning("steps not sent before stopping; a restart sends them again",
                        num_unsent=self.sender.num_unsent if self.sender else 0, error=str(exc))
        finally:
            self._send_stop.set()

    def _report_fatal(self, exc: BaseException) -> None:
        """Hand the error that stops the orchestrator to the broker's status (one heartbeat, best effort)."""
        from primerl.client.control import BrokerError

        if self.control is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        self.control.report_error(f"orchestrator stopped: {type(exc).__name__}: {str(exc)[:600]}")
        try:
            self.control.heartbeat(dict(getattr(self, "progress", {})))
        except (BrokerError, ValueError) as err:
            log.warning("could not report the error to the broker", error=str(err))

    def _flush_sender(self, timeout_s: float) -> None:
        """Wait until the steps handed to the send thread are sent (their errors are raised here)."""
        if self.sender is not None:
            self.sender.flush(timeout_s)

    def _produce_step(self, step: int) -> bool:
        started_s = time.monotonic()
        self.counters = collections.Counter()
        self.fallbacks = collections.Counter()
        self.timers: collections.Counter = collections.Counter()
        min_version = self.bound.min_policy_version(step)
        self._observe_lineage()
        while (batch := self.assembler.take(min_policy_version=min_version)) is None:
            if self._should_stop():
                return False
            if self.sender is not None:
                self.sender.check()  # a failed send stops the run here, in the main thread
            assert self.failures is not None
            self.failures.check()  # a step's worth of failures in a row, or no inference worker for long: stop
            self._refresh_endpoints()
            self._observe_lineage()
            with self._timed("dispatch_s"):
                self._dispatch(step)
            self._collect(timeout_s=VERSION_WAIT_S if self._waiting_for_version else COLLECT_WAIT_S)
            self._cancel_stale(step)
        samples = batch.samples
        with self._timed("packing_s"):
            packed = pack_samples(samples, seq_len=self.config.seq_len, num_ranks=self.config.num_train_ranks)
            _check_loss_tokens_survive(packed, samples, self.config.seq_len)
            messages = to_broker_batches(step, packed)
        state = self._state(step)  # what a restart after this step must resume from (saved once it is sent)

        def on_sent(send_s: float) -> None:  # on the send thread, once the step's batches are durable
            self._save_state(state)
            self.progress["orchestrator_step"] = step
            if self.exporter is not None:
                self.step_gauge.set(step)

        assert self.sender is not None
        self.timers["send_wait_s"] += self.sender.put(
            step, (messages, packed.per_rank), on_sent,
            timeout_s=self.config.rollout_timeout_s + self.config.broker.outage_s, should_stop=self._should_stop)
        self.timers["send_s"] = self.sender.last_send_s
        self._report(step, batch, packed, time.monotonic() - started_s)
        if self.config.eval is not None and step % self.config.eval.interval == 0:
            self._evaluate(step)
        return True

    def _send_step(self, step: int, item: tuple[list[tuple[Any, bytes]], Any]) -> None:
        """On the send thread: one step's batches to the broker, through outages, until every one is durable;
        then its ``step sent`` lines (``primerl.orchestrator.step_send``)."""
        from primerl.client.rollouts import RolloutRefused

        messages, per_rank = item
        digests = rank_digests(per_rank)
        log_step_data("step sending", step, per_rank, digests)
        try:
            send_step(self.producer, step, messages, outage_s=self.config.broker.outage_s,
                      backpressure_timeout_s=self.config.rollout_timeout_s, stop_event=self._send_stop)
        except RolloutRefused as exc:  # e.g. a broker spool that still holds another run's step
            raise ValueError(f"the broker refused the batches of step {step}: {exc}. If this is a new run, give the "
                             "broker a fresh spool_dir; to continue a run, keep the orchestrator's output_dir") from None
        log_step_data("step sent", step, per_rank, digests)

    def _report_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """``report_metrics`` to the broker, waiting through an outage (within ``broker.outage_s``)."""
        watch = OutageWatch(f"ReportMetrics({step})", self.config.broker.outage_s, worker="orchestrator")
        try:
            retry_through_outage(lambda: self.control.report_metrics(step, metrics), watch, self._broker_unavailable,
                                 stop_event=self.stop_event)
        except OutageStopped:
            log.warning("metrics not reported to the broker: stopping", step=step)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timers[name] += time.perf_counter() - started

    def _evaluate(self, step: int) -> None:
        """Each eval environment's eval split against the current policy, logged apart as ``eval/<env>/...``."""
        config = self.config
        eval_config = config.eval
        endpoint = min(self.endpoints.values(), key=lambda e: e.num_inflight) if self.endpoints else None
        if endpoint is None:
            log.warning("no inference worker for the eval; skipped", step=step)
            return
        for worker in self.eval_workers.values():
            worker.ensure_alive()
        from primerl.orchestrator.evaluation import run_eval_groups, summarize_groups

        started_s = time.monotonic()
        metrics: dict[str, float] = {}
        for env_id, worker in self.eval_workers.items():
            count = worker.info.num_eval_examples
            if eval_config.num_examples is not None:
                count = min(count, eval_config.num_examples)
            groups, failed = run_eval_groups(
                worker, range(count), num_rollouts=eval_config.rollouts_per_example, base_url=endpoint.base_url,
                model=config.model.name, api_key=config.broker.run_token or "EMPTY",
                sampling=config.sampling.model_dump(), split="eval",  # seeded by example index when seeded
                max_concurrent_groups=max(1, count), timeout_s=config.rollout_timeout_s)
            for index, error in failed.items():  # counted and reported like training rollouts
                log.warning("eval group failed", env_id=env_id, example_index=index, error=error)
            summary = summarize_groups(groups, failed, rollouts_per_group=eval_config.rollouts_per_example)
            metrics.update(summary.as_metrics(f"eval/{env_id}"))
        metrics["eval/time_s"] = time.monotonic() - started_s
        self._report_metrics(step, metrics)
        self.sink.log(step, metrics)
        log.info("eval done", step=step, **{k: round(v, 4) for k, v in metrics.items() if k.endswith("/reward")})

    def _refresh_endpoints(self) -> None:
        """Take the endpoint watcher's latest worker list (no IO here; its thread reads the broker)."""
        watcher = self.endpoint_watcher
        assert watcher is not None
        watcher.check()  # BrokerOutageExceeded (or another error of the list call) stops the run here
        watcher.set_fast(self._waiting_for_version)
        generation, workers = watcher.snapshot()
        if generation == self._endpoints_generation:
            return
        self._endpoints_generation = generation
        alive = {}
        for worker_id, (base_url, version) in workers.items():
            endpoint = self.endpoints.get(worker_id) or InferenceEndpoint(worker_id, base_url, version)
            endpoint.policy_version = version
            alive[worker_id] = endpoint
        if not alive and self.endpoints:
            log.warning("no inference worker is alive; waiting for one")
        self.endpoints = alive

    def _dispatch(self, step: int) -> None:
        config = self.config
        if not self.endpoints:
            return
        served_version = min(e.policy_version for e in self.endpoints.values())
        self._waiting_for_version = not self.bound.may_dispatch(step, served_version)
        if self._waiting_for_version:
            self.counters["dispatch_waits"] += 1
            return
        now_s = time.monotonic()
        answering = [e for e in self.endpoints.values() if e.retry_at_s <= now_s]  # not backing off
        if not answering:
            return
        max_inflight = config.max_inflight or 2 * config.batch_size
        groups_wanted = math.ceil(max_inflight / config.rollouts_per_example)
        # Groups are drawn one by one (the same draws, seeds and group ids as one at a time), then handed to
        # each env worker in one write per (env, endpoint, seed).
        batches: dict[tuple[str, str, int | None], list[int]] = collections.defaultdict(list)
        entries: dict[tuple[str, str, int | None], list[_Inflight]] = collections.defaultdict(list)
        for _ in range(groups_wanted - len(self.inflight)):
            endpoint = min(answering, key=lambda e: e.num_inflight)
            # groups lost with a dead env worker go first (their draws were made already)
            env_id, example_index = self._rescheduled.popleft() if self._rescheduled else self.sampler.next()
            seed = group_seed(config.sampling.seed, self._next_group_id, config.rollouts_per_example)
            key = (env_id, endpoint.worker_id, seed)
            batches[key].append(example_index)
            entries[key].append(_Inflight(env_id, example_index, endpoint, served_version,
                                          lineage_epoch=self.lineage.epoch))
            endpoint.num_inflight += config.rollouts_per_example
            self._next_group_id += 1
        for key, example_indices in batches.items():
            env_id, _, seed = key
            endpoint = entries[key][0].endpoint
            self._ensure_worker(env_id)
            try:
                futures = self.workers[env_id].submit_rollouts(
                    example_indices, num_rollouts=config.rollouts_per_example, base_url=endpoint.base_url,
                    model=config.model.name, api_key=config.broker.run_token or "EMPTY",
                    sampling=config.sampling.model_dump() | {"seed": seed},
                )
            except EnvWorkerDied as exc:  # it died since the check above: the next dispatch restarts it
                for entry in entries[key]:
                    entry.endpoint.num_inflight -= config.rollouts_per_example
                    self._reschedule(entry, exc, restart=False)
                continue
            for future, entry in zip(futures, entries[key]):
                self.inflight[future] = entry
        self._inflight_changed()

    def _inflight_changed(self) -> None:
        num_inflight = len(self.inflight) * self.config.rollouts_per_example
        self.progress["num_inflight"] = num_inflight
        if self.exporter is not None:
            self.inflight_gauge.set(num_inflight)

    def _count_error(self, kind: str, failure_kind: str, error: str, endpoint: InferenceEndpoint,
                     num_rollouts: int = 1) -> None:
        """A failed rollout (``rollout_errors``) or rollout group (``env_errors``): both add to rollout/errors;
        ``failure_kind`` (the error's class) is counted apart and reported (``RolloutFailures``). A failure that
        says the inference worker could not be reached pauses dispatch to it (it may be restarting)."""
        self.counters[kind] += 1
        self.counters[f"errors/{kind_name(failure_kind)}"] += num_rollouts
        if self.exporter is not None:
            self.errors_counter.inc()
        assert self.failures is not None
        if self.failures.failed(failure_kind, error, num_rollouts):
            endpoint.unreachable(time.monotonic())

    def _ensure_worker(self, env_id: str) -> None:
        """Restart a dead env worker (``EnvWorkerDied`` once its restarts are used up)."""
        worker = self.workers[env_id]
        while not worker.is_alive():
            try:
                worker.ensure_alive()
            except EnvWorkerDied:  # the new process died at start: try again while restarts are left
                if worker.num_restarts >= worker.max_restarts:
                    raise

    def _reschedule(self, entry: _Inflight, exc: BaseException, *, restart: bool = True) -> None:
        """A group lost with its env worker: restart the worker, dispatch the same example again."""
        if restart:
            self._ensure_worker(entry.env_id)
        self._rescheduled.append((entry.env_id, entry.example_index))
        self.counters["rescheduled"] += self.config.rollouts_per_example
        log.info("rollout group rescheduled", env_id=entry.env_id, example_index=entry.example_index,
                 reason=str(exc).split("\n", 1)[0][:200])

    def _collect(self, timeout_s: float) -> None:
        if not self.inflight:
            with self._timed("collect_wait_s"):
                self.stop_event.wait(timeout_s)
            return
        with self._timed("collect_wait_s"):
            done, _ = concurrent.futures.wait(list(self.inflight), timeout=timeout_s,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            entry = self.inflight.pop(future)
            entry.endpoint.num_inflight -= self.config.rollouts_per_example
            try:
                rollout_group = future.result()
            except EnvWorkerDied as exc:  # the worker is restarted and the group dispatched again
                self._reschedule(entry, exc)
                continue
            except Exception as exc:  # an env worker failure: counted, reported, the group is dropped
                failure_kind = exc.error_type if isinstance(exc, EnvRequestError) else type(exc).__name__
                self._count_error("env_errors", failure_kind, f"{entry.env_id}: {exc}", entry.endpoint,
                                  self.config.rollouts_per_example)
                continue
            self._time_group(rollout_group)
            tokens_before = self.counters["completion_tokens"]
            with self._timed("to_samples_s"):
                group = self._to_group(rollout_group, entry)
            self.throughput.add(entry.started_s, time.monotonic(), self.counters["completion_tokens"] - tokens_before)
            if group is None:
                continue
            with self._timed("advantages_s"):
                prepare_groups([group], self.config)
            self.assembler.add([group])
            self.counters["generation_s"] += time.monotonic() - entry.started_s
            self.counters["groups_done"] += 1
        if done:
            self._inflight_changed()

    def _time_group(self, rollout_group: Any) -> None:
        """Add a finished group's env-worker timings to the step's sums (means are taken in ``_report``)."""
        timings = getattr(rollout_group, "timings", None) or {}
        roundtrip_s = getattr(rollout_group, "roundtrip_s", None)
        self.timers["groups_timed"] += 1
        for wire_name, name in (("generate_s", "inference_wait_s"), ("score_s", "env_score_s"),
                                ("encode_s", "env_encode_s")):
            self.timers[f"group_{name}"] += float(timings.get(wire_name, 0.0))
        if roundtrip_s is not None:
            self.timers["group_env_roundtrip_s"] += roundtrip_s
            if "total_s" in timings:
                self.timers["group_env_overhead_s"] += max(0.0, roundtrip_s - float(timings["total_s"]))

    def _perf_metrics(self, elapsed_s: float) -> dict[str, float]:
        timers = getattr(self, "timers", collections.Counter())
        groups = max(1, timers["groups_timed"])
        metrics = {f"perf/{name}": float(timers[name]) for name in
                   ("dispatch_s", "collect_wait_s", "to_samples_s", "advantages_s", "packing_s", "send_wait_s",
                    "send_s")}
        for name in ("env_roundtrip_s", "inference_wait_s", "env_score_s", "env_encode_s", "env_overhead_s"):
            metrics[f"perf/{name}"] = float(timers[f"group_{name}"]) / groups
        metrics["perf/step_s"] = elapsed_s
        return metrics

    def _to_group(self, rollout_group: Any, entry: _Inflight) -> Group | None:
        config = self.config
        group_id = f"{entry.env_id}:{entry.example_index}:{self._next_group_id}"
        samples = []
        for rollout in rollout_group.rollouts:
            if not rollout.ok or rollout.reward is None:
                self._count_error("rollout_errors", rollout.error_type or "RolloutError",
                                  f"{entry.env_id}: {rollout.error}", entry.endpoint)
                continue
            entry.endpoint.answered()
            try:
                samples += rollout_to_samples(
                    rollout, config.trajectory_strategy, temperature=config.sampling.temperature,
                    default_policy_version=entry.dispatched_version, fallback_counts=self.fallbacks,
                    group_id=group_id, example_id=entry.example_index, env_id=entry.env_id,
                )
            except MalformedTrajectory as exc:
                self.counters[f"malformed_{exc.reason}"] += 1
                self._count_error("rollout_errors", f"malformed_{exc.reason}", f"{entry.env_id}: {exc}",
                                  entry.endpoint)
            else:
                assert self.failures is not None
                self.failures.succeeded()
            self.counters["rollouts"] += 1
            self.counters["completion_tokens"] += rollout.num_completion_tokens
            self.counters["truncated"] += int(rollout.is_truncated)
        if not samples:
            return None
        ceiling = self.lineage.ceiling_since(entry.lineage_epoch)
        if ceiling is not None:  # made by weights a rollback since its dispatch removed
            cap_versions(samples, ceiling)
        return Group(group_id=group_id, example_id=entry.example_index, env_id=entry.env_id, samples=samples)

    def _observe_lineage(self) -> None:
        """A rollback (a newer policy lineage in the broker's heartbeat answer): samples made with the rolled-back
        weights count as the lineage's base version from now on (``primerl.orchestrator.lineage``)."""
        heartbeat = self.control.last_heartbeat if self.control is not None else None
        if heartbeat is None:
            return
        base = self.lineage.observe(heartbeat.policy_lineage, heartbeat.lineage_base_version)
        if base is None:
            return
        num_waiting = cap_versions((s for group in self.assembler.pending_groups() for s in group.samples), base)
        num_inflight = 0
        for entry in self.inflight.values():
            if entry.dispatched_version > base:
                entry.dispatched_version = base
                num_inflight += 1
        log.warning("policy rolled back: samples made with the rolled-back weights count as the base version",
                    lineage=heartbeat.policy_lineage, base_version=base, waiting_samples_capped=num_waiting,
                    inflight_groups_capped=num_inflight)

    def _cancel_stale(self, step: int) -> None:
        stale = self.bound.stale_groups({f: e.dispatched_version for f, e in self.inflight.items()}, step)
        for future in stale:
            entry = self.inflight.pop(future)
            entry.endpoint.num_inflight -= self.config.rollouts_per_example
            self.workers[entry.env_id].cancel(future)
            self.counters["stale_groups_cancelled"] += 1
        if stale:
            self._inflight_changed()

    # -- metrics and shutdown ------------------------------------------------------------------------

    def _report(self, step: int, batch: Any, packed: Any, elapsed_s: float) -> None:
        rewards = [reward for g in batch.groups for reward in g.rollout_rewards()]
        multi_env = len(self.config.env) > 1
        versions = [s.min_policy_version for s in batch.samples]
        rollouts = [samples for g in batch.groups for samples in g.rollouts().values()]
        lengths = [sum(s.num_completion_tokens or 0 for s in samples) for samples in rollouts]
        metrics = {
            "train/reward": float(np.mean(rewards)),
            "rollout/reward_std": float(np.std(rewards)),
            "rollout/mean_length": float(np.mean(lengths)),
            "rollout/truncation_rate": float(np.mean([any(s.truncated for s in samples) for samples in rollouts])),
            "rollout/generation_time": elapsed_s,
            # generated tokens per second of wall time over a trailing window (primerl.orchestrator.throughput)
            "rollout/tokens_per_s": self.throughput.tokens_per_s(time.monotonic()),
            "rollout/completion_tokens": float(self.counters["completion_tokens"]),  # of rollouts collected this step
            **reward_spread_metrics(rewards),
            **fallback_metrics(self.fallbacks),
            **(env_reward_metrics(batch.groups) if multi_env else {}),
            "rollout/errors": float(self.counters["rollout_errors"] + self.counters["env_errors"]),
            **{f"rollout/{name}": float(count) for name, count in self.counters.items() if name.startswith("errors/")},
            "rollout/rescheduled": float(self.counters["rescheduled"]),
            "rollout/stale_groups_cancelled": float(self.counters["stale_groups_cancelled"]),
            **batch.metrics, **packed.metrics(), **self.bound.lag_metrics(step, versions),
            **self._perf_metrics(elapsed_s),
        }
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self._log_new_fallbacks()
        self._num_fallbacks_total += sum(self.fallbacks.values())
        metrics["rollout/interleave_fallbacks_total"] = float(self._num_fallbacks_total)
        # the broker merges all roles' last metrics: the batch's step lets the progress line pair its reward
        self._report_metrics(step, {**metrics, "orchestrator/step": float(step)})
        self.sink.log(step, metrics)
        log.info("batch sent", reward=round(metrics["train/reward"], 4), num_samples=len(batch.samples),
                 seconds=round(elapsed_s, 2), tokens_per_s=round(metrics["rollout/tokens_per_s"], 1))

    def _log_new_fallbacks(self) -> None:
        """Once per reason and run: interleaved trajectories that were trained as branching samples instead."""
        for reason, count in self.fallbacks.items():
            if reason not in self._fallback_reasons_logged:
                self._fallback_reasons_logged.add(reason)
                log.warning("interleaved trajectories fall back to branching samples (more samples, prompts "
                            "trained again); counted in rollout/interleave_fallbacks", reason=reason,
                            num_this_step=count)

    def close(self) -> None:
        self._send_stop.set()  # a send still waiting for the broker gives up (a restart sends its step again)
        if self.endpoint_watcher is not None:
            self.endpoint_watcher.stop()
        for future, entry in list(self.inflight.items()):
            self.workers[entry.env_id].cancel(future)
        self.inflight.clear()
        for worker in [*self.workers.values(), *getattr(self, "eval_workers", {}).values()]:
            worker.close()
        sender_stopped = True
        if self.sender is not None:
            sender_stopped = self.sender.close(timeout_s=STOP_FLUSH_S)
            if not sender_stopped:
                log.warning("the send thread is still sending; its step is not saved as done",
                            num_unsent=self.sender.num_unsent)
        if self.producer is not None and sender_stopped:  # never close a socket another thread still uses
            self.producer.close()
        if self.control is not None:
            if not self._broker_lost:  # an unreachable broker would only make the goodbye time out
                self.control.deregister("orchestrator finished")
            self.control.close()
        if self.sink is not None:
            self.sink.close()
        if self.exporter is not None:
            self.exporter.stop()


def _check_loss_tokens_survive(packed: Any, samples: list, seq_len: int) -> None:
    """A step whose completions were all cut off by truncation to ``seq_len`` would stop the trainer with "no loss
    tokens"; say the cause here instead (a configuration error: exit 2, not restarted)."""
    if packed.num_loss_tokens_global or not any(any(sample.loss_mask) for sample in samples):
        return
    longest_prompt = max(next((i for i, in_loss in enumerate(s.loss_mask) if in_loss), s.num_tokens) for s in samples)
    raise ValueError(f"no sample keeps a completion token within seq_len = {seq_len}: prompts are up to "
                     f"{longest_prompt} tokens long, so truncation to seq_len leaves nothing to train on; raise "
                     "seq_len (and the inference max_model_len) above the prompts' length plus max_tokens")


def group_seed(run_seed: int | None, group_id: int, rollouts_per_example: int) -> int | None:
    """The sampling seed of training group ``group_id`` (its rollout i: this plus i); ``primerl.orchestrator.seeds``."""
    return rollout_seed_base(run_seed, group_id, rollouts_per_example)


def reward_spread_metrics(rewards: list[float]) -> dict[str, float]:
    """Where the batch's rollout rewards lie: min, max and the 10th/90th percentiles (the plot's band)."""
    if not rewards:
        return {}
    p10, p90 = np.percentile(rewards, [10, 90])
    return {"rollout/reward_min": float(min(rewards)), "rollout/reward_max": float(max(rewards)),
            "rollout/reward_p10": float(p10), "rollout/reward_p90": float(p90)}


def fallback_metrics(fallbacks: collections.Counter) -> dict[str, float]:
    """``rollout/interleave_fallbacks`` (trajectories of this step's rollouts that could not be interleaved and
    were trained as branching samples) and one ``rollout/interleave_fallbacks/<reason>`` per reason seen."""
    return {"rollout/interleave_fallbacks": float(sum(fallbacks.values())),
            **{f"rollout/interleave_fallbacks/{reason}": float(count) for reason, count in sorted(fallbacks.items())}}


def env_reward_metrics(groups: list) -> dict[str, float]:
    """Per environment of a batch: ``env/<id>/reward`` (mean rollout reward), ``env/<id>/num_rollouts`` and
    ``env/<id>/num_samples``."""
    rewards: dict[str, list[float]] = collections.defaultdict(list)
    num_samples: collections.Counter = collections.Counter()
    for group in groups:
        rewards[group.env_id].extend(group.rollout_rewards().tolist())
        num_samples[group.env_id] += len(group.samples)
    metrics = {}
    for env_id in sorted(rewards):
        if rewards[env_id]:
            metrics[f"env/{env_id}/reward"] = float(np.mean(rewards[env_id]))
        metrics[f"env/{env_id}/num_rollouts"] = float(len(rewards[env_id]))
        metrics[f"env/{env_id}/num_samples"] = float(num_samples[env_id])
    return metrics

"""The orchestrator daemon: keep rollouts in flight, turn finished groups into training batches, ship them.

    environments (own interpreters: classic env workers, verifiers v1 env servers) ◄── rollout requests ──┐
           └── HTTP (OpenAI API; v1: the token route) ──► inference workers listed by the broker        │
                                                                           OrchestratorRunner ── batches ──► broker

``OrchestratorRunner`` is the wiring: it connects to the broker, starts the environments, builds the
collaborators (sampler, failure tracker, inference workers, async bound, teacher stage) and hands them to the
``RolloutScheduler`` (no sockets). One step: the scheduler dispatches and collects groups until ``take_batch``
returns the step's batch (advantages, difficulty filter and teacher scoring on the way); the runner packs it into
micro-batches per trainer rank, hands them to the send thread (``batch_sender``: in step order, through broker
outages, ``step send``), and reports the step's metrics from the scheduler's ``StepReport``. State (step,
sampler positions, next group id) is saved to ``{output_dir}/orchestrator_state.json`` once a step is durable.

``started`` is set once the orchestrator is registered and its environments are loaded: a stop signal from then
on ends the loop gracefully (``stopping``, the steps handed to the send thread get a grace, ``run`` returns 0).
Faults that make the process useless raise out of ``run`` after one report to the broker: ``batch_size`` failed
rollouts in a row or no inference worker for ``INFERENCE_OUTAGE_S`` (``RolloutsFailing``), a broker outage past
``broker.outage_s`` (``BrokerOutageExceeded``), an environment past its restarts.

Metrics (``step_metrics``: what each one means): one row per step (and one per eval) in
``{output_dir}/metrics.jsonl``, W&B with ``[wandb]``, and a Prometheus endpoint (``[orchestrator.prometheus]``)
with live ``primerl_orchestrator_step``, ``primerl_orchestrator_inflight_rollouts`` and
``primerl_orchestrator_rollout_errors_total``. The broker also gets ``orchestrator/step`` with each batch's metrics.

Concurrency (``concurrency``): the scheduler's cap on rollouts in flight is ``max_inflight`` (fixed) or, with
``[orchestrator.concurrency]``, steered toward a KV-cache target read from each inference worker's ``/metrics``
(``concurrency/*`` in each row). Advice (``primerl.runtime.advice``), once per window of steps: ``the orchestrator
waits for policies longer than it works: add trainer`` (dispatch held by the async bound plus the send queue's
back-pressure, against the rest of the step) and ``more than half of the rollouts were discarded``.
"""

from __future__ import annotations

import collections
import gc
import json
import threading
import time
from typing import TYPE_CHECKING, Any

from primerl.client.broker_errors import BrokerUnavailable
from primerl.client.control import ControlClient
from primerl.client.outage import OutageStopped, OutageWatch, retry_through_outage
from primerl.client.rollouts import RolloutProducer
from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.batch_sender import BatchSender, SendInterrupted
from primerl.orchestrator.concurrency import AdaptiveConcurrency, FixedConcurrency, WorkerLoad, build_concurrency
from primerl.orchestrator.endpoints import EndpointWatcher, InferenceWorkers
from primerl.orchestrator.env_preflight import EnvPreflight
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.envs.base import EnvClient
from primerl.orchestrator.filtering import AssembledBatch
from primerl.orchestrator.packing import to_broker_batches
from primerl.orchestrator.rollout_failures import RolloutFailures
from primerl.orchestrator.rollout_samples import RolloutSamples
from primerl.orchestrator.rollout_scheduler import RolloutScheduler
from primerl.orchestrator.startup import (
    VERSION_WAIT_S,
    connect_broker,
    rollout_failures,
    start_environments,
    watch_workers,
)
from primerl.orchestrator.step_reporter import StepReporter
from primerl.orchestrator.step_send import log_step_data, rank_digests, send_step
from primerl.orchestrator.teacher_scoring import TeacherScorer
from primerl.orchestrator.teacher_stage import TeacherStage
from primerl.orchestrator.types import SchedulerEvents, StepReport
from primerl.proto import telemetry
from primerl.proto.packing import PackedMicroBatch, PackedStep, check_loss_tokens_survive, pack_samples
from primerl.proto.v1 import control_pb2, data_pb2
from primerl.runtime.durable_files import write_atomically
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.metrics_sink import MetricsSink
from primerl.runtime.prometheus import MetricsExporter, start_exporter
from primerl.runtime.start_gate import wait_for_gate

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

log = get_logger("primerl.orchestrator")

StepItem = tuple[list[tuple[data_pb2.RolloutBatchHeader, bytes]], list[list[PackedMicroBatch]]]
"""What the send thread gets of a step: its batch messages, and its micro-batches per rank (for the digests)."""

COLLECT_WAIT_S = 0.5  # the longest the main loop waits for a rollout group before looking at the rest again
STOP_FLUSH_S = 30.0  # on stop, how long steps already handed to the send thread may take to be sent
SHUTDOWN_FLUSH_S = 2.0  # the same when the broker ended the run (the role must be gone within 10 s)


class OrchestratorRunner:
    """The orchestrator's life: set-up, the step loop, the send, reporting, evals and shutdown (module docstring).
    Every collaborator is None (or empty) until ``run`` builds it; ``started`` says when all of them exist."""

    def __init__(
        self,
        config: OrchestratorConfig,
        *,
        env_python: str,
        stop_event: threading.Event | None = None,
        freeze_heap: bool = False,
    ):
        if config.max_steps is None:
            raise ValueError("the orchestrator needs max_steps (top-level `max_steps` or `orchestrator.max_steps`)")
        self.config = config
        self.env_python = env_python
        self.stop_event = stop_event or threading.Event()
        self.started = threading.Event()  # registered, environments loaded, state restored: stops are graceful
        # Once started, move what start-up left alive (torch, the tokenizer, the clients) to the collector's
        # permanent generation: full collections, set off by the rollouts' allocations, no longer walk it. For
        # the daemon's own process (`primerl-orchestrator`), not a runner inside another program.
        self.freeze_heap = freeze_heap
        self.state_path = config.output_dir / "orchestrator_state.json"
        self.progress: dict[str, int] = {"orchestrator_step": 0, "num_inflight": 0}  # sent with each heartbeat
        self.inference = InferenceWorkers()
        self.bound = AsyncBound(config.max_async_level)
        self.control: ControlClient | None = None
        self.producer: RolloutProducer | None = None
        self.exporter: MetricsExporter | None = None
        self.step_gauge: Gauge | None = None  # Prometheus instruments, with an exporter
        self.inflight_gauge: Gauge | None = None
        self.errors_counter: Counter | None = None
        self.sink: MetricsSink | None = None
        self.sender: BatchSender[StepItem] | None = None
        self.endpoint_watcher: EndpointWatcher | None = None
        self.teacher_watcher: EndpointWatcher | None = None  # the broker's teacher workers (no teacher.base_url)
        self.env_clients: dict[str, EnvClient] = {}  # training environments by env id
        self.eval_clients: dict[str, EnvClient] = {}  # eval environments by env id
        self.failures: RolloutFailures | None = None
        self.teacher = (
            TeacherStage(TeacherScorer(config.teacher, run_token=config.broker.run_token))
            if config.teacher is not None
            else None
        )  # first: a bad teacher.api_key_var fails at once
        self.scheduler: RolloutScheduler | None = None
        self.concurrency: FixedConcurrency | AdaptiveConcurrency | None = None  # the scheduler's in-flight cap
        self.reporter = StepReporter(config, self.bound)
        self._policy_wait_s = 0.0  # of the step under way: dispatch held for a newer policy
        self._send_stop = threading.Event()  # ends the send thread's waits when the orchestrator stops
        self._broker_lost = False  # stopped by BrokerOutageExceeded: no goodbye to the broker
        self._stop_reason = ""
        # Under `primerl rl`: the preflight's environment check, on the env workers this run starts.
        self.env_preflight = EnvPreflight.requested(config)

    # -- set-up --------------------------------------------------------------------------------------

    def _open_metrics(self) -> None:
        """The Prometheus endpoint and the metrics sink (first: a bad [wandb] or port fails at once)."""
        config = self.config
        self.exporter = start_exporter("orchestrator", config.prometheus)
        if self.exporter is not None:
            self.step_gauge = self.exporter.gauge(
                telemetry.ORCHESTRATOR_STEP_GAUGE, "Latest step whose batch was sent."
            )
            self.inflight_gauge = self.exporter.gauge(
                telemetry.ORCHESTRATOR_INFLIGHT_ROLLOUTS, "Rollouts in flight against the inference workers."
            )
            self.errors_counter = self.exporter.counter(
                telemetry.ORCHESTRATOR_ROLLOUT_ERRORS, "Failed rollouts and rollout groups (the sum of rollout/errors)."
            )
            self.exporter.gauge(
                telemetry.ORCHESTRATOR_MAX_ASYNC_LEVEL,
                "max_async_level: how many policy versions behind the trainer a rollout's policy may be.",
            ).set(config.max_async_level)
        self.sink = MetricsSink("orchestrator", config.output_dir, config.wandb, config, exporter=self.exporter)
        # A few sample rollouts per step for the dashboard: to rollouts.jsonl and the broker's run history.
        self.rollout_samples = RolloutSamples(
            config.output_dir,
            config.model.name,
            on_records=lambda step, records: self._send_samples(step, records),
            tokenizer_loading=self.env_preflight.tokenizer_of(config.model.name) if self.env_preflight else None,
        )

    def _connect(self) -> None:
        """Register with the broker, start the worker-list threads and the send thread."""
        capabilities = {"metrics_url": self.exporter.url} if self.exporter is not None else {}
        self.control, self.producer = connect_broker(self.config, capabilities, lambda: dict(self.progress))
        self.sender = BatchSender(self._send_step)
        self.endpoint_watcher, self.teacher_watcher = watch_workers(self.config, self.control)
        self.failures = rollout_failures(self.config, self.control)

    def _build_scheduler(self, sampler: EnvSampler) -> RolloutScheduler:
        config = self.config
        assert self.failures is not None
        self.concurrency = build_concurrency(config, self._worker_loads, token=config.broker.run_token)
        return RolloutScheduler(
            config,
            stop_event=self.stop_event,
            env_clients=self.env_clients,
            sampler=sampler,
            failures=self.failures,
            inference=self.inference,
            bound=self.bound,
            teacher=self.teacher,
            events=SchedulerEvents(inflight_changed=self._inflight_changed, rollout_failed=self._rollout_failed),
            inflight_limit=self.concurrency,
        )

    def _worker_loads(self) -> list[WorkerLoad]:
        """The ready inference workers and their rollouts in flight (read by the adaptive concurrency's thread)."""
        return [
            WorkerLoad(e.worker_id, e.base_url, e.num_inflight)
            for e in list(self.inference.endpoints.values())
            if e.ready
        ]

    def _restore(self, scheduler: RolloutScheduler) -> int:
        if not self.state_path.exists():
            return 1
        state = json.loads(self.state_path.read_text())
        scheduler.restore(state)
        log.info("resumed orchestrator state", step=state["step"])
        return int(state["step"]) + 1

    def _save_state(self, state: dict[str, Any]) -> None:
        write_atomically(self.state_path, [json.dumps(state).encode()])

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        from primerl.client.outage import BrokerOutageExceeded

        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.env_preflight is not None:
                self.env_preflight.start()  # its tokenizer loads while the broker is dialled and the envs load
            self._open_metrics()
            self._connect()
            sampler = start_environments(
                self.config, self.env_python, self.inference, self.env_preflight, self.env_clients, self.eval_clients
            )
            scheduler = self.scheduler = self._build_scheduler(sampler)
            start_step = self._restore(scheduler)
            if self.step_gauge is not None:
                self.step_gauge.set(start_step - 1)
            self.started.set()
            if self.freeze_heap:
                gc.freeze()
                log.info("start-up heap frozen", num_objects=gc.get_freeze_count())
            if not wait_for_gate(self.stop_event, log):  # `primerl rl`'s preflight, run beside the start
                log.info(telemetry.STOPPING, step=start_step, reason="stop requested before the preflight passed")
                return 0
            for step in range(start_step, self.config.max_steps + 1):
                bind_context(step=step)
                try:
                    produced = self._produce_step(scheduler, step)
                except SendInterrupted:
                    produced = False
                if not produced:
                    log.info(telemetry.STOPPING, step=step, reason=self._stop_reason)
                    self._stop_flush()
                    return 0
            self._flush_sender(self.config.rollout_timeout_s + self.config.broker.outage_s)
            log.info(telemetry.ALL_STEPS_PRODUCED, max_steps=self.config.max_steps)
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
            log.warning(
                "steps not sent before stopping; a restart sends them again",
                num_unsent=self.sender.num_unsent if self.sender else 0,
                error=str(exc),
            )
        finally:
            self._send_stop.set()

    def _report_fatal(self, exc: BaseException) -> None:
        """Hand the error that stops the orchestrator to the broker's status (one heartbeat, best effort)."""
        from primerl.client.broker_errors import BrokerError

        if self.control is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        self.control.report_error(f"orchestrator stopped: {type(exc).__name__}: {str(exc)[:600]}")
        try:
            self.control.heartbeat(dict(self.progress))
        except (BrokerError, ValueError) as err:
            log.warning("could not report the error to the broker", error=str(err))

    def _flush_sender(self, timeout_s: float) -> None:
        """Wait until the steps handed to the send thread are sent (their errors are raised here)."""
        if self.sender is not None:
            self.sender.flush(timeout_s)

    def _produce_step(self, scheduler: RolloutScheduler, step: int) -> bool:
        """One step: rounds of the scheduler until its batch is assembled, then pack, send and report it; False
        when the orchestrator stops first."""
        assert self.sender is not None and self.failures is not None and self.endpoint_watcher is not None
        started_s = time.monotonic()
        scheduler.observe_lineage(self._heartbeat())
        while (batch := scheduler.take_batch(step)) is None:
            if self._should_stop():
                return False
            self.sender.check()  # a failed send stops the run here, in the main thread
            self.failures.check()  # a step's worth of failures in a row, or no inference worker for long: stop
            scheduler.refresh_endpoints(self.endpoint_watcher)
            if self.teacher is not None and self.teacher_watcher is not None:
                self.teacher.refresh(self.teacher_watcher)
            scheduler.observe_lineage(self._heartbeat())
            scheduler.dispatch(step)
            round_started_s = time.monotonic()
            scheduler.collect(timeout_s=VERSION_WAIT_S if scheduler.waiting_for_version else COLLECT_WAIT_S)
            if scheduler.waiting_for_version:  # held by the async bound: waiting for the trainer's next policy
                self._policy_wait_s += time.monotonic() - round_started_s
            scheduler.cancel_stale(step)
            scheduler.retry_silent()
        phase_s: collections.Counter = collections.Counter()  # the runner's own phases of the step
        packing_started_s = time.perf_counter()
        samples = batch.samples
        packed = pack_samples(samples, seq_len=self.config.seq_len, num_ranks=self.config.num_train_ranks)
        check_loss_tokens_survive(packed, samples, self.config.seq_len)
        messages = to_broker_batches(step, packed)
        phase_s["packing_s"] = time.perf_counter() - packing_started_s
        state = {"step": step, **scheduler.state()}  # what a restart after this step resumes from (saved once sent)

        def on_sent(send_s: float) -> None:  # on the send thread, once the step's batches are durable
            self._save_state(state)
            self.progress["orchestrator_step"] = step
            if self.step_gauge is not None:
                self.step_gauge.set(step)

        phase_s["send_wait_s"] = self.sender.put(
            step,
            (messages, packed.per_rank),
            on_sent,
            timeout_s=self.config.rollout_timeout_s + self.config.broker.outage_s,
            should_stop=self._should_stop,
        )
        phase_s["send_s"] = self.sender.last_send_s
        report = scheduler.take_report()
        report.timers.totals.update(phase_s)
        self._report(step, batch, packed, report, time.monotonic() - started_s)
        if self.config.eval is not None and step % self.config.eval.interval == 0:
            self._evaluate(step)
        return True

    def _send_step(self, step: int, item: StepItem) -> None:
        """On the send thread: one step's batches to the broker, through outages, until every one is durable;
        then its ``step sent`` lines (``primerl.orchestrator.step_send``)."""
        from primerl.client.rollouts import RolloutRefused

        messages, per_rank = item
        digests = rank_digests(per_rank)
        log_step_data(telemetry.STEP_SENDING, step, per_rank, digests)
        try:
            send_step(
                self.producer,
                step,
                messages,
                outage_s=self.config.broker.outage_s,
                backpressure_timeout_s=self.config.rollout_timeout_s,
                stop_event=self._send_stop,
            )
        except RolloutRefused as exc:  # e.g. a broker spool that still holds another run's step
            raise ValueError(
                f"the broker refused the batches of step {step}: {exc}. If this is a new run, give the "
                "broker a fresh spool_dir; to continue a run, keep the orchestrator's output_dir"
            ) from None
        log_step_data(telemetry.STEP_SENT, step, per_rank, digests)

    def _heartbeat(self) -> control_pb2.HeartbeatResponse | None:
        """The broker's latest heartbeat answer (its policy lineage), None before the first."""
        return self.control.last_heartbeat if self.control is not None else None

    def _inflight_changed(self, num_inflight: int) -> None:
        self.progress["num_inflight"] = num_inflight
        if self.inflight_gauge is not None:
            self.inflight_gauge.set(num_inflight)

    def _rollout_failed(self) -> None:
        if self.errors_counter is not None:
            self.errors_counter.inc()

    def _report_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """``report_metrics`` to the broker, waiting through an outage (within ``broker.outage_s``)."""
        watch = OutageWatch(f"ReportMetrics({step})", self.config.broker.outage_s, worker="orchestrator")
        control = self.control
        assert control is not None
        try:
            retry_through_outage(
                lambda: control.report_metrics(step, metrics), watch, (BrokerUnavailable,), stop_event=self.stop_event
            )
        except OutageStopped:
            log.warning("metrics not reported to the broker: stopping", step=step)

    def _send_samples(self, step: int, records: list[dict]) -> None:
        if self.control is not None and not self._broker_lost:
            self.control.report_rollouts(step, [json.dumps(record, ensure_ascii=False) for record in records])

    def _evaluate(self, step: int) -> None:
        """Each eval environment's eval split against the current policy, logged apart as ``eval/<env>/...``."""
        from primerl.orchestrator.evaluation import evaluate_workers

        config = self.config
        endpoints = self.inference.ready()  # not one that joined and has yet to catch up
        endpoint = min(endpoints, key=lambda e: e.num_inflight) if endpoints else None
        if endpoint is None:
            log.warning("no inference worker for the eval; skipped", step=step)
            return
        for client in self.eval_clients.values():
            client.ensure_alive()
        started_s = time.monotonic()
        metrics = evaluate_workers(
            self.eval_clients,
            config.eval,
            base_url=endpoint.base_url,
            model=config.model.name,
            api_key=config.broker.run_token or "EMPTY",
            sampling=config.sampling.model_dump(),
            timeout_s=config.rollout_timeout_s,
        )
        metrics[telemetry.EVAL_TIME_S] = time.monotonic() - started_s
        self._report_metrics(step, metrics)
        self.sink.log(step, metrics)
        log.info("eval done", step=step, **{k: round(v, 4) for k, v in metrics.items() if k.endswith("/reward")})

    # -- metrics and shutdown ------------------------------------------------------------------------

    def _report(
        self, step: int, batch: AssembledBatch, packed: PackedStep, report: StepReport, elapsed_s: float
    ) -> None:
        """The step's metrics (``primerl.orchestrator.step_metrics``) to the broker, the sink and the log."""
        assert self.sink is not None
        waited_s = self._policy_wait_s + report.timers.totals.get("send_wait_s", 0.0)
        self._policy_wait_s = 0.0
        concurrency = self.concurrency.metrics() if self.concurrency is not None else {}
        metrics = self.reporter.metrics(
            step, batch, packed, report, elapsed_s=elapsed_s, waited_s=waited_s, concurrency=concurrency
        )
        # the broker merges all roles' last metrics: the batch's step lets the progress line pair its reward
        self._report_metrics(step, {**metrics, telemetry.ORCHESTRATOR_STEP: float(step)})
        self.sink.log(step, metrics)
        self.rollout_samples.add(step, batch.samples)
        log.info(
            telemetry.BATCH_SENT,
            reward=round(metrics[telemetry.TRAIN_REWARD], 4),
            num_samples=len(batch.samples),
            seconds=round(elapsed_s, 2),
            tokens_per_s=round(metrics[telemetry.ROLLOUT_TOKENS_PER_S], 1),
        )

    def close(self) -> None:
        self._send_stop.set()  # a send still waiting for the broker gives up (a restart sends its step again)
        for watcher in (self.endpoint_watcher, self.teacher_watcher):
            if watcher is not None:
                watcher.stop()
        if self.concurrency is not None:
            self.concurrency.close()
        if self.scheduler is not None:
            self.scheduler.cancel_all()
        elif self.teacher is not None:
            self.teacher.close()
        for client in [*self.env_clients.values(), *self.eval_clients.values()]:
            client.close()
        sender_stopped = True
        if self.sender is not None:
            sender_stopped = self.sender.close(timeout_s=STOP_FLUSH_S)
            if not sender_stopped:
                log.warning(
                    "the send thread is still sending; its step is not saved as done", num_unsent=self.sender.num_unsent
                )
        if self.producer is not None and sender_stopped:  # never close a socket another thread still uses
            self.producer.close()
        if self.control is not None:
            if not self._broker_lost:  # an unreachable broker would only make the goodbye time out
                self.control.deregister("orchestrator finished")
            self.control.close()
        if self.sink is not None:
            self.sink.close()
            self.rollout_samples.close()
        if self.exporter is not None:
            self.exporter.stop()

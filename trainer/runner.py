"""The RL trainer daemon: pull each step's micro-batches from the broker, step, publish, checkpoint, commit.

    rank r (torchrun) ── fetch thread: RolloutConsumer ──► broker rollout stream (step N+1, while N computes)
                     ── compute loop: TrainStep ──► optimizer step N
    rank 0           ── IO thread, in order: PolicyPublisher ──► broker weight plane (policy version N)
                     ── every ckpt.interval: checkpoint, then CommitStep(N) over gRPC
                        (without [trainer.ckpt]: CommitStep(N) after every step)
                     ── ReportMetrics(N); one row of {output_dir}/metrics.jsonl (and W&B, Prometheus)

The threads and their invariants are in ``primerl.trainer.step_io``. Several ranks replicate the model (``ddp``);
``fsdp2`` with several ranks is refused before anything loads (``primerl.trainer.distributed.resolve_parallel``).

- Commits: with ``[trainer.ckpt]`` a step is committed (the broker deletes its batches) only once its checkpoint is
  durable, so a restarted trainer trains every later step exactly once; without it each step is committed once
  trained, and a trainer that would train an already committed step refuses before registering (``CannotResume``,
  exit 2, not restarted by ``primerl rl``).
- Resume (``ckpt.resume_step``): model, optimizer, scheduler and RNG come back from the checkpoint; the resumed step
  is committed again (idempotent) and its metrics row and ``step done`` line are written from the checkpoint when
  ``metrics.jsonl`` lacks them, never twice.
- The trained model is always saved: every checkpoint exports ``{output_dir}/weights/step_N``; without
  ``[trainer.ckpt]`` the last step, or the last step trained before a clean stop, is exported (rank 0).
- Broker outages: control calls wait up to ``broker.outage_s``; the fetch thread logs while it waits for data and
  raises ``BrokerLost`` once the broker has been unreachable for longer. ``shutdown_requested``: stop, exit 0.
- Telemetry: phase timers ``perf/*`` (seconds unless ``_ms``) in each metrics row; rank 0 serves Prometheus
  (``primerl_trainer_step``, ``primerl_trainer_loss``, ``primerl_trainer_loss_tokens``; names in
  ``primerl.proto.telemetry``); every ``step done`` line carries ``data_digest`` (``primerl.proto.step_digest``),
  the digest the orchestrator logs in its ``step sent`` line.
- Advice (rank 0, ``primerl.runtime.advice``): once per window of steps in which it waited for batches longer than
  it computed, the warning ``the trainer waits for batches longer than it computes: add inference`` with the
  window's figures; ``advice/add_inference`` and ``advice/trainer_wait_to_compute`` in the rows after it.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import torch
from prometheus_client import Counter, Gauge

from primerl.client.rollouts import FetchStopped
from primerl.configs.trainer import TrainerConfig
from primerl.proto import telemetry
from primerl.proto.roles import TRAINING_FINISHED_REASON
from primerl.proto.step_digest import data_digest
from primerl.runtime.advice import WaitWindow
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.metrics_sink import MetricsSink, finite_values
from primerl.runtime.prometheus import DiskCollector, MetricsExporter, start_exporter
from primerl.trainer.distributed import DistInfo, barrier, resolve_parallel, unwrap_model
from primerl.trainer.step_io import StepIOThread, StepPrefetcher, Ticket
from primerl.trainer.train_step import distillation_objective, rl_objective, sft_objective
from primerl.trainer.training_setup import (
    Training,
    build_training,
    refuse_going_back,
    resume_from_checkpoint,
    save_training_checkpoint,
    warn_unused_options,
)

log = get_logger("primerl.trainer")

WEIGHTS_JOB_TIMEOUT_S = 600.0
"""Longest wait of the compute loop for the previous step's publish and checkpoint before its optimizer step."""
IO_DRAIN_TIMEOUT_S = 600.0
"""Longest wait at shutdown for the IO thread to finish its queued jobs."""


class TrainerRunner:
    def __init__(
        self,
        config: TrainerConfig,
        dist_info: DistInfo,
        *,
        objective: str = "rl",
        stop_event: threading.Event | None = None,
    ):
        if config.max_steps is None:
            raise ValueError("the trainer needs max_steps (top-level `max_steps` or `trainer.max_steps`)")
        self.config = config
        self.dist = dist_info
        self.objective_name = objective
        self.stop_event = stop_event or threading.Event()
        self.control = None
        self.consumer = None
        self.publisher = None
        self.exporter: MetricsExporter | None = None
        self.sink: MetricsSink | None = None
        self.gauges: _StepGauges | None = None  # rank 0 with a Prometheus endpoint
        self.training: Training | None = None  # model, optimizer, scheduler, step function (`_build`)
        self.resumed_state: dict | None = None  # extra_state of the checkpoint resumed from
        self.last_trained_step: int | None = None  # the last step this incarnation trained
        self.progress = {"trainer_step": 0}  # what the heartbeats report
        self.io: StepIOThread | None = None  # the ordered IO thread: publish, checkpoint, commit (`_start_io`)
        self.prefetcher: StepPrefetcher | None = None  # the fetch thread
        self.weights_ticket: Ticket | None = None  # the previous step's job that reads the weights
        # rank 0: "add inference" when, over a window of steps, it waits for batches longer than it computes
        self.advice = WaitWindow(
            telemetry.ADVICE_TRAINER_WAITS, telemetry.ADVICE_ADD_INFERENCE, telemetry.ADVICE_TRAINER_WAIT_TO_COMPUTE
        )
        # First, before anything loads: an explicit fsdp2 with several ranks is refused here (ValueError).
        self.parallel = resolve_parallel(config.model.parallel, dist_info.world_size)

    # -- set-up --------------------------------------------------------------------------------------

    def _open_metrics(self) -> None:
        """Rank 0: the Prometheus endpoint and the metrics sink (first: a bad [wandb] or port fails at once)."""
        if not self.dist.is_main:
            return
        config = self.config
        self.exporter = start_exporter("trainer", config.prometheus)
        if self.exporter is not None:
            self.gauges = _StepGauges(
                step=self.exporter.gauge(
                    telemetry.TRAINER_STEP, "Latest optimizer step done (= the policy version published)."
                ),
                loss=self.exporter.gauge(telemetry.TRAINER_LOSS, "Loss of the latest step."),
                loss_tokens=self.exporter.counter(
                    telemetry.TRAINER_LOSS_TOKENS, "Loss tokens trained on, over all ranks."
                ),
            )
            self.exporter.register(
                DiskCollector(
                    "checkpoints", config.checkpoint_dir, telemetry.DISK_FREE_BYTES, telemetry.DISK_SIZE_BYTES
                )
            )
        self.sink = MetricsSink("trainer", config.output_dir, config.wandb, config, exporter=self.exporter)

    def _build(self) -> int:
        """Model, optimizer, scheduler, step function; returns the first step to train."""
        config = self.config
        warn_unused_options(config)
        torch.manual_seed(0)
        objective = {
            "rl": lambda: rl_objective(config.loss),
            "sft": lambda: sft_objective,
            "distill": lambda: distillation_objective(config.loss),
        }[self.objective_name]()
        self.training = build_training(
            config, self.parallel, self.dist, config.max_steps, objective, kl_config=config.kl
        )
        start_step = 1
        state = resume_from_checkpoint(config, self.training, self.dist.rank)
        if state is not None:
            start_step = int(state["step"]) + 1
            self.resumed_state = state
            log.info(telemetry.RESUMED_FROM_CHECKPOINT, step=state["step"], checkpoint_dir=str(config.checkpoint_dir))
        return start_step

    def _connect(self, start_step: int) -> None:
        from primerl.client.control import ControlClient
        from primerl.client.rollouts import RolloutConsumer
        from primerl.trainer.publish import PolicyPublisher
        from primerl.trainer.update_builder import serving_dtype

        config = self.config
        name = f"trainer-rank{self.dist.rank}"
        capabilities = {"objective": self.objective_name, "weight_broadcast": str(config.weight_broadcast.type)}
        if self.exporter is not None:
            capabilities["metrics_url"] = self.exporter.url
        self.control = ControlClient(
            config.broker,
            "trainer",
            name,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            capabilities=capabilities,
        )
        self.control.wait_ready(config.broker.connect_timeout_s)
        refuse_going_back(config, start_step, int(self.control.get_run_status().last_committed_step))
        registration = self.control.register()
        self.control.start_heartbeats(lambda: dict(self.progress))
        limits = self.control.limits  # the broker's: every client sizes itself from them
        self.consumer = RolloutConsumer(
            registration.rollout_endpoint,
            auth_token=config.broker.run_token,
            worker_id=registration.worker_id,
            rank=self.dist.rank,
            limits=limits.frames,
            curve=self.control.curve,
        )
        if self.dist.is_main:
            self.publisher = PolicyPublisher(
                registration.weight_endpoint,
                config.broker.run_token,
                name,
                chunk_bytes=min(64 << 20, limits.weight_chunk_bytes),
                kind=config.weight_broadcast.type,
                policy_name=config.model.name,
                outage_s=config.broker.outage_s,
                stop_event=self.stop_event,
                curve=self.control.curve,
                serving_dtype=serving_dtype(config.weight_broadcast.dtype),
                stream=None if config.weight_broadcast.stream == "auto" else config.weight_broadcast.stream,
                transport=config.weight_broadcast.transport,
                run_id=registration.run_id,
                # The broker's counter orders incarnations (None: a broker that hands out none; the clock then).
                lineage=registration.policy_lineage or None,
            )

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        config = self.config
        try:
            self._open_metrics()
            start_step = self._build()
            self._connect(start_step)
            self._settle_resumed_step()
            self._start_io(start_step)
            for step in range(start_step, config.max_steps + 1):
                if self.stop_event.is_set():
                    log.info("stopping before step", step=step)
                    return self._stopped()
                if self.control.shutdown_requested.is_set():
                    log.info("the broker says the run is over; stopping before step", step=step)
                    return self._stopped()
                bind_context(step=step)
                try:
                    self._train_one(step)
                except FetchStopped:
                    log.info("stopped while waiting for the step's data", step=step)
                    return self._stopped()
            log.info(telemetry.TRAINING_FINISHED, max_steps=config.max_steps)
            return 0
        finally:
            self.close()

    def _start_io(self, start_step: int) -> None:
        """The fetch thread (from ``start_step``) and the ordered IO thread (``primerl.trainer.step_io``)."""
        from primerl.trainer.batch import MicroBatch
        from primerl.trainer.step_io import StepDataWait

        config = self.config

        def fetch(step: int, halt: threading.Event) -> list:
            return self.consumer.fetch_step(
                step, timeout_s=config.data_timeout_s, stop_event=halt, on_wait=StepDataWait(step, self.control)
            )

        def decode(raw: list) -> list:
            return [MicroBatch.from_tensors(tensors) for _, tensors in raw]

        self.io = StepIOThread()
        self.prefetcher = StepPrefetcher(
            fetch, decode, start_step, config.max_steps, describe=lambda raw: data_digest([t for _, t in raw])
        )

    def _wait_for_weights(self) -> None:
        """Before the optimizer changes the parameters: the previous step's publish and checkpoint have read them."""
        if self.weights_ticket is not None:
            self.weights_ticket.wait(WEIGHTS_JOB_TIMEOUT_S)
            self.weights_ticket = None

    def _train_one(self, step: int) -> None:
        config = self.config
        started_s = time.monotonic()
        self.io.check()
        # A bound on the wait of its own: the fetch thread gives up after data_timeout_s and says so here.
        fetched = self.prefetcher.get(step, timeout_s=config.data_timeout_s + 30.0, stop_event=self.stop_event)
        micro_batches = fetched.micro_batches
        waited_s = time.monotonic() - started_s
        stats = self.training.step_fn.step(step, micro_batches, before_update=self._wait_for_weights)
        self.progress["trainer_step"] = step
        self.last_trained_step = step
        due = self._checkpoint_due(step)
        export_final = step == config.max_steps and not due  # a checkpoint exports its step's weights itself
        commit = due or config.ckpt is None  # without checkpoints nothing durable is awaited
        timings: dict[str, float] = {}
        compute_s = time.monotonic() - started_s
        metrics = stats.as_metrics()
        metrics.update(
            {
                telemetry.PERF_WAIT_FOR_DATA_S: waited_s,
                telemetry.PERF_STEP_TIME_S: compute_s,
                telemetry.PERF_FETCH_S: fetched.fetch_s,
                telemetry.PERF_DECODE_S: fetched.decode_s,
                telemetry.TRAIN_NUM_MICRO_BATCHES: float(len(micro_batches)),
                telemetry.CKPT_SAVED: float(due),
            }
        )
        metrics.update({f"perf/{name}": value for name, value in stats.timings.items()})
        if self.dist.is_main:
            self._advise(waited_s, compute_s - waited_s, metrics)
        done_line = {
            "loss": round(stats.loss, 6),
            "grad_norm": round(stats.grad_norm, 4),
            "kl_divergence": stats.metrics.get("kl_divergence"),
            "tokens": stats.num_loss_tokens,
            **({"teacher_kl": round(stats.metrics["teacher_kl"], 6)} if "teacher_kl" in stats.metrics else {}),
            "wait_s": round(waited_s, 3),
            "step_s": round(compute_s, 3),
            "data_digest": fetched.data_digest,
        }
        record = {"metrics": metrics, "done_line": done_line}  # goes into the step's checkpoint (resume back-fill)
        if due and self.dist.enabled:
            # Collectives (barriers) stay on the compute thread: they must not interleave with DDP's.
            timings["checkpoint_s"] = self._write_checkpoint(step, record if self.dist.is_main else None)
        if not self.dist.is_main:
            return
        model = unwrap_model(self.training.model)

        def weights_job() -> None:  # reads the weights of this step: runs before the next optimizer step
            if self.publisher is not None:
                result = self.publisher.publish(model, version=step)
                timings["publish_ms"] = result.build_ms + result.send_ms
                metrics[telemetry.PERF_PUBLISH_MS] = timings["publish_ms"]  # also in the checkpoint's record
                # What went, and how (why a delta went as FULL: the `policy published` line's reason).
                metrics[telemetry.WEIGHTS_PAYLOAD_MIB] = result.payload_bytes / 2**20
                metrics[telemetry.WEIGHTS_SENT_DELTA] = float(result.kind == "delta")
                metrics[telemetry.WEIGHTS_SHARED_MEMORY] = float(result.transport == "shared_memory")
            if due and not self.dist.enabled:
                timings["checkpoint_s"] = self._write_checkpoint(step, record)
            if export_final:
                timings["export_s"] = self._export_weights(step)

        def finish_job() -> None:  # after the weights job (same ordered thread): commit only a durable checkpoint
            if commit:
                commit_started_s = time.perf_counter()
                self._commit(step)
                timings["commit_s"] = time.perf_counter() - commit_started_s
            metrics[telemetry.PERF_PUBLISH_MS] = timings.get("publish_ms", 0.0)
            metrics.update(
                {f"perf/{name}": timings[name] for name in ("checkpoint_s", "commit_s", "export_s") if name in timings}
            )
            metrics[telemetry.PERF_IO_S] = time.monotonic() - io_started_s
            self._record_step(step, metrics, {**done_line, "publish_ms": round(metrics[telemetry.PERF_PUBLISH_MS], 1)})
            if self.gauges is not None:
                self.gauges.loss.set(stats.loss)
                self.gauges.loss_tokens.inc(stats.num_loss_tokens)

        io_started_s = time.monotonic()
        self.weights_ticket = self.io.submit(f"publish/checkpoint step {step}", weights_job)
        self.io.submit(f"commit/metrics step {step}", finish_job)

    def _advise(self, waited_s: float, computed_s: float, metrics: dict) -> None:
        """The "add inference" advice (``primerl.runtime.advice``): logged once per window, flagged in the rows."""
        advice = self.advice.add(waited_s, computed_s)
        if advice is not None:
            log.warning(advice.event, **advice.figures)
        metrics.update(self.advice.metrics)

    def _record_step(self, step: int, metrics: dict, done_line: dict, **extra) -> None:
        """Rank 0: the step's metrics row (file, W&B, Prometheus), its report to the broker, its "step done" line."""
        self.sink.log(step, metrics)
        log.info(telemetry.STEP_DONE, step=step, **done_line, **extra)  # with the row: the broker may be away next
        if self.gauges is not None:
            self.gauges.step.set(step)
        self.control.report_metrics(step, metrics)

    def _settle_resumed_step(self) -> None:
        """Rank 0, after resuming from checkpoint c: commit c (a trainer killed between its checkpoint and its
        commit left it uncommitted; committing again is harmless), and write c's metrics row and "step done"
        line from the checkpoint if ``metrics.jsonl`` lacks them."""
        state = self.resumed_state
        if state is None or not self.dist.is_main:
            return
        step = int(state["step"])
        self._commit(step)
        self.progress["trainer_step"] = step
        record = state.get("record")
        if record is None or _has_trainer_row(self.sink.path, step):
            return
        log.info("writing the resumed step's record from its checkpoint", step=step)
        self._record_step(step, record["metrics"], record["done_line"], from_checkpoint=True)

    def _checkpoint_due(self, step: int) -> bool:
        ckpt = self.config.ckpt
        if ckpt is None:
            return False
        return step == self.config.max_steps or (ckpt.interval is not None and step % ckpt.interval == 0)

    def _write_checkpoint(self, step: int, record: dict | None = None) -> float:
        """Model, optimizer, scheduler (all ranks) and, on rank 0, the HF weights export; returns seconds.
        ``record``: the step's metrics and "step done" fields, kept for a resumed trainer to write them."""
        started_s = time.perf_counter()
        extra_state = {"step": step, "policy_version": step}
        if record is not None:
            extra_state["record"] = {"metrics": finite_values(record["metrics"]), "done_line": record["done_line"]}
        save_training_checkpoint(self.config, self.training, step, extra_state, self.dist)
        barrier(self.dist)
        if self.dist.is_main:
            self._export_weights(step)
        return time.perf_counter() - started_s

    def _export_weights(self, step: int) -> float:
        """Rank 0: the model as Hugging Face weights in ``{output_dir}/weights/step_{step}``; returns seconds."""
        from primerl.trainer.weights_export import export_hf_weights

        started_s = time.perf_counter()
        export_hf_weights(
            unwrap_model(self.training.model),
            self.config.tokenizer.name,
            self.config.output_dir / "weights" / f"step_{step}",
        )
        return time.perf_counter() - started_s

    def _stopped(self) -> int:
        """A clean stop before ``max_steps`` (a signal, the broker's end of the run): rank 0 exports the weights of
        the last step trained unless its checkpoint did, here and now (nothing changes the weights any more; the
        IO thread may still be publishing or committing them, and may wait for the broker). Exit 0."""
        step = self.last_trained_step
        if self.dist.is_main and step is not None and not self._checkpoint_due(step):
            log.info("exporting the weights of the last step trained", step=step, max_steps=self.config.max_steps)
            self._export_weights(step)
        return 0

    def _commit(self, step: int) -> None:
        """Rank 0: CommitStep(step) once the step's checkpoint is durable (pruning old checkpoints first), or,
        without ``[trainer.ckpt]``, as soon as the step is trained (nothing durable to wait for)."""
        from primerl.trainer.checkpoint import prune_checkpoints

        ckpt = self.config.ckpt
        if ckpt is not None:
            prune_checkpoints(self.config.checkpoint_dir, keep_last=ckpt.keep_last, keep_interval=ckpt.keep_interval)
        response = self.control.commit_step(step)  # the broker may now delete the batches of steps <= step
        log.info(
            "checkpoint committed" if ckpt is not None else telemetry.STEP_COMMITTED,
            step=step,
            batches_released=response.num_batches_released,
        )

    def _leaving_reason(self, io_error: BaseException | None) -> str:
        """Why this rank deregisters: ``TRAINING_FINISHED_REASON`` (the broker's end-of-run signal) only when it did."""
        if io_error is not None:
            return "trainer IO failed"
        if sys.exc_info()[1] is not None:
            return "trainer failed"
        if self.stop_event.is_set():
            return "stopped"
        return TRAINING_FINISHED_REASON

    def close(self) -> None:
        """Stop fetching, drain the IO thread in order (publish, checkpoint, commit of the last steps), then close
        the connections. A failed IO job is raised here (after everything is closed) unless an error is already
        on its way out."""
        io_error: BaseException | None = None
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.io is not None:
            try:
                self.io.close(IO_DRAIN_TIMEOUT_S)
            except Exception as exc:  # raised below, once the connections are closed
                io_error = exc
        for closer in (self.publisher, self.consumer):
            if closer is not None:
                closer.close()
        if self.control is not None:
            self.control.deregister(self._leaving_reason(io_error))
            self.control.close()
        if self.sink is not None:
            self.sink.close()
        if self.exporter is not None:
            self.exporter.stop()
        if io_error is not None and sys.exc_info()[1] is None:
            raise io_error


@dataclass(frozen=True)
class _StepGauges:
    """Rank 0's Prometheus families of the trainer's progress."""

    step: Gauge
    loss: Gauge
    loss_tokens: Counter


def _has_trainer_row(path, step: int) -> bool:
    """Whether ``metrics.jsonl`` at ``path`` has a trainer row for ``step`` (a half-written last line is not one)."""
    from primerl.runtime.run_metrics import MetricsFileError, read_metrics_file

    try:
        rows = read_metrics_file(path).rows
    except FileNotFoundError:
        return False
    except MetricsFileError as err:
        log.warning("cannot read metrics.jsonl to check the resumed step's row; writing it", error=str(err))
        return False
    return any(row.get("role") == "trainer" and row.get("step") == step for row in rows)

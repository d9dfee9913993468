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
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from primerl.orchestrator.advantages import prepare_groups
from primerl.orchestrator.async_bound import AsyncBound
from primerl.orchestrator.batch_sender import BatchSender
from primerl.orchestrator.config import OrchestratorConfig
from primerl.orchestrator.filtering import BatchAssembler, DifficultyFilter
from primerl.orchestrator.packing import pack_samples, to_broker_batches
from primerl.orchestrator.samples import Group, MalformedTrajectory, TurnTokens, trajectory_to_samples
from primerl.runtime.log_setup import bind_context, get_logger
from primerl.runtime.metrics_sink import MetricsSink
from primerl.runtime.prometheus import MetricsExporter, start_exporter

log = get_logger("primerl.orchestrator")

WORKER_REFRESH_S = 1.0
VERSION_WAIT_S = 0.05  # re-read the served versions this often while dispatch waits for a newer policy
COLLECT_WAIT_S = 0.5  # the longest the main loop waits for a rollout group before looking at the rest again
STOP_FLUSH_S = 30.0  # on stop, how long steps already handed to the send thread may take to be sent


@dataclass
class InferenceEndpoint:
    worker_id: str
    base_url: str
    policy_version: int
    num_inflight: int = 0


@dataclass
class _Inflight:
    env_id: str
    example_index: int
    endpoint: InferenceEndpoint
    dispatched_version: int
    started_s: float = field(default_factory=time.monotonic)


class EnvSampler:
    """Draws (env, example) pairs: an env by weight, then the next example of its shuffled order."""

    def __init__(self, env_sizes: dict[str, int], weights: dict[str, float], seed: int):
        self.env_ids = list(env_sizes)
        self.weights = [weights[env_id] for env_id in self.env_ids]
        self.sizes = env_sizes
        self.rng = random.Random(seed)
        self.positions = {env_id: 0 for env_id in self.env_ids}
        self.seed = seed

    def _order(self, env_id: str, epoch: int) -> list[int]:
        order = list(range(self.sizes[env_id]))
        random.Random(f"{self.seed}:{env_id}:{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[str, int]:
        env_id = self.rng.choices(self.env_ids, weights=self.weights)[0]
        position = self.positions[env_id]
        self.positions[env_id] = position + 1
        epoch, offset = divmod(position, self.sizes[env_id])
        return env_id, self._order(env_id, epoch)[offset]

    def state(self) -> dict[str, Any]:
        return {"positions": dict(self.positions), "rng": _encode_rng(self.rng.getstate())}

    def restore(self, state: dict[str, Any]) -> None:
        self.positions.update(state["positions"])
        self.rng.setstate(_decode_rng(state["rng"]))


def _encode_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_rng(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


class OrchestratorRunner:
    def __init__(self, config: OrchestratorConfig, *, env_python: str, stop_event: threading.Event | None = None):
        if config.max_steps is None:
            raise ValueError("the orchestrator needs max_steps (top-level `max_steps` or `orchestrator.max_steps`)")
        self.config = config
        self.env_python = env_python
        self.stop_event = stop_event or threading.Event()
        self.state_path = config.output_dir / "orchestrator_state.json"
        self.bound = AsyncBound(config.max_async_level)
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
        self._endpoints_refreshed_s = 0.0
        self._waiting_for_version = False
        self.sender: BatchSender | None = None

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
        from primerl.broker.control_client import ControlClient
        from primerl.broker.rollout_clients import RolloutProducer
        from primerl.orchestrator.env_client import EnvWorker

        config = self.config
        capabilities = {"metrics_url": self.exporter.url} if self.exporter is not None else {}
        self.control = ControlClient(config.broker, "orchestrator", "orchestrator", capabilities=capabilities)
        self.control.wait_ready(config.broker.connect_timeout_s)
        registration = self.control.register()
        self.progress = {"orchestrator_step": 0, "num_inflight": 0}
        self.control.start_heartbeats(lambda: dict(self.progress))
        self.producer = RolloutProducer(registration.rollout_endpoint, auth_token=config.broker.run_token,
                                        sender="orchestrator")
        self.sender = BatchSender(self._send_step)
        sizes, weights = {}, {}
        for env in config.env:
            if env.id in self.workers:
                raise ValueError(f"environment {env.id!r} is listed twice in orchestrator.env")
            worker = EnvWorker(self.env_python, env.id, env.args, request_timeout_s=config.rollout_timeout_s)
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
                worker = EnvWorker(self.env_python, env.id, env.args, request_timeout_s=config.rollout_timeout_s)
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
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._open_metrics()
            self._connect()
            start_step = self._restore()
            if self.exporter is not None:
                self.step_gauge.set(start_step - 1)
            for step in range(start_step, self.config.max_steps + 1):
                bind_context(step=step)
                if not self._produce_step(step):
                    log.info("stopping", step=step)
                    self._flush_sender(min(STOP_FLUSH_S, self.config.rollout_timeout_s))
                    return 0
            self._flush_sender(self.config.rollout_timeout_s)
            log.info("all steps produced", max_steps=self.config.max_steps)
            return 0
        finally:
            self.close()

    def _flush_sender(self, timeout_s: float) -> None:
        """Wait until the steps handed to the send thread are sent (their errors are raised here)."""
        if self.sender is not None:
            self.sender.flush(timeout_s)

    def _produce_step(self, step: int) -> bool:
        started_s = time.monotonic()
        self.counters = collections.Counter()
        self.timers: collections.Counter = collections.Counter()
        min_version = self.bound.min_policy_version(step)
        while (batch := self.assembler.take(min_policy_version=min_version)) is None:
            if self.stop_event.is_set():
                return False
            if self.sender is not None:
                self.sender.check()  # a failed send stops the run here, in the main thread
            self._refresh_endpoints()
            with self._timed("dispatch_s"):
                self._dispatch(step)
            self._collect(timeout_s=VERSION_WAIT_S if self._waiting_for_version else COLLECT_WAIT_S)
            self._cancel_stale(step)
        samples = batch.samples
        with self._timed("packing_s"):
            packed = pack_samples(samples, seq_len=self.config.seq_len, num_ranks=self.config.num_train_ranks)
            messages = to_broker_batches(step, packed)
        state = self._state(step)  # what a restart after this step must resume from (saved once it is sent)

        def on_sent(send_s: float) -> None:  # on the send thread, once the step's batches are durable
            self._save_state(state)
            self.progress["orchestrator_step"] = step
            if self.exporter is not None:
                self.step_gauge.set(step)

        assert self.sender is not None
        self.timers["send_wait_s"] += self.sender.put(step, messages, on_sent, timeout_s=self.config.rollout_timeout_s)
        self.timers["send_s"] = self.sender.last_send_s
        self._report(step, batch, packed, time.monotonic() - started_s)
        if self.config.eval is not None and step % self.config.eval.interval == 0:
            self._evaluate(step)
        return True

    def _send_step(self, step: int, messages: list[tuple[Any, bytes]]) -> None:
        """On the send thread: one step's batches to the broker, until every one is durable."""
        from primerl.broker.rollout_clients import RolloutRefused

        try:
            self.producer.send_batches(messages, timeout_s=self.config.rollout_timeout_s)
        except RolloutRefused as exc:  # e.g. a broker spool that still holds another run's step
            raise ValueError(f"the broker refused the batches of step {step}: {exc}. If this is a new run, give the "
                             "broker a fresh spool_dir; to continue a run, keep the orchestrator's output_dir") from None

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
                sampling=config.sampling.model_dump() | {"seed": None}, split="eval",
                max_concurrent_groups=max(1, count), timeout_s=config.rollout_timeout_s)
            for index, error in failed.items():  # counted and reported like training rollouts
                log.warning("eval group failed", env_id=env_id, example_index=index, error=error)
            summary = summarize_groups(groups, failed, rollouts_per_group=eval_config.rollouts_per_example)
            metrics.update(summary.as_metrics(f"eval/{env_id}"))
        metrics["eval/time_s"] = time.monotonic() - started_s
        self.control.report_metrics(step, metrics)
        self.sink.log(step, metrics)
        log.info("eval done", step=step, **{k: round(v, 4) for k, v in metrics.items() if k.endswith("/reward")})

    def _refresh_endpoints(self) -> None:
        now = time.monotonic()
        interval_s = VERSION_WAIT_S if self._waiting_for_version else WORKER_REFRESH_S
        if now - self._endpoints_refreshed_s < interval_s and self.endpoints:
            return
        self._endpoints_refreshed_s = now
        from primerl.proto.v1 import common_pb2

        alive = {}
        for info in self.control.list_workers(common_pb2.ROLE_INFERENCE):
            if not info.address:
                continue
            known = self.endpoints.get(info.worker_id)
            version = info.policy_version if info.HasField("policy_version") else 0
            endpoint = known or InferenceEndpoint(info.worker_id, info.address.rstrip("/") + "/v1", version)
            endpoint.policy_version = version
            alive[info.worker_id] = endpoint
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
        max_inflight = config.max_inflight or 2 * config.batch_size
        groups_wanted = math.ceil(max_inflight / config.rollouts_per_example)
        # Groups are drawn one by one (the same draws, seeds and group ids as one at a time), then handed to
        # each env worker in one write per (env, endpoint, seed).
        batches: dict[tuple[str, str, int | None], list[int]] = collections.defaultdict(list)
        entries: dict[tuple[str, str, int | None], list[_Inflight]] = collections.defaultdict(list)
        for _ in range(groups_wanted - len(self.inflight)):
            endpoint = min(self.endpoints.values(), key=lambda e: e.num_inflight)
            env_id, example_index = self.sampler.next()
            seed = config.sampling.seed
            if seed is not None:  # a different, reproducible seed per group
                seed = seed + self._next_group_id
            key = (env_id, endpoint.worker_id, seed)
            batches[key].append(example_index)
            entries[key].append(_Inflight(env_id, example_index, endpoint, served_version))
            endpoint.num_inflight += config.rollouts_per_example
            self._next_group_id += 1
        for key, example_indices in batches.items():
            env_id, _, seed = key
            endpoint = entries[key][0].endpoint
            futures = self.workers[env_id].submit_rollouts(
                example_indices, num_rollouts=config.rollouts_per_example, base_url=endpoint.base_url,
                model=config.model.name, api_key=config.broker.run_token or "EMPTY",
                sampling=config.sampling.model_dump() | {"seed": seed},
            )
            for future, entry in zip(futures, entries[key]):
                self.inflight[future] = entry
        self._inflight_changed()

    def _inflight_changed(self) -> None:
        num_inflight = len(self.inflight) * self.config.rollouts_per_example
        self.progress["num_inflight"] = num_inflight
        if self.exporter is not None:
            self.inflight_gauge.set(num_inflight)

    def _count_error(self, kind: str) -> None:
        """A failed rollout (``rollout_errors``) or rollout group (``env_errors``): both add to rollout/errors."""
        self.counters[kind] += 1
        if self.exporter is not None:
            self.errors_counter.inc()

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
            except Exception as exc:  # an env worker failure: counted, reported, the group is dropped
                self._count_error("env_errors")
                log.warning("rollout group failed", env_id=entry.env_id, error=str(exc))
                self.control.report_error(f"{entry.env_id}: {exc}")
                continue
            self._time_group(rollout_group)
            with self._timed("to_samples_s"):
                group = self._to_group(rollout_group, entry)
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
                self._count_error("rollout_errors")
                continue
            turns = [TurnTokens.from_wire_turn(t, temperature=config.sampling.temperature,
                                               default_policy_version=entry.dispatched_version) for t in rollout.turns]
            try:
                samples += trajectory_to_samples(
                    turns, config.trajectory_strategy, fallback_counts=self.counters, reward=float(rollout.reward),
                    truncated=rollout.is_truncated, group_id=group_id, example_id=entry.example_index,
                    env_id=entry.env_id, rollout_id=rollout.rollout_index,
                )
            except MalformedTrajectory as exc:
                self.counters[f"malformed_{exc.reason}"] += 1
                self._count_error("rollout_errors")
            self.counters["rollouts"] += 1
            self.counters["completion_tokens"] += rollout.num_completion_tokens
            self.counters["truncated"] += int(rollout.is_truncated)
        if not samples:
            return None
        return Group(group_id=group_id, example_id=entry.example_index, env_id=entry.env_id, samples=samples)

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
        versions = [s.min_policy_version for s in batch.samples]
        rollouts = [samples for g in batch.groups for samples in g.rollouts().values()]
        lengths = [sum(s.num_completion_tokens or 0 for s in samples) for samples in rollouts]
        metrics = {
            "train/reward": float(np.mean(rewards)),
            "rollout/reward_std": float(np.std(rewards)),
            "rollout/mean_length": float(np.mean(lengths)),
            "rollout/truncation_rate": float(np.mean([any(s.truncated for s in samples) for samples in rollouts])),
            "rollout/generation_time": elapsed_s,
            # generation during this step's wait (0 when the batch came from the previous step's surplus)
            "rollout/tokens_per_s": self.counters["completion_tokens"] / max(elapsed_s, 1e-9),
            "rollout/errors": float(self.counters["rollout_errors"] + self.counters["env_errors"]),
            "rollout/stale_groups_cancelled": float(self.counters["stale_groups_cancelled"]),
            **batch.metrics, **packed.metrics(), **self.bound.lag_metrics(step, versions),
            **self._perf_metrics(elapsed_s),
        }
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self.control.report_metrics(step, metrics)
        self.sink.log(step, metrics)
        log.info("batch sent", reward=round(metrics["train/reward"], 4), num_samples=len(batch.samples),
                 seconds=round(elapsed_s, 2), tokens_per_s=round(metrics["rollout/tokens_per_s"], 1))

    def close(self) -> None:
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
            self.control.deregister("orchestrator finished")
            self.control.close()
        if self.sink is not None:
            self.sink.close()
        if self.exporter is not None:
            self.exporter.stop()


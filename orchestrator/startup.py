"""The orchestrator's set-up, apart from its step loop: the broker connection and its worker-list threads, the
rollout failure tracker, and the training and eval environments started side by side."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from primerl.client.broker_errors import BrokerUnavailable
from primerl.client.control import ControlClient
from primerl.client.rollouts import RolloutProducer
from primerl.configs.orchestrator import OrchestratorConfig
from primerl.orchestrator.endpoints import EndpointWatcher, InferenceWorkers
from primerl.orchestrator.env_preflight import EnvPreflight
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.envs.base import EnvClient
from primerl.orchestrator.rollout_failures import RolloutFailures
from primerl.orchestrator.step_send import RESEND_INTERVAL_S
from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator")

WORKER_REFRESH_S = 1.0
VERSION_WAIT_S = 0.05  # re-read the served versions this often while dispatch waits for a newer policy
INFERENCE_OUTAGE_S = 300.0  # how long rollouts may fail because no inference worker answers (one restarting)


def connect_broker(
    config: OrchestratorConfig, capabilities: dict[str, str], progress: Callable[[], dict[str, int]]
) -> tuple[ControlClient, RolloutProducer]:
    """Register with the broker, heartbeat with ``progress()``, and open the rollout producer."""
    control = ControlClient(config.broker, "orchestrator", "orchestrator", capabilities=capabilities)
    control.wait_ready(config.broker.connect_timeout_s)
    registration = control.register()
    control.start_heartbeats(progress)
    producer = RolloutProducer(
        registration.rollout_endpoint,
        auth_token=config.broker.run_token,
        sender="orchestrator",
        resend_interval_s=RESEND_INTERVAL_S,
        limits=control.limits.frames,
        curve=control.curve,
    )
    return control, producer


def watch_workers(config: OrchestratorConfig, control: ControlClient) -> tuple[EndpointWatcher, EndpointWatcher | None]:
    """The started threads that read the broker's inference workers and, for a teacher without ``base_url``, its
    teacher workers."""
    from primerl.proto.v1 import common_pb2

    inference = EndpointWatcher(
        lambda: control.list_workers(common_pb2.ROLE_INFERENCE),
        outage_s=config.broker.outage_s,
        healable=(BrokerUnavailable,),
        interval_s=WORKER_REFRESH_S,
        fast_interval_s=VERSION_WAIT_S,
    )
    inference.start()
    teacher = None
    if config.teacher is not None and not config.teacher.base_url:
        teacher = EndpointWatcher(
            lambda: control.list_workers(common_pb2.ROLE_TEACHER),
            outage_s=config.broker.outage_s,
            healable=(BrokerUnavailable,),
            interval_s=WORKER_REFRESH_S,
            name="teacher-watcher",
            what="teacher workers",
        )
        teacher.start()
    if config.teacher is not None:
        log.info(
            telemetry.SCORING_ROLLOUTS_WITH_A_TEACHER,
            model=config.teacher.model or "(first listed)",
            base_url=config.teacher.base_url or "(teacher workers listed by the broker)",
            max_inflight=config.teacher.max_inflight,
        )
    return inference, teacher


def rollout_failures(config: OrchestratorConfig, control: ControlClient) -> RolloutFailures:
    """The failure tracker, reporting to the broker: ``batch_size`` failed rollouts in a row, or no inference worker
    for ``INFERENCE_OUTAGE_S``, stop the run."""
    return RolloutFailures(
        config.batch_size,
        report=control.report_error,
        hint_values={
            "seq_len": config.seq_len,
            "model": config.model.name,
            "rollout_timeout_s": config.rollout_timeout_s,
        },
        inference_outage_s=INFERENCE_OUTAGE_S,
    )


def start_environments(
    config: OrchestratorConfig,
    env_python: str,
    inference: InferenceWorkers,
    preflight: EnvPreflight | None,
    env_clients: MutableMapping[str, EnvClient],
    eval_clients: MutableMapping[str, EnvClient],
) -> EnvSampler:
    """Start the training and eval environments side by side (into ``env_clients`` and ``eval_clients``); the
    sampler over the training ones."""
    from primerl.orchestrator.envs.factory import EnvClients, endpoint_version_fn

    clients = EnvClients(
        config,
        env_python=env_python,
        version_of=endpoint_version_fn(inference),
        probe=preflight.probe if preflight is not None else None,
    )
    evals = [(config.eval.env, "orchestrator.eval.env", eval_clients)] if config.eval is not None else []
    groups = [(config.env, "orchestrator.env", env_clients), *evals]
    if preflight is None:
        loaded = clients.start_groups(groups)
    else:  # the findings go to the launcher before an error of the start ends this process
        outcomes: dict = {}
        try:
            loaded = clients.start_groups(groups, outcomes)
        finally:
            preflight.report(outcomes)
    sizes, weights = {}, {}
    for resolved, info in loaded[0]:
        env = resolved.env
        if info.num_examples == 0:
            raise ValueError(f"environment {env.id!r} has no training examples ({resolved.setting}.args)")
        sizes[env.id], weights[env.id] = info.num_examples, env.weight
        log.info(
            "environment loaded",
            env_id=env.id,
            kind=resolved.kind,
            env_class=info.env_class,
            num_examples=info.num_examples,
            weight=env.weight,
        )
    for resolved, info in loaded[1] if evals else []:
        log.info(
            "eval environment loaded",
            env_id=resolved.env.id,
            kind=resolved.kind,
            num_eval_examples=info.num_eval_examples,
            has_eval_dataset=info.has_eval_dataset,
        )
    return EnvSampler(sizes, weights, seed=config.sampling.seed or 0)

"""The broker's Prometheus families, read live from the registry and the data planes at every scrape.

primerl_broker_workers{role}                      workers alive per role (trainer counts ranks; teacher:
                                                   the frozen servers of online distillation)
primerl_broker_latest_policy_version               newest policy version the trainer published
primerl_broker_committed_step                      last step the trainer committed (checkpointed)
primerl_broker_trainer_step / _orchestrator_step   the roles' progress from their heartbeats
primerl_broker_rollout_batches_queued              rollout micro-batches held (memory and spool)
primerl_broker_rollout_bytes_spooled               their bytes
primerl_broker_rollout_batches_received_total      micro-batches accepted from the orchestrator
primerl_broker_weight_bytes_received_total         weight-update bytes received from the trainer
primerl_broker_weight_bytes_pushed_total           weight-update bytes sent to inference workers
primerl_broker_weight_updates_stored               snapshot + deltas held in the weight store
primerl_broker_weight_forward_lag_seconds          the latest update's last byte in -> last byte out to the
                                                   workers that were receiving it (or had it next)
primerl_broker_history_bytes                       the run history the dashboard reads (broker.history_max_bytes)
primerl_broker_weight_relay_chains_total           relay chains formed (broker.weight_fanout = "chain")
primerl_broker_weight_relay_heals_total            workers sent an update again because their relay did not
                                                   reach them within weight_relay_timeout_s
primerl_broker_weight_descriptors_sent_total       updates sent to same-host workers as a shared-memory descriptor
                                                   (no payload bytes; [trainer.weight_broadcast] transport)
primerl_broker_weight_segments_released_total      trainer segments handed back once their readers were done
primerl_broker_workers_lost{role}                 workers marked lost (silent past the timeout), still listed
primerl_broker_run_finished                       1 once the run reached max_steps and its trainer finished
primerl_broker_rollout_messages_refused_total      messages the rollout socket refused (malformed, unknown step, ...)
primerl_broker_discovery_targets                  metrics targets its Prometheus service discovery lists
primerl_disk_free_bytes{purpose="spool"}          free bytes of the spool's file system (and its size,
primerl_disk_size_bytes{purpose="spool"}          for the "disk filling" alert)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from primerl.broker.worker_record import ALIVE, LOST
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2
from primerl.runtime.prometheus import disk_families

if TYPE_CHECKING:
    from primerl.broker.service import BrokerService

ROLES = {
    common_pb2.ROLE_TRAINER: "trainer",
    common_pb2.ROLE_ORCHESTRATOR: "orchestrator",
    common_pb2.ROLE_INFERENCE: "inference",
    common_pb2.ROLE_TEACHER: "teacher",
}


class _Family(NamedTuple):
    """One unlabelled family: its kind (``CounterMetricFamily`` or ``GaugeMetricFamily``), name, help, and how
    its value is read from the status it belongs to."""

    kind: type[CounterMetricFamily] | type[GaugeMetricFamily]
    name: str
    help: str
    value: Callable[[Any], float]


_COUNTER, _GAUGE = CounterMetricFamily, GaugeMetricFamily

_WEIGHT_FAMILIES = (  # read from ``WeightPlane.status()``
    _Family(
        _COUNTER,
        telemetry.BROKER_WEIGHT_BYTES_RECEIVED,
        "Weight-update bytes received from the trainer.",
        lambda w: w.bytes_in_total,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_WEIGHT_BYTES_PUSHED,
        "Weight-update bytes sent to inference workers.",
        lambda w: w.bytes_out_total,
    ),
    _Family(
        _GAUGE,
        telemetry.BROKER_WEIGHT_UPDATES_STORED,
        "Weight updates held in the store (snapshot and deltas).",
        lambda w: (w.store.snapshot_version is not None) + w.store.num_deltas,
    ),
    _Family(
        _GAUGE,
        telemetry.BROKER_WEIGHT_FORWARD_LAG_SECONDS,
        "Seconds from the latest update's last byte into the broker to its last byte out to the workers that were "
        "receiving it or had it next (what the broker adds to a transfer).",
        lambda w: w.forward_lag_s,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_WEIGHT_RELAY_CHAINS,
        "Relay chains formed (weight_fanout = chain).",
        lambda w: w.num_relay_chains,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_WEIGHT_RELAY_HEALS,
        "Workers sent an update again because their relay did not reach them in time.",
        lambda w: w.num_relay_heals,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_WEIGHT_DESCRIPTORS_SENT,
        "Updates sent to same-host workers as a shared-memory descriptor instead of their bytes.",
        lambda w: w.num_descriptors_sent,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_WEIGHT_SEGMENTS_RELEASED,
        "Trainer shared-memory segments released once every reader was done with them.",
        lambda w: w.num_segments_released,
    ),
)

_RUN_FAMILIES = (  # read from ``Registry.run_status()``
    _Family(
        _GAUGE,
        telemetry.BROKER_LATEST_POLICY_VERSION,
        "Newest policy version published by the trainer.",
        lambda s: s.latest_policy_version,
    ),
    _Family(
        _GAUGE, telemetry.BROKER_COMMITTED_STEP, "Last step the trainer committed.", lambda s: s.last_committed_step
    ),
    _Family(_GAUGE, telemetry.BROKER_TRAINER_STEP, "Trainer step from its heartbeats.", lambda s: s.trainer_step),
    _Family(
        _GAUGE,
        telemetry.BROKER_ORCHESTRATOR_STEP,
        "Orchestrator step from its heartbeats.",
        lambda s: s.orchestrator_step,
    ),
)

_CONNECTION_FAMILIES = (  # read from ``RolloutPlane.status()`` when its connections are gated
    _Family(
        _GAUGE,
        telemetry.BROKER_ROLLOUT_CONNECTIONS,
        "Peers connected to the rollout socket (admitted at the handshake, at most max_rollout_connections).",
        lambda r: r.num_connections,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_ROLLOUT_CONNECTIONS_REFUSED,
        "Connections to the rollout socket refused at the handshake: max_rollout_connections peers were connected.",
        lambda r: r.num_connections_refused,
    ),
)

_QUEUE_FAMILIES = (  # read from the rollout queue's status
    _Family(
        _GAUGE,
        telemetry.BROKER_ROLLOUT_BATCHES_QUEUED,
        "Rollout micro-batches held (memory and spool) until their step is committed.",
        lambda q: q.num_batches,
    ),
    _Family(
        _GAUGE,
        telemetry.BROKER_ROLLOUT_BYTES_SPOOLED,
        "Bytes of the rollout micro-batches held.",
        lambda q: q.num_bytes,
    ),
    _Family(
        _COUNTER,
        telemetry.BROKER_ROLLOUT_BATCHES_RECEIVED,
        "Rollout micro-batches accepted from the orchestrator.",
        lambda q: q.num_accepted,
    ),
)


def _read(families: tuple[_Family, ...], source: Any) -> Iterator[Metric]:
    for family in families:
        yield family.kind(family.name, family.help, value=family.value(source))


class BrokerCollector:
    """A custom prometheus_client collector over a running ``BrokerService``."""

    def __init__(self, service: BrokerService):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        status = service.registry.run_status()
        workers = GaugeMetricFamily(telemetry.BROKER_WORKERS, "Workers alive per role.", labels=["role"])
        lost = GaugeMetricFamily(
            telemetry.BROKER_WORKERS_LOST,
            "Workers marked lost per role: silent for longer than the heartbeat timeout, still listed.",
            labels=["role"],
        )
        for role, name in ROLES.items():
            workers.add_metric([name], sum(1 for w in status.workers if w.role == role and w.state == ALIVE))
            lost.add_metric([name], sum(1 for w in status.workers if w.role == role and w.state == LOST))
        yield workers
        yield lost
        yield GaugeMetricFamily(
            telemetry.BROKER_RUN_FINISHED,
            "1 once the run reached max_steps and its trainer finished, else 0.",
            value=float(service.registry.shutdown_requested),
        )
        yield GaugeMetricFamily(
            telemetry.BROKER_DISCOVERY_TARGETS,
            "Metrics targets the broker's Prometheus service discovery (/discovery) lists.",
            value=service.num_discovery_targets(status.workers),
        )
        yield from disk_families(
            "spool", service.config.spool_dir, telemetry.DISK_FREE_BYTES, telemetry.DISK_SIZE_BYTES
        )
        if service.weight_plane is not None:
            yield from _read(_WEIGHT_FAMILIES, service.weight_plane.status())
        yield from _read(_RUN_FAMILIES, status)
        if service.rollout_plane is not None:
            rollout = service.rollout_plane.status()
            if rollout.num_connections is not None:
                yield from _read(_CONNECTION_FAMILIES, rollout)
            yield CounterMetricFamily(
                telemetry.BROKER_ROLLOUT_MESSAGES_REFUSED,
                "Messages the rollout socket refused (malformed, unknown step, full spool, internal error).",
                value=rollout.num_refused,
            )
            yield from _read(_QUEUE_FAMILIES, rollout.queue)
        yield GaugeMetricFamily(
            telemetry.BROKER_HISTORY_BYTES,
            "Bytes the run history holds (metric rows, events, sample rollouts), at most broker.history_max_bytes.",
            value=service.history.num_bytes,
        )

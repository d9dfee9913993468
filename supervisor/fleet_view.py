"""What each worker of a ``RunStatus`` is doing, said plainly for a fleet: ``condition(worker)`` and per role
``fleet_counts(status)``, so that no script has to combine states, capabilities and heartbeat ages itself.

    condition      meaning
    serving        alive, and an inference or teacher worker the orchestrator sends rollouts to (it has an address)
    not_serving    alive, but its engine stalled (heartbeats say ``serving: false``): out of rotation
    alive          alive, any other role (trainer ranks, orchestrators), or an inference worker without an HTTP
                   address (a weight relay only: no rollouts go to it)
    lost           no heartbeat within the broker's timeout; still listed (``since``: its last heartbeat)
    gone           deregistered (it left: stopped, or its job ended); still listed until the broker forgets it

``primerl status`` prints one line of these counts per role, and ``--json`` gives each worker its
``condition`` (and ``lost_since_unix_ms`` when lost) and the counts as ``fleet``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

SERVING, NOT_SERVING, ALIVE, LOST, GONE = "serving", "not_serving", "alive", "lost", "gone"
CONDITIONS = (SERVING, NOT_SERVING, ALIVE, LOST, GONE)


def condition(worker: Any) -> str:
    """The condition of one ``WorkerInfo`` (see the module docstring)."""
    from primerl.proto import telemetry
    from primerl.proto.v1 import common_pb2, control_pb2

    if worker.state == control_pb2.WORKER_STATE_LOST:
        return LOST
    if worker.state != control_pb2.WORKER_STATE_ALIVE:
        return GONE
    if worker.role in (common_pb2.ROLE_INFERENCE, common_pb2.ROLE_TEACHER) and worker.address:
        return NOT_SERVING if worker.capabilities.get(telemetry.SERVING_CAPABILITY) == "false" else SERVING
    return ALIVE


def role_name(worker: Any) -> str:
    from primerl.proto.v1 import common_pb2

    return common_pb2.Role.Name(worker.role).removeprefix("ROLE_").lower()


def fleet_counts(status: Any) -> dict[str, dict[str, int]]:
    """Role -> condition -> how many workers (conditions with none left out)."""
    counts: dict[str, Counter] = {}
    for worker in status.workers:
        counts.setdefault(role_name(worker), Counter())[condition(worker)] += 1
    return {role: {c: n for c in CONDITIONS if (n := found[c])} for role, found in counts.items()}


def fleet_line(status: Any) -> str:
    """``inference: 998 serving, 2 lost; trainer: 64 alive; orchestrator: 8 alive`` (empty without workers)."""
    return "; ".join(
        f"{role}: " + ", ".join(f"{n} {c.replace('_', ' ')}" for c, n in found.items())
        for role, found in fleet_counts(status).items()
    )


def annotate_json(status: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (the ``MessageToDict`` of ``status``) with each worker's ``condition`` and, when lost,
    ``lost_since_unix_ms`` (its last heartbeat), and the counts as ``fleet``."""
    for worker, entry in zip(status.workers, data.get("workers", []), strict=False):
        entry["condition"] = condition(worker)
        if entry["condition"] == LOST:
            entry["lost_since_unix_ms"] = worker.last_heartbeat_unix_ms
    data["fleet"] = fleet_counts(status)
    return data

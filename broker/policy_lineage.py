"""Policy lineages, one per trainer incarnation (``WeightUpdateHeader.lineage``), handed out by the registry.

Trainer rank 0's first ``register`` gets a lineage one above every lineage handed out before (the run state's counter,
written before the answer) and above the lineage the weight store holds (a run dir from before the counter holds
time-based lineages); its re-registrations (a broker restart, the broker forgot it) name that lineage and get it
back. A restarted trainer's lineage is then larger than its predecessors' whatever its host's clock says.

Split brain: once a newer lineage is handed out, the older incarnations are over. The weight store refuses their
updates at once (``refuse_lineages_below``: before the new trainer's first publish), and an old trainer that
registers again naming its lineage, or commits a step, is refused with ``IncarnationSuperseded`` (ABORTED): a
trainer cut off by a partition while its replacement took over comes back, is told, and stops.

No lock: the registry calls it under its own.
"""

from __future__ import annotations

from primerl.broker.registry_errors import IncarnationSuperseded, InvalidRequest
from primerl.broker.weight_fanout import WeightFanout
from primerl.proto.v1 import common_pb2, control_pb2

MAX_POLICY_LINEAGE = 1 << 62
"""Above every lineage a broker hands out (a counter) or a trainer before the counter sent (unix microseconds,
~1.8e15): a re-registration naming a larger one is refused, so the counter can never run out of uint64."""


class PolicyLineages:
    """The largest lineage handed out (or named by a re-registering trainer), and the refusals of older ones."""

    def __init__(self, policy: WeightFanout):
        self.policy = policy
        self.handed_out = 0

    def floor(self) -> int:
        """The largest policy lineage this run knows: handed out, or held by the weight store."""
        return max(self.handed_out, self.policy.latest().lineage)

    def restore(self, lineage: int) -> None:
        """An earlier broker's counter (its run state)."""
        self.handed_out = max(self.handed_out, lineage)
        self.policy.refuse_lineages_below(self.handed_out)

    def assign(self, request: control_pb2.RegisterRequest) -> tuple[int, bool]:
        """The policy lineage a registering worker gets, and whether the counter moved: for trainer rank 0 a new one
        (above every lineage the run knows), or the one it names (a re-registration of the same incarnation; an
        older one than the newest is ``IncarnationSuperseded``); 0 for every other worker. The weight store refuses
        older lineages from then on."""
        if request.role != common_pb2.ROLE_TRAINER or request.rank != 0:
            return 0, False
        self.refuse_superseded(request)
        if request.policy_lineage:
            lineage = request.policy_lineage
            changed = lineage > self.handed_out
        else:
            lineage = self.floor() + 1
            changed = True
        if changed:
            self.handed_out = lineage
        self.policy.refuse_lineages_below(self.handed_out)
        return lineage, changed

    def refuse_superseded(self, request: control_pb2.RegisterRequest) -> None:
        """A trainer rank 0 naming a lineage the broker never hands out, or one older than the newest it knows."""
        if request.role != common_pb2.ROLE_TRAINER or request.rank != 0 or not request.policy_lineage:
            return
        if request.policy_lineage >= MAX_POLICY_LINEAGE:
            raise InvalidRequest(
                f"policy_lineage {request.policy_lineage} is not one a broker hands out (< {MAX_POLICY_LINEAGE}); "
                "register with the lineage the broker gave this trainer, or 0 for a new one"
            )
        newest = self.floor()
        if request.policy_lineage < newest:
            raise IncarnationSuperseded(_superseded(request.name, request.policy_lineage, newest, "registers again"))

    def refuse_superseded_commit(self, name: str, lineage: int, step: int) -> None:
        """A trainer of an older lineage than the newest handed out commits ``step``."""
        if lineage and lineage < self.handed_out:
            raise IncarnationSuperseded(_superseded(name, lineage, self.handed_out, f"commits step {step}"))


def _superseded(name: str, lineage: int, newest: int, doing: str) -> str:
    return (
        f"trainer {name!r} of policy lineage {lineage} {doing}, but lineage {newest} superseded it: a newer trainer "
        "incarnation registered while this one was cut off or stuck. This trainer must stop (do not restart it; "
        "the newer one goes on with the run)"
    )

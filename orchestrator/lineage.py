"""Rollbacks of the policy, as the orchestrator learns of them, and what they do to samples already made.

A trainer that resumes from an older checkpoint than the newest version it published starts a new *lineage*
(``primerl.broker.weight_store``): it publishes versions ``B + 1, B + 2, ...`` again, where ``B`` (the lineage's
base version) is the step it resumed from, and the old lineage's versions above ``B`` are gone. The broker tells
every worker the latest lineage and its base in each heartbeat answer. A sample made by the older lineage's
weights of version ``v`` counts as version ``min(v, B)``: its tokens came from weights the run no longer has,
of which the newest ancestor still in the run is ``B``. The async bound then treats it like any stale sample
(dropped from waiting groups, cancelled in flight, never packed into a step it is too old for).

What the orchestrator can cap is what it holds: groups waiting for a batch, rollouts in flight (by the lineage
epoch they were dispatched in), and rollouts that finish later. Batches already spooled by the broker are
trained as they are (exactly once); with ``max_async_level`` steps of lead at most, that is where a rollback's
samples can still reach the trainer.
"""

from __future__ import annotations

from collections.abc import Iterable


class PolicyLineage:
    """The latest policy lineage seen and the base versions of the rollbacks seen since this process started."""

    def __init__(self) -> None:
        self.lineage: int | None = None
        self._bases: list[int] = []

    @property
    def epoch(self) -> int:
        """Rollbacks seen so far: a rollout dispatched in epoch e was made by weights of that epoch's lineage."""
        return len(self._bases)

    def observe(self, lineage: int, base_version: int) -> int | None:
        """A heartbeat answer's ``policy_lineage`` and ``lineage_base_version``; returns the base version when this
        is a rollback (a newer lineage than one seen before), else None. 0 means no policy published yet."""
        if not lineage:
            return None
        if self.lineage is None or lineage <= self.lineage:
            self.lineage = lineage if self.lineage is None else self.lineage
            return None
        self.lineage = lineage
        self._bases.append(int(base_version))
        return int(base_version)

    def ceiling_since(self, epoch: int) -> int | None:
        """The highest version a sample made in ``epoch`` may still count as (None: no rollback since)."""
        later = self._bases[epoch:]
        return min(later) if later else None


def cap_versions(samples: Iterable, ceiling: int) -> int:
    """Lower every token's policy version above ``ceiling`` to it; returns how many samples changed."""
    num_changed = 0
    for sample in samples:
        if max(sample.policy_versions, default=0) > ceiling:
            sample.policy_versions = [min(int(v), ceiling) for v in sample.policy_versions]
            num_changed += 1
    return num_changed

"""The rollout queue's step index: which spooled batch fills each (step, rank, micro-batch), and which producer
incarnation owns each step. No lock and no disk: ``RolloutQueue`` holds it under its lock and deletes from the spool
what ``seal`` drops.

Atomic steps: a batch whose id names its producer incarnation (``proto.batch_ids.producer_batch_id``, what the
orchestrator sends) is kept per (step, producer) and served only once that producer's set of the step is whole (every
rank, every micro-batch). The first incarnation whose set is whole owns the step: the other incarnations' partial sets
of it are dropped, and their later batches of it are superseded. So a step is trained on exactly one orchestrator
incarnation's rollouts, even when one was killed half-way through sending it and the next one made the step again.
Ownership needs no file of its own: after a broker restart it is found again from the spool (the one whole set of a
step). Batches with other ids (``default_batch_id``) are served as they come, and a step takes one kind or the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from primerl.proto.batch_ids import ProducerBatchId, parse_producer_batch_id
from primerl.proto.v1 import data_pb2


@dataclass
class Slot:
    """The batches of one (step, rank), by micro_batch_index."""

    num_micro_batches: int
    batch_ids: dict[int, str] = field(default_factory=dict)


@dataclass
class Candidate:
    """One producer incarnation's batches of one step, not served until the set is whole."""

    num_ranks: int
    slots: dict[int, Slot] = field(default_factory=dict)  # rank -> its batches

    def whole(self) -> bool:
        return len(self.slots) == self.num_ranks and all(
            len(slot.batch_ids) == slot.num_micro_batches for slot in self.slots.values()
        )

    def batch_ids(self) -> list[str]:
        return [batch_id for slot in self.slots.values() for batch_id in slot.batch_ids.values()]


class StepIndex:
    """The served slots, the producers' sets not whole yet, and each step's owner."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], Slot] = {}  # what sessions are served from
        # Batches with a producer id: step -> producer -> its set, until one producer's set is whole ...
        self.candidates: dict[int, dict[str, Candidate]] = {}
        # ... then step -> that producer (its slots moved to ``slots``).
        self.sealed: dict[int, str] = {}

    def steps(self) -> list[int]:
        """The steps that hold a batch (served or not)."""
        return [key[0] for key, slot in self.slots.items() if slot.batch_ids] + list(self.candidates)

    def add(self, header: data_pb2.RolloutBatchHeader) -> tuple[int, str] | None:
        """Index an accepted batch; returns (step, producer) when it made its producer's set of the step whole and
        the step had no owner yet (it is now that producer's: ``seal`` once the batches are durable)."""
        tag = parse_producer_batch_id(header.batch_id)
        if tag is None:
            slot = self.slots.setdefault((header.step, header.rank), Slot(header.num_micro_batches))
            slot.batch_ids[header.micro_batch_index] = header.batch_id
            return None
        candidate = self.candidates.setdefault(header.step, {}).setdefault(tag.producer, Candidate(tag.num_ranks))
        slot = candidate.slots.setdefault(header.rank, Slot(header.num_micro_batches))
        slot.batch_ids[header.micro_batch_index] = header.batch_id
        if header.step not in self.sealed and candidate.whole():
            self.sealed[header.step] = tag.producer
            return header.step, tag.producer
        return None

    def remove(self, header: data_pb2.RolloutBatchHeader) -> None:
        """Undo ``add`` (the batch could not be spooled)."""
        tag = parse_producer_batch_id(header.batch_id)
        if tag is not None:
            candidate = self.candidates.get(header.step, {}).get(tag.producer)
            slot = candidate.slots.get(header.rank) if candidate is not None else None
            if slot is not None and slot.batch_ids.get(header.micro_batch_index) == header.batch_id:
                del slot.batch_ids[header.micro_batch_index]
                if not slot.batch_ids:
                    del candidate.slots[header.rank]  # type: ignore[union-attr]
                if candidate is not None and not candidate.slots:
                    del self.candidates[header.step][tag.producer]
                    if not self.candidates[header.step]:
                        del self.candidates[header.step]
            return
        key = (header.step, header.rank)
        slot = self.slots.get(key)
        if slot is not None and slot.batch_ids.get(header.micro_batch_index) == header.batch_id:
            del slot.batch_ids[header.micro_batch_index]
            if not slot.batch_ids:
                del self.slots[key]

    def seal(self, step: int, producer: str) -> tuple[set[tuple[int, int]], dict[str, Candidate]]:
        """``producer`` owns ``step``: its set is served from now on. Returns the (step, rank) keys now served and
        the other producers' sets of the step, dropped here (the caller deletes their batches)."""
        self.sealed[step] = producer
        candidates = self.candidates.pop(step, {})
        owned = candidates.pop(producer)
        for rank, slot in owned.slots.items():
            self.slots[(step, rank)] = slot
        return {(step, rank) for rank in owned.slots}, candidates

    def unseal(self, step: int) -> None:
        """Undo the ownership ``add`` gave (its batches could not be spooled)."""
        del self.sealed[step]

    def whole_sets(self) -> list[tuple[int, str]]:
        """(step, producer) for each step with a whole set (the first producer by name when two are: only if the
        broker died between spooling the second and deleting it; no batch of the step was served then)."""
        owners = []
        for step in sorted(self.candidates):
            whole = sorted(producer for producer, c in self.candidates[step].items() if c.whole())
            if whole:
                owners.append((step, whole[0]))
        return owners

    def release_through(self, step: int) -> None:
        for key in [key for key in self.slots if key[0] <= step]:
            del self.slots[key]
        for old in [s for s in self.candidates if s <= step]:
            del self.candidates[old]
        for old in [s for s in self.sealed if s <= step]:
            del self.sealed[old]

    def forget_served(self, batch_id: str) -> None:
        """A served batch is gone from the spool (quarantined): no session is given it again."""
        for slot in self.slots.values():
            for index, other in list(slot.batch_ids.items()):
                if other == batch_id:
                    del slot.batch_ids[index]

    def candidate_slot(self, step: int, rank: int, producer: str) -> Slot | None:
        candidate = self.candidates.get(step, {}).get(producer)
        if candidate is None:
            return self.slots.get((step, rank)) if self.sealed.get(step) == producer else None
        return candidate.slots.get(rank)

    def kind_problem(self, header: data_pb2.RolloutBatchHeader, tag: ProducerBatchId | None) -> str:
        """Why the batch cannot join its step ("" if it can): a producer id that disagrees with the header, or a
        step that holds batches of the other kind (with and without a producer id)."""
        step = header.step
        if tag is None:
            if step in self.candidates or step in self.sealed:
                return (
                    f"batch {header.batch_id!r} has no producer id but step {step} holds batches with one; "
                    "a step is sent by orchestrators of one version"
                )
            return ""
        if (tag.step, tag.rank, tag.micro_batch_index) != (step, header.rank, header.micro_batch_index):
            return (
                f"batch id {header.batch_id!r} names step {tag.step} rank {tag.rank} micro-batch "
                f"{tag.micro_batch_index}, the header step {step} rank {header.rank} micro-batch "
                f"{header.micro_batch_index}"
            )
        if header.rank >= tag.num_ranks:
            return f"batch {header.batch_id!r}: rank {header.rank} is not below its num_ranks {tag.num_ranks}"
        if step not in self.sealed and any(key[0] == step for key in self.slots):
            return (
                f"batch {header.batch_id!r} has a producer id but step {step} holds batches without one; "
                "a step is sent by orchestrators of one version"
            )
        return ""

    def owner_problem(self, header: data_pb2.RolloutBatchHeader, tag: ProducerBatchId, owner: str) -> str:
        """Why a batch of a step held whole from another producer (``owner``) is packed otherwise than that set
        (other rank count, or micro-batch count for its rank): most likely another run's spool. "" when it is
        packed alike: then it is only superseded."""
        step, rank = header.step, header.rank
        owned = self.candidate_slot(step, rank, owner)  # a candidate still, when sealed earlier in this group
        pending_owner = self.candidates.get(step, {}).get(owner)
        num_ranks = (
            pending_owner.num_ranks if pending_owner is not None else sum(1 for key in self.slots if key[0] == step)
        )
        if owned is not None and owned.num_micro_batches == header.num_micro_batches and num_ranks == tag.num_ranks:
            return ""
        return (
            f"batch {header.batch_id!r} says step {step} has {tag.num_ranks} ranks and rank {rank} "
            f"{header.num_micro_batches} micro-batches; the step is already held whole from producer "
            f"{owner!r} with {num_ranks} ranks and "
            f"{owned.num_micro_batches if owned is not None else 'no'} micro-batches for rank {rank}"
        )

    def placement_problem(self, header: data_pb2.RolloutBatchHeader, tag: ProducerBatchId | None) -> str:
        """Why the batch disagrees with the batches of its step already indexed from its producer ("" if it does
        not): another rank count, another micro-batch count, or its micro-batch taken by another batch."""
        batch_id, step, rank, index = header.batch_id, header.step, header.rank, header.micro_batch_index
        if tag is None:
            slot = self.slots.get((step, rank))
        else:
            candidate = self.candidates.get(step, {}).get(tag.producer)
            if candidate is not None and candidate.num_ranks != tag.num_ranks:
                return (
                    f"batch {batch_id!r} says step {step} has {tag.num_ranks} ranks; earlier batches of its producer "
                    f"said {candidate.num_ranks}"
                )
            slot = self.candidate_slot(step, rank, tag.producer)
        if slot is None:
            return ""
        if slot.num_micro_batches != header.num_micro_batches:
            return (
                f"batch {batch_id!r} says step {step} rank {rank} has {header.num_micro_batches} "
                f"micro-batches; earlier batches of it said {slot.num_micro_batches}"
            )
        other = slot.batch_ids.get(index)
        if other is not None:
            return (
                f"micro-batch {index} of step {step} rank {rank} is already spooled as batch "
                f"{other!r}; a different batch {batch_id!r} cannot take its place"
            )
        return ""

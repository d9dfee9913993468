"""Rollout batch ids.

``default_batch_id``: the id of a batch when its producer gives none, one per (step, rank, micro-batch), so a batch
sent again after a reconnect is recognised as the same batch (the broker keeps the first).

``producer_batch_id``: the id the orchestrator gives every batch, ``"<step>:<rank>:<index>/<num_ranks>@<producer>"``.
``producer`` names the producer incarnation (one per ``RolloutProducer``, i.e. per orchestrator process) and
``num_ranks`` how many trainer ranks the step has, so the broker can tell when it holds a step whole from one
incarnation: it serves a step only from one incarnation's whole set and drops another incarnation's partial set
(``broker.rollout_queue``). ``parse_producer_batch_id`` reads one back (None for any other id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_PRODUCER_CHARS = 64
_PRODUCER_ID = re.compile(r"^(\d{1,20}):(\d{1,10}):(\d{1,10})/(\d{1,10})@([A-Za-z0-9._-]{1,%d})$" % MAX_PRODUCER_CHARS)
_PRODUCER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,%d}$" % MAX_PRODUCER_CHARS)


def default_batch_id(step: int, rank: int, micro_batch_index: int) -> str:
    return f"{step}:{rank}:{micro_batch_index}"


@dataclass(frozen=True)
class ProducerBatchId:
    step: int
    rank: int
    micro_batch_index: int
    num_ranks: int
    producer: str


def producer_batch_id(step: int, rank: int, micro_batch_index: int, num_ranks: int, producer: str) -> str:
    if not _PRODUCER_NAME.match(producer):
        raise ValueError(f"producer {producer!r} must be 1-{MAX_PRODUCER_CHARS} characters of [A-Za-z0-9._-]")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} must be below num_ranks {num_ranks}")
    return f"{step}:{rank}:{micro_batch_index}/{num_ranks}@{producer}"


def parse_producer_batch_id(batch_id: str) -> ProducerBatchId | None:
    match = _PRODUCER_ID.match(batch_id)
    if match is None:
        return None
    step, rank, index, num_ranks = (int(match.group(i)) for i in range(1, 5))
    return ProducerBatchId(step, rank, index, num_ranks, match.group(5))


__all__ = ["ProducerBatchId", "default_batch_id", "parse_producer_batch_id", "producer_batch_id"]

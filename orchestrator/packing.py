"""The orchestrator's side of packing: a packed step as the broker's batch messages.

The packer itself (``pack_samples`` and its shapes) is ``primerl.proto.packing``, shared with the trainer's SFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from primerl.proto.packing import PackedMicroBatch, PackedStep


def to_broker_batches(
    step: int, per_rank: Sequence[Sequence[PackedMicroBatch]] | PackedStep, *, num_loss_tokens_global: int | None = None
) -> list[tuple[Any, bytes]]:
    """``(header, payload)`` of every micro-batch for ``RolloutProducer.send_batches``, rank by rank."""
    from primerl.client.rollouts import pack_batch

    if isinstance(per_rank, PackedStep):
        if num_loss_tokens_global is None:
            num_loss_tokens_global = per_rank.num_loss_tokens_global
        per_rank = per_rank.per_rank
    empty = [rank for rank, batches in enumerate(per_rank) if not batches]
    if empty:
        raise ValueError(f"ranks {empty} have no micro-batch for step {step}: every rank needs one")
    if num_loss_tokens_global is None:
        num_loss_tokens_global = sum(b.num_loss_tokens for batches in per_rank for b in batches)
    messages = []
    for rank, batches in enumerate(per_rank):
        for index, batch in enumerate(batches):
            messages.append(
                pack_batch(
                    step,
                    rank,
                    index,
                    len(batches),
                    batch.tensors,
                    num_samples=batch.num_samples,
                    num_tokens=batch.num_tokens,
                    min_policy_version=batch.min_policy_version,
                    max_policy_version=batch.max_policy_version,
                    num_loss_tokens_global=num_loss_tokens_global,
                )
            )
    return messages

"""The id of a rollout batch when its producer gives none: one per (step, rank, micro-batch), so a batch sent
again after a reconnect is recognised as the same batch (the broker keeps the first)."""

from __future__ import annotations


def default_batch_id(step: int, rank: int, micro_batch_index: int) -> str:
    return f"{step}:{rank}:{micro_batch_index}"


__all__ = ["default_batch_id"]

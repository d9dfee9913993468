"""Packing samples into the trainer's micro-batches, balanced across trainer ranks (RL steps and SFT alike).

1. A sample longer than ``seq_len`` is truncated to its first ``seq_len`` tokens (``overlong="truncate"``, the
   default: the rollout already counts in its group's advantages, and its prompt and early tokens still train) or
   left out (``overlong="reject"``); either way it is counted.
2. Samples are spread over the ranks by token count, largest first, each to the rank with the fewest tokens so far
   (LPT). The ranks' token counts then differ by at most one sample's length (the largest), and every rank gets a
   sample when there are at least ``num_ranks`` samples. Balancing samples rather than whole bins is what gives
   that bound: bins of up to ``seq_len`` tokens could leave the ranks a whole bin apart.
3. Each rank packs its samples first-fit-decreasing into bins of at most ``seq_len`` tokens; a bin is a micro-batch.
4. Ranks are given the same number of micro-batches where possible: a rank with fewer bins than the most any rank
   has splits its fullest bin of two or more samples in two (balanced by tokens) until the counts match. A rank
   whose samples are all alone in their bins cannot split further and keeps fewer micro-batches; the trainer
   handles unequal counts (padding passes), equal counts just waste less of it.
5. A rank left without samples (fewer samples than ranks) gets one padding micro-batch: a single ``pad_token_id``
   token with no loss, so that every rank has a micro-batch for the step, as the trainer requires.

Micro-batch tensors: the schema of ``primerl.proto.micro_batch`` (names and dtypes), which the trainer's
``MicroBatch`` reads; ``policy_versions`` always, ``teacher_logprobs`` when every sample has them. A sample is
anything of the ``PackableSample`` shape (the orchestrator's ``TrainingSample``, the trainer's SFT samples).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from primerl.proto.micro_batch import TENSOR_DTYPES

OverlongPolicy = Literal["truncate", "reject"]


class PackableSample(Protocol):
    """One sequence to pack: per-token fields all of one length, its advantage, and optional teacher logprobs."""

    token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    inference_logprobs: Sequence[float]
    temperatures: Sequence[float]
    policy_versions: Sequence[int]
    advantage: float
    teacher_logprobs: Sequence[float] | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def min_policy_version(self) -> int: ...

    @property
    def max_policy_version(self) -> int: ...


@dataclass
class PackedMicroBatch:
    tensors: dict[str, np.ndarray]
    sample_indices: list[int]  # positions in the packed input list, in packed order; empty for padding
    num_loss_tokens: int
    min_policy_version: int
    max_policy_version: int

    @property
    def num_tokens(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)

    @property
    def is_padding(self) -> bool:
        return not self.sample_indices


@dataclass
class PackedStep:
    per_rank: list[list[PackedMicroBatch]]
    num_loss_tokens_global: int
    num_overlong_truncated: int = 0
    num_overlong_rejected: int = 0
    num_padding_micro_batches: int = 0
    rank_num_tokens: list[int] = field(default_factory=list)  # real (non-padding) tokens per rank

    def metrics(self) -> dict[str, float]:
        counts = [len(batches) for batches in self.per_rank]
        tokens = self.rank_num_tokens or [0]
        return {
            "packing/num_micro_batches": float(sum(counts)),
            "packing/max_micro_batches_per_rank": float(max(counts)),
            "packing/min_micro_batches_per_rank": float(min(counts)),
            "packing/num_loss_tokens": float(self.num_loss_tokens_global),
            "packing/rank_token_imbalance": float(max(tokens) - min(tokens)),
            "packing/num_overlong_truncated": float(self.num_overlong_truncated),
            "packing/num_overlong_rejected": float(self.num_overlong_rejected),
            "packing/num_padding_micro_batches": float(self.num_padding_micro_batches),
        }


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins whose sums are <= ``capacity``: longest first, each into the first bin with
    room. Deterministic (ties by index). Every length must be in [1, capacity]."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if not 1 <= length <= capacity:
            raise ValueError(f"item {index} has length {length}, outside [1, {capacity}]")
        for b, load in enumerate(loads):
            if load + length <= capacity:
                bins[b].append(index)
                loads[b] += length
                break
        else:
            bins.append([index])
            loads.append(length)
    return bins


def balance_across_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank: longest first, each to the rank with the least total so far (LPT; ties
    to the lower rank). Rank totals differ by at most ``max(lengths)``."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    heap = [(0, rank) for rank in range(num_ranks)]
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(heap)
        per_rank[rank].append(index)
        heapq.heappush(heap, (load + lengths[index], rank))
    return per_rank


def _split_bin(bin_indices: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for index in sorted(bin_indices, key=lambda i: (-lengths[i], i)):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(index)
        loads[side] += lengths[index]
    return halves


def _equalize_bin_counts(bins: list[list[int]], target: int, lengths: Sequence[int]) -> list[list[int]]:
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -b))
        first, second = _split_bin(bins[fullest], lengths)
        bins[fullest] = first
        bins.append(second)
    return bins


def _sample_arrays(sample: PackableSample, seq_len: int, with_teacher: bool) -> dict[str, np.ndarray]:
    end = min(sample.num_tokens, seq_len)
    values = {
        "input_ids": sample.token_ids[:end],
        "position_ids": np.arange(end),
        "loss_mask": sample.loss_mask[:end],
        "advantages": np.full(end, sample.advantage),
        "inference_logprobs": sample.inference_logprobs[:end],
        "temperatures": sample.temperatures[:end],
        "policy_versions": sample.policy_versions[:end],
    }
    if with_teacher:
        values["teacher_logprobs"] = sample.teacher_logprobs[:end]
    return {name: np.asarray(value, dtype=TENSOR_DTYPES[name]) for name, value in values.items()}


def _micro_batch(indices: list[int], arrays: list[dict[str, np.ndarray]]) -> PackedMicroBatch:
    names = arrays[indices[0]].keys()
    tensors = {name: np.concatenate([arrays[i][name] for i in indices]) for name in names}
    versions = tensors["policy_versions"]
    return PackedMicroBatch(
        tensors=tensors,
        sample_indices=list(indices),
        num_loss_tokens=int(np.count_nonzero(tensors["loss_mask"])),
        min_policy_version=int(versions.min()),
        max_policy_version=int(versions.max()),
    )


def _padding_micro_batch(
    pad_token_id: int, policy_version: int, max_policy_version: int, with_teacher: bool
) -> PackedMicroBatch:
    values = {
        "input_ids": pad_token_id,
        "position_ids": 0,
        "loss_mask": False,
        "advantages": 0.0,
        "inference_logprobs": 0.0,
        "temperatures": 1.0,
        "policy_versions": policy_version,
    }
    if with_teacher:
        values["teacher_logprobs"] = 0.0
    tensors = {name: np.full(1, value, dtype=TENSOR_DTYPES[name]) for name, value in values.items()}
    return PackedMicroBatch(
        tensors=tensors,
        sample_indices=[],
        num_loss_tokens=0,
        min_policy_version=policy_version,
        max_policy_version=max_policy_version,
    )


def pack_samples(
    samples: Sequence[PackableSample],
    *,
    seq_len: int,
    num_ranks: int = 1,
    overlong: OverlongPolicy = "truncate",
    pad_token_id: int = 0,
) -> PackedStep:
    """Pack one step's samples into micro-batches per rank (see the module docstring)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if overlong not in ("truncate", "reject"):
        raise ValueError(f"overlong must be 'truncate' or 'reject', got {overlong!r}")
    if not samples:
        raise ValueError("no samples to pack: a step needs at least one")
    num_with_teacher = sum(sample.teacher_logprobs is not None for sample in samples)
    if num_with_teacher not in (0, len(samples)):
        raise ValueError(f"{num_with_teacher} of {len(samples)} samples have teacher_logprobs: all or none must")
    with_teacher = num_with_teacher > 0

    overlong_indices = [i for i, sample in enumerate(samples) if sample.num_tokens > seq_len]
    if overlong == "reject":
        rejected = set(overlong_indices)
        kept = [i for i in range(len(samples)) if i not in rejected]
        if not kept:
            raise ValueError(f"all {len(samples)} samples are longer than seq_len ({seq_len}) and were rejected")
    else:
        kept = list(range(len(samples)))
    lengths = [min(samples[i].num_tokens, seq_len) for i in kept]
    arrays = [_sample_arrays(samples[i], seq_len, with_teacher) for i in kept]

    rank_items = balance_across_ranks(lengths, num_ranks)  # positions in `kept`
    rank_bins = []
    for items in rank_items:
        local = first_fit_decreasing([lengths[i] for i in items], seq_len)
        rank_bins.append([[items[j] for j in b] for b in local])
    target = max(len(bins) for bins in rank_bins)
    rank_bins = [_equalize_bin_counts(bins, target, lengths) for bins in rank_bins]

    min_version = min(sample.min_policy_version for sample in samples)
    max_version = max(sample.max_policy_version for sample in samples)
    per_rank: list[list[PackedMicroBatch]] = []
    num_padding = 0
    for bins in rank_bins:
        if bins:
            batches = [_micro_batch(b, arrays) for b in bins]
            for batch in batches:  # report indices into the caller's list
                batch.sample_indices = [kept[i] for i in batch.sample_indices]
        else:
            batches = [_padding_micro_batch(pad_token_id, min_version, max_version, with_teacher)]
            num_padding += 1
        per_rank.append(batches)
    return PackedStep(
        per_rank=per_rank,
        num_loss_tokens_global=sum(b.num_loss_tokens for batches in per_rank for b in batches),
        num_overlong_truncated=len(overlong_indices) if overlong == "truncate" else 0,
        num_overlong_rejected=len(overlong_indices) if overlong == "reject" else 0,
        num_padding_micro_batches=num_padding,
        rank_num_tokens=[sum(lengths[i] for i in items) for items in rank_items],
    )


def check_loss_tokens_survive(packed: PackedStep, samples: Sequence[PackableSample], seq_len: int) -> None:
    """A step whose completions were all cut off by truncation to ``seq_len`` would stop the trainer with "no loss
    tokens"; say the cause here instead (a configuration error: exit 2, not restarted)."""
    if packed.num_loss_tokens_global or not any(any(sample.loss_mask) for sample in samples):
        return
    longest_prompt = max(next((i for i, in_loss in enumerate(s.loss_mask) if in_loss), s.num_tokens) for s in samples)
    raise ValueError(
        f"no sample keeps a completion token within seq_len = {seq_len}: prompts are up to "
        f"{longest_prompt} tokens long, so truncation to seq_len leaves nothing to train on; raise "
        "seq_len (and the inference max_model_len) above the prompts' length plus max_tokens"
    )

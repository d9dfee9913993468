"""Training micro-batches: the packed token tensors the broker delivers, and the model's logprobs on them.

A micro-batch packs several samples into one sequence of at most ``seq_len`` tokens; ``position_ids``
restart at 0 where a sample starts. The forward pass unpacks it into a padded [samples, longest] batch
with an attention mask, so no sample attends to another whatever the attention implementation, then
packs the per-token results back into the original order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

REQUIRED_TENSORS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")
OPTIONAL_TENSORS = ("policy_versions", "teacher_logprobs")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [n] int64
    position_ids: torch.Tensor  # [n] int64, restarting at 0 for each sample
    loss_mask: torch.Tensor  # [n] bool
    advantages: torch.Tensor  # [n] float32
    inference_logprobs: torch.Tensor  # [n] float32
    temperatures: torch.Tensor  # [n] float32
    policy_versions: torch.Tensor | None = None  # [n] int64
    teacher_logprobs: torch.Tensor | None = None  # [n] float32

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Any]) -> MicroBatch:
        """From decoded frame tensors (numpy views or torch tensors); checks names and lengths."""
        missing = [name for name in REQUIRED_TENSORS if name not in tensors]
        if missing:
            raise ValueError(f"micro-batch lacks tensors {missing}; it has {sorted(tensors)}")
        unknown = sorted(set(tensors) - set(REQUIRED_TENSORS) - set(OPTIONAL_TENSORS))
        if unknown:
            raise ValueError(f"micro-batch has unknown tensors {unknown}")
        values = {name: _as_tensor(array) for name, array in tensors.items()}
        lengths = {name: tuple(t.shape) for name, t in values.items()}
        if len(set(lengths.values())) != 1 or len(next(iter(lengths.values()))) != 1:
            raise ValueError(f"micro-batch tensors must be 1-D of one length, got {lengths}")
        batch = cls(
            input_ids=values["input_ids"].long(),
            position_ids=values["position_ids"].long(),
            loss_mask=values["loss_mask"].bool(),
            advantages=values["advantages"].float(),
            inference_logprobs=values["inference_logprobs"].float(),
            temperatures=values["temperatures"].float(),
            policy_versions=values["policy_versions"].long() if "policy_versions" in values else None,
            teacher_logprobs=values["teacher_logprobs"].float() if "teacher_logprobs" in values else None,
        )
        if batch.num_tokens and batch.position_ids[0].item() != 0:
            raise ValueError("position_ids of a micro-batch must start at 0 (the first sample's first token)")
        return batch

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        names = REQUIRED_TENSORS + OPTIONAL_TENSORS
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def _as_tensor(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    return torch.from_numpy(np.array(array, copy=True))  # frames are read-only views: own the memory


def sample_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each packed sample: a new sample starts wherever the position id is 0."""
    starts = torch.nonzero(position_ids == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids must start at 0")
    ends = starts[1:] + [int(position_ids.shape[0])]
    return list(zip(starts, ends))


def forward_logits_packed(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """The model's logits for each packed sample (a list of [len_i, vocab] tensors), computed as one padded batch."""
    spans = sample_spans(position_ids)
    longest = max(end - start for start, end in spans)
    padded = input_ids.new_zeros((len(spans), longest))
    attention = input_ids.new_zeros((len(spans), longest))
    for row, (start, end) in enumerate(spans):
        padded[row, : end - start] = input_ids[start:end]
        attention[row, : end - start] = 1
    logits = model(input_ids=padded, attention_mask=attention, use_cache=False).logits
    return [logits[row, : end - start] for row, (start, end) in enumerate(spans)]


def packed_token_logprobs(
    model: torch.nn.Module, batch: MicroBatch, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs [n] (differentiable) and entropies [n] (detached) in packed order; the first token
    of each sample has no context: its logprob is 0 and it must not be a loss token."""
    from primerl.trainer.losses import token_entropy, token_logprobs

    spans = sample_spans(batch.position_ids)
    if any(bool(batch.loss_mask[start]) for start, _ in spans):
        raise ValueError("the first token of a sample cannot be a loss token (it has no context to predict it)")
    logprobs, entropies = [], []
    for (start, end), logits in zip(spans, forward_logits_packed(model, batch.input_ids, batch.position_ids)):
        temperatures = batch.temperatures[start:end]
        logprobs.append(token_logprobs(logits, batch.input_ids[start:end], temperatures))
        if with_entropy:
            entropies.append(token_entropy(logits, temperatures))
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None

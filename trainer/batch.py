"""Training micro-batches: the packed token tensors the broker delivers, and the model's logprobs on them.

A micro-batch packs several samples into one sequence of at most ``seq_len`` tokens; ``position_ids``
restart at 0 where a sample starts. The forward pass unpacks it into a padded [samples, longest] batch
with an attention mask, so no sample attends to another whatever the attention implementation, then
packs the per-token results back into the original order.

A mixture-of-experts model (its config has ``router_aux_loss_coef``: Qwen2/3-MoE, Mixtral) also gives its router
load-balancing loss when asked (``router_aux``): transformers' own loss of the family, computed by the model
over the real tokens of the padded batch (its attention mask leaves the padding out), so packing changes nothing.
`router_aux_term` turns it into the step's loss term and the ``router_aux_loss`` metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from primerl.proto.micro_batch import OPTIONAL_TENSORS, REQUIRED_TENSORS, TENSOR_DTYPES, check_tensor_names
from primerl.proto.tensor_frames import DTYPES

_TORCH_DTYPES = {
    np.dtype(numpy_dtype): getattr(torch, torch_name)
    for _, numpy_dtype, torch_name in DTYPES.values()
    if numpy_dtype is not None
}


@dataclass
class MicroBatch:
    """A micro-batch's tensors (the schema: ``primerl.proto.micro_batch``)."""

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
        """From decoded frame tensors (numpy views or torch tensors), in the schema's dtypes; checks names and
        lengths."""
        check_tensor_names(tensors)
        values = {name: _as_tensor(array) for name, array in tensors.items()}
        lengths = {name: tuple(t.shape) for name, t in values.items()}
        if len(set(lengths.values())) != 1 or len(next(iter(lengths.values()))) != 1:
            raise ValueError(f"micro-batch tensors must be 1-D of one length, got {lengths}")
        batch = cls(**{name: tensor.to(_TORCH_DTYPES[TENSOR_DTYPES[name]]) for name, tensor in values.items()})
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


def _padded(values: torch.Tensor, spans: list[tuple[int, int]], longest: int, fill: float | int) -> torch.Tensor:
    """[samples, longest]: each packed sample's values in its own row, ``fill`` after its end."""
    rows = values.new_full((len(spans), longest), fill)
    for row, (start, end) in enumerate(spans):
        rows[row, : end - start] = values[start:end]
    return rows


def hf_config(model: torch.nn.Module) -> Any:
    """The transformers config of `model`, under DDP (``.module``) and peft wrappers; None if it has none."""
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return getattr(model, "config", None)


def router_aux_loss_coef(model: torch.nn.Module) -> float | None:
    """None for a dense model; for a mixture-of-experts model, the weight of its router load-balancing loss in
    the training loss as the family defines it: ``router_aux_loss_coef`` when the config's
    ``output_router_logits`` is on (transformers adds the loss only then), else 0.0 (reported, not trained)."""
    config = hf_config(model)
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None or not hasattr(config, "output_router_logits"):
        return None
    return float(coef) if config.output_router_logits else 0.0


def forward_logits_padded(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    router_aux: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """The model's logits on the packed samples as one padded batch: (logits [samples, longest, vocab], the padded
    input ids [samples, longest], the samples' spans). Row i holds sample i; positions past its end are padding.

    ``router_aux`` (a dict to fill): for a mixture-of-experts model, ``"loss"`` (the router load-balancing loss
    over the batch's real tokens, differentiable) and ``"coef"`` (`router_aux_loss_coef`); left empty for a
    dense model."""
    spans = sample_spans(position_ids)
    longest = max(end - start for start, end in spans)
    padded = _padded(input_ids, spans, longest, 0)
    attention = _padded(torch.ones_like(input_ids), spans, longest, 0)
    coef = router_aux_loss_coef(model) if router_aux is not None else None
    if coef is None:
        return model(input_ids=padded, attention_mask=attention, use_cache=False).logits, padded, spans
    output = model(input_ids=padded, attention_mask=attention, use_cache=False, output_router_logits=True)
    if output.aux_loss is not None:
        router_aux.update(loss=output.aux_loss, coef=coef)
    return output.logits, padded, spans


def router_aux_term(router_aux: dict[str, Any], batch_loss_tokens: int, num_loss_tokens: int) -> Any:
    """The router loss of one micro-batch as a step loss term (``losses.LossOutput``): coef x loss, weighted by
    the micro-batch's share of the step's loss tokens, so the terms of a step add up to the token-weighted mean;
    metric ``router_aux_loss`` (the loss without coef, same weighting). Zero for an empty ``router_aux``."""
    from primerl.trainer.losses import LossOutput

    if "loss" not in router_aux:
        return LossOutput(loss=torch.zeros(()), metrics={})
    share = batch_loss_tokens / max(num_loss_tokens, 1)
    aux = router_aux["loss"] * share
    return LossOutput(loss=aux * router_aux["coef"], metrics={"router_aux_loss": float(aux.detach())})


def packed_token_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    *,
    with_entropy: bool = True,
    router_aux: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs [n] (differentiable) and entropies [n] (detached) in packed order; the first token
    of each sample has no context: its logprob is 0 and it must not be a loss token. ``router_aux``: see
    `forward_logits_padded`.

    Computed on the padded batch at once (one log-softmax, one gather), the same numbers as
    ``losses.token_logprobs``/``token_entropy`` sample by sample without a Python loop over the samples."""
    from primerl.trainer.losses import at_least_float32

    spans = sample_spans(batch.position_ids)
    if any(bool(batch.loss_mask[start]) for start, _ in spans):
        raise ValueError("the first token of a sample cannot be a loss token (it has no context to predict it)")
    logits, padded_ids, spans = forward_logits_padded(model, batch.input_ids, batch.position_ids, router_aux=router_aux)
    longest = padded_ids.shape[1]
    valid = _padded(torch.ones_like(batch.loss_mask), spans, longest, False)
    temperatures = _padded(batch.temperatures.float(), spans, longest, 1.0)
    # Position t's logits predict token t + 1, sampled at token t + 1's temperature.
    scaled = at_least_float32(logits[:, :-1])
    scaled = scaled / temperatures[:, 1:].to(scaled.dtype).clamp_min(1e-6).unsqueeze(-1)
    log_p = torch.log_softmax(scaled, dim=-1)
    picked = log_p.gather(-1, padded_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logprobs = torch.cat([picked.new_zeros((len(spans), 1)), picked], dim=1)[valid]
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        detached = log_p.detach()
        entropy = -(detached.exp() * detached).sum(-1)
        entropies = torch.cat([entropy.new_zeros((len(spans), 1)), entropy], dim=1)[valid]
    return logprobs, entropies

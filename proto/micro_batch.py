"""The tensors of a training micro-batch, as the packer makes them (``primerl.proto.packing``), the broker carries
them (a ``RolloutBatchHeader`` with one safetensors payload) and the trainer reads them
(``primerl.trainer.batch.MicroBatch``).

Every tensor is 1-D, one entry per token of the packed sequence, all of one length (at most ``seq_len``):

    name                 dtype    required  per token
    input_ids            int64    yes       the token id
    position_ids         int64    yes       its position in its sample: 0 where each sample starts
    loss_mask            bool     yes       trained on (completion tokens the model generated)
    advantages           float32  yes       its sample's advantage (only loss tokens use it)
    inference_logprobs   float32  yes       log p(token | tokens before) as the inference engine sampled it; 0
                                            where it is not a loss token
    temperatures         float32  yes       the sampling temperature of its turn
    policy_versions      int64    no        the policy version that generated it (a prompt token: its turn's)
    teacher_logprobs     float32  no        a teacher's logprob (distillation); all samples of a step or none

The first token of a sample is never a loss token: nothing precedes it to predict it from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from primerl.proto.tensor_frames import DTYPES

TENSOR_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int64),
    "position_ids": np.dtype(np.int64),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float32),
    "inference_logprobs": np.dtype(np.float32),
    "temperatures": np.dtype(np.float32),
    "policy_versions": np.dtype(np.int64),
    "teacher_logprobs": np.dtype(np.float32),
}
"""Each micro-batch tensor's dtype, in the order of the table above."""

REQUIRED_TENSORS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")
OPTIONAL_TENSORS = ("policy_versions", "teacher_logprobs")


def check_tensor_names(tensors: Mapping[str, Any]) -> None:
    """``ValueError`` when a required tensor is missing or a tensor is not one of the schema's."""
    missing = [name for name in REQUIRED_TENSORS if name not in tensors]
    if missing:
        raise ValueError(f"micro-batch lacks tensors {missing}; it has {sorted(tensors)}")
    unknown = sorted(set(tensors) - set(TENSOR_DTYPES))
    if unknown:
        raise ValueError(f"micro-batch has unknown tensors {unknown}")


def tensor_spec_problem(specs: Iterable[Any]) -> str:
    """What is wrong with a micro-batch's ``TensorSpec`` list against the schema ("" when nothing): a tensor the
    schema does not name, one of another dtype, or one that is not 1-D. (The broker checks this at intake; a
    missing tensor is the trainer's to refuse: producers of test traffic send a few tensors only.)"""
    for spec in specs:
        expected = TENSOR_DTYPES.get(spec.name)
        if expected is None:
            return f"tensor {spec.name!r} is not a micro-batch tensor; they are {list(TENSOR_DTYPES)}"
        entry = DTYPES.get(spec.dtype)
        if entry is None or entry[1] is None or np.dtype(entry[1]) != expected:
            return f"tensor {spec.name!r} has dtype {spec.dtype}; a micro-batch carries it as {expected}"
        if len(spec.shape) != 1:
            return f"tensor {spec.name!r} has shape {list(spec.shape)}; micro-batch tensors are 1-D"
    return ""


__all__ = ["OPTIONAL_TENSORS", "REQUIRED_TENSORS", "TENSOR_DTYPES", "check_tensor_names", "tensor_spec_problem"]

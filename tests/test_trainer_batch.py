"""Packed micro-batches: unpacking keeps samples apart, and per-token logprobs match each sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from primerl.trainer.batch import MicroBatch, packed_token_logprobs, sample_spans
from primerl.trainer.losses import token_logprobs


@pytest.fixture(scope="module")
def model(small_tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_tiny_model, dtype=torch.float32).eval()


def packed(lengths, seed=0):
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    position_ids = np.concatenate([np.arange(length) for length in lengths])
    loss_mask = position_ids > 2
    return {
        "input_ids": rng.integers(5, 500, n).astype(np.int64),
        "position_ids": position_ids.astype(np.int64),
        "loss_mask": loss_mask,
        "advantages": rng.standard_normal(n).astype(np.float32),
        "inference_logprobs": -rng.random(n).astype(np.float32),
        "temperatures": np.where(np.arange(n) % 2 == 0, 1.0, 0.7).astype(np.float32),
    }


def test_spans_follow_position_resets():
    assert sample_spans(torch.tensor([0, 1, 2, 0, 1, 0])) == [(0, 3), (3, 5), (5, 6)]
    with pytest.raises(ValueError):
        sample_spans(torch.tensor([1, 2, 0]))


def test_packed_logprobs_equal_each_sample_alone(model):
    batch = MicroBatch.from_tensors(packed([7, 4, 9]))
    logprobs, entropy = packed_token_logprobs(model, batch)
    assert logprobs.shape == entropy.shape == (20,)
    with torch.no_grad():
        for start, end in sample_spans(batch.position_ids):
            ids = batch.input_ids[start:end]
            alone = model(input_ids=ids.unsqueeze(0)).logits[0]
            expected = token_logprobs(alone, ids, batch.temperatures[start:end])
            torch.testing.assert_close(logprobs[start:end].detach(), expected, atol=1e-5, rtol=0)


def test_micro_batch_checks_its_tensors():
    tensors = packed([5, 5])
    with pytest.raises(ValueError, match="lacks tensors"):
        MicroBatch.from_tensors({k: v for k, v in tensors.items() if k != "advantages"})
    with pytest.raises(ValueError, match="unknown tensors"):
        MicroBatch.from_tensors({**tensors, "rewards": tensors["advantages"]})
    with pytest.raises(ValueError, match="one length"):
        MicroBatch.from_tensors({**tensors, "advantages": tensors["advantages"][:3]})


def test_packer_and_micro_batch_follow_the_schema():
    """What the orchestrator packs is what the trainer reads: the names and dtypes of ``primerl.proto.micro_batch``."""
    from primerl.orchestrator.samples import TrainingSample
    from primerl.proto.micro_batch import REQUIRED_TENSORS, TENSOR_DTYPES
    from primerl.proto.packing import pack_samples

    def sample(teacher):
        return TrainingSample(
            token_ids=[3, 4, 5],
            loss_mask=[False, True, True],
            inference_logprobs=[0.0, -0.5, -0.2],
            temperatures=[1.0] * 3,
            policy_versions=[2] * 3,
            advantage=0.5,
            teacher_logprobs=[0.0, -0.4, -0.1] if teacher else None,
        )

    torch_dtypes = {
        np.dtype(np.int64): torch.int64,
        np.dtype(np.bool_): torch.bool,
        np.dtype(np.float32): torch.float32,
    }
    for teacher in (False, True):
        step = pack_samples([sample(teacher)] * 2, seq_len=8, num_ranks=3)  # a padding micro-batch for rank 2
        for batch in (b for batches in step.per_rank for b in batches):
            expected = TENSOR_DTYPES if teacher else {k: v for k, v in TENSOR_DTYPES.items() if k != "teacher_logprobs"}
            assert {name: t.dtype for name, t in batch.tensors.items()} == expected
            read = MicroBatch.from_tensors(batch.tensors).to_tensors()
            assert {name: t.dtype for name, t in read.items()} == {n: torch_dtypes[d] for n, d in expected.items()}
    assert set(REQUIRED_TENSORS) <= set(TENSOR_DTYPES)
    # the trainer casts what it gets to the schema's dtypes (a producer may send float64 advantages, say)
    cast = MicroBatch.from_tensors({**packed([4]), "advantages": np.zeros(4, dtype=np.float64)})
    assert cast.advantages.dtype == torch.float32


def test_first_token_of_a_sample_cannot_be_a_loss_token(model):
    tensors = packed([5, 5])
    tensors["loss_mask"] = tensors["loss_mask"].copy()
    tensors["loss_mask"][5] = True
    with pytest.raises(ValueError, match="first token"):
        packed_token_logprobs(model, MicroBatch.from_tensors(tensors))

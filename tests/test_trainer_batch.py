"""Packed micro-batches: unpacking keeps samples apart, and per-token logprobs match each sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from primerl.trainer.batch import MicroBatch, packed_token_logprobs, sample_spans
from primerl.trainer.losses import token_logprobs
from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelSpec(hidden_size=64, num_layers=1,
                                                                                        num_attention_heads=2, num_key_value_heads=1))
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


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


def test_first_token_of_a_sample_cannot_be_a_loss_token(model):
    tensors = packed([5, 5])
    tensors["loss_mask"] = tensors["loss_mask"].copy()
    tensors["loss_mask"][5] = True
    with pytest.raises(ValueError, match="first token"):
        packed_token_logprobs(model, MicroBatch.from_tensors(tensors))

"""DELTA updates end to end: the trainer's `PolicyPublisher(kind="delta")` -> an in-process broker -> the real
`primerl-infer` daemon on the tiny model. The publisher sends FULL first (no base yet), then XOR+zlib deltas of a
transformers model stepped with AdamW; after each update the served logprobs match a transformers forward pass
with the same weights. A DELTA on a base that is not the latest version is refused by the broker (OUT_OF_ORDER)
and never reaches the worker, which keeps serving what it served.

A second publisher (a newer lineage) then sends a SPARSE delta of a few rows, a third of a norm and a bias, served
exactly too.

The daemon, broker and helpers are those of tests/conftest.py and tests/support/inference.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from support.broker import BrokerHarness
from support.daemons import InferenceDaemon
from support.inference import (
    AUTH,
    TOKEN,
    TOLERANCE,
    greedy_completion,
    reference_max_diff,
    save_weights,
    served_versions,
    wait_applied,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

LR = 1e-3  # large enough that one step moves the served logprobs well past the tolerance
NUM_TRAIN_TOKENS = 16


# The module-scoped fixtures (a broker, one primerl-infer daemon and an HTTP client) are conftest.py's; this
# module gets its own instances.


def adamw_step(model: Any, optimizer: Any, seed: int) -> None:
    """One real optimizer step: next-token loss on a few random tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (1, NUM_TRAIN_TOKENS), generator=generator)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model: Any) -> dict[str, Any]:
    """The tensors a FULL publish would send, copied (the next step must not change them)."""
    from primerl.trainer.hf_state_dict import hf_state_dict

    return {name: t.detach().clone().contiguous() for name, t in hf_state_dict(model).items()}


def token_logprobs(body: dict[str, Any]) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


def test_delta_updates_are_served_and_a_wrong_base_is_refused(
    infer_daemon: InferenceDaemon,
    infer_http: httpx.Client,
    infer_broker: BrokerHarness,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    import torch

    from primerl.configs.trainer import ModelConfig, OptimizerConfig
    from primerl.proto.v1 import common_pb2, data_pb2
    from primerl.proto.weight_delta import encode_delta
    from primerl.proto.weight_refusals import WeightUpdateRefused
    from primerl.trainer.model import load_model
    from primerl.trainer.optim import build_optimizer
    from primerl.trainer.publish import PolicyPublisher

    model = load_model(ModelConfig(name=str(tiny_model)))
    optimizer = build_optimizer(model, OptimizerConfig(lr=LR))
    endpoint = infer_broker.weight_endpoint
    snapshots: dict[int, dict[str, Any]] = {}
    _, previous = greedy_completion(infer_http)
    # "always": this test is about deltas end to end (with "auto", dense fp32 steps go as FULL: test_publish).
    with PolicyPublisher(
        endpoint,
        TOKEN,
        "trainer",
        infer_broker.service.chunk_bytes,
        kind="delta",
        policy_name="policy",
        delta_policy="always",
    ) as publisher:
        for version, expected_kind in ((1, "full"), (2, "delta"), (3, "delta")):
            adamw_step(model, optimizer, seed=version)
            snapshots[version] = snapshot(model)
            result = publisher.publish(model, version)
            assert (result.kind, result.policy_version) == (expected_kind, version), result
            # On one host, FULL and deltas alike go in shared memory: the worker reads the trainer's segment, its
            # host copy (the base of the next delta) takes its own bytes before the trainer may write it again.
            assert result.transport == "shared_memory"
            if expected_kind == "delta":
                assert result.base_version == version - 1 and result.fallback is None
                full_bytes = sum(t.numel() * t.element_size() for t in snapshots[version].values())
                assert 0 < result.payload_bytes < full_bytes  # XOR + zlib of one small step
            wait_applied(infer_broker, version)

            response, body = greedy_completion(infer_http)
            assert served_versions(response) == (version, version)
            assert max(abs(a - b) for a, b in zip(token_logprobs(previous), token_logprobs(body))) > 1e-3
            weights_dir = save_weights(tiny_model, tmp_path / f"v{version}", snapshots[version])
            assert reference_max_diff(infer_http, weights_dir, body) <= TOLERANCE, f"v{version} ({expected_kind})"
            previous = body

        # A delta from v2 to v4 while the broker holds v3: the broker refuses it, the worker never sees it.
        adamw_step(model, optimizer, seed=4)
        payload, specs, decoded = encode_delta(snapshot(model), snapshots[2])
        header = data_pb2.WeightUpdateHeader(
            policy_version=4,
            kind=data_pb2.WEIGHT_UPDATE_KIND_DELTA,
            base_version=2,
            delta_encoding=data_pb2.DELTA_ENCODING_XOR_ZLIB,
            policy_name="policy",
            tensors=specs,
            decoded_tensors=decoded,
        )
        with pytest.raises(WeightUpdateRefused) as refused:
            infer_broker.publish(header, payload)
        assert refused.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER, refused.value
        with infer_broker.client() as client:
            assert client.get_run_status().latest_policy_version == 3
        assert infer_broker.inference_worker().policy_version == 3
        response, body = greedy_completion(infer_http)
        assert served_versions(response) == (3, 3)
        assert token_logprobs(body) == token_logprobs(previous)

        # The publisher's own chain was not disturbed: its next delta applies on v3.
        result = publisher.publish(model, 4)
        assert (result.kind, result.base_version) == ("delta", 3), result
        wait_applied(infer_broker, 4)
        response, body = greedy_completion(infer_http)
        assert served_versions(response) == (4, 4)
        weights_dir = save_weights(tiny_model, tmp_path / "v4", snapshot(model))
        assert reference_max_diff(infer_http, weights_dir, body) <= TOLERANCE

    # SPARSE (what a bf16 publisher sends; any dtype decodes) on the same path: a new trainer incarnation (a newer
    # lineage) publishes FULL v5, then a delta with a few rows of one matrix (positions as gaps), a third of a
    # norm (a mask) and a whole bias.
    with PolicyPublisher(
        endpoint,
        TOKEN,
        "trainer-sparse",
        infer_broker.service.chunk_bytes,
        kind="delta",
        policy_name="policy",
        delta_policy="always",
        delta_encoding="sparse",
    ) as publisher:
        assert publisher.publish(model, 5).kind == "full"
        wait_applied(infer_broker, 5)
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight[[3, 70, 101]] += 0.05
            model.model.norm.weight[::3] += 0.1
            model.model.layers[1].self_attn.v_proj.bias.add_(0.05)
        result = publisher.publish(model, 6)
        assert (result.kind, result.base_version, result.num_tensors) == ("delta", 5, 3), result
        header = infer_broker.service.weight_store.latest().header
        assert header.delta_encoding == data_pb2.DELTA_ENCODING_SPARSE
        assert {
            "model.layers.0.self_attn.q_proj.weight#gaps",
            "model.norm.weight#mask",
            "model.layers.1.self_attn.v_proj.bias#values",
        } <= {spec.name for spec in header.tensors}
        wait_applied(infer_broker, 6)
        response, body = greedy_completion(infer_http)
        assert served_versions(response) == (6, 6)
        weights_dir = save_weights(tiny_model, tmp_path / "v6", snapshot(model))
        assert reference_max_diff(infer_http, weights_dir, body) <= TOLERANCE
    assert infer_daemon.process.poll() is None
    assert infer_http.get("/health", headers=AUTH).status_code == 200


def test_a_streamed_full_update_is_served_exactly(
    infer_daemon: InferenceDaemon,
    infer_http: httpx.Client,
    infer_broker: BrokerHarness,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """`weight_broadcast.stream`: the publisher sends the tiny model's 2.5 MB in 1 MiB chunks while it still writes
    them, the digest following in the last chunk; the broker stores it with that digest, and the worker checks it
    against what it received before it serves the new weights exactly."""
    from primerl.configs.trainer import ModelConfig, OptimizerConfig
    from primerl.proto.digests import payload_digest
    from primerl.trainer.model import load_model
    from primerl.trainer.optim import build_optimizer
    from primerl.trainer.publish import PolicyPublisher

    model = load_model(ModelConfig(name=str(tiny_model)))
    adamw_step(model, build_optimizer(model, OptimizerConfig(lr=LR)), seed=77)
    version = (infer_broker.service.weight_store.latest_version or 0) + 1
    with PolicyPublisher(
        infer_broker.weight_endpoint, TOKEN, "trainer-streamed", 1 << 20, kind="full", policy_name="policy", stream=True
    ) as publisher:
        result = publisher.publish(model, version)
    assert result.kind == "full" and result.payload_bytes > 2 << 20 and "layout" in result.phases_ms, result
    stored = infer_broker.service.weight_store.latest()
    assert stored.header.digest == payload_digest(stored.payload)
    wait_applied(infer_broker, version)
    response, body = greedy_completion(infer_http)
    assert served_versions(response) == (version, version)
    weights_dir = save_weights(tiny_model, tmp_path / "streamed", snapshot(model))
    assert reference_max_diff(infer_http, weights_dir, body) <= TOLERANCE

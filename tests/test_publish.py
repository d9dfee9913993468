"""Policy publishing against an in-process broker: FULL (Hugging Face names, loadable), LORA (peft's files),
DELTA (bit-exact against the previous version), fallbacks to FULL, and the broker's refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from primerl.broker.service import BrokerService
from primerl.configs.trainer import LoRAConfig, ModelConfig, OptimizerConfig
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused
from primerl.trainer.hf_state_dict import hf_state_dict
from primerl.trainer.model import load_model
from primerl.trainer.optim import build_optimizer
from primerl.trainer.publish import PolicyPublisher

CHUNK_BYTES = 1 << 20  # the tiny model's 2.5 MB travel in 3 chunks


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture
def broker(make_broker) -> tuple[BrokerService, str]:
    harness = make_broker(stop_grace_s=0)
    return harness.service, harness.weight_endpoint


@pytest.fixture
def publishers() -> Iterator[list[PolicyPublisher]]:
    opened: list[PolicyPublisher] = []
    yield opened
    for publisher in opened:
        publisher.close()


def make_publisher(opened: list[PolicyPublisher], endpoint: str, kind: str, **kwargs) -> PolicyPublisher:
    publisher = PolicyPublisher(endpoint, None, "trainer-0", CHUNK_BYTES, kind, "tiny", **kwargs)
    opened.append(publisher)
    return publisher


def adamw_step(model: torch.nn.Module, lr: float = 1e-5, seed: int = 0) -> None:
    optimizer = build_optimizer(model, OptimizerConfig(lr=lr, weight_decay=0.0))
    input_ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def stored_payload(service: BrokerService) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    update = service.weight_store.latest()
    return update.header, bytes(update.payload)


def randomize_lora_b(model: torch.nn.Module) -> None:
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)


def test_full_publish_has_save_pretrained_names_and_reproduces_logits(model_dir, broker, publishers, tmp_path):
    from transformers import AutoModelForCausalLM

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    adamw_step(model, lr=1e-3)  # differ from the checkpoint on disk
    result = make_publisher(publishers, endpoint, "full").publish(model, 1, timeout_s=30)
    assert result.ack.applied and result.kind == "full" and result.fallback is None
    assert service.weight_store.latest_version == 1
    assert result.build_ms > 0 and result.send_ms > 0

    header, payload = stored_payload(service)
    assert header.kind == data_pb2.WEIGHT_UPDATE_KIND_FULL and header.policy_name == "tiny"
    assert header.payload_bytes == len(payload) == result.payload_bytes
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    reference = load_file(saved / "model.safetensors")
    received = load_safetensors(payload)
    assert "lm_head.weight" not in received  # tied to embed_tokens: saved once, as transformers does
    assert {k: tuple(v.shape) for k, v in received.items()} == {k: tuple(v.shape) for k, v in reference.items()}
    assert {spec.name for spec in header.tensors} == set(reference)
    assert payload == (saved / "model.safetensors").read_bytes()  # byte for byte the file save_pretrained writes

    # A fresh transformers model loaded from the payload (as an inference worker would) gives the same logits.
    (saved / "model.safetensors").write_bytes(payload)
    fresh = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation="sdpa").eval()
    input_ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=input_ids).logits, model(input_ids=input_ids).logits, rtol=0, atol=0)


def test_lora_publish_is_peft_adapter_file_and_config(model_dir, broker, publishers, tmp_path):
    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir), lora=LoRAConfig(rank=4, alpha=8)))
    randomize_lora_b(model)
    result = make_publisher(publishers, endpoint, "lora").publish(model, 1, timeout_s=30)
    assert result.ack.applied and result.kind == "lora"
    assert service.weight_store.latest_version == 1

    header, payload = stored_payload(service)
    assert header.kind == data_pb2.WEIGHT_UPDATE_KIND_LORA
    model.save_pretrained(tmp_path / "adapter")
    reference = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    received = load_safetensors(payload)
    assert received.keys() == reference.keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in received
    for name, tensor in reference.items():
        assert torch.equal(received[name], tensor), name
    assert any(tensor.abs().sum() > 0 for name, tensor in received.items() if "lora_B" in name)
    assert payload == (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
    adapter_config = json.loads(header.adapter_config_json)
    saved_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config.keys() == saved_config.keys()
    for key, value in saved_config.items():  # peft writes sets as list(set): compare those as sets
        same = sorted(value) == adapter_config[key] if key == "target_modules" else value == adapter_config[key]
        assert same, key
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8 and adapter_config["inference_mode"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_publish_of_a_lora_model_is_the_merged_model(model_dir, broker, publishers, tmp_path, dtype):
    """Bit for bit peft's merge_and_unload, in the base model's dtype (in bf16 the fp32 adapter's delta is added
    in fp32 and the sum rounded once to bf16, as peft does)."""
    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir), optimization_dtype=dtype, lora=LoRAConfig(rank=4, alpha=8)))
    randomize_lora_b(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = make_publisher(publishers, endpoint, "full").publish(model, 1, timeout_s=30)
    assert result.ack.applied
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # nothing merged in place

    _, payload = stored_payload(service)
    assert {tensor.dtype for tensor in load_safetensors(payload).values()} == {getattr(torch, dtype)}
    merged = model.merge_and_unload()  # the reference: peft's own merge (changes the model, last use)
    merged.save_pretrained(tmp_path / "merged")
    assert payload == (tmp_path / "merged" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("lora", [False, True], ids=["full-fine-tune", "lora"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_publish_sends_the_weights_the_trainer_exports(model_dir, broker, publishers, tmp_path, lora, dtype):
    """What inference workers load and what ``weights/step_N`` holds are the same tensors: same keys, dtypes and
    bits (the same file, byte for byte)."""
    from primerl.trainer.weights_export import export_hf_weights

    service, endpoint = broker
    model = load_model(
        ModelConfig(name=str(model_dir), optimization_dtype=dtype, lora=LoRAConfig(rank=4, alpha=8) if lora else None)
    )
    randomize_lora_b(model)
    adamw_step(model, lr=1e-3)
    assert make_publisher(publishers, endpoint, "full").publish(model, 1, timeout_s=30).ack.applied
    _, payload = stored_payload(service)
    exported_dir = export_hf_weights(model, None, tmp_path / "weights" / "step_1")

    published = load_safetensors(payload)
    exported = load_file(exported_dir / "model.safetensors")
    assert published.keys() == exported.keys()
    assert not [key for key in exported if "lora" in key or "base_layer" in key]
    for key, tensor in exported.items():
        assert published[key].dtype == tensor.dtype == getattr(torch, dtype), key
        assert torch.equal(published[key].view(torch.uint8), tensor.view(torch.uint8)), key
    assert payload == (exported_dir / "model.safetensors").read_bytes()


def test_delta_after_full_decodes_to_the_new_weights_bit_exactly(model_dir, broker, publishers):
    from primerl.proto.weight_delta import decode_delta

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "delta", delta_policy="always")
    assert publisher.base_version is None
    first = publisher.publish(model, 1, timeout_s=30)
    assert first.kind == "full" and first.fallback == "no base version yet"
    full_header, full_payload = stored_payload(service)
    base = load_safetensors(full_payload)

    adamw_step(model, lr=1e-5)
    second = publisher.publish(model, 2, timeout_s=30)
    assert second.ack.applied and second.kind == "delta" and second.base_version == 1
    assert service.weight_store.latest_version == 2
    assert second.payload_bytes < first.payload_bytes
    header, payload = stored_payload(service)
    assert header.kind == data_pb2.WEIGHT_UPDATE_KIND_DELTA and header.base_version == 1
    assert header.delta_encoding == data_pb2.DELTA_ENCODING_XOR_ZLIB

    changed = decode_delta(payload, header, base)
    expected = hf_state_dict(model)
    rebuilt = {**base, **changed}
    assert rebuilt.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(rebuilt[name].view(torch.uint8), tensor.detach().contiguous().view(torch.uint8)), name
    assert changed  # the step changed something

    # Unchanged weights give an (almost) empty delta, still accepted.
    third = publisher.publish(model, 3, timeout_s=30)
    assert third.kind == "delta" and third.num_tensors == 0 and service.weight_store.latest_version == 3


def test_delta_publisher_sends_full_when_the_broker_requires_it(model_dir, broker, publishers):
    service, endpoint = broker
    service.weight_store.max_deltas = 1  # the chain is full after one delta
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "delta", delta_policy="always")
    assert publisher.publish(model, 1, timeout_s=30).kind == "full"
    adamw_step(model)
    second = publisher.publish(model, 2, timeout_s=30)
    assert second.kind == "delta" and second.ack.full_required
    adamw_step(model, seed=1)
    third = publisher.publish(model, 3, timeout_s=30)
    assert third.kind == "full" and third.fallback == "full required by the broker"
    assert service.weight_store.status().snapshot_version == 3


def test_delta_refused_as_out_of_order_is_resent_as_full(model_dir, broker, publishers):
    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "delta", delta_policy="always", lineage=7)
    publisher.publish(model, 1, timeout_s=30)
    # Another publisher of the same lineage moves the broker on: the delta publisher's base (v1) is no longer the
    # latest.
    make_publisher(publishers, endpoint, "full", lineage=7).publish(model, 2, timeout_s=30)
    adamw_step(model)
    result = publisher.publish(model, 3, timeout_s=30)
    assert result.kind == "full" and result.fallback.startswith("delta refused: ERROR_CODE_OUT_OF_ORDER")
    assert service.weight_store.latest_version == 3


def test_a_superseded_publisher_is_told_to_stop(model_dir, broker, publishers):
    """A trainer replaced by a newer incarnation (a newer lineage) gets ``LineageSuperseded`` on its next update,
    delta or FULL, and the broker keeps the newer lineage's version."""
    from primerl.proto.weight_refusals import LineageSuperseded

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    old = make_publisher(publishers, endpoint, "delta", delta_policy="always", lineage=100)
    old.publish(model, 1, timeout_s=30)
    new = make_publisher(publishers, endpoint, "full", lineage=200)
    assert new.publish(model, 2, timeout_s=30).ack.lineage == 200
    adamw_step(model)
    for _ in range(2):  # the delta, then (a publish after a failure is FULL) a FULL update
        with pytest.raises(LineageSuperseded) as info:
            old.publish(model, 3, timeout_s=30)
        assert info.value.broker_lineage == 200 and "superseded" in str(info.value)
    assert (service.weight_store.latest_version, service.weight_store.lineage) == (2, 200)


def test_auto_delta_falls_back_to_full_when_it_would_not_pay(model_dir, broker, publishers):
    """An AdamW step moves every fp32 element: the delta's encode + decode time exceeds what its bytes save, so
    FULL goes (and says why); a change to one small tensor is sent as a delta; the base is kept in step."""
    from primerl.proto.weight_delta import decode_delta

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "delta")  # delta_policy="auto"
    assert publisher.publish(model, 1, timeout_s=30).kind == "full"
    adamw_step(model, lr=1e-5)
    dense = publisher.publish(model, 2, timeout_s=30)
    assert dense.kind == "full" and dense.fallback.startswith("delta would not pay"), dense.fallback
    assert {"read", "estimate", "encode", "digest", "send"} <= set(
        dense.phases_ms
    )  # no host copy: the payload is the base
    full_header, full_payload = stored_payload(service)
    assert full_header.kind == data_pb2.WEIGHT_UPDATE_KIND_FULL
    base = load_safetensors(full_payload)

    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # one small tensor changes
    sparse = publisher.publish(model, 3, timeout_s=30)
    assert sparse.kind == "delta" and sparse.fallback is None and sparse.base_version == 2
    assert sparse.num_tensors == 1 and sparse.payload_bytes < dense.payload_bytes / 10
    header, payload = stored_payload(service)
    changed = decode_delta(payload, header, base)
    assert torch.equal(changed["model.norm.weight"], model.model.norm.weight.detach())


def bf16_bits(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {
        name: t.detach().to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
        for name, t in tensors.items()
    }


@pytest.mark.parametrize("encoding", ["auto", "xor_zlib"])
def test_bf16_delta_publisher_sends_sparse_deltas_bit_exactly(model_dir, broker, publishers, encoding):
    """fp32 master weights served in bf16: a small step keeps most elements' bits, the delta goes as SPARSE by
    default (XOR_ZLIB when asked) and decodes, against the FULL the broker stored, to the cast weights exactly."""
    from primerl.proto.weight_delta import decode_delta

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(
        publishers, endpoint, "delta", serving_dtype=torch.bfloat16, delta_policy="always", delta_encoding=encoding
    )
    first = publisher.publish(model, 1, timeout_s=30)
    assert first.kind == "full"
    _, full_payload = stored_payload(service)
    base = load_safetensors(full_payload)
    assert all(t.dtype == torch.bfloat16 for t in base.values())

    adamw_step(model, lr=1e-5)
    second = publisher.publish(model, 2, timeout_s=30)
    assert second.kind == "delta" and second.base_version == 1 and second.fallback is None
    header, payload = stored_payload(service)
    expected_encoding = data_pb2.DELTA_ENCODING_SPARSE if encoding == "auto" else data_pb2.DELTA_ENCODING_XOR_ZLIB
    assert header.delta_encoding == expected_encoding
    assert second.num_tensors == len(header.decoded_tensors) > 0
    assert second.payload_bytes < 0.5 * first.payload_bytes
    changed = decode_delta(payload, header, base)
    assert bf16_bits({**base, **changed}) == bf16_bits(hf_state_dict(model))

    # The next delta applies to v2: the publisher's base moved with what the broker stored.
    adamw_step(model, lr=1e-5, seed=1)
    assert publisher.publish(model, 3, timeout_s=30).base_version == 2
    header, payload = stored_payload(service)
    assert bf16_bits({**base, **changed, **decode_delta(payload, header, {**base, **changed})}) == bf16_bits(
        hf_state_dict(model)
    )


def test_auto_sparse_delta_falls_back_to_full_when_it_would_not_pay(model_dir, broker, publishers):
    """bf16 SPARSE under "auto": a step that moves nearly every element goes as FULL (the estimate says so); so
    does a change the estimate's samples (the middle of each tensor) miss, once the delta built is found to be
    nearly as large as FULL."""
    from primerl.proto.weight_delta import sampled_elements

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "delta", serving_dtype=torch.bfloat16)
    assert publisher.publish(model, 1, timeout_s=30).kind == "full"

    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    dense = publisher.publish(model, 2, timeout_s=30)
    assert dense.kind == "full" and dense.fallback.startswith("delta would not pay: SPARSE"), dense.fallback

    # Every element but those the estimate samples (of the bf16 snapshot): it sees no change, the delta built is
    # almost FULL.
    with torch.no_grad():
        state = hf_state_dict(model)
        for name, (begin, end) in sampled_elements({k: v.to(torch.bfloat16) for k, v in state.items()}).items():
            flat = state[name].view(-1)
            keep = flat[begin:end].clone()
            flat.mul_(1.5)
            flat[begin:end] = keep
    missed = publisher.publish(model, 3, timeout_s=30)
    assert missed.kind == "full" and missed.fallback.startswith("delta built is "), missed.fallback
    assert "encode_delta" in missed.phases_ms
    header, payload = stored_payload(service)
    assert header.kind == data_pb2.WEIGHT_UPDATE_KIND_FULL and header.policy_version == 3
    assert bf16_bits(load_safetensors(payload)) == bf16_bits(hf_state_dict(model))

    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # one small tensor changes: a delta
    small = publisher.publish(model, 4, timeout_s=30)
    assert small.kind == "delta" and small.fallback is None and small.num_tensors == 1


def test_full_payload_buffers_are_reused_and_stay_exact(model_dir, broker, publishers):
    """FULL payloads sent as bytes go into pooled buffers: the second publish reuses the first one's buffer and the
    broker still stores exactly the bytes safetensors would write for the new weights."""
    from safetensors.torch import save

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "full", transport="socket")
    publisher.publish(model, 1, timeout_s=30)
    idle = list(publisher._places._pool._idle)
    assert len(idle) == 1
    adamw_step(model)
    publisher.publish(model, 2, timeout_s=30)
    assert publisher._places._pool._idle == idle and publisher._places._pool._idle[0] is idle[0]
    _, payload = stored_payload(service)
    expected = save({k: v.detach().contiguous() for k, v in hf_state_dict(model).items()}, metadata={"format": "pt"})
    assert payload == expected


def test_out_of_order_version_is_refused_with_the_brokers_error(model_dir, broker, publishers):
    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    publisher = make_publisher(publishers, endpoint, "full")
    publisher.publish(model, 5, timeout_s=30)
    with pytest.raises(WeightUpdateRefused) as info:
        publisher.publish(model, 4, timeout_s=30)
    assert info.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER
    assert "FULL v4 is not newer than the latest version v5 held" in str(info.value)
    assert service.weight_store.latest_version == 5
    # The publisher is still usable.
    assert publisher.publish(model, 6, timeout_s=30).ack.applied


def test_lora_kind_on_a_model_without_lora_is_a_clear_error(model_dir, broker, publishers):
    _, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    with pytest.raises(ValueError, match=r"needs a LoRA model"):
        make_publisher(publishers, endpoint, "lora").publish(model, 1, timeout_s=30)


@pytest.mark.parametrize("transport", ["auto", "socket"])
def test_full_publish_in_a_serving_dtype_is_cast_in_its_one_copy(model_dir, broker, publishers, transport):
    """A FULL update of fp32 weights served in bf16: the cast happens in the copy into the payload buffer (or the
    shared segment), and the broker stores exactly what safetensors writes for the cast tensors."""
    from safetensors.torch import save

    service, endpoint = broker
    model = load_model(ModelConfig(name=str(model_dir)))
    adamw_step(model)
    publisher = make_publisher(publishers, endpoint, "full", serving_dtype=torch.bfloat16, transport=transport)
    result = publisher.publish(model, 1, timeout_s=30)
    assert "snapshot" not in result.phases_ms  # no copy of the model before the payload's
    _, payload = stored_payload(service)
    cast = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in hf_state_dict(model).items()}
    assert payload == save(cast, metadata={"format": "pt"})

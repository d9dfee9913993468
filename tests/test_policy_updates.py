"""In-flight weight updates on a real vLLM engine (the tiny model): after each FULL, LORA and DELTA update the
served logprobs match a transformers forward pass with the same new weights, and bad updates are refused with the
right code while the engine keeps serving the previous policy. One in-process engine serves these tests;
they move its policy version forward, and each starts from whatever the engine serves. Fast tests of the
updater's checks against a fake engine: ``test_policy_updater.py``; what the updates cost:
``bench/policy_apply_times.py``."""

from __future__ import annotations

import copy
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import engine_for_test
from support.policy_updates import DELTA, delta_update, full_update, lora_update, perturbed, sha256

from primerl.inference.engine import EngineOptions
from primerl.inference.logprob_check import (
    GenerationResult,
    check_logprobs,
    generate_with_logprobs,
    load_reference_model,
    max_abs_diff,
)
from primerl.inference.weight_tensors import REFUSAL_PREFIX, weights_digest
from primerl.inference.worker_extension import WORKER_EXTENSION_CLS
from primerl.proto.tensor_frames import encode_tensors, parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import torch_dtype_name

# vLLM's own import-time deprecation noise (torch.distributed.reduce_op), not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

TOLERANCE = 1e-4
PROMPTS = ["Reverse the string: a b c d", "What is 12 plus 30?", "hello", "Count from 1 to 5."]
MAX_TOKENS = 12
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LORA_RANK = 8


# ---- fixtures ---------------------------------------------------------------------------------------------------


@dataclass
class Served:
    """What the engine should be serving: the full weights, and the peft adapter on top when one is served."""

    model_dir: Path
    weights: dict[str, torch.Tensor]
    adapter_dir: Path | None = None

    def model(self, weights: dict[str, torch.Tensor] | None = None) -> Any:
        model = load_reference_model(self.model_dir)
        model.load_state_dict(weights if weights is not None else self.weights, strict=False)
        return model

    def reference(self) -> Any:
        """A transformers (or peft) model computing what the engine should serve."""
        if self.adapter_dir is None:
            return self.model()
        from peft import PeftModel

        return PeftModel.from_pretrained(self.model(), str(self.adapter_dir)).eval()


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    options = EngineOptions(
        model=model_dir,
        in_process=True,
        work_dir=tmp_path_factory.mktemp("work"),
        seed=0,
        enable_lora=True,
        max_lora_rank=MAX_LORA_RANK,
        worker_extension_cls=WORKER_EXTENSION_CLS,
    )
    with engine_for_test(options) as llm:
        yield llm


@pytest.fixture(scope="module")
def updater(llm: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from primerl.inference.policy_updates import PolicyUpdater

    updater = PolicyUpdater.for_llm(llm, tmp_path_factory.mktemp("policy"))
    updater.prepare()
    yield updater
    updater.close()  # its shared payload files


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Served:
    from safetensors.torch import load_file

    return Served(model_dir=model_dir, weights=load_file(str(model_dir / "model.safetensors")))


def generate(llm: Any, updater: Any) -> GenerationResult:
    return generate_with_logprobs(
        llm,
        PROMPTS,
        max_tokens=MAX_TOKENS,
        seed=0,
        temperature=1.0,
        ignore_eos=True,
        lora_request=updater.lora_request(),
    )


def served_diff(llm: Any, updater: Any, served: Served) -> float:
    """Max |engine - transformers| logprob over the sampled tokens of PROMPTS."""
    result = generate(llm, updater)
    return check_logprobs(served.reference(), result.samples, logprobs_mode="processed_logprobs", temperature=1.0)


def apply(updater: Any, served: Served, label: str, update: tuple[data_pb2.WeightUpdateHeader, bytes]) -> float:
    apply_ms = updater.apply(*update)
    print(f"\n{label}: v{update[0].policy_version} applied in {apply_ms:.1f} ms, payload {len(update[1])} bytes")
    return apply_ms


def make_adapter(served: Served, out_dir: Path, seed: int, rank: int = MAX_LORA_RANK) -> Path:
    """A peft LoRA adapter on the served weights with non-zero A and B matrices, saved as peft saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0, init_lora_weights=False
    )
    peft_model = get_peft_model(served.model(), config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.2)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def adamw_step(served: Served, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """The weights after one AdamW step of next-token loss on a few random tokens."""
    model = served.model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    input_ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    state = model.state_dict()
    return {name: state[name].detach().clone() for name in served.weights}


# ---- the three kinds of update ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_base_weights_are_served_first(llm: Any, updater: Any, served: Served) -> None:
    if updater.policy_version != 0:
        pytest.skip("the engine has moved past the base weights")
    assert updater.lora_request() is None and updater.kind == "full"
    assert updater.weight_digest() == weights_digest(served.weights)
    assert served_diff(llm, updater, served) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.vllm
def test_full_update_serves_the_new_weights(llm: Any, updater: Any, served: Served) -> None:
    before = generate(llm, updater)
    version = updater.policy_version + 1
    new = perturbed(served.weights, seed=version)
    apply(updater, served, "full", full_update(new, version))
    served.weights, served.adapter_dir = new, None

    assert updater.policy_version == version and updater.lora_request() is None
    diff = served_diff(llm, updater, served)
    print(f"full: max |vLLM - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE
    after = generate(llm, updater)
    changed = any(a.completion_token_ids != b.completion_token_ids for a, b in zip(after.samples, before.samples))
    assert (
        changed
        or max_abs_diff([s.completion_logprobs for s in after.samples], [s.completion_logprobs for s in before.samples])
        > 1e-3
    )
    assert updater.weight_digest() == weights_digest(new)


@pytest.mark.slow
@pytest.mark.vllm
def test_delta_update_after_an_adamw_step(llm: Any, updater: Any, served: Served) -> None:
    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    base_version = updater.policy_version
    new = adamw_step(served, lr=1e-5, seed=base_version)
    header, payload = delta_update(new, served.weights, base_version + 1, base_version)
    full_bytes = len(encode_tensors(new)[0])
    print(
        f"\ndelta after AdamW lr=1e-5: {len(payload)} / {full_bytes} bytes = {len(payload) / full_bytes:.3f} "
        f"of a full update ({len(header.tensors)}/{len(new)} tensors changed)"
    )
    apply(updater, served, "delta", (header, payload))
    served.weights = new

    assert updater.policy_version == base_version + 1
    diff = served_diff(llm, updater, served)
    print(f"delta: max |vLLM - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE
    assert updater.weight_digest() == weights_digest(new)  # the worker's host copy is bit-exact


@pytest.mark.slow
@pytest.mark.vllm
def test_sparse_deltas_in_each_form(llm: Any, updater: Any, served: Served) -> None:
    """SPARSE deltas (a bf16 publisher's encoding; any dtype decodes): an AdamW step moves every fp32 element
    (whole tensors), then a few rows of one matrix (positions as gaps), a third of a norm (a mask) and a bias."""
    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    q_proj, norm = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    bias = "model.layers.1.self_attn.v_proj.bias"

    def edited(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        new = {k: v.clone() for k, v in weights.items()}
        new[q_proj][[3, 70, 101]] += 0.05
        new[norm][::3] += 0.1
        new[bias] += 0.05
        return new

    for label, make in (
        ("sparse delta, whole tensors", lambda _: adamw_step(served, lr=1e-5, seed=0)),
        ("sparse delta, gaps and mask", edited),
    ):
        base_version = updater.policy_version
        new = make(served.weights)
        header, payload = delta_update(
            new, served.weights, base_version + 1, base_version, encoding=data_pb2.DELTA_ENCODING_SPARSE
        )
        if make is edited:
            assert {spec.name for spec in header.tensors} == {
                q_proj + "#gaps",
                q_proj + "#values",
                norm + "#mask",
                norm + "#values",
                bias + "#values",
            }
        apply(updater, served, label, (header, payload))
        served.weights = new
        assert updater.policy_version == base_version + 1
        assert served_diff(llm, updater, served) <= TOLERANCE
        assert updater.weight_digest() == weights_digest(new)  # the worker's host copy is bit-exact


@pytest.mark.slow
@pytest.mark.vllm
def test_two_partial_deltas_then_a_full_update(llm: Any, updater: Any, served: Served) -> None:
    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    # Only q_proj of layer 1 (vLLM fuses q, k and v into one layer: the worker must reload all three), then a
    # norm and one half of the fused gate-up layer.
    for names in (
        ["model.layers.1.self_attn.q_proj.weight"],
        ["model.norm.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.bias"],
    ):
        base_version = updater.policy_version
        new = perturbed(served.weights, seed=100 + base_version, scale=0.05, names=names)
        header, payload = delta_update(new, served.weights, base_version + 1, base_version)
        assert sorted(spec.name for spec in header.tensors) == sorted(names)
        apply(updater, served, "delta", (header, payload))
        served.weights = new
        assert updater.policy_version == base_version + 1
        assert served_diff(llm, updater, served) <= TOLERANCE
    assert updater.weight_digest() == weights_digest(served.weights)

    version = updater.policy_version + 1
    new = perturbed(served.weights, seed=version)
    apply(updater, served, "full", full_update(new, version))
    served.weights = new
    assert updater.policy_version == version
    assert served_diff(llm, updater, served) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.vllm
def test_lora_update_then_replacement_then_full(llm: Any, updater: Any, served: Served, tmp_path: Path) -> None:
    base_weights = served.weights
    version = updater.policy_version + 1
    adapter = make_adapter(served, tmp_path / "adapter-1", seed=1)
    apply(updater, served, "lora", lora_update(adapter, version))
    served.adapter_dir = adapter
    first = updater.lora_request()
    assert updater.policy_version == version and updater.kind == "lora"
    assert first is not None and first.lora_name == "tiny-policy"
    diff = served_diff(llm, updater, served)
    print(f"lora: max |vLLM - peft| = {diff:.2e}")
    assert diff <= TOLERANCE
    without_adapter = check_logprobs(
        served.model(), generate(llm, updater).samples, logprobs_mode="processed_logprobs", temperature=1.0
    )
    assert without_adapter > 1e-2  # the adapter really changes the policy

    # The next version: a new int id (same name); the previous adapter is removed from the engine.
    adapter = make_adapter(served, tmp_path / "adapter-2", seed=2)
    apply(updater, served, "lora", lora_update(adapter, version + 1))
    served.adapter_dir = adapter
    second = updater.lora_request()
    assert second.lora_int_id != first.lora_int_id and second.lora_path != first.lora_path
    assert llm.llm_engine.list_loras() == {second.lora_int_id}
    assert served_diff(llm, updater, served) <= TOLERANCE

    # A delta needs full weights: refused while an adapter is served.
    from primerl.inference.update_checks import UpdateRefused

    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(*delta_update(perturbed(base_weights, seed=7), base_weights, version + 2, version + 1))
    assert excinfo.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER

    # A full update replaces the adapter.
    new = perturbed(base_weights, seed=version + 2)
    apply(updater, served, "full", full_update(new, version + 2))
    served.weights, served.adapter_dir = new, None
    assert updater.lora_request() is None and updater.kind == "full"
    assert llm.llm_engine.list_loras() == set()
    assert served_diff(llm, updater, served) <= TOLERANCE


# ---- the daemon's path: loaded while it arrives, switched to in apply ----------------------------------------------


def receive_chunks(
    updater: Any,
    header: data_pb2.WeightUpdateHeader,
    payload: bytes,
    *,
    chunk_bytes: int = 1 << 16,
    stop_at: int | None = None,
) -> memoryview:
    """What the weight subscriber does: the payload written chunk by chunk into the updater's buffer, each chunk
    announced (``stop_at``: the transfer stops there and is dropped)."""
    view = updater.begin_payload(header, len(payload))
    end = len(payload) if stop_at is None else stop_at
    for start in range(0, end, chunk_bytes):
        stop = min(start + chunk_bytes, end)
        view[start:stop] = payload[start:stop]
        updater.payload_progress(stop)
    updater.end_payload(stop_at is None)
    return view


@pytest.mark.slow
@pytest.mark.vllm
def test_a_full_update_is_loaded_as_it_arrives_and_served_only_once_applied(
    llm: Any, updater: Any, served: Served
) -> None:
    """The worker loads a FULL update beside the served weights while its chunks arrive (a staged load): the engine
    serves the previous weights until `apply` switches; an update dropped midway, or whose digest does not match
    (the broker forwards chunks before checking it), changes nothing."""
    from primerl.inference.update_checks import UpdateRefused

    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    before = generate(llm, updater)
    digest_before = updater.weight_digest()
    version = updater.policy_version + 1
    new = perturbed(served.weights, seed=100 + version)
    header, payload = full_update(new, version)

    receive_chunks(updater, header, payload, stop_at=len(payload) // 2)  # the trainer died midway
    view = receive_chunks(updater, header, payload)
    with pytest.raises(UpdateRefused) as excinfo:
        updater.preload(header, view, payload_digest=sha256(payload + b"x"))  # what the subscriber computed
    assert excinfo.value.code == common_pb2.ERROR_CODE_BAD_DIGEST
    assert updater.policy_version == version - 1 and updater.weight_digest() == digest_before

    view = receive_chunks(updater, header, payload)
    updater.preload(header, view, payload_digest=sha256(payload))
    assert updater.reload_in_place_reason is None  # staged, not reloaded in place
    during = generate(llm, updater)  # loaded, not switched to: the previous weights still serve
    assert [s.completion_token_ids for s in during.samples] == [s.completion_token_ids for s in before.samples]
    assert (
        max_abs_diff([s.completion_logprobs for s in during.samples], [s.completion_logprobs for s in before.samples])
        == 0.0
    )
    apply_ms = updater.apply(header, view)
    print(
        f"\nstaged full: v{version} switched in {updater.last_phases_ms['engine']:.1f} ms "
        f"({apply_ms:.1f} ms with checks and load; phases {updater.last_phases_ms})"
    )
    served.weights = new
    assert updater.policy_version == version
    assert served_diff(llm, updater, served) <= TOLERANCE
    assert updater.weight_digest() == weights_digest(new)
    # The host copy now views the file this update came in: the next one goes to the other file, and a delta
    # decodes against the viewed copy.
    base_version = updater.policy_version
    newer = adamw_step(served, lr=1e-5, seed=base_version)
    header, payload = delta_update(newer, served.weights, base_version + 1, base_version)
    updater.apply(header, receive_chunks(updater, header, payload))
    served.weights = newer
    assert served_diff(llm, updater, served) <= TOLERANCE
    assert updater.weight_digest() == weights_digest(newer)


@pytest.mark.slow
@pytest.mark.vllm
def test_generation_beside_a_staged_load_is_served_by_the_previous_weights(
    llm: Any, updater: Any, served: Served
) -> None:
    """The staged load runs on its own thread in the engine's process while the engine generates: what is generated
    meanwhile comes from the previous weights, bit for bit."""
    import threading

    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    before = generate(llm, updater)
    version = updater.policy_version + 1
    new = perturbed(served.weights, seed=200 + version)
    header, payload = full_update(new, version)
    view = updater.begin_payload(header, len(payload))  # the worker's staged load starts here

    def arrive() -> None:  # the chunks trickle in while the engine generates
        step = max(1, len(payload) // 64)
        for start in range(0, len(payload), step):
            stop = min(start + step, len(payload))
            view[start:stop] = payload[start:stop]
            updater.payload_progress(stop)
            time.sleep(0.002)

    writer = threading.Thread(target=arrive)
    writer.start()
    during = [generate(llm, updater) for _ in range(3)]
    writer.join()
    updater.end_payload(True)
    for result in during:
        assert [s.completion_token_ids for s in result.samples] == [s.completion_token_ids for s in before.samples]
        assert (
            max_abs_diff(
                [s.completion_logprobs for s in result.samples], [s.completion_logprobs for s in before.samples]
            )
            == 0.0
        )
    updater.apply(header, view)
    served.weights = new
    assert served_diff(llm, updater, served) <= TOLERANCE


# ---- refusals ---------------------------------------------------------------------------------------------------


def _bad_digest(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    header, payload = full_update(perturbed(served.weights, seed=1), version + 1)
    header.digest = sha256(payload + b"x")
    return header, payload


def _unknown_tensor(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    return full_update(
        {**perturbed(served.weights, seed=2), "model.layers.7.mlp.gate_proj.weight": torch.zeros(4)}, version + 1
    )


def _missing_tensor(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    weights = perturbed(served.weights, seed=3)
    del weights["model.norm.weight"]
    return full_update(weights, version + 1)


def _wrong_shape(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    weights = perturbed(served.weights, seed=4)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:-64].clone()
    return full_update(weights, version + 1)


def _older_version(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    return full_update(perturbed(served.weights, seed=5), version)


def _delta_on_wrong_base(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    return delta_update(perturbed(served.weights, seed=6), served.weights, version + 2, version + 1)


def _delta_wrong_shape(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    header, payload = delta_update(perturbed(served.weights, seed=7), served.weights, version + 1, version)
    header.decoded_tensors[0].shape[0] += 1
    return header, payload


def _corrupt_delta(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    """Header and payload agree, the digest is right, but the compressed data is not the tensor's delta: only
    the worker, decoding against its host copy, can tell."""
    from safetensors.torch import save

    name = "model.layers.0.mlp.down_proj.weight"
    stream = zlib.compress(bytes(served.weights[name].numel() * 4 - 8))
    payload = save({name: torch.frombuffer(bytearray(stream), dtype=torch.uint8)})
    decoded = [
        common_pb2.TensorSpec(
            name=name, dtype=torch_dtype_name(served.weights[name].dtype), shape=list(served.weights[name].shape)
        )
    ]
    return data_pb2.WeightUpdateHeader(
        policy_version=version + 1,
        kind=DELTA,
        base_version=version,
        digest=sha256(payload),
        tensors=specs_of(parse_header(payload)),
        decoded_tensors=decoded,
        delta_encoding=data_pb2.DELTA_ENCODING_XOR_ZLIB,
    ), payload


def _lora_rank_too_large(served: Served, version: int, tmp_path: Path) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    return lora_update(make_adapter(served, tmp_path / "big-adapter", seed=3, rank=2 * MAX_LORA_RANK), version + 1)


def _lora_unknown_module(served: Served, version: int, tmp_path: Path) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    header, payload = lora_update(make_adapter(served, tmp_path / "adapter", seed=4), version + 1)
    renamed = payload.replace(b"layers.1.self_attn.q_proj.lora_A", b"layers.1.self_attn.x_proj.lora_A")
    header.digest = sha256(renamed)
    del header.tensors[:]
    header.tensors.extend(specs_of(parse_header(renamed)))
    return header, renamed


BAD_UPDATES: dict[str, tuple[Callable[..., tuple[data_pb2.WeightUpdateHeader, bytes]], int]] = {
    "bad_digest": (_bad_digest, common_pb2.ERROR_CODE_BAD_DIGEST),
    "unknown_tensor": (_unknown_tensor, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    "missing_tensor": (_missing_tensor, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    "wrong_shape": (_wrong_shape, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    "older_version": (_older_version, common_pb2.ERROR_CODE_OUT_OF_ORDER),
    "delta_on_wrong_base": (_delta_on_wrong_base, common_pb2.ERROR_CODE_OUT_OF_ORDER),
    "delta_wrong_shape": (_delta_wrong_shape, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    "corrupt_delta": (_corrupt_delta, common_pb2.ERROR_CODE_MALFORMED_HEADER),
    "lora_rank_too_large": (_lora_rank_too_large, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    "lora_unknown_module": (_lora_unknown_module, common_pb2.ERROR_CODE_TENSOR_MISMATCH),
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_bad_update_is_refused_and_the_previous_policy_still_served(
    llm: Any,
    updater: Any,
    served: Served,
    case: str,
    tmp_path: Path,
) -> None:
    from primerl.inference.update_checks import UpdateRefused

    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    make, code = BAD_UPDATES[case]
    version = updater.policy_version
    update = make(served, version, tmp_path) if case.startswith("lora") else make(served, version)
    before = generate(llm, updater)
    digest_before = updater.weight_digest()

    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(*update)
    print(f"\n{case}: {excinfo.value}")
    assert excinfo.value.code == code, str(excinfo.value)
    assert updater.policy_version == version and updater.lora_request() is None
    assert updater.weight_digest() == digest_before
    after = generate(llm, updater)
    assert [s.completion_token_ids for s in after.samples] == [s.completion_token_ids for s in before.samples]
    assert (
        max_abs_diff([s.completion_logprobs for s in after.samples], [s.completion_logprobs for s in before.samples])
        == 0.0
    )
    assert served_diff(llm, updater, served) <= TOLERANCE
    assert not list((updater.work_dir / "adapters").glob(f"v{version + 1:08d}-*"))  # no adapter left behind


@pytest.mark.slow
@pytest.mark.vllm
def test_worker_checks_a_full_update_before_touching_the_model(llm: Any, updater: Any, served: Served) -> None:
    """The worker extension refuses on its own too (its callers are not all the updater)."""
    digest_before = updater.weight_digest()
    weights = copy.copy(served.weights)
    weights["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    payload, _ = encode_tensors(weights)
    with pytest.raises(ValueError, match="o_proj") as excinfo:
        llm.collective_rpc("primerl_load_full", args=(payload,))
    assert str(excinfo.value).startswith(f"{REFUSAL_PREFIX}ERROR_CODE_TENSOR_MISMATCH]")
    assert updater.weight_digest() == digest_before
    assert served_diff(llm, updater, served) <= TOLERANCE

"""In-flight weight updates on a real vLLM engine (the tiny model): after each FULL, LORA and DELTA update the
served logprobs match a transformers forward pass with the same new weights, and bad updates are refused with the
right code while the engine keeps serving the previous policy. One in-process engine serves the slow tests;
they move its policy version forward, and each starts from whatever the engine serves. Two fast tests drive the
updater's checks and adapter bookkeeping against a fake engine."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from primerl.inference.engine import EngineOptions
from primerl.inference.logprob_check import (
    GenerationResult,
    check_logprobs,
    generate_with_logprobs,
    load_reference_model,
    max_abs_diff,
)
from primerl.inference.worker_extension import REFUSAL_PREFIX, WORKER_EXTENSION_CLS, weights_digest
from primerl.proto.tensor_frames import encode_tensors, parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_delta import encode_delta, torch_dtype_name

# vLLM's own import-time deprecation noise (torch.distributed.reduce_op), not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

TOLERANCE = 1e-4
PROMPTS = ["Reverse the string: a b c d", "What is 12 plus 30?", "hello", "Count from 1 to 5."]
MAX_TOKENS = 12
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LORA_RANK = 8

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
LORA = data_pb2.WEIGHT_UPDATE_KIND_LORA
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA


# ---- building updates -------------------------------------------------------------------------------------------


def sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def full_update(weights: dict[str, torch.Tensor], version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs = encode_tensors(weights)
    return data_pb2.WeightUpdateHeader(policy_version=version, kind=FULL, digest=sha256(payload), tensors=specs,
                                       payload_bytes=len(payload)), payload


def delta_update(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], version: int,
                 base_version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs, decoded = encode_delta(new, base)
    return data_pb2.WeightUpdateHeader(
        policy_version=version, kind=DELTA, base_version=base_version, digest=sha256(payload), tensors=specs,
        decoded_tensors=decoded, delta_encoding=data_pb2.DELTA_ENCODING_XOR_ZLIB, payload_bytes=len(payload),
    ), payload


def lora_update(adapter_dir: Path, version: int, policy_name: str = "tiny-policy",
                ) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload = (adapter_dir / "adapter_model.safetensors").read_bytes()
    return data_pb2.WeightUpdateHeader(
        policy_version=version, kind=LORA, digest=sha256(payload), tensors=specs_of(parse_header(payload)),
        adapter_config_json=(adapter_dir / "adapter_config.json").read_text(), policy_name=policy_name,
        payload_bytes=len(payload),
    ), payload


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.02,
              names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """`weights` with seeded Gaussian noise added to `names` (all by default)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: (t + scale * torch.randn(t.shape, generator=generator)) if names is None or name in names
            else t.clone() for name, t in weights.items()}


# ---- fast: the updater's own logic against a fake engine ----------------------------------------------------------


class FakeEngine:
    """`EngineOps` that records calls; the worker methods answer like the real extension would."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.manifest = {name: (torch_dtype_name(t.dtype), list(t.shape)) for name, t in weights.items()}
        self.calls: list[tuple[str, Any]] = []
        self.loras: dict[int, Any] = {}
        self.fail_add_lora = False

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append((method, len(args)))
        if method == "primerl_weight_manifest":
            return [self.manifest]
        if method in ("primerl_apply_delta", "primerl_apply_delta_file"):
            # what vLLM's multiprocess executor raises for a worker's WeightUpdateInvalid
            raise Exception("Call to collective_rpc method failed: Worker failed with error '[primerl:"
                            "ERROR_CODE_MALFORMED_HEADER] delta: corrupt', please check the stack trace above")
        return [{"apply_ms": 1.0}]

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", 0))

    def add_lora(self, lora_request: Any) -> bool:
        if self.fail_add_lora:
            raise ValueError("cannot load adapter")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None


def tiny_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=generator),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=generator),
            "model.norm.weight": torch.ones(4)}


def fake_adapter(version: int, rank: int = 2) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    from safetensors.torch import save

    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    payload = save({f"{prefix}.lora_A.weight": torch.ones(rank, 4), f"{prefix}.lora_B.weight": torch.ones(8, rank)})
    return data_pb2.WeightUpdateHeader(
        policy_version=version, kind=LORA, digest=sha256(payload), tensors=specs_of(parse_header(payload)),
        adapter_config_json=json.dumps({"r": rank, "lora_alpha": rank, "target_modules": ["q_proj"]}),
    ), payload


def test_updater_checks_without_an_engine(tmp_path: Path) -> None:
    from primerl.inference.policy_updates import PolicyUpdater, UpdateRefused

    weights = tiny_weights()
    engine = FakeEngine(weights)
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4)
    assert updater.apply(*full_update(weights, 3)) > 0
    assert updater.policy_version == 3
    # The payload reaches the worker through the shared payload file: only its path crosses the RPC.
    assert [call for call, _ in engine.calls] == ["primerl_weight_manifest", "primerl_load_full_file",
                                                 "reset_prefix_cache"]
    assert set(updater.last_phases_ms) == {"check", "stage", "engine", "reset_cache"}

    header, payload = full_update(weights, 4)
    for mutate, code in [
        (lambda h: setattr(h, "digest", "00" * 32), common_pb2.ERROR_CODE_BAD_DIGEST),
        (lambda h: setattr(h, "payload_bytes", 12), common_pb2.ERROR_CODE_TRUNCATED),
        (lambda h: setattr(h, "policy_version", 3), common_pb2.ERROR_CODE_OUT_OF_ORDER),
        (lambda h: setattr(h, "kind", data_pb2.WEIGHT_UPDATE_KIND_UNSPECIFIED), common_pb2.ERROR_CODE_MALFORMED_HEADER),
        (lambda h: h.tensors[0].shape.append(1), common_pb2.ERROR_CODE_TENSOR_MISMATCH),
    ]:
        bad = data_pb2.WeightUpdateHeader()
        bad.CopyFrom(header)
        mutate(bad)
        with pytest.raises(UpdateRefused) as excinfo:
            updater.apply(bad, payload)
        assert excinfo.value.code == code, excinfo.value
    updater.apply(*full_update(weights, 4))
    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(*delta_update(perturbed(weights, seed=1), weights, 6, 3))
    assert excinfo.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and "v4 is served" in excinfo.value.message
    # A refusal raised inside the worker comes back as text in multiprocess mode and keeps its code.
    with pytest.raises(UpdateRefused) as excinfo:
        updater.apply(*delta_update(perturbed(weights, seed=1), weights, 5, 4))
    assert excinfo.value.code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    assert excinfo.value.message == "delta: corrupt"
    assert updater.policy_version == 4


def test_updater_follows_lineages_without_an_engine(tmp_path: Path) -> None:
    """A FULL of a newer lineage is applied even at (or below) the served version (a rollback); an older
    lineage's update and a delta across lineages are refused; `wants` says the same before any payload check."""
    from primerl.inference.policy_updates import PolicyUpdater, UpdateRefused

    weights = tiny_weights()
    updater = PolicyUpdater(FakeEngine(weights), tmp_path, max_lora_rank=4)

    def with_lineage(update, lineage, base=0):
        update[0].lineage, update[0].lineage_base_version = lineage, base
        return update

    updater.apply(*with_lineage(full_update(weights, 3), 10))
    assert (updater.policy_version, updater.lineage) == (3, 10)
    same_version = with_lineage(full_update(perturbed(weights, seed=2), 3), 10)
    assert not updater.wants(same_version[0])  # a resend of the served version, same lineage
    rollback = with_lineage(full_update(perturbed(weights, seed=3), 3), 20, base=2)
    assert updater.wants(rollback[0])
    updater.apply(*rollback)
    assert (updater.policy_version, updater.lineage, updater.lineage_base_version) == (3, 20, 2)
    further_back = with_lineage(full_update(weights, 2), 30, base=1)  # resumed from checkpoint 1: v2 again
    updater.apply(*further_back)
    assert (updater.policy_version, updater.lineage) == (2, 30)
    for update, text in [
        (with_lineage(full_update(weights, 9), 20), "older than the served"),
        (with_lineage(delta_update(perturbed(weights, seed=4), weights, 3, 2), 40), "new lineage starts with a FULL"),
    ]:
        assert not updater.wants(update[0])
        with pytest.raises(UpdateRefused) as excinfo:
            updater.apply(*update)
        assert excinfo.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and text in excinfo.value.message
    assert (updater.policy_version, updater.lineage) == (2, 30)


def test_updater_swaps_lora_adapters_under_new_ids(tmp_path: Path) -> None:
    from primerl.inference.policy_updates import PolicyUpdater, UpdateRefused

    engine = FakeEngine(tiny_weights())
    updater = PolicyUpdater(engine, tmp_path, max_lora_rank=4, policy_name="served")
    requests = []
    for version in (1, 2, 3):
        updater.apply(*fake_adapter(version))
        requests.append(updater.lora_request())
        assert set(engine.loras) == {requests[-1].lora_int_id}  # the previous id was removed
        assert (Path(requests[-1].lora_path) / "adapter_config.json").is_file()
    assert len({r.lora_int_id for r in requests}) == 3 and {r.lora_name for r in requests} == {"served"}
    # The previous adapter's files stay (requests in flight may reload them), older ones go.
    assert [Path(r.lora_path).is_dir() for r in requests] == [False, True, True]

    engine.fail_add_lora = True
    with pytest.raises(UpdateRefused, match="could not load the adapter"):
        updater.apply(*fake_adapter(4))
    assert updater.lora_request() == requests[-1] and updater.policy_version == 3
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [Path(r.lora_path).name for r in requests[1:]]
    engine.fail_add_lora = False
    with pytest.raises(UpdateRefused, match="rank 8 exceeds"):
        updater.apply(*fake_adapter(4, rank=8))
    without_lora = PolicyUpdater(FakeEngine(tiny_weights()), tmp_path / "other", max_lora_rank=None)
    with pytest.raises(UpdateRefused, match="without LoRA"):
        without_lora.apply(*fake_adapter(1))

    updater.apply(*full_update(tiny_weights(), 4))
    assert updater.lora_request() is None and engine.loras == {}


# ---- slow: one real engine ---------------------------------------------------------------------------------------

# ---- fixtures ---------------------------------------------------------------------------------------------------


@dataclass
class Served:
    """What the engine should be serving: the full weights, and the peft adapter on top when one is served."""

    model_dir: Path
    weights: dict[str, torch.Tensor]
    adapter_dir: Path | None = None
    apply_ms: dict[str, list[float]] = field(default_factory=dict)

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
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("updates") / "tiny-model", TinyModelSpec(seed=0))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[Any]:
    from primerl.inference.engine import create_llm, shutdown_llm

    saved_env, saved_tempdir = dict(os.environ), tempfile.tempdir
    llm = create_llm(EngineOptions(model=model_dir, in_process=True, work_dir=model_dir.parent / "work", seed=0,
                                   enable_lora=True, max_lora_rank=MAX_LORA_RANK,
                                   worker_extension_cls=WORKER_EXTENSION_CLS))
    try:
        yield llm
    finally:
        shutdown_llm(llm)
        del llm
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = saved_tempdir


@pytest.fixture(scope="module")
def updater(llm: Any, model_dir: Path) -> Any:
    from primerl.inference.policy_updates import PolicyUpdater

    updater = PolicyUpdater.for_llm(llm, model_dir.parent / "policy")
    updater.prepare()
    return updater


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Served:
    from safetensors.torch import load_file

    return Served(model_dir=model_dir, weights=load_file(str(model_dir / "model.safetensors")))


def generate(llm: Any, updater: Any) -> GenerationResult:
    return generate_with_logprobs(llm, PROMPTS, max_tokens=MAX_TOKENS, seed=0, temperature=1.0, ignore_eos=True,
                                  lora_request=updater.lora_request())


def served_diff(llm: Any, updater: Any, served: Served) -> float:
    """Max |engine - transformers| logprob over the sampled tokens of PROMPTS."""
    result = generate(llm, updater)
    return check_logprobs(served.reference(), result.samples, logprobs_mode="processed_logprobs", temperature=1.0)


def apply(updater: Any, served: Served, label: str, update: tuple[data_pb2.WeightUpdateHeader, bytes]) -> float:
    apply_ms = updater.apply(*update)
    served.apply_ms.setdefault(label, []).append(apply_ms)
    print(f"\n{label}: v{update[0].policy_version} applied in {apply_ms:.1f} ms, payload {len(update[1])} bytes")
    return apply_ms


def make_adapter(served: Served, out_dir: Path, seed: int, rank: int = MAX_LORA_RANK) -> Path:
    """A peft LoRA adapter on the served weights with non-zero A and B matrices, saved as peft saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0,
                        init_lora_weights=False)
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
    assert changed or max_abs_diff([s.completion_logprobs for s in after.samples],
                                   [s.completion_logprobs for s in before.samples]) > 1e-3
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
    print(f"\ndelta after AdamW lr=1e-5: {len(payload)} / {full_bytes} bytes = {len(payload) / full_bytes:.3f} "
          f"of a full update ({len(header.tensors)}/{len(new)} tensors changed)")
    apply(updater, served, "delta", (header, payload))
    served.weights = new

    assert updater.policy_version == base_version + 1
    diff = served_diff(llm, updater, served)
    print(f"delta: max |vLLM - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE
    assert updater.weight_digest() == weights_digest(new)  # the worker's host copy is bit-exact


@pytest.mark.slow
@pytest.mark.vllm
def test_two_partial_deltas_then_a_full_update(llm: Any, updater: Any, served: Served) -> None:
    if updater.lora_request() is not None:
        apply(updater, served, "full", full_update(served.weights, updater.policy_version + 1))
        served.adapter_dir = None
    # Only q_proj of layer 1 (vLLM fuses q, k and v into one layer: the worker must reload all three), then a
    # norm and one half of the fused gate-up layer.
    for names in (["model.layers.1.self_attn.q_proj.weight"],
                  ["model.norm.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.bias"]):
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
    without_adapter = check_logprobs(served.model(), generate(llm, updater).samples,
                                     logprobs_mode="processed_logprobs", temperature=1.0)
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
    from primerl.inference.policy_updates import UpdateRefused

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


# ---- refusals ---------------------------------------------------------------------------------------------------


def _bad_digest(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    header, payload = full_update(perturbed(served.weights, seed=1), version + 1)
    header.digest = sha256(payload + b"x")
    return header, payload


def _unknown_tensor(served: Served, version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    return full_update({**perturbed(served.weights, seed=2), "model.layers.7.mlp.gate_proj.weight": torch.zeros(4)},
                       version + 1)


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
    decoded = [common_pb2.TensorSpec(name=name, dtype=torch_dtype_name(served.weights[name].dtype),
                                     shape=list(served.weights[name].shape))]
    return data_pb2.WeightUpdateHeader(
        policy_version=version + 1, kind=DELTA, base_version=version, digest=sha256(payload),
        tensors=specs_of(parse_header(payload)), decoded_tensors=decoded,
        delta_encoding=data_pb2.DELTA_ENCODING_XOR_ZLIB), payload


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
    llm: Any, updater: Any, served: Served, case: str, tmp_path: Path,
) -> None:
    from primerl.inference.policy_updates import UpdateRefused

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
    assert max_abs_diff([s.completion_logprobs for s in after.samples],
                        [s.completion_logprobs for s in before.samples]) == 0.0
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


@pytest.mark.slow
@pytest.mark.vllm
def test_apply_times(served: Served) -> None:
    """Not a check: prints what the updates above cost on this machine."""
    for label, times in sorted(served.apply_ms.items()):
        print(f"\n{label}: {len(times)} updates, median {sorted(times)[len(times) // 2]:.1f} ms, "
              f"max {max(times):.1f} ms")

"""The tiny MoE model (`primerl init-tiny-model --moe`, a Qwen3-MoE) on a real vLLM engine: served logprobs match a
transformers float32 pass of the checkpoint, and after in-flight FULL and DELTA updates they match a float32 pass
of the new weights (the worker re-processes the reloaded MoE layers and reloads all experts of a layer together).
Which layers the worker packs or loads after vLLM's reload is checked on stand-in layers (fast).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import engine_for_test
from support.policy_updates import delta_update, full_update, perturbed

from primerl.inference.engine import EngineOptions
from primerl.inference.logprob_check import check_logprobs, generate_with_logprobs, load_reference_model
from primerl.inference.weight_tensors import REFUSAL_PREFIX, WeightUpdateInvalid, weights_digest
from primerl.inference.worker_extension import (
    WORKER_EXTENSION_CLS,
    _load_groups,
    _observed_moe_processing,
    _repack_cpu_moe_layers,
    check_cpu_moe_reload,
)
from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

MOE_SPEC = TinyModelSpec(seed=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
TOLERANCE = 1e-3
PROMPTS = ["Reverse the string: a b c d", "What is 12 plus 30?", "hello", "Count from 1 to 5."]
MAX_TOKENS = 12


def test_expert_weights_load_with_every_expert_of_their_layer() -> None:
    names = [
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        for layer in (0, 1)
        for e in range(3)
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]
    names += [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    groups = _load_groups(names)
    layer0 = {n for n in names if n.startswith("model.layers.0.mlp.experts.")}
    assert set(groups["model.layers.0.mlp.experts.2.down_proj.weight"]) == layer0
    assert len(layer0) == 9
    assert not any(".layers.1." in n for n in groups["model.layers.0.mlp.experts.0.up_proj.weight"])
    assert groups["model.layers.0.mlp.gate.weight"] == ["model.layers.0.mlp.gate.weight"]  # the router: its own layer
    assert len(groups["model.layers.0.self_attn.k_proj.weight"]) == 3


class _Experts:  # stands for vLLM's CPU experts: packing is `process_weights_after_loading`
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packs += 1


class _MoEMethod:  # stands for vLLM's unquantized MoE method, its kernel built at first load
    def __init__(self) -> None:
        self.moe_kernel = type("Kernel", (), {"fused_experts": _Experts()})()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.processed += 1


class _MoELayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(2, 2))
        self.quant_method, self.packs, self.processed = _MoEMethod(), 0, 0


class _MoEModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"experts": _MoELayer()}) for _ in range(4)])
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.loaded += [name for name, _ in weights]


def test_after_a_reload_only_the_moe_layers_vllm_left_unpacked_are_packed_and_unloaded_ones_are_loaded() -> None:
    """Layer 0: the reload processed it without packing (Qwen3-MoE) -> packed here. Layer 1: the reload packed it
    -> left alone. Layer 2: the reload did not process it (gpt-oss's direct copies) -> loaded, then packed. Layer 3:
    not in the (partial) update -> left alone."""
    model = _MoEModel()
    layers = [block["experts"] for block in model.layers]
    sent = {f"layers.{i}.experts.gate_up_proj": torch.ones(1) for i in range(3)}
    original = _MoEMethod.process_weights_after_loading
    with _observed_moe_processing(model) as (processed, packed):
        for layer in layers[:2]:  # what vLLM's reload does to the layers it loads
            layer.quant_method.process_weights_after_loading(layer)
        layers[1].quant_method.moe_kernel.fused_experts.process_weights_after_loading(layers[1])
    assert _MoEMethod.process_weights_after_loading is original  # the classes are left as they were
    assert processed == {id(layers[0]), id(layers[1])} and packed == {id(layers[1])}
    assert _repack_cpu_moe_layers(model, sent, True, processed, packed) == 2
    assert [layer.packs for layer in layers] == [1, 1, 1, 0]
    assert model.loaded == ["layers.2.experts.gate_up_proj"]


def test_experts_vllm_cpu_cannot_reload_are_refused_before_the_engine_is_touched() -> None:
    def manifest(size: int) -> dict[str, tuple[str, list[int]]]:
        return {
            "model.layers.0.mlp.experts.0.down_proj.weight": ("F32", [128, size]),
            "model.layers.0.mlp.experts.0.up_proj.weight": ("F32", [size, 128]),
            "model.norm.weight": ("F32", [128]),
        }

    check_cpu_moe_reload(list(manifest(64)), manifest(64))
    check_cpu_moe_reload(["model.norm.weight"], manifest(48))  # no expert reloaded
    with pytest.raises(WeightUpdateInvalid, match="intermediate size 48 cannot be updated in flight") as info:
        check_cpu_moe_reload(list(manifest(48)), manifest(48))
    assert str(info.value).startswith(REFUSAL_PREFIX)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", MOE_SPEC)


@pytest.fixture(scope="module")
def llm(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    options = EngineOptions(
        model=moe_model,
        in_process=True,
        work_dir=tmp_path_factory.mktemp("work"),
        seed=0,
        worker_extension_cls=WORKER_EXTENSION_CLS,
    )
    with engine_for_test(options) as llm:
        yield llm


def reference_model(model_dir: Path, weights: dict[str, torch.Tensor], work: Path) -> Any:
    """transformers float32 model of `weights` (checkpoint names: per-expert tensors), loaded from a copy of
    the model directory as any checkpoint is (transformers fuses the experts on load)."""
    from safetensors.torch import save_file

    out = work / "reference"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model_dir, out)
    save_file(
        {n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return load_reference_model(out)


def served_diff(llm: Any, model_dir: Path, weights: dict[str, torch.Tensor], work: Path) -> float:
    result = generate_with_logprobs(llm, PROMPTS, max_tokens=MAX_TOKENS, seed=0, temperature=1.0, ignore_eos=True)
    return check_logprobs(
        reference_model(model_dir, weights, work), result.samples, logprobs_mode="processed_logprobs", temperature=1.0
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_generate_check_logprobs_passes_on_the_moe_model(
    llm: Any, moe_model: Path, capsys: pytest.CaptureFixture
) -> None:
    """`primerl generate DIR --check-logprobs` on the checkpoint's weights (before any update of this module)."""
    from primerl.cli import generate

    code = generate.main([str(moe_model), "--check-logprobs", "--num-prompts", "6", "--max-tokens", "16"], llm=llm)
    out = capsys.readouterr().out
    assert code == 0, out
    assert ": OK" in out and out.count("completion:") == 6
    print(out.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.vllm
def test_moe_served_logprobs_match_and_follow_full_and_delta_updates(llm: Any, moe_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from primerl.inference.policy_updates import PolicyUpdater

    updater = PolicyUpdater.for_llm(llm, tmp_path / "policy", staging_dir=tmp_path)  # its payload files too
    updater.prepare()
    base = load_file(str(moe_model / "model.safetensors"))
    assert any(".mlp.experts.7.down_proj.weight" in name for name in base)
    assert updater.weight_digest() == weights_digest(base)
    diffs = {"base": served_diff(llm, moe_model, base, tmp_path)}

    # FULL: every weight changed, experts and router included.
    full = perturbed(base, seed=1, scale=0.05)
    updater.apply(*full_update(full, 1))
    diffs["full"] = served_diff(llm, moe_model, full, tmp_path)

    # DELTA of a few tensors: one expert's up projection in layer 0 (the worker reloads all experts of that
    # layer from its host copy), layer 1's router and q projection. Layer 1's experts are untouched and must
    # not be re-packed.
    changed = [
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    delta = perturbed(full, seed=2, scale=0.05, names=changed)
    header, payload = delta_update(delta, full, 2, 1)
    assert sorted(spec.name for spec in header.tensors) == sorted(changed)
    updater.apply(header, payload)
    diffs["delta"] = served_diff(llm, moe_model, delta, tmp_path)

    # DELTA of everything (an optimizer step changes every tensor).
    everything = perturbed(delta, seed=3, scale=0.01)
    updater.apply(*delta_update(everything, delta, 3, 2))
    diffs["delta_all"] = served_diff(llm, moe_model, everything, tmp_path)
    print("\nMoE max |vLLM - transformers fp32| logprob: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert updater.weight_digest() == weights_digest(everything)
    assert all(diff <= TOLERANCE for diff in diffs.values()), diffs

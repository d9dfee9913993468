"""The trainer on the tiny MoE model (`primerl init-tiny-model --moe`, a Qwen3-MoE): the router load-balancing loss
is computed over exactly the packed tokens, added to the loss with the model's coefficient and reported as
``train/router_aux_loss`` (nothing for a dense model); full and LoRA training change the weights and publish them
under the checkpoint's names (every expert separately, as vLLM loads them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.trainer_runs import packed, samples

from primerl.configs.trainer import DefaultLossConfig, LoRAConfig, ModelConfig
from primerl.trainer.batch import MicroBatch, packed_token_logprobs, router_aux_loss_coef
from primerl.trainer.distributed import DistInfo
from primerl.trainer.hf_state_dict import hf_state_dict
from primerl.trainer.model import load_model
from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model, read_spec
from primerl.trainer.train_step import TrainStep, rl_objective

ONE_RANK = DistInfo(0, 1, 0, None)
MOE_SPEC = TinyModelSpec(
    seed=0,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe-train") / "model", MOE_SPEC)


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def micro_batch(step: int = 0, count: int = 4) -> MicroBatch:
    return MicroBatch.from_tensors(packed(samples(step)[:count]))


def step_once(model: torch.nn.Module, batch: MicroBatch, lr: float = 1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return TrainStep(model, optimizer, scheduler, rl_objective(DefaultLossConfig()), ONE_RANK, max_grad_norm=1.0).step(
        1, [batch]
    )


def test_init_tiny_model_moe_writes_a_qwen3_moe_with_the_dense_tokenizer(
    moe_dir: Path, small_tiny_model: Path, capsys
) -> None:
    from primerl.cli import tiny_model as cli

    config = json.loads((moe_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["output_router_logits"]
    assert config["moe_intermediate_size"] == 32 and config["num_experts_per_tok"] == 2
    assert read_spec(moe_dir) == MOE_SPEC
    assert (moe_dir / "tokenizer.json").read_bytes() == (small_tiny_model / "tokenizer.json").read_bytes()
    names = set(checkpoint(moe_dir))
    assert {
        f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")
    } <= names
    # The dense spec file is what it was before MoE fields existed.
    assert "num_experts" not in json.loads((small_tiny_model / "primerl_tiny_model.json").read_text())["spec"]

    assert cli.main([str(moe_dir.parent / "bad"), "--moe", "--expert-size", "48"]) == 2
    assert "must be a positive multiple of 32" in capsys.readouterr().err
    assert not (moe_dir.parent / "bad").exists()


def test_router_aux_loss_over_packed_samples_is_the_loss_of_their_tokens(moe_dir: Path) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_model(ModelConfig(name=str(moe_dir)))
    group = samples(0)[:4]
    router_aux: dict = {}
    packed_token_logprobs(model, MicroBatch.from_tensors(packed(group)), router_aux=router_aux)
    # The same tokens one sample at a time, each without padding: the router logits of every real token.
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(MOE_SPEC.num_layers)]
    with torch.no_grad():
        for sample in group:
            out = model(input_ids=torch.from_numpy(sample["input_ids"])[None], output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                per_layer[layer].append(logits)
    expected = load_balancing_loss_func(
        tuple(torch.cat(chunks) for chunks in per_layer), MOE_SPEC.num_experts, MOE_SPEC.num_experts_per_tok
    )
    assert router_aux["coef"] == pytest.approx(0.001)
    assert router_aux["loss"].requires_grad
    torch.testing.assert_close(router_aux["loss"].detach(), expected.to(router_aux["loss"].dtype), atol=1e-6, rtol=1e-5)


def test_full_training_adds_the_router_loss_and_reports_it(moe_dir: Path) -> None:
    batch = micro_batch()
    model = load_model(ModelConfig(name=str(moe_dir)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = step_once(model, batch)
    metrics = stats.as_metrics()
    assert metrics["train/router_aux_loss"] > 0 and torch.isfinite(torch.tensor(stats.loss))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.0.mlp.gate.weight",
    } <= changed

    # The loss holds coef x router loss: the same step with the coefficient set to 0 differs by exactly that.
    model0 = load_model(ModelConfig(name=str(moe_dir)))
    model0.config.router_aux_loss_coef = 0.0
    stats0 = step_once(model0, batch)
    assert stats.loss - stats0.loss == pytest.approx(0.001 * metrics["train/router_aux_loss"], rel=1e-3)
    assert stats0.metrics["router_aux_loss"] == pytest.approx(metrics["train/router_aux_loss"], rel=1e-5)

    # Published under the checkpoint's names and shapes (per expert), what the inference workers load.
    published = hf_state_dict(model)
    base = checkpoint(moe_dir)
    assert set(published) == set(base)
    assert all(published[n].shape == base[n].shape for n in base)
    assert not torch.equal(
        published["model.layers.0.mlp.experts.2.up_proj.weight"].float(),
        base["model.layers.0.mlp.experts.2.up_proj.weight"],
    )


def test_a_dense_model_reports_no_router_loss(small_tiny_model: Path) -> None:
    model = load_model(ModelConfig(name=str(small_tiny_model)))
    assert router_aux_loss_coef(model) is None
    stats = step_once(model, micro_batch())
    assert not any("router" in name for name in stats.as_metrics())


def test_lora_training_on_the_moe_model(moe_dir: Path) -> None:
    # The default targets name the dense MLP's projections; a Qwen3-MoE's experts are fused 3-D parameters.
    with pytest.raises(ValueError, match=r"gate_proj.*match no module.*remove the missing names.*fused 3-D"):
        load_model(ModelConfig(name=str(moe_dir), lora=LoRAConfig()))

    model = load_model(ModelConfig(name=str(moe_dir), lora=LoRAConfig(rank=4, alpha=8, target_modules=ATTENTION)))
    assert router_aux_loss_coef(model) == pytest.approx(0.001)  # through the peft wrapper
    stats = step_once(model, micro_batch())
    assert stats.as_metrics()["train/router_aux_loss"] > 0
    merged = hf_state_dict(model)
    base = checkpoint(moe_dir)
    assert set(merged) == set(base)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q_proj], base[q_proj])
    assert torch.equal(
        merged["model.layers.0.mlp.experts.1.down_proj.weight"], base["model.layers.0.mlp.experts.1.down_proj.weight"]
    )  # frozen base weights


def test_primerl_rl_refuses_lora_served_on_a_moe_model_on_vllm_cpu(moe_dir: Path, tmp_path: Path) -> None:
    from support.rl_configs import BASE, config_writer, error_of, load

    from primerl.configs.lora_support import is_moe_model, vllm_is_cpu_build

    assert is_moe_model(moe_dir)
    if not vllm_is_cpu_build():
        pytest.skip("vLLM's GPU build serves LoRA on MoE models")
    lora = '\n[trainer.model.lora]\nrank = 4\ntarget_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]\n'
    path = config_writer(tmp_path)("rl.toml", BASE + lora)
    error = error_of(path, "--model.name", str(moe_dir))
    assert "mixture-of-experts model and vLLM's CPU build cannot serve LoRA" in error
    assert "inference.enable_lora = false" in error and 'trainer.weight_broadcast.type = "full"' in error
    # The way out it names: LoRA trained, merged weights published.
    config = load(
        "@",
        str(path),
        "--model.name",
        str(moe_dir),
        "--inference.enable-lora",
        "false",
        "--trainer.weight-broadcast.type",
        "full",
    )
    assert config.trainer.model.lora is not None and not config.inference.enable_lora

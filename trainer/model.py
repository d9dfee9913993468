"""Load the model being trained: a transformers causal LM from a local directory, optionally with activation
checkpointing and a LoRA adapter (peft).

    model = load_model(config.model)            # train mode, fp32 or bf16 as `optimization_dtype` says
    optimizer = build_optimizer(model, config.optim)  # over trainable_parameters(model) only

No hub download is attempted: the model directory must exist (``HF_HUB_OFFLINE`` semantics), so a typo in
``model.name`` fails at once with the path, instead of after a network timeout.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from primerl.configs.trainer import ActivationCheckpointConfig, LoRAConfig, ModelConfig
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["AttnImplementation", "load_model", "trainable_parameters", "num_parameters", "is_peft_model"]

log = get_logger(__name__)

AttnImplementation = Literal["sdpa", "eager"]


def load_model(
    config: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    attn_implementation: AttnImplementation = "sdpa",
) -> torch.nn.Module:
    """The model of ``config``, in train mode on ``device``, in ``config.optimization_dtype``.

    - Activation checkpointing when ``config.ac`` is set (non-reentrant ``torch.utils.checkpoint``): every
      ``ac.freq``-th decoder layer, starting with the first.
    - LoRA when ``config.lora`` is set: a ``peft.PeftModel`` whose only trainable parameters are the adapter's.
      A target module the model does not have is a ``ValueError`` that names it and lists the ones it has.

    ``attn_implementation``: "sdpa" (default) or "eager"; both are deterministic on CPU (no atomics), so two
    identical forward passes give bit-identical logits.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = Path(config.name).expanduser()
    if not model_dir.is_dir():
        raise ValueError(
            f"model.name = {config.name!r} is not a local model directory; primerl loads models from disk only "
            "(no hub downloads): point it at a directory with config.json and *.safetensors, e.g. the one "
            "`primerl init-tiny-model DIR` builds"
        )
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f'attn_implementation must be "sdpa" or "eager", got {attn_implementation!r}')
    dtype = getattr(torch, config.optimization_dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    model.to(device)
    model.config.use_cache = False  # training never reuses a KV cache; building one costs memory
    if config.ac is not None:
        enable_activation_checkpointing(model, config.ac)
    if config.lora is not None:
        model = apply_lora(model, config.lora)
    model.train()
    log.info(
        "model loaded",
        model=str(model_dir),
        dtype=config.optimization_dtype,
        device=str(device),
        attn=attn_implementation,
        ac_freq=None if config.ac is None else config.ac.freq,
        lora_rank=None if config.lora is None else config.lora.rank,
        num_parameters=num_parameters(model),
        num_trainable=num_parameters(model, trainable_only=True),
    )
    return model


def enable_activation_checkpointing(model: torch.nn.Module, config: ActivationCheckpointConfig) -> None:
    """Checkpoint every ``config.freq``-th decoder layer (non-reentrant). When the installed transformers cannot
    skip layers, ``freq > 1`` falls back to every layer, with a warning."""
    enable = model.gradient_checkpointing_enable
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if "every_n_layers" in inspect.signature(enable).parameters:
        enable(every_n_layers=config.freq, **kwargs)
    else:
        if config.freq > 1:
            warnings.warn(
                f"ac.freq = {config.freq} has no effect with this transformers version (no `every_n_layers`): "
                "every decoder layer is checkpointed, as with freq = 1",
                stacklevel=2,
            )
        enable(**kwargs)


def apply_lora(model: torch.nn.Module, config: LoRAConfig) -> torch.nn.Module:
    """Wrap ``model`` in a peft LoRA adapter named "default"; only the adapter's parameters are trainable."""
    from peft import LoraConfig, TaskType, get_peft_model

    check_lora_targets(model, config.target_modules)
    lora_config = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        task_type=TaskType.CAUSAL_LM,
        bias="none",
    )
    return get_peft_model(model, lora_config)


def check_lora_targets(model: torch.nn.Module, target_modules: list[str]) -> None:
    """Raise ValueError naming every entry of ``target_modules`` that matches no module of ``model``.

    Matching is peft's for a list: a module matches when its full name equals the entry or ends with
    ``"." + entry``.
    """
    import torch

    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    )
    moe_hint = ""
    if getattr(getattr(model, "config", None), "router_aux_loss_coef", None) is not None:
        moe_hint = (
            " (a mixture-of-experts model keeps each layer's experts in fused 3-D parameters, not linear "
            'modules: adapt the attention, e.g. target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"])'
        )
    raise ValueError(
        f"lora.target_modules {missing} match no module of {type(model).__name__}; its linear modules are "
        f"{linear}: remove the missing names from [trainer.model.lora] target_modules{moe_hint}"
    )


def is_peft_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency of the trainer
        return False
    return isinstance(model, PeftModel)


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that requires a gradient, in ``named_parameters`` order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def num_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (tied parameters counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

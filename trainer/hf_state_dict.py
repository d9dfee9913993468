"""The trained model's tensors as Hugging Face and peft save them: one implementation for the weights the trainer
publishes to the inference workers (``primerl.trainer.publish``) and the ones it exports to disk
(``primerl.trainer.weights_export``), so that both are the same tensors, bit for bit.

- ``hf_state_dict``: what ``save_pretrained`` writes to ``model.safetensors``: Hugging Face names, tied weights
  once (no ``lm_head.weight`` with ``tie_word_embeddings``), ``_keys_to_ignore_on_save`` left out, transformers'
  load-time renamings reverted (transformers' own functions, as ``save_pretrained`` calls them).
- A peft LoRA model is the merged model: each adapted weight is W + scale * B @ A, computed aside (the training
  weights are never merged in place) and kept in the base weight's dtype, as peft's ``merge_and_unload`` leaves
  it (the delta is added in its own, wider dtype and the sum rounded once); no ``lora_*`` or ``base_layer`` names.
  ``hf_model_and_state`` gives that merged state before ``save_pretrained``'s steps, for ``save_pretrained``.
- ``lora_state_dict`` / ``lora_adapter_config_json``: the adapter alone, as peft's ``save_pretrained`` writes
  ``adapter_model.safetensors`` (training dtype) and ``adapter_config.json``.

DoRA, LoRA biases and peft ``modules_to_save`` are refused (``ValueError``): their merge is not implemented.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING

from primerl.trainer.model import is_peft_model

if TYPE_CHECKING:
    import torch

__all__ = ["SAFETENSORS_METADATA", "hf_model_and_state", "hf_state_dict", "lora_adapter_config_json", "lora_state_dict"]

SAFETENSORS_METADATA = {"format": "pt"}
"""The metadata transformers and peft write into their safetensors files."""
_LORA_KEY_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
"""Parts of a peft state-dict key that belong to the adapter, not to the base model."""


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` would write, under the names it would write them (views of the model's
    parameters where it can; merged weights for a peft LoRA model). Not copied: copy before the next step."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    hf_model, state = hf_model_and_state(model)
    for key in getattr(hf_model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, hf_model)
    return dict(revert_weight_conversion(hf_model, state))


def hf_model_and_state(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The Hugging Face model under ``model`` (the base model of a peft model) and its state dict, LoRA adapters
    merged (module docstring): what ``hf_model.save_pretrained(dir, state_dict=state)`` takes."""
    if not is_peft_model(model):
        return model, model.state_dict()
    hf_model = model.get_base_model()
    return hf_model, _merged_lora_state(hf_model)


def _merged_lora_state(hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict of a model with LoRA layers injected, with each adapted weight merged and peft's names
    (``.base_layer.``, ``lora_*``) removed: what ``merge_and_unload()`` would give, without touching the model."""
    import torch
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if not isinstance(module, LoraLayer) or module.merged:
                continue  # an already merged layer holds the sum in its base weight
            weight = module.get_base_layer().weight.detach()
            for adapter in module.active_adapters:
                if adapter not in module.lora_A and adapter not in module.lora_embedding_A:
                    continue
                if module.use_dora.get(adapter, False) or module.lora_bias.get(adapter, False):
                    raise ValueError(f"{name}: merging DoRA or LoRA-bias adapters is not supported")
                # As peft's merge: the sum in the delta's dtype (fp32 for an adapter peft upcast), rounded once.
                weight = (weight + module.get_delta_weight(adapter)).to(weight.dtype)
            merged[f"{name}.base_layer.weight"] = weight
    state = {}
    for key, tensor in hf_model.state_dict().items():
        parts = key.split(".")
        if _LORA_KEY_PARTS.intersection(parts):
            continue
        if "modules_to_save" in parts or "original_module" in parts:
            raise ValueError(f"{key}: peft modules_to_save are not supported in merged weights")
        state[key.replace(".base_layer.", ".")] = merged.get(key, tensor)
    return state


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors exactly as peft's ``save_pretrained`` writes them (contiguous, no aliasing)."""
    from peft.utils import get_peft_model_state_dict

    if not is_peft_model(model):
        raise ValueError('weight_broadcast.type = "lora" needs a LoRA model (set [trainer.model.lora])')
    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        out[name] = tensor.contiguous()
    return out


def lora_adapter_config_json(model: torch.nn.Module) -> str:
    """``adapter_config.json`` as peft's ``save_pretrained`` writes it for the active adapter (same keys, values
    and layout; sets such as ``target_modules`` sorted, where peft's order depends on hashing)."""
    config = copy.deepcopy(model.peft_config[model.active_adapter])
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = model.base_model.model.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    output = config.to_dict()
    for key, value in output.items():
        if isinstance(value, set):
            output[key] = sorted(value)  # peft writes list(set): an order that varies between processes
    return json.dumps(output, indent=2, sort_keys=True)

"""Export the trained model as a Hugging Face model directory: ``config.json``, ``generation_config.json``,
``model.safetensors`` and the tokenizer's files, which ``AutoModelForCausalLM.from_pretrained`` and vLLM load.
The RL trainer writes ``{output_dir}/weights/step_N`` at each checkpoint (and the last step), SFT its final step.

The weights are ``primerl.trainer.hf_state_dict``'s, the ones a FULL publish sends to the inference workers (a
LoRA model merged in the base model's dtype, without changing the training model); ``save_pretrained`` writes
them. The directory is committed like a checkpoint (``primerl.trainer.committed_dir``: temp + ``STABLE`` +
rename): a reader that sees ``STABLE`` sees the whole export.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.runtime.log_setup import get_logger
from primerl.trainer.committed_dir import remove_leftovers, writing_committed_dir
from primerl.trainer.distributed import replicated_model
from primerl.trainer.hf_state_dict import hf_model_and_state

if TYPE_CHECKING:
    import torch

__all__ = ["export_hf_weights"]

log = get_logger("primerl.trainer.checkpoint")  # the logger its lines have always named


def export_hf_weights(
    model: torch.nn.Module,
    tokenizer_or_dir: Any | str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
) -> Path:
    """Write `model` as a Hugging Face model directory (config, safetensors, tokenizer) that
    `AutoModelForCausalLM.from_pretrained` and vLLM load, atomically (temp + STABLE + rename) to `out_dir`,
    e.g. `{output_dir}/weights/step_{N}`; an existing `out_dir` is replaced.

    A peft model is exported with its adapters merged into the base weights, computed without changing the
    training model. `tokenizer_or_dir` is a tokenizer, a directory to load one from, or None for no tokenizer.
    """
    out_dir = Path(out_dir)
    model = replicated_model(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    leftovers = remove_leftovers(out_dir.parent, re.escape(out_dir.name))
    if leftovers:
        log.info("removed leftovers of an interrupted weight export", dirs=leftovers)
    with writing_committed_dir(out_dir) as tmp_dir:
        hf_model, state = hf_model_and_state(model)
        hf_model.save_pretrained(str(tmp_dir), state_dict=state)
        if tokenizer_or_dir is not None:
            tokenizer = tokenizer_or_dir
            if isinstance(tokenizer_or_dir, (str, os.PathLike)):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_or_dir))
            tokenizer.save_pretrained(str(tmp_dir))
    log.info("exported weights", path=str(out_dir))
    return out_dir

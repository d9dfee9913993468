"""The models of bench part e: the tiny model's Qwen2 family at ~100M, ~500M and ~1B parameters, fp32 or bf16, and
two other families at ~100M in fp32 (``100m-mistral``: untied embeddings; ``100m-phi3``: fused ``qkv_proj`` and
``gate_up_proj`` in the checkpoint), so that the update path is not measured on one architecture only.

    point = ModelPoint("1b", "bf16")
    model_dir = build_point(work_dir / point.label, point, tokenizer_dir)

"tiny", "100m" and the family points in fp32 are built with ``build_tiny_model`` (byte-identical to the checkpoints
earlier runs of the bench measured). Every other point is written directly in its dtype: the tokenizer and
generation config are copied from a tiny model, ``config.json`` comes from ``Qwen2Config``, and each tensor is
created in the point's dtype and filled (normal(0, 0.02) for matrices and embeddings, 1 for norms, 0 for biases, as
transformers' own init does) with a seeded generator, then all are saved with ``safetensors.torch.save_file`` (tied
embeddings stored once, ``{"format": "pt"}`` metadata: what ``save_pretrained`` writes). A 1B bf16 model takes ~2 GB
of memory and well under a minute to build on 2 cores, where a float32 ``Qwen2ForCausalLM(config)`` would need 4 GB
and its slow init.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILY_POINTS = ("mistral", "phi3")
"""Families measured at the ~100M shape beside Qwen2 (fp32 only: built with ``build_tiny_model``)."""

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""Bench dtype label -> torch / vLLM dtype name."""

INIT_STD = 0.02
"""transformers' ``initializer_range`` for Qwen2."""

FAST_BUILD_FILES = ("config.json", "model.safetensors")
"""What the direct builder writes itself; every other file of a tiny model (tokenizer, generation config) is
copied."""


def model_specs() -> dict[str, Any]:
    """Model name -> ``TinyModelSpec``: Qwen2 (1088-token vocabulary, tied embeddings, head_dim 64) at each size,
    and the ~100M shape in two more families (``FAMILY_POINTS``)."""
    from primerl.trainer.tiny_model import TinyModelSpec

    shape_100m = dict(
        hidden_size=768, num_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=3072
    )
    return {
        "tiny": TinyModelSpec(),
        # intermediate = 4 x hidden (the default): ~105M parameters.
        "100m": TinyModelSpec(**shape_100m),
        **{f"100m-{family}": TinyModelSpec(**shape_100m, family=family) for family in FAMILY_POINTS},
        # ~489M parameters.
        "500m": TinyModelSpec(
            hidden_size=1536, num_layers=20, num_attention_heads=24, num_key_value_heads=4, intermediate_size=4096
        ),
        # TinyLlama-1.1B's shape with this vocabulary: ~971M parameters.
        "1b": TinyModelSpec(
            hidden_size=2048, num_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632
        ),
    }


@dataclass(frozen=True)
class ModelPoint:
    """One scale point: a model of ``model_specs()`` in one dtype ("fp32" or "bf16")."""

    model: str
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.model}-{self.dtype}"

    @property
    def torch_dtype_name(self) -> str:
        return DTYPES[self.dtype]

    @property
    def uses_build_tiny_model(self) -> bool:
        return self.dtype == "fp32" and (self.model in ("tiny", "100m") or self.is_family_point)

    @property
    def is_family_point(self) -> bool:
        return self.model.removeprefix("100m-") in FAMILY_POINTS


def build_point(out_dir: Path, point: ModelPoint, tokenizer_dir: Path | None) -> Path:
    """Write the model of ``point`` to ``out_dir`` (see the module docstring); ``tokenizer_dir``: a tiny model
    (needed unless ``point.uses_build_tiny_model``)."""
    from primerl.trainer.tiny_model import SPEC_FILE, build_tiny_model

    spec = model_specs()[point.model]
    if point.uses_build_tiny_model:
        return build_tiny_model(out_dir, spec)
    if point.is_family_point:
        raise ValueError(f"{point.label}: the family points are built in fp32 only (--models {point.model}:fp32)")
    spec.validate()
    if tokenizer_dir is None:
        raise ValueError(f"{point.label} is built directly: it needs a tiny model's tokenizer (tokenizer_dir)")
    out_dir.mkdir(parents=True, exist_ok=False)
    for path in tokenizer_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", SPEC_FILE):
            shutil.copy2(path, out_dir / path.name)
    (out_dir / SPEC_FILE).write_text(
        json.dumps({"spec": spec.to_json_dict(), "dtype": point.torch_dtype_name}, indent=2, sort_keys=True) + "\n"
    )
    config = _qwen2_config(spec, point.torch_dtype_name, tokenizer_dir)
    config.save_pretrained(str(out_dir))
    _save_weights(out_dir / "model.safetensors", config, spec.seed, point.torch_dtype_name)
    return out_dir


def _qwen2_config(spec: Any, dtype_name: str, tokenizer_dir: Path) -> Any:
    from transformers import Qwen2Config

    tiny_config = json.loads((tokenizer_dir / "config.json").read_text())
    vocab_size = spec.vocab_size or tiny_config["vocab_size"]
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=tiny_config["bos_token_id"],
        eos_token_id=tiny_config["eos_token_id"],
        pad_token_id=tiny_config["pad_token_id"],
        dtype=dtype_name,
        architectures=["Qwen2ForCausalLM"],
    )


def _save_weights(path: Path, config: Any, seed: int, dtype_name: str) -> None:
    """The checkpoint's tensors (names and shapes from a model on the meta device), made in ``dtype_name``."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        meta = Qwen2ForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})


if __name__ == "__main__":  # build one point: python bench/scale_models.py 1b bf16 OUT_DIR
    import sys
    import tempfile

    from primerl.trainer.tiny_model import build_tiny_model, count_parameters

    name, dtype, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tiny_model(Path(tmp) / "tiny")
        started = time.monotonic()
        build_point(out, ModelPoint(name, dtype), tokenizer)
        print(f"{name} {dtype}: {count_parameters(out):,} parameters in {time.monotonic() - started:.1f} s")

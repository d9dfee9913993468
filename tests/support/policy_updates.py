"""Weight updates of real tensors for tests of the inference side (``PolicyUpdater``, the worker extension):
FULL, DELTA and LORA headers with their payloads, and seeded perturbations of a set of weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from primerl.proto.tensor_frames import encode_tensors, parse_header, specs_of
from primerl.proto.v1 import data_pb2
from primerl.proto.weight_delta import encode_delta

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
LORA = data_pb2.WEIGHT_UPDATE_KIND_LORA
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA


def sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def full_update(weights: dict[str, torch.Tensor], version: int) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs = encode_tensors(weights)
    return data_pb2.WeightUpdateHeader(
        policy_version=version, kind=FULL, digest=sha256(payload), tensors=specs, payload_bytes=len(payload)
    ), payload


def delta_update(
    new: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    version: int,
    base_version: int,
    encoding: int = data_pb2.DELTA_ENCODING_XOR_ZLIB,
) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs, decoded = encode_delta(new, base, encoding=encoding)
    return data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=DELTA,
        base_version=base_version,
        digest=sha256(payload),
        tensors=specs,
        decoded_tensors=decoded,
        delta_encoding=encoding,
        payload_bytes=len(payload),
    ), payload


def lora_update(
    adapter_dir: Path,
    version: int,
    policy_name: str = "tiny-policy",
) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload = (adapter_dir / "adapter_model.safetensors").read_bytes()
    return data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=LORA,
        digest=sha256(payload),
        tensors=specs_of(parse_header(payload)),
        adapter_config_json=(adapter_dir / "adapter_config.json").read_text(),
        policy_name=policy_name,
        payload_bytes=len(payload),
    ), payload


def perturbed(
    weights: dict[str, torch.Tensor], seed: int, scale: float = 0.02, names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """`weights` with seeded Gaussian noise added to `names` (all by default)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t + scale * torch.randn(t.shape, generator=generator)) if names is None or name in names else t.clone()
        for name, t in weights.items()
    }

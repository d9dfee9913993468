"""The worker's weights as plain data: manifests ({name: (dtype, shape)}), digests, zero-copy views of a
safetensors frame, and the check of an update against a manifest. `WeightUpdateInvalid` (a ValueError) is how a
worker refuses an update: its message starts with ``[primerl:<ERROR_CODE>]`` so it survives vLLM's process boundary."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from primerl.proto import weight_delta
from primerl.proto.tensor_frames import DTYPES, TensorFrameError, parse_header
from primerl.proto.v1 import common_pb2

if TYPE_CHECKING:
    import torch

REFUSAL_PREFIX = "[primerl:"


class WeightUpdateInvalid(ValueError):
    """An update that does not fit the model (unknown, missing or misshapen tensors; a corrupt delta)."""

    def __init__(self, message: str, code: int = common_pb2.ERROR_CODE_TENSOR_MISMATCH):
        super().__init__(f"{REFUSAL_PREFIX}{common_pb2.ErrorCode.Name(code)}] {message}")
        self.code = code
        self.reason = message


def dtype_name(tensor: torch.Tensor) -> str:
    return weight_delta.torch_dtype_name(tensor.dtype)


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    """{name: (safetensors dtype, shape)}: plain data that crosses process boundaries."""
    return {name: (dtype_name(t), list(t.shape)) for name, t in tensors.items()}


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over name, dtype, shape and raw bytes of each tensor, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().reshape(-1)
        digest.update(f"{name}\0{dtype_name(tensors[name])}\0{list(tensors[name].shape)}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def check_against(
    tensors: Mapping[str, Any], manifest: Mapping[str, tuple[str, list[int]]], *, require_all: bool, what: str
) -> None:
    """Raise `WeightUpdateInvalid` unless every tensor (dtype name, shape) of `tensors` is in `manifest` with the
    same dtype and shape, and, with `require_all`, every tensor of `manifest` is there."""
    unknown = sorted(set(tensors) - set(manifest))
    if unknown:
        raise WeightUpdateInvalid(
            f"{what}: {len(unknown)} unknown tensor(s), e.g. {unknown[:3]}; the model has no such weights"
        )
    if require_all:
        missing = sorted(set(manifest) - set(tensors))
        if missing:
            raise WeightUpdateInvalid(
                f"{what}: {len(missing)} missing tensor(s), e.g. {missing[:3]}; a full update "
                "must hold every weight of the model"
            )
    for name, (dtype, shape) in tensors.items():
        expected_dtype, expected_shape = manifest[name]
        if dtype != expected_dtype or list(shape) != list(expected_shape):
            raise WeightUpdateInvalid(
                f"{what}: tensor {name!r} is {dtype}{list(shape)} but the model's is "
                f"{expected_dtype}{list(expected_shape)}"
            )


def full_update_invalid(exc: TensorFrameError) -> WeightUpdateInvalid:
    """The refusal of a FULL payload whose safetensors header cannot be read."""
    code = common_pb2.ERROR_CODE_TENSOR_MISMATCH if exc.mismatch else common_pb2.ERROR_CODE_MALFORMED_HEADER
    return WeightUpdateInvalid(f"full update: {exc}", code)


def entry_tensor(view: memoryview, entry: Any) -> torch.Tensor:
    """The tensor of one safetensors header entry, a VIEW of ``view`` (no copy)."""
    import torch

    dtype = getattr(torch, DTYPES[entry.dtype][2])
    if entry.end > entry.start:
        return torch.frombuffer(view[entry.start : entry.end], dtype=dtype).reshape(entry.shape)
    return torch.empty(entry.shape, dtype=dtype)


def torch_views(frame: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors frame as torch tensors that VIEW the frame (no copy; the frame must stay
    unchanged while they are used). Raises `TensorFrameError` for an unreadable frame."""
    view = memoryview(frame)
    return {name: entry_tensor(view, entry) for name, entry in parse_header(view).items()}

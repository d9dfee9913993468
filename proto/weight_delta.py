"""The lossless weight delta of the wire contract ``DELTA_ENCODING_XOR_ZLIB``.

For each tensor: the raw bits of the new version XOR the raw bits of the base version (same dtype, same shape),
zlib-compressed, stored as a 1-D ``U8`` tensor under the tensor's own (model) name in one safetensors blob.
A small optimizer step changes few high bits, so the XOR is mostly zero bytes and compresses well; the round trip
is bit-exact whatever the dtype. Tensors whose bits did not change may be left out of the delta.

The header's ``tensors`` lists the encoded (U8) tensors and ``decoded_tensors`` the dtype and shape of each
decoded tensor, in the same order.

    payload, specs, decoded = encode_delta(new_state, base_state)
    header = WeightUpdateHeader(kind=DELTA, delta_encoding=DELTA_ENCODING_XOR_ZLIB, tensors=specs,
                                decoded_tensors=decoded, ...)
    changed = decode_delta(payload, header, base_state)  # {name: new tensor} for the tensors in the delta

Decoding trusts nothing: names, dtypes and shapes are checked against the header and the base, and each
tensor is decompressed with a bound equal to its expected size (a zip bomb stops there).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from primerl.proto.tensor_frames import DTYPES, TensorFrameError, check_tensor_frame, parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2

if TYPE_CHECKING:
    import torch

__all__ = ["DeltaError", "decode_delta", "encode_delta", "torch_dtype_name"]

# Unsigned integer of each element width: XOR is done on these (any width gives the same bits).
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(ValueError):
    """A delta that cannot be applied. ``code`` says why, as a wire ``ErrorCode``:
    TENSOR_MISMATCH (names, dtypes or shapes disagree with the header or the base) or MALFORMED_HEADER
    (the header or the compressed data cannot be read)."""

    def __init__(self, message: str, code: int = common_pb2.ERROR_CODE_TENSOR_MISMATCH):
        super().__init__(message)
        self.code = code


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string ("F32", "BF16", ...) of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for st_name, (_, _, torch_name) in DTYPES.items():
        if torch_name == name:
            return st_name
    raise DeltaError(f"dtype {dtype} has no safetensors equivalent")


def _raw_bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat numpy array of unsigned integers of the element's width (a view when the
    tensor is contiguous and on the CPU)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    width = flat.element_size()
    return flat.view(torch.uint8).numpy().view(_UINT_OF_WIDTH[width])


def encode_delta(
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    *,
    changed_only: bool = True,
    level: int = 1,
) -> tuple[bytes, list[common_pb2.TensorSpec], list[common_pb2.TensorSpec]]:
    """Encode ``new`` against ``base``: returns (safetensors payload, ``tensors`` specs, ``decoded_tensors``
    specs in the same order).

    Every tensor of ``new`` must exist in ``base`` with the same dtype and shape (ValueError otherwise); tensors
    of ``base`` absent from ``new`` are simply not part of the delta. With ``changed_only``, tensors whose bits
    are identical are left out (the payload may then hold no tensor at all). ``level`` is zlib's (0-9).
    """
    import torch
    from safetensors.torch import save

    if not 0 <= level <= 9:
        raise ValueError(f"level must be in 0..9, got {level}")
    encoded: dict[str, torch.Tensor] = {}
    decoded: dict[str, common_pb2.TensorSpec] = {}
    for name, tensor in new.items():
        if name not in base:
            raise DeltaError(f"tensor {name!r} is not in the base")
        base_tensor = base[name]
        if tensor.dtype != base_tensor.dtype or tuple(tensor.shape) != tuple(base_tensor.shape):
            raise DeltaError(
                f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)} but the base has "
                f"{base_tensor.dtype}{list(base_tensor.shape)}"
            )
        xor = np.bitwise_xor(_raw_bits(tensor), _raw_bits(base_tensor))
        if changed_only and not xor.any():
            continue
        compressed = zlib.compress(xor.view(np.uint8).data, level)
        encoded[name] = torch.frombuffer(bytearray(compressed), dtype=torch.uint8)
        decoded[name] = common_pb2.TensorSpec(name=name, dtype=torch_dtype_name(tensor.dtype),
                                              shape=list(tensor.shape))
    payload = save(encoded)
    specs = specs_of(parse_header(payload))
    return payload, specs, [decoded[spec.name] for spec in specs]


def decode_delta(
    payload: Any,
    header: data_pb2.WeightUpdateHeader,
    base: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Decode a delta against ``base``: {name: new tensor} for every tensor in the delta (the others are
    unchanged). Raises `DeltaError` (a ValueError) for anything inconsistent or corrupt; ``base`` is never
    modified and the returned tensors own their memory."""
    import torch

    if header.delta_encoding != data_pb2.DELTA_ENCODING_XOR_ZLIB:
        raise DeltaError(f"delta_encoding {header.delta_encoding} is not DELTA_ENCODING_XOR_ZLIB",
                         common_pb2.ERROR_CODE_MALFORMED_HEADER)
    if len(header.tensors) != len(header.decoded_tensors):
        raise DeltaError(f"the header lists {len(header.tensors)} encoded tensors but "
                         f"{len(header.decoded_tensors)} decoded ones")
    try:
        entries = check_tensor_frame(payload, header.tensors)
    except TensorFrameError as exc:
        code = common_pb2.ERROR_CODE_TENSOR_MISMATCH if exc.mismatch else common_pb2.ERROR_CODE_MALFORMED_HEADER
        raise DeltaError(f"delta payload: {exc}", code) from None

    plan = []
    for spec, decoded_spec in zip(header.tensors, header.decoded_tensors, strict=True):
        name = spec.name
        if decoded_spec.name != name:
            raise DeltaError(f"decoded_tensors[{len(plan)}] is {decoded_spec.name!r} but tensors[{len(plan)}] "
                             f"is {name!r}: they must list the same names in the same order")
        if spec.dtype != "U8" or len(spec.shape) != 1:
            raise DeltaError(f"encoded tensor {name!r} must be 1-D U8, got {spec.dtype}{list(spec.shape)}")
        if name not in base:
            raise DeltaError(f"tensor {name!r} of the delta is not in the base weights")
        base_tensor = base[name]
        base_dtype = torch_dtype_name(base_tensor.dtype)
        if decoded_spec.dtype != base_dtype or tuple(decoded_spec.shape) != tuple(base_tensor.shape):
            raise DeltaError(
                f"tensor {name!r}: the delta decodes to {decoded_spec.dtype}{list(decoded_spec.shape)} but the "
                f"base holds {base_dtype}{list(base_tensor.shape)}"
            )
        plan.append((name, entries[name], base_tensor))

    view = memoryview(getattr(payload, "buffer", payload)).cast("B")
    out: dict[str, torch.Tensor] = {}
    for name, entry, base_tensor in plan:
        base_bits = _raw_bits(base_tensor)
        xor = _bounded_decompress(name, view[entry.start:entry.end], base_bits.nbytes)
        if base_tensor.numel() == 0:
            out[name] = torch.empty(base_tensor.shape, dtype=base_tensor.dtype)
            continue
        new_bits = np.bitwise_xor(np.frombuffer(xor, dtype=base_bits.dtype), base_bits)
        flat = torch.from_numpy(new_bits).view(torch.uint8)  # new_bits owns fresh memory
        out[name] = flat.view(base_tensor.dtype).reshape(base_tensor.shape)
    return out


def _bounded_decompress(name: str, data: memoryview, expected_bytes: int) -> bytearray:
    """zlib-decompress ``data`` into exactly ``expected_bytes`` bytes, never producing more than one extra."""
    decompressor = zlib.decompressobj()
    try:
        # One byte of room beyond the expected size: a stream that decodes to more is caught there, and one
        # that decodes to exactly the expected size gets to read its end marker.
        out = decompressor.decompress(data, expected_bytes + 1)
    except zlib.error as exc:
        raise DeltaError(f"tensor {name!r}: corrupt compressed delta ({exc})",
                         common_pb2.ERROR_CODE_MALFORMED_HEADER) from None
    if len(out) > expected_bytes:
        raise DeltaError(f"tensor {name!r}: the delta decompresses to more than the {expected_bytes} bytes "
                         "expected", common_pb2.ERROR_CODE_MALFORMED_HEADER)
    if not decompressor.eof:
        raise DeltaError(f"tensor {name!r}: the compressed delta is truncated",
                         common_pb2.ERROR_CODE_MALFORMED_HEADER)
    if decompressor.unused_data:
        raise DeltaError(f"tensor {name!r}: {len(decompressor.unused_data)} bytes after the compressed delta",
                         common_pb2.ERROR_CODE_MALFORMED_HEADER)
    if len(out) != expected_bytes:
        raise DeltaError(f"tensor {name!r}: the delta decompresses to {len(out)} bytes, expected {expected_bytes}",
                         common_pb2.ERROR_CODE_MALFORMED_HEADER)
    return bytearray(out)

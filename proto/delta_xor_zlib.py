"""The XOR_ZLIB weight delta (``DELTA_ENCODING_XOR_ZLIB``): per tensor, the raw bits of the new version XOR those
of the base, zlib-compressed, as a 1-D ``U8`` tensor under the tensor's own name.

``tensors[i]`` and ``decoded_tensors[i]`` name the same tensor. A small step changes few high bits, so the XOR is
mostly zero bytes; but in fp32 every element changes (the XOR compresses to ~50-70 %) and zlib runs at ~50-100
MB/s one way. Decoding decompresses with a bound equal to the tensor's size: a zip bomb stops there.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from primerl.proto.delta_base import DecodeStep, DeltaError, as_torch, checked_base, fresh_empty, malformed, raw_bits
from primerl.proto.tensor_frames import TensorEntry
from primerl.proto.v1 import data_pb2

if TYPE_CHECKING:
    import torch


def encode_tensor(new_bits: np.ndarray, base_bits: np.ndarray, *, changed_only: bool, level: int) -> bytes | None:
    """The compressed XOR of one tensor, or None when nothing changed and ``changed_only``."""
    xor = np.bitwise_xor(new_bits, base_bits)
    if changed_only and not xor.any():
        return None
    return zlib.compress(xor.view(np.uint8).data, level)


def price(new_bits: np.ndarray, base_bits: np.ndarray, level: int) -> tuple[int, int, float, float] | None:
    """(changed bytes, encoded bytes, encode s, decode s) of a slice, or None when it did not change."""
    start = time.perf_counter()
    compressed = encode_tensor(new_bits, base_bits, changed_only=True, level=level)
    if compressed is None:
        return None
    middle = time.perf_counter()
    np.bitwise_xor(np.frombuffer(zlib.decompress(compressed), dtype=base_bits.dtype), base_bits)
    end = time.perf_counter()
    return new_bits.nbytes, len(compressed), middle - start, end - middle


def decode_plan(
    entries: dict[str, TensorEntry], header: data_pb2.WeightUpdateHeader, base: Mapping[str, torch.Tensor]
) -> list[DecodeStep]:
    """One step per tensor: ``tensors`` and ``decoded_tensors`` list the same names in the same order."""
    if len(header.tensors) != len(header.decoded_tensors):
        raise DeltaError(
            f"the header lists {len(header.tensors)} encoded tensors but {len(header.decoded_tensors)} decoded ones"
        )
    plan = []
    for spec, decoded_spec in zip(header.tensors, header.decoded_tensors, strict=True):
        name = spec.name
        if decoded_spec.name != name:
            raise DeltaError(
                f"decoded_tensors[{len(plan)}] is {decoded_spec.name!r} but tensors[{len(plan)}] "
                f"is {name!r}: they must list the same names in the same order"
            )
        if spec.dtype != "U8" or len(spec.shape) != 1:
            raise DeltaError(f"encoded tensor {name!r} must be 1-D U8, got {spec.dtype}{list(spec.shape)}")
        plan.append(DecodeStep(name, checked_base(decoded_spec, base), entries[name]))
    return plan


def decode_tensor(view: memoryview, step: DecodeStep) -> torch.Tensor:
    """The new tensor of one step of `decode_plan`, from the payload ``view``."""
    import torch

    base_bits = raw_bits(step.base)
    xor = _bounded_decompress(step.name, view[step.data.start : step.data.end], base_bits.nbytes)
    if step.base.numel() == 0:
        return torch.empty(step.base.shape, dtype=step.base.dtype)
    new_bits = np.bitwise_xor(
        np.frombuffer(xor, dtype=base_bits.dtype), base_bits, out=fresh_empty(base_bits.size, base_bits.dtype)
    )
    return as_torch(new_bits, step.base)


def _bounded_decompress(name: str, data: memoryview, expected_bytes: int) -> bytearray:
    """zlib-decompress ``data`` into exactly ``expected_bytes`` bytes, never producing more than one extra."""
    decompressor = zlib.decompressobj()
    try:
        # One byte of room beyond the expected size: a stream that decodes to more is caught there, and one
        # that decodes to exactly the expected size gets to read its end marker.
        out = decompressor.decompress(data, expected_bytes + 1)
    except zlib.error as exc:
        raise malformed(f"tensor {name!r}: corrupt compressed delta ({exc})") from None
    if len(out) > expected_bytes:
        raise malformed(f"tensor {name!r}: the delta decompresses to more than the {expected_bytes} bytes expected")
    if not decompressor.eof:
        raise malformed(f"tensor {name!r}: the compressed delta is truncated")
    if decompressor.unused_data:
        raise malformed(f"tensor {name!r}: {len(decompressor.unused_data)} bytes after the compressed delta")
    if len(out) != expected_bytes:
        raise malformed(f"tensor {name!r}: the delta decompresses to {len(out)} bytes, expected {expected_bytes}")
    return bytearray(out)

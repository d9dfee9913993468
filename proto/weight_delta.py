"""The lossless weight deltas of the wire contract: ``DELTA_ENCODING_SPARSE`` (``delta_sparse``) and
``DELTA_ENCODING_XOR_ZLIB`` (``delta_xor_zlib``); this module encodes, decodes and prices either.

Both are bit-exact whatever the dtype (raw bits are compared and copied: -0.0, +0.0 and NaN payloads survive),
travel as one safetensors payload, and leave out tensors whose bits did not change. The header's ``tensors``
lists the encoded tensors of the payload and ``decoded_tensors`` the dtype and shape of each tensor the delta
changes.

    payload, specs, decoded = encode_delta(new_state, base_state, encoding=DELTA_ENCODING_SPARSE)
    header = WeightUpdateHeader(kind=DELTA, delta_encoding=DELTA_ENCODING_SPARSE, tensors=specs,
                                decoded_tensors=decoded, ...)
    changed = decode_delta(payload, header, base_state)  # {name: new tensor} for the tensors in the delta

``estimate_delta`` prices either encoding on a sample before it is built (size, encode and decode times), so a
publisher can send FULL when a delta would not pay (the policy is in ``primerl.trainer.publish``).

Decoding trusts nothing: names, dtypes and shapes are checked against the header and the base, SPARSE positions
against the tensor and the values, and XOR_ZLIB data is decompressed with a bound equal to the tensor's size.
Anything wrong raises `DeltaError`, with the wire error code to answer.

Speed: `encode_delta` and `decode_delta` work on several tensors at once, on a thread pool (numpy and zlib
release the GIL), largest tensors first; the payload and the error raised do not depend on the number of
threads.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from primerl.proto import delta_sparse, delta_xor_zlib
from primerl.proto.delta_base import DeltaError, malformed, map_threads, raw_bits, torch_dtype_name
from primerl.proto.tensor_frames import DTYPES, TensorFrameError, byte_view, check_tensor_frame, parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2

if TYPE_CHECKING:
    import torch

__all__ = ["DeltaError", "DeltaEstimate", "decode_delta", "encode_delta", "estimate_delta", "sampled_elements"]

SPARSE = data_pb2.DELTA_ENCODING_SPARSE
_CODECS = {SPARSE: delta_sparse, data_pb2.DELTA_ENCODING_XOR_ZLIB: delta_xor_zlib}


def _codec(encoding: int) -> Any:
    """The codec module of a ``DeltaEncoding`` the caller chose (ValueError for any other)."""
    if encoding not in _CODECS:
        raise ValueError(f"encoding must be DELTA_ENCODING_SPARSE or DELTA_ENCODING_XOR_ZLIB, got {encoding}")
    return _CODECS[encoding]


def encode_delta(
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    *,
    encoding: int = data_pb2.DELTA_ENCODING_XOR_ZLIB,
    changed_only: bool = True,
    level: int = 1,
    num_threads: int | None = None,
) -> tuple[bytes, list[common_pb2.TensorSpec], list[common_pb2.TensorSpec]]:
    """Encode ``new`` against ``base`` as ``encoding`` (a ``DeltaEncoding``): returns (safetensors payload,
    ``tensors`` specs, ``decoded_tensors`` specs).

    Every tensor of ``new`` must exist in ``base`` with the same dtype and shape (`DeltaError` otherwise); tensors
    of ``base`` absent from ``new`` are simply not part of the delta. With ``changed_only``, tensors whose bits
    are identical are left out (the payload may then hold no tensor at all); without, they are sent too (SPARSE:
    as an empty gaps form). ``level`` is zlib's (0-9, XOR_ZLIB only).
    Tensors are encoded on ``num_threads`` threads (zlib and numpy release the GIL; None: up to 4, one per usable
    core); the result does not depend on it.
    """
    codec = _codec(encoding)
    if not 0 <= level <= 9:
        raise ValueError(f"level must be in 0..9, got {level}")
    for name, tensor in new.items():
        if name not in base:
            raise DeltaError(f"tensor {name!r} is not in the base")
        base_tensor = base[name]
        if tensor.dtype != base_tensor.dtype or tuple(tensor.shape) != tuple(base_tensor.shape):
            raise DeltaError(
                f"tensor {name!r} is {tensor.dtype}{list(tensor.shape)} but the base has "
                f"{base_tensor.dtype}{list(base_tensor.shape)}"
            )

    def encode_one(name: str) -> Any:
        new_bits, base_bits = raw_bits(new[name]), raw_bits(base[name])
        if encoding == SPARSE:
            return delta_sparse.encode_tensor(new_bits, base_bits, keep_unchanged=not changed_only)
        return codec.encode_tensor(new_bits, base_bits, changed_only=changed_only, level=level)

    names = list(new)
    parts = map_threads(
        encode_one, names, [new[name].numel() * new[name].element_size() for name in names], num_threads
    )
    decoded = {
        name: common_pb2.TensorSpec(name=name, dtype=torch_dtype_name(new[name].dtype), shape=list(new[name].shape))
        for name, part in zip(names, parts, strict=True)
        if part is not None
    }
    encoded: dict[str, tuple[str, np.ndarray]] = {}
    for name, part in zip(names, parts, strict=True):
        if encoding == SPARSE:
            for suffix, array in (part or {}).items():
                encoded[name + suffix] = (decoded[name].dtype if suffix == delta_sparse.VALUES else "U8", array)
        elif part is not None:
            encoded[name] = ("U8", np.frombuffer(part, dtype=np.uint8))
    payload = _safetensors_blob(encoded)
    specs = specs_of(parse_header(payload))
    if encoding == SPARSE:
        return payload, specs, list(decoded.values())
    return payload, specs, [decoded[spec.name] for spec in specs]


def _safetensors_blob(arrays: dict[str, tuple[str, np.ndarray]]) -> bytes:
    """The bytes ``safetensors.torch.save`` writes for 1-D tensors given as {name: (safetensors dtype, raw bits)},
    copied once: 8-byte little-endian header length, the compact JSON header padded with spaces to a multiple of
    8, the data back to back in safetensors' order (by dtype, then name: asked of safetensors on one-element
    stand-ins, so it follows the installed version)."""
    import torch
    from safetensors.torch import save

    probe = save({name: torch.zeros(1, dtype=getattr(torch, DTYPES[dtype][2])) for name, (dtype, _) in arrays.items()})
    (probe_length,) = struct.unpack("<Q", probe[:8])
    probe_header = json.loads(probe[8 : 8 + probe_length])
    order = sorted(arrays, key=lambda name: probe_header[name]["data_offsets"][0])
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        dtype, array = arrays[name]
        header[name] = {"dtype": dtype, "shape": [array.size], "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(arrays[name][1].view(np.uint8).data for name in order)])


@dataclass(frozen=True)
class DeltaEstimate:
    """What a delta of ``new`` against ``base`` would cost, from a sample (`estimate_delta`)."""

    encoding: int  # the DeltaEncoding priced
    full_bytes: int  # raw bytes of the tensors
    # Raw bytes that changed: of the tensors whose sample changed (XOR_ZLIB: what is XORed and compressed), of
    # the elements that changed (SPARSE).
    changed_bytes: int
    delta_bytes: int  # estimated payload
    encode_s: float  # estimated encode time, one thread
    decode_s: float  # estimated decode time (each worker)
    sample_bytes: int


def estimate_delta(
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    *,
    encoding: int = data_pb2.DELTA_ENCODING_XOR_ZLIB,
    level: int = 1,
    sample_fraction: float = 1 / 256,
    min_sample_bytes: int = 64 * 1024,
    max_sample_bytes: int = 1 << 20,
) -> DeltaEstimate:
    """Price a delta without building it: encode and decode one contiguous slice (from the middle) of each
    tensor (`sampled_elements`), timed, and scale by size: ~10-30 ms here for any model size. A tensor whose slice
    did not change counts as unchanged (a sparse change elsewhere in it is missed: the estimate errs towards the
    delta, which is then built exactly). Tensors missing from ``base`` or of another shape raise `DeltaError`."""
    codec = _codec(encoding)
    spans = sampled_elements(
        new, sample_fraction=sample_fraction, min_sample_bytes=min_sample_bytes, max_sample_bytes=max_sample_bytes
    )
    full = sampled = 0
    changed = delta = encode_s = decode_s = 0.0
    for name, tensor in new.items():
        if name not in base or tensor.dtype != base[name].dtype or tuple(tensor.shape) != tuple(base[name].shape):
            raise DeltaError(f"tensor {name!r} does not match the base")
        new_bits, base_bits = raw_bits(tensor), raw_bits(base[name])
        full += new_bits.nbytes
        if new_bits.size == 0:
            continue
        begin, end = spans[name]
        sampled += (end - begin) * new_bits.itemsize
        priced = codec.price(new_bits[begin:end], base_bits[begin:end], level)
        if priced is None:
            continue
        slice_changed, slice_delta, slice_encode_s, slice_decode_s = priced
        scale = new_bits.size / (end - begin)
        changed += slice_changed * scale
        delta += slice_delta * scale
        encode_s += slice_encode_s * scale
        decode_s += slice_decode_s * scale
    return DeltaEstimate(
        encoding=encoding,
        full_bytes=full,
        changed_bytes=int(changed),
        delta_bytes=int(delta),
        encode_s=encode_s,
        decode_s=decode_s,
        sample_bytes=sampled,
    )


def sampled_elements(
    tensors: Mapping[str, torch.Tensor],
    *,
    sample_fraction: float = 1 / 256,
    min_sample_bytes: int = 64 * 1024,
    max_sample_bytes: int = 1 << 20,
) -> dict[str, tuple[int, int]]:
    """{name: (begin, end)}: the flat elements of each tensor `estimate_delta` samples, from the middle. Slices
    are proportional to the tensors' sizes and add up to ``sample_fraction`` of the bytes, within
    [``min_sample_bytes``, ``max_sample_bytes``], and take at least 4 KiB of each tensor (or all of it)."""
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    budget = min(max_sample_bytes, max(min_sample_bytes, int(total_bytes * sample_fraction)))
    spans = {}
    for name, tensor in tensors.items():
        numel, width = tensor.numel(), tensor.element_size()
        take = min(numel, max(1, max(4096, budget * numel * width // max(1, total_bytes)) // width))
        begin = (numel - take) // 2
        spans[name] = (begin, begin + take)
    return spans


def decode_delta(
    payload: Any,
    header: data_pb2.WeightUpdateHeader,
    base: Mapping[str, torch.Tensor],
    *,
    num_threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a delta (SPARSE or XOR_ZLIB, from ``header.delta_encoding``) against ``base``: {name: new tensor}
    for every tensor in the delta (the others are unchanged). Raises `DeltaError` (a ValueError) for anything
    inconsistent or corrupt; ``base`` is never modified and the returned tensors own their memory. Tensors are
    decoded on ``num_threads`` threads (None: up to 4, one per usable core) once the whole header is checked;
    the result, and which error is raised, do not depend on it."""
    if header.delta_encoding not in _CODECS:
        encoding = header.delta_encoding
        name = data_pb2.DeltaEncoding.Name(encoding) if encoding in data_pb2.DeltaEncoding.values() else encoding
        raise malformed(f"delta_encoding {name} is neither DELTA_ENCODING_SPARSE nor DELTA_ENCODING_XOR_ZLIB")
    try:
        entries = check_tensor_frame(payload, header.tensors)
    except TensorFrameError as exc:
        code = common_pb2.ERROR_CODE_TENSOR_MISMATCH if exc.mismatch else common_pb2.ERROR_CODE_MALFORMED_HEADER
        raise DeltaError(f"delta payload: {exc}", code) from None
    view = byte_view(payload)
    codec = _CODECS[header.delta_encoding]
    plan = codec.decode_plan(entries, header, base)
    sizes = [step.base.numel() * step.base.element_size() for step in plan]
    decoded = map_threads(lambda step: codec.decode_tensor(view, step), plan, sizes, num_threads)
    return {step.name: tensor for step, tensor in zip(plan, decoded, strict=True)}

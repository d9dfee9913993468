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

Cost (measured here, fp32, one AdamW step): every element changes, the XOR compresses to ~50-70 % and zlib runs
at ~50-100 MB/s one way, while a loopback send moves ~1 GB/s: a dense delta costs far more time than the bytes it
saves. `estimate_delta` prices a delta on a sample before it is built, so a publisher can send FULL instead when
the delta would not pay (see ``trainer/publish.py``).

Decoding trusts nothing: names, dtypes and shapes are checked against the header and the base, and each
tensor is decompressed with a bound equal to its expected size (a zip bomb stops there).
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from primerl.proto.tensor_frames import DTYPES, TensorFrameError, check_tensor_frame, parse_header, specs_of
from primerl.proto.v1 import common_pb2, data_pb2

if TYPE_CHECKING:
    import torch

__all__ = ["DeltaError", "DeltaEstimate", "decode_delta", "encode_delta", "estimate_delta", "torch_dtype_name"]

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


def _default_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def encode_delta(
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    *,
    changed_only: bool = True,
    level: int = 1,
    num_threads: int | None = None,
) -> tuple[bytes, list[common_pb2.TensorSpec], list[common_pb2.TensorSpec]]:
    """Encode ``new`` against ``base``: returns (safetensors payload, ``tensors`` specs, ``decoded_tensors``
    specs in the same order).

    Every tensor of ``new`` must exist in ``base`` with the same dtype and shape (ValueError otherwise); tensors
    of ``base`` absent from ``new`` are simply not part of the delta. With ``changed_only``, tensors whose bits
    are identical are left out (the payload may then hold no tensor at all). ``level`` is zlib's (0-9).
    Tensors are XORed and compressed on ``num_threads`` threads (zlib and numpy release the GIL; None: up to 4,
    one per usable core); the result does not depend on it.
    """
    from safetensors.numpy import save

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

    def encode_one(name: str) -> bytes | None:
        xor = np.bitwise_xor(_raw_bits(new[name]), _raw_bits(base[name]))
        if changed_only and not xor.any():
            return None
        return zlib.compress(xor.view(np.uint8).data, level)

    names = list(new)
    threads = num_threads or _default_threads()
    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="delta-encode") as pool:
            compressed = list(pool.map(encode_one, names))
    else:
        compressed = [encode_one(name) for name in names]
    encoded: dict[str, np.ndarray] = {}
    decoded: dict[str, common_pb2.TensorSpec] = {}
    for name, data in zip(names, compressed, strict=True):
        if data is None:
            continue
        encoded[name] = np.frombuffer(data, dtype=np.uint8)
        decoded[name] = common_pb2.TensorSpec(name=name, dtype=torch_dtype_name(new[name].dtype),
                                              shape=list(new[name].shape))
    payload = save(encoded) if encoded else _empty_safetensors()
    specs = specs_of(parse_header(payload))
    return payload, specs, [decoded[spec.name] for spec in specs]


def _empty_safetensors() -> bytes:
    from safetensors.torch import save

    return save({})


@dataclass(frozen=True)
class DeltaEstimate:
    """What a delta of ``new`` against ``base`` would cost, from a sample (`estimate_delta`)."""

    full_bytes: int  # raw bytes of the tensors
    changed_bytes: int  # raw bytes of the tensors whose sample changed (what is XORed and compressed)
    delta_bytes: int  # estimated payload
    encode_s: float  # estimated XOR + compress time, one thread
    decode_s: float  # estimated decompress + XOR time (each worker)
    sample_bytes: int


def estimate_delta(
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    *,
    level: int = 1,
    sample_fraction: float = 1 / 256,
    min_sample_bytes: int = 64 * 1024,
    max_sample_bytes: int = 1 << 20,
) -> DeltaEstimate:
    """Price a delta without building it: XOR, compress and decompress one contiguous slice (from the middle)
    of each tensor, timed, and scale by size. Slices are proportional to the tensors' sizes and add up to
    ``sample_fraction`` of the bytes, within [``min_sample_bytes``, ``max_sample_bytes``] (at least 4 KiB of each
    tensor): ~10-30 ms here for any model size. A tensor whose slice did not change counts as unchanged (a sparse
    change elsewhere in it is missed: the estimate errs towards the delta, which is then built exactly).
    Tensors missing from ``base`` or of another shape raise `DeltaError`."""
    total_bytes = sum(t.numel() * t.element_size() for t in new.values())
    budget = min(max_sample_bytes, max(min_sample_bytes, int(total_bytes * sample_fraction)))
    full = changed = sampled = 0
    delta_estimate = 0.0
    encode_s = decode_s = 0.0
    changed_sampled = 0
    for name, tensor in new.items():
        if name not in base or tensor.dtype != base[name].dtype or tuple(tensor.shape) != tuple(base[name].shape):
            raise DeltaError(f"tensor {name!r} does not match the base")
        new_bits = _raw_bits(tensor).view(np.uint8)
        base_bits = _raw_bits(base[name]).view(np.uint8)
        size = new_bits.nbytes
        full += size
        if size == 0:
            continue
        take = min(size, max(4096, budget * size // max(1, total_bytes)))
        begin = (size - take) // 2
        start = time.perf_counter()
        xor = np.bitwise_xor(new_bits[begin:begin + take], base_bits[begin:begin + take])
        if not xor.any():
            sampled += take
            continue
        compressed = zlib.compress(xor.data, level)
        middle = time.perf_counter()
        zlib.decompress(compressed)
        end = time.perf_counter()
        encode_s += middle - start
        decode_s += end - middle
        changed += size
        changed_sampled += take
        sampled += take
        delta_estimate += size * len(compressed) / take
    scale = changed / changed_sampled if changed_sampled else 0.0
    return DeltaEstimate(full_bytes=full, changed_bytes=changed, delta_bytes=int(delta_estimate),
                         encode_s=encode_s * scale, decode_s=decode_s * scale, sample_bytes=sampled)


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

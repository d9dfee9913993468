"""The lossless weight deltas of the wire contract: ``DELTA_ENCODING_SPARSE`` and ``DELTA_ENCODING_XOR_ZLIB``.

Both are bit-exact whatever the dtype (raw bits are compared and copied: -0.0, +0.0 and NaN payloads survive),
travel as one safetensors payload, and leave out tensors whose bits did not change. The header's ``tensors``
lists the encoded tensors of the payload and ``decoded_tensors`` the dtype and shape of each tensor the delta
changes.

SPARSE sends only the elements that changed. A changed tensor ``T`` of n elements of w bytes, k of them changed,
is sent in the smallest of three forms:

- gaps (~k + k*w bytes): ``T#values`` (T's dtype, 1-D [k]) the new values in position order, and ``T#gaps``
  (U8, 1-D) their flat positions as distances, one byte each: from position -1, a byte b in 1..255 advances b
  and marks that position; a 0 byte advances 255 and marks nothing (a gap g > 255 is (g-1)//255 zero bytes, then
  one marker). The stream never ends with a 0 byte.
- mask (n/8 + k*w bytes): ``T#values`` as above, and ``T#mask`` (U8, 1-D [ceil(n/8)]): bit i (little bit order)
  set when flat element i changed, padding bits 0. Smaller than gaps once more than ~1/8 of the elements changed.
- whole (n*w bytes): ``T#values`` (1-D [n]) holds the tensor flattened; no positions.

``decoded_tensors`` lists the changed tensors in the order of the model, ``tensors`` every ``T#...`` of the
payload (safetensors' order) and nothing else; the suffixes keep the names apart whatever the model calls its
tensors. The decoder checks that positions are in range (increasing by construction) and as many as the values.

XOR_ZLIB: for each tensor, the raw bits of the new version XOR the
raw bits of the base, zlib-compressed, as a 1-D ``U8`` tensor under the tensor's own name; ``tensors[i]`` and
``decoded_tensors[i]`` name the same tensor. A small step changes few high bits, so the XOR is mostly zero bytes;
but in fp32 every element changes (the XOR compresses to ~50-70 %) and zlib runs at ~50-100 MB/s one way.

    payload, specs, decoded = encode_delta(new_state, base_state, encoding=DELTA_ENCODING_SPARSE)
    header = WeightUpdateHeader(kind=DELTA, delta_encoding=DELTA_ENCODING_SPARSE, tensors=specs,
                                decoded_tensors=decoded, ...)
    changed = decode_delta(payload, header, base_state)  # {name: new tensor} for the tensors in the delta

``estimate_delta`` prices either encoding on a sample before it is built (size, encode and decode times), so a
publisher can send FULL when a delta would not pay (the policy is in ``primerl.trainer.publish``).

Decoding trusts nothing: names, dtypes and shapes are checked against the header and the base, SPARSE positions
against the tensor and the values, and XOR_ZLIB data is decompressed with a bound equal to the tensor's size (a
zip bomb stops there). Anything wrong raises `DeltaError`, with the wire error code to answer.

Speed: `encode_delta` and `decode_delta` work on several tensors at once, on a thread pool (numpy and zlib
release the GIL), largest tensors first; the payload and the error raised do not depend on the number of
threads. The SPARSE kernels are numpy operations over whole arrays, no Python loop per element: the encoder
compares each tensor in cache-sized chunks and takes the positions and values of a chunk while it is in cache;
the decoder copies the base once and writes the values at their positions.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from primerl.proto.tensor_frames import (
    DTYPES,
    TensorEntry,
    TensorFrameError,
    check_tensor_frame,
    parse_header,
    specs_of,
)
from primerl.proto.v1 import common_pb2, data_pb2

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeltaError",
    "DeltaEstimate",
    "SPARSE_SUFFIXES",
    "decode_delta",
    "encode_delta",
    "estimate_delta",
    "sampled_elements",
    "torch_dtype_name",
]

XOR_ZLIB = data_pb2.DELTA_ENCODING_XOR_ZLIB
SPARSE = data_pb2.DELTA_ENCODING_SPARSE
_ENCODINGS = (SPARSE, XOR_ZLIB)
# Unsigned integer of each element width: bits are compared, XORed and copied as these (any width, same bits).
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
VALUES, GAPS, MASK = "#values", "#gaps", "#mask"
SPARSE_SUFFIXES = (VALUES, GAPS, MASK)
"""Suffixes of the encoded tensors of a SPARSE delta (module docstring)."""
_GAP_SKIP = 255  # how far a 0 byte of a gaps stream advances
T = TypeVar("T")
R = TypeVar("R")


class DeltaError(ValueError):
    """A delta that cannot be applied. ``code`` says why, as a wire ``ErrorCode``:
    TENSOR_MISMATCH (names, dtypes or shapes disagree with the header or the base) or MALFORMED_HEADER
    (the header, the compressed data or the positions cannot be read)."""

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


def _as_torch(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D numpy array of raw bits as a 1-D torch tensor of ``dtype`` (sharing its memory)."""
    import torch

    return torch.from_numpy(bits.view(np.uint8)).view(dtype)


def _default_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _map_threads(work: Callable[[T], R], items: list[T], sizes: list[int], num_threads: int | None) -> list[R]:
    """``[work(item) for item in items]``, on ``num_threads`` threads (None: `_default_threads`). The numpy,
    torch and zlib kernels release the GIL, so tensors run side by side; the largest start first so that the
    threads finish together. An exception is raised for the first failing item in ``items``' order, whatever
    the threads' timing, and the items not yet started are dropped."""
    threads = min(num_threads or _default_threads(), len(items))
    if threads <= 1:
        return [work(item) for item in items]
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weight-delta")
    try:
        futures = {i: pool.submit(work, items[i]) for i in sorted(range(len(items)), key=lambda i: -sizes[i])}
        return [futures[i].result() for i in range(len(items))]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _encoding_name(encoding: int) -> str:
    return data_pb2.DeltaEncoding.Name(encoding) if encoding in data_pb2.DeltaEncoding.values() else str(encoding)


# ---------------------------------------------------------------------------------------------------------
# SPARSE: one tensor's raw bits


_SCAN_BYTES = 2 << 20
"""Bytes of a tensor (new and base each) the encoder compares at a time: the compare's output, and the chunk of
``new`` the changed values are read from, are read back while they are still in cache."""


class _Chunk(NamedTuple):
    """What `_scan` found in the flat elements [start, stop) of a tensor: with few changes their positions (flat,
    in the tensor) and new values, with many the packed change mask of the chunk (little bit order)."""

    start: int
    stop: int
    num_changed: int
    positions: np.ndarray | None = None
    values: np.ndarray | None = None
    packed: np.ndarray | None = None


def _sparse_encode(new_bits: np.ndarray, base_bits: np.ndarray, keep_unchanged: bool) -> dict[str, np.ndarray] | None:
    """The SPARSE form of one tensor: {suffix: array} (values as raw bits), or None when nothing changed (and
    ``keep_unchanged`` is false; else an empty gaps form). One pass of whole-array kernels over cache-sized chunks
    (`_scan`); the form is chosen from the sizes counted there, before it is built."""
    chunks = _scan(new_bits, base_bits)
    num_changed = sum(chunk.num_changed for chunk in chunks)
    if num_changed == 0:
        return {GAPS: np.zeros(0, np.uint8), VALUES: new_bits[:0]} if keep_unchanged else None
    numel, width = new_bits.size, new_bits.itemsize
    whole_bytes = numel * width
    values_bytes = num_changed * width
    mask_bytes = -(-numel // 8) + values_bytes
    if min(mask_bytes, num_changed + values_bytes) >= whole_bytes:  # gaps take at least one byte per position
        return {VALUES: new_bits}  # the payload is a copy
    positions, values = _positions_and_values(new_bits, chunks)
    if mask_bytes > num_changed + values_bytes:
        steps, long_at, skips = _steps_of(positions)
        if num_changed + int(skips.sum()) + values_bytes < min(mask_bytes, whole_bytes):
            return {GAPS: _gaps_stream(steps, long_at, skips), VALUES: values}
    if mask_bytes < whole_bytes:
        return {MASK: _packed_mask(chunks), VALUES: values}
    return {VALUES: new_bits}


def _scan(new_bits: np.ndarray, base_bits: np.ndarray) -> list[_Chunk]:
    """Compare two tensors' raw bits chunk by chunk (chunks of a multiple of 8 elements): where under 1/10 of a
    chunk changed, its positions and values are taken at once (the common case of a small step, read from cache);
    elsewhere only its packed mask is kept, for `_positions_and_values` to expand if the form needs it (a tensor
    sent whole never does)."""
    numel = new_bits.size
    step = max(8, _SCAN_BYTES // new_bits.itemsize // 8 * 8)
    scratch = np.empty(min(step, numel), np.bool_)
    chunks = []
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        changed = np.not_equal(new_bits[start:stop], base_bits[start:stop], out=scratch[: stop - start])
        num_changed = int(np.count_nonzero(changed))
        if num_changed == 0:
            chunks.append(_Chunk(start, stop, 0))
        elif num_changed * 10 <= stop - start:
            positions = _changed_positions(changed, num_changed)
            values = np.take(new_bits[start:stop], positions)
            positions += start
            chunks.append(_Chunk(start, stop, num_changed, positions=positions, values=values))
        else:
            chunks.append(_Chunk(start, stop, num_changed, packed=np.packbits(changed, bitorder="little")))
    return chunks


def _positions_and_values(new_bits: np.ndarray, chunks: list[_Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """The flat positions of a tensor's changed elements, increasing, and their new values, from `_scan`."""
    positions, values = [], []
    for chunk in chunks:
        if chunk.num_changed == 0:
            continue
        if chunk.positions is not None and chunk.values is not None:
            positions.append(chunk.positions)
            values.append(chunk.values)
            continue
        assert chunk.packed is not None  # `_scan` keeps one or the other
        changed = np.unpackbits(chunk.packed, count=chunk.stop - chunk.start, bitorder="little").view(np.bool_)
        local = np.flatnonzero(changed)
        values.append(np.take(new_bits[chunk.start : chunk.stop], local))
        local += chunk.start
        positions.append(local)
    if len(positions) == 1:
        return positions[0], values[0]
    return np.concatenate(positions), np.concatenate(values)


def _packed_mask(chunks: list[_Chunk]) -> np.ndarray:
    """The mask form's bits (module docstring) of a tensor, from `_scan`'s chunks."""
    parts = []
    for chunk in chunks:
        if chunk.packed is None:
            changed = np.zeros(chunk.stop - chunk.start, np.bool_)
            if chunk.positions is not None:
                changed[chunk.positions - chunk.start] = True
            parts.append(np.packbits(changed, bitorder="little"))
        else:
            parts.append(chunk.packed)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _changed_positions(changed: np.ndarray, num_changed: int) -> np.ndarray:
    """``np.flatnonzero(changed)`` (a 1-D bool array with ``num_changed`` set), faster when few are set.

    numpy finds the set elements of a bool array branch-free when more than 1/10 of them are set, else by
    searching for each (~1.5x slower at a few %). Below that, the array is read as words of 8 elements: the words
    with a change are found first (about 1/3 of them at 4 % changed), then the elements within those, both
    branch-free."""
    numel = changed.size
    if num_changed * 10 > numel or numel < 64:
        return np.flatnonzero(changed)
    whole_words = numel // 8
    words = changed[: whole_words * 8].view(np.uint64)
    changed_words = np.flatnonzero(words != 0)
    within = np.flatnonzero(words[changed_words].view(np.bool_))
    positions = changed_words[within >> 3]
    positions <<= 3
    positions += within & 7
    if whole_words * 8 == numel:
        return positions
    tail = np.flatnonzero(changed[whole_words * 8 :])
    return np.concatenate((positions, tail + whole_words * 8)) if tail.size else positions


def _steps_of(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, long_at, skips) of strictly increasing flat positions: the distance of each from the one before
    (the first from -1), the indices of the steps over 255, and the 0 bytes each of those needs."""
    steps = np.empty_like(positions)
    steps[0] = positions[0] + 1
    np.subtract(positions[1:], positions[:-1], out=steps[1:])
    long_at = np.flatnonzero(steps > _GAP_SKIP)
    return steps, long_at, (steps[long_at] - 1) // _GAP_SKIP


def _gaps_stream(steps: np.ndarray, long_at: np.ndarray, skips: np.ndarray) -> np.ndarray:
    """The gaps stream (module docstring) of `_steps_of`'s steps: one marker byte per step, and before the
    marker of each long step its ``skips`` 0 bytes (the marker then advances what the 0 bytes left)."""
    markers = steps.astype(np.uint8)  # a long step wraps here and is set right below
    if long_at.size == 0:
        return markers
    markers[long_at] = steps[long_at] - _GAP_SKIP * skips
    return np.insert(markers, np.repeat(long_at, skips), 0)


def _gaps_of(positions: np.ndarray) -> np.ndarray:
    """The gaps stream (module docstring) of strictly increasing flat positions."""
    if positions.size == 0:
        return np.zeros(0, np.uint8)
    return _gaps_stream(*_steps_of(positions))


def _positions_of(name: str, gaps: np.ndarray, numel: int, num_values: int) -> np.ndarray:
    """The flat positions a gaps stream codes, checked: < ``numel``, as many as ``num_values``."""
    if gaps.size == 0:
        positions = np.zeros(0, np.int64)
    elif gaps[-1] == 0:
        raise _malformed(f"tensor {name!r}: the gaps stream ends with a skip byte (0)")
    else:
        num_markers = int(np.count_nonzero(gaps))
        if num_markers != num_values:
            raise _malformed(f"tensor {name!r}: {num_markers} positions but {num_values} values")
        if num_markers == gaps.size:  # no skip byte: each byte is a marker's step
            positions = gaps.astype(np.int64)  # then summed in place: faster than a cumsum that casts
        else:  # each marker's step is its byte plus 255 per skip byte just before it
            skips_at = np.flatnonzero(gaps == 0)
            positions = np.delete(gaps, skips_at).astype(np.int64)
            skipped_to, num_skips = np.unique(skips_at - np.arange(skips_at.size), return_counts=True)
            positions[skipped_to] += _GAP_SKIP * num_skips  # skipped_to: the index of the marker after each run
        np.cumsum(positions, out=positions)
        positions -= 1
    if positions.size != num_values:
        raise _malformed(f"tensor {name!r}: {positions.size} positions but {num_values} values")
    if positions.size and positions[-1] >= numel:
        raise _malformed(f"tensor {name!r}: position {int(positions[-1])} is out of range for {numel} elements")
    return positions


def _mask_of(name: str, mask: np.ndarray, numel: int, num_values: int) -> np.ndarray:
    """The boolean change mask of a mask form, checked: ceil(numel/8) bytes, padding bits 0, as many set bits as
    ``num_values``."""
    if mask.size != -(-numel // 8):
        raise _malformed(
            f"tensor {name!r}: a mask of {mask.size} bytes for {numel} elements (expected {-(-numel // 8)})"
        )
    if numel % 8 and int(mask[-1]) >> (numel % 8):
        raise _malformed(f"tensor {name!r}: the mask sets bits past its {numel} elements")
    changed = np.unpackbits(mask, count=numel, bitorder="little").view(np.bool_)
    num_set = int(np.count_nonzero(changed))
    if num_set != num_values:
        raise _malformed(f"tensor {name!r}: the mask marks {num_set} elements but there are {num_values} values")
    return changed


def _sparse_decode(
    name: str, base_bits: np.ndarray, values: np.ndarray, gaps: np.ndarray | None, mask: np.ndarray | None
) -> np.ndarray:
    """The new raw bits of one tensor (fresh memory), from its base and its SPARSE form (checked)."""
    numel = base_bits.size
    if gaps is not None or mask is not None:
        if gaps is not None:
            positions = _positions_of(name, gaps, numel, values.size)
        else:  # positions: several times faster than a boolean index here
            positions = _changed_positions(_mask_of(name, mask, numel, values.size), values.size)
        out = _fresh_empty(numel, base_bits.dtype)
        np.copyto(out, base_bits)
        np.put(out, positions, values)
        return out
    if values.size != numel:
        raise _malformed(f"tensor {name!r}: {values.size} values for a whole tensor of {numel} elements")
    out = _fresh_empty(numel, values.dtype)
    np.copyto(out, values)
    return out


def _fresh_empty(numel: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised 1-D array for a decoded tensor, in memory torch allocates: numpy asks the kernel for huge
    pages on arrays from 4 MiB on, which may first compact memory (a 1B model's first decode took 2.6 s instead of
    0.65 s on a 2-vCPU VM, later ones the same either way)."""
    import torch

    return torch.empty(numel * np.dtype(dtype).itemsize, dtype=torch.uint8).numpy().view(dtype)


def _malformed(message: str) -> DeltaError:
    return DeltaError(message, common_pb2.ERROR_CODE_MALFORMED_HEADER)


# ---------------------------------------------------------------------------------------------------------
# encode


def encode_delta(
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    *,
    encoding: int = XOR_ZLIB,
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
    if encoding not in _ENCODINGS:
        raise ValueError(f"encoding must be DELTA_ENCODING_SPARSE or DELTA_ENCODING_XOR_ZLIB, got {encoding}")
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
        new_bits, base_bits = _raw_bits(new[name]), _raw_bits(base[name])
        if encoding == SPARSE:
            return _sparse_encode(new_bits, base_bits, keep_unchanged=not changed_only)
        xor = np.bitwise_xor(new_bits, base_bits)
        if changed_only and not xor.any():
            return None
        return zlib.compress(xor.view(np.uint8).data, level)

    names = list(new)
    parts = _map_threads(
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
                encoded[name + suffix] = (decoded[name].dtype if suffix == VALUES else "U8", array)
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


# ---------------------------------------------------------------------------------------------------------
# estimate


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
    encoding: int = XOR_ZLIB,
    level: int = 1,
    sample_fraction: float = 1 / 256,
    min_sample_bytes: int = 64 * 1024,
    max_sample_bytes: int = 1 << 20,
) -> DeltaEstimate:
    """Price a delta without building it: encode and decode one contiguous slice (from the middle) of each
    tensor (`sampled_elements`), timed, and scale by size: ~10-30 ms here for any model size. A tensor whose slice
    did not change counts as unchanged (a sparse change elsewhere in it is missed: the estimate errs towards the
    delta, which is then built exactly). Tensors missing from ``base`` or of another shape raise `DeltaError`."""
    if encoding not in _ENCODINGS:
        raise ValueError(f"encoding must be DELTA_ENCODING_SPARSE or DELTA_ENCODING_XOR_ZLIB, got {encoding}")
    spans = sampled_elements(
        new, sample_fraction=sample_fraction, min_sample_bytes=min_sample_bytes, max_sample_bytes=max_sample_bytes
    )
    price = _price_sparse if encoding == SPARSE else _price_xor_zlib
    full = sampled = 0
    changed = delta = encode_s = decode_s = 0.0
    for name, tensor in new.items():
        if name not in base or tensor.dtype != base[name].dtype or tuple(tensor.shape) != tuple(base[name].shape):
            raise DeltaError(f"tensor {name!r} does not match the base")
        new_bits, base_bits = _raw_bits(tensor), _raw_bits(base[name])
        full += new_bits.nbytes
        if new_bits.size == 0:
            continue
        begin, end = spans[name]
        sampled += (end - begin) * new_bits.itemsize
        priced = price(new_bits[begin:end], base_bits[begin:end], level)
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


def _price_sparse(new_bits: np.ndarray, base_bits: np.ndarray, level: int) -> tuple[int, int, float, float] | None:
    """(changed bytes, encoded bytes, encode s, decode s) of a slice, or None when it did not change."""
    start = time.perf_counter()
    form = _sparse_encode(new_bits, base_bits, keep_unchanged=False)
    middle = time.perf_counter()
    if form is None:
        return None
    _sparse_decode("sample", base_bits, form[VALUES], form.get(GAPS), form.get(MASK))
    end = time.perf_counter()
    changed = int(np.count_nonzero(np.not_equal(new_bits, base_bits))) * new_bits.itemsize
    return changed, sum(a.nbytes for a in form.values()), middle - start, end - middle


def _price_xor_zlib(new_bits: np.ndarray, base_bits: np.ndarray, level: int) -> tuple[int, int, float, float] | None:
    """(changed bytes, encoded bytes, encode s, decode s) of a slice, or None when it did not change."""
    start = time.perf_counter()
    xor = np.bitwise_xor(new_bits, base_bits)
    if not xor.any():
        return None
    compressed = zlib.compress(xor.view(np.uint8).data, level)
    middle = time.perf_counter()
    np.bitwise_xor(np.frombuffer(zlib.decompress(compressed), dtype=base_bits.dtype), base_bits)
    end = time.perf_counter()
    return new_bits.nbytes, len(compressed), middle - start, end - middle


# ---------------------------------------------------------------------------------------------------------
# decode


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
    if header.delta_encoding not in _ENCODINGS:
        raise _malformed(
            f"delta_encoding {_encoding_name(header.delta_encoding)} is neither "
            "DELTA_ENCODING_SPARSE nor DELTA_ENCODING_XOR_ZLIB"
        )
    try:
        entries = check_tensor_frame(payload, header.tensors)
    except TensorFrameError as exc:
        code = common_pb2.ERROR_CODE_TENSOR_MISMATCH if exc.mismatch else common_pb2.ERROR_CODE_MALFORMED_HEADER
        raise DeltaError(f"delta payload: {exc}", code) from None
    view = memoryview(getattr(payload, "buffer", payload)).cast("B")
    decode = _decode_sparse if header.delta_encoding == SPARSE else _decode_xor_zlib
    return decode(view, entries, header, base, num_threads)


def _checked_base(decoded_spec: common_pb2.TensorSpec, base: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The base tensor a decoded tensor replaces, of the same dtype and shape."""
    name = decoded_spec.name
    if name not in base:
        raise DeltaError(f"tensor {name!r} of the delta is not in the base weights")
    base_tensor = base[name]
    base_dtype = torch_dtype_name(base_tensor.dtype)
    if decoded_spec.dtype != base_dtype or tuple(decoded_spec.shape) != tuple(base_tensor.shape):
        raise DeltaError(
            f"tensor {name!r}: the delta decodes to {decoded_spec.dtype}{list(decoded_spec.shape)} but the "
            f"base holds {base_dtype}{list(base_tensor.shape)}"
        )
    return base_tensor


def _decode_sparse(
    view: memoryview,
    entries: dict[str, TensorEntry],
    header: data_pb2.WeightUpdateHeader,
    base: Mapping[str, torch.Tensor],
    num_threads: int | None,
) -> dict[str, torch.Tensor]:
    plan = []
    unclaimed = set(entries)
    for decoded_spec in header.decoded_tensors:
        name = decoded_spec.name
        base_tensor = _checked_base(decoded_spec, base)
        values = entries.get(name + VALUES)
        if values is None:
            raise DeltaError(f"tensor {name!r}: the payload has no {name + VALUES!r}")
        if name + VALUES not in unclaimed:
            raise DeltaError(f"tensor {name!r} is listed twice in decoded_tensors")
        if values.dtype != decoded_spec.dtype or len(values.shape) != 1:
            raise DeltaError(
                f"tensor {name!r}: values must be 1-D {decoded_spec.dtype}, got {values.dtype}{list(values.shape)}"
            )
        positions = [entries[name + s] for s in (GAPS, MASK) if name + s in entries]
        if len(positions) > 1:
            raise DeltaError(f"tensor {name!r}: the payload has both {name + GAPS!r} and {name + MASK!r}")
        for entry in positions:
            if entry.dtype != "U8" or len(entry.shape) != 1:
                raise DeltaError(f"{entry.name!r} must be 1-D U8, got {entry.dtype}{list(entry.shape)}")
        unclaimed -= {name + VALUES, *(entry.name for entry in positions)}
        plan.append((name, base_tensor, values, positions[0] if positions else None))
    if unclaimed:
        raise DeltaError(f"the payload holds tensors no decoded tensor claims: {sorted(unclaimed)[:8]}")

    def decode_one(step: tuple[str, torch.Tensor, TensorEntry, TensorEntry | None]) -> torch.Tensor:
        name, base_tensor, values, positions = step
        base_bits = _raw_bits(base_tensor)
        value_bits = np.frombuffer(view[values.start : values.end], dtype=base_bits.dtype)
        stream = None if positions is None else np.frombuffer(view[positions.start : positions.end], dtype=np.uint8)
        is_gaps = positions is not None and positions.name.endswith(GAPS)
        new_bits = _sparse_decode(name, base_bits, value_bits, stream if is_gaps else None, None if is_gaps else stream)
        return _as_torch(new_bits, base_tensor.dtype).reshape(base_tensor.shape)

    sizes = [step[1].numel() * step[1].element_size() for step in plan]
    return dict(zip((step[0] for step in plan), _map_threads(decode_one, plan, sizes, num_threads), strict=True))


def _decode_xor_zlib(
    view: memoryview,
    entries: dict[str, TensorEntry],
    header: data_pb2.WeightUpdateHeader,
    base: Mapping[str, torch.Tensor],
    num_threads: int | None,
) -> dict[str, torch.Tensor]:
    import torch

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
        plan.append((name, entries[name], _checked_base(decoded_spec, base)))

    def decode_one(step: tuple[str, TensorEntry, torch.Tensor]) -> torch.Tensor:
        name, entry, base_tensor = step
        base_bits = _raw_bits(base_tensor)
        xor = _bounded_decompress(name, view[entry.start : entry.end], base_bits.nbytes)
        if base_tensor.numel() == 0:
            return torch.empty(base_tensor.shape, dtype=base_tensor.dtype)
        new_bits = np.bitwise_xor(
            np.frombuffer(xor, dtype=base_bits.dtype), base_bits, out=_fresh_empty(base_bits.size, base_bits.dtype)
        )
        return _as_torch(new_bits, base_tensor.dtype).reshape(base_tensor.shape)

    sizes = [step[2].numel() * step[2].element_size() for step in plan]
    return dict(zip((step[0] for step in plan), _map_threads(decode_one, plan, sizes, num_threads), strict=True))


def _bounded_decompress(name: str, data: memoryview, expected_bytes: int) -> bytearray:
    """zlib-decompress ``data`` into exactly ``expected_bytes`` bytes, never producing more than one extra."""
    decompressor = zlib.decompressobj()
    try:
        # One byte of room beyond the expected size: a stream that decodes to more is caught there, and one
        # that decodes to exactly the expected size gets to read its end marker.
        out = decompressor.decompress(data, expected_bytes + 1)
    except zlib.error as exc:
        raise _malformed(f"tensor {name!r}: corrupt compressed delta ({exc})") from None
    if len(out) > expected_bytes:
        raise _malformed(f"tensor {name!r}: the delta decompresses to more than the {expected_bytes} bytes expected")
    if not decompressor.eof:
        raise _malformed(f"tensor {name!r}: the compressed delta is truncated")
    if decompressor.unused_data:
        raise _malformed(f"tensor {name!r}: {len(decompressor.unused_data)} bytes after the compressed delta")
    if len(out) != expected_bytes:
        raise _malformed(f"tensor {name!r}: the delta decompresses to {len(out)} bytes, expected {expected_bytes}")
    return bytearray(out)

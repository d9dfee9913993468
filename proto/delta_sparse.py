"""The SPARSE weight delta (``DELTA_ENCODING_SPARSE``): only the elements that changed, bit-exact.

A changed tensor ``T`` of n elements of w bytes, k of them changed, is sent in the smallest of three forms:

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

The kernels are numpy operations over whole arrays, no Python loop per element: the encoder compares each tensor in
cache-sized chunks and takes the positions and values of a chunk while it is in cache; the decoder copies the base
once and writes the values at their positions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from primerl.proto.delta_base import DecodeStep, DeltaError, as_torch, checked_base, fresh_empty, malformed, raw_bits
from primerl.proto.tensor_frames import TensorEntry
from primerl.proto.v1 import data_pb2

if TYPE_CHECKING:
    import torch

VALUES, GAPS, MASK = "#values", "#gaps", "#mask"
_GAP_SKIP = 255  # how far a 0 byte of a gaps stream advances


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


def encode_tensor(new_bits: np.ndarray, base_bits: np.ndarray, keep_unchanged: bool) -> dict[str, np.ndarray] | None:
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
        raise malformed(f"tensor {name!r}: the gaps stream ends with a skip byte (0)")
    else:
        num_markers = int(np.count_nonzero(gaps))
        if num_markers != num_values:
            raise malformed(f"tensor {name!r}: {num_markers} positions but {num_values} values")
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
        raise malformed(f"tensor {name!r}: {positions.size} positions but {num_values} values")
    if positions.size and positions[-1] >= numel:
        raise malformed(f"tensor {name!r}: position {int(positions[-1])} is out of range for {numel} elements")
    return positions


def _mask_of(name: str, mask: np.ndarray, numel: int, num_values: int) -> np.ndarray:
    """The boolean change mask of a mask form, checked: ceil(numel/8) bytes, padding bits 0, as many set bits as
    ``num_values``."""
    if mask.size != -(-numel // 8):
        raise malformed(
            f"tensor {name!r}: a mask of {mask.size} bytes for {numel} elements (expected {-(-numel // 8)})"
        )
    if numel % 8 and int(mask[-1]) >> (numel % 8):
        raise malformed(f"tensor {name!r}: the mask sets bits past its {numel} elements")
    changed = np.unpackbits(mask, count=numel, bitorder="little").view(np.bool_)
    num_set = int(np.count_nonzero(changed))
    if num_set != num_values:
        raise malformed(f"tensor {name!r}: the mask marks {num_set} elements but there are {num_values} values")
    return changed


def decode_bits(
    name: str, base_bits: np.ndarray, values: np.ndarray, gaps: np.ndarray | None, mask: np.ndarray | None
) -> np.ndarray:
    """The new raw bits of one tensor (fresh memory), from its base and its SPARSE form (checked)."""
    numel = base_bits.size
    if gaps is not None or mask is not None:
        if gaps is not None:
            positions = _positions_of(name, gaps, numel, values.size)
        else:  # positions: several times faster than a boolean index here
            positions = _changed_positions(_mask_of(name, mask, numel, values.size), values.size)
        out = fresh_empty(numel, base_bits.dtype)
        np.copyto(out, base_bits)
        np.put(out, positions, values)
        return out
    if values.size != numel:
        raise malformed(f"tensor {name!r}: {values.size} values for a whole tensor of {numel} elements")
    out = fresh_empty(numel, values.dtype)
    np.copyto(out, values)
    return out


def price(new_bits: np.ndarray, base_bits: np.ndarray, level: int) -> tuple[int, int, float, float] | None:
    """(changed bytes, encoded bytes, encode s, decode s) of a slice, or None when it did not change."""
    start = time.perf_counter()
    form = encode_tensor(new_bits, base_bits, keep_unchanged=False)
    middle = time.perf_counter()
    if form is None:
        return None
    decode_bits("sample", base_bits, form[VALUES], form.get(GAPS), form.get(MASK))
    end = time.perf_counter()
    changed = int(np.count_nonzero(np.not_equal(new_bits, base_bits))) * new_bits.itemsize
    return changed, sum(a.nbytes for a in form.values()), middle - start, end - middle


def decode_plan(
    entries: dict[str, TensorEntry], header: data_pb2.WeightUpdateHeader, base: Mapping[str, torch.Tensor]
) -> list[DecodeStep]:
    """One step per decoded tensor, its values and positions checked against the header; every tensor of the
    payload must be claimed by one."""
    plan = []
    unclaimed = set(entries)
    for decoded_spec in header.decoded_tensors:
        name = decoded_spec.name
        base_tensor = checked_base(decoded_spec, base)
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
        plan.append(DecodeStep(name, base_tensor, values, positions[0] if positions else None))
    if unclaimed:
        raise DeltaError(f"the payload holds tensors no decoded tensor claims: {sorted(unclaimed)[:8]}")
    return plan


def decode_tensor(view: memoryview, step: DecodeStep) -> torch.Tensor:
    """The new tensor of one step of `decode_plan`, from the payload ``view``."""
    base_bits = raw_bits(step.base)
    value_bits = np.frombuffer(view[step.data.start : step.data.end], dtype=base_bits.dtype)
    positions = step.positions
    stream = None if positions is None else np.frombuffer(view[positions.start : positions.end], dtype=np.uint8)
    is_gaps = positions is not None and positions.name.endswith(GAPS)
    new_bits = decode_bits(step.name, base_bits, value_bits, stream if is_gaps else None, None if is_gaps else stream)
    return as_torch(new_bits, step.base)

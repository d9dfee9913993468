"""Tensors as safetensors bytes in their own ZMQ frame: encode, check against a header, decode zero-copy.

The safetensors header (8-byte little-endian length, then JSON) is parsed and checked here before any
tensor is touched: dtypes, shapes, offsets inside the buffer, byte counts that match the shapes.
Nothing is ever unpickled. torch is imported only when a caller asks for torch tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from primerl.proto.v1 import common_pb2

# safetensors dtype -> (bytes per element, numpy dtype or None when numpy has none, torch dtype name)
DTYPES: dict[str, tuple[int, Any, str]] = {
    "BOOL": (1, np.bool_, "bool"),
    "U8": (1, np.uint8, "uint8"),
    "I8": (1, np.int8, "int8"),
    "I16": (2, np.int16, "int16"),
    "U16": (2, np.uint16, "uint16"),
    "F16": (2, np.float16, "float16"),
    "BF16": (2, None, "bfloat16"),
    "I32": (4, np.int32, "int32"),
    "U32": (4, np.uint32, "uint32"),
    "F32": (4, np.float32, "float32"),
    "I64": (8, np.int64, "int64"),
    "U64": (8, np.uint64, "uint64"),
    "F64": (8, np.float64, "float64"),
}
_NUMPY_TO_SAFETENSORS = {np.dtype(np_dtype): name for name, (_, np_dtype, _) in DTYPES.items() if np_dtype is not None}
MAX_HEADER_BYTES = 16 << 20
# A safetensors header nests 3 levels (object, tensor entry, list); __metadata__ is a flat object.
MAX_JSON_NESTING = 8
MAX_INT_DIGITS = 20  # uint64 has 20 decimal digits
MAX_TENSOR_DIMS = 64


class TensorFrameError(ValueError):
    """A tensor frame that cannot be trusted. ``truncated``/``mismatch`` say which kind, for error codes."""

    def __init__(self, message: str, *, truncated: bool = False, mismatch: bool = False):
        super().__init__(message)
        self.truncated = truncated
        self.mismatch = mismatch


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset into the whole frame
    end: int


def byte_view(frame: Any) -> memoryview:
    """bytes, bytearray, memoryview or a zmq.Frame (received with copy=False) as a flat byte view."""
    view = memoryview(getattr(frame, "buffer", frame))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def parse_header(frame: Any, total_bytes: int | None = None) -> dict[str, TensorEntry]:
    """Parse and check the safetensors header of ``frame``; offsets returned are absolute in the frame.

    ``total_bytes``: the size of the whole blob when ``frame`` holds only its beginning (at least the length
    prefix and the JSON header), e.g. the first of the segments a payload arrived in."""
    view = byte_view(frame)
    total = view.nbytes if total_bytes is None else total_bytes
    if view.nbytes < 8:
        raise TensorFrameError(
            f"tensor frame of {view.nbytes} bytes is shorter than the 8-byte safetensors length prefix", truncated=True
        )
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > MAX_HEADER_BYTES:
        raise TensorFrameError(f"safetensors header claims {header_len} bytes; the limit is {MAX_HEADER_BYTES}")
    if 8 + header_len > min(view.nbytes, total):
        raise TensorFrameError(
            f"safetensors header claims {header_len} bytes but the frame has {total - 8}", truncated=True
        )
    raw = _load_header_json(view[8 : 8 + header_len])
    data_start = 8 + header_len
    data_bytes = total - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise TensorFrameError("safetensors __metadata__ must be a JSON object of strings")
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise TensorFrameError(
                f"tensor {_short(name)}: header entry must have exactly dtype, shape and data_offsets"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise TensorFrameError(f"tensor {_short(name)}: unsupported dtype {_short(dtype)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_TENSOR_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise TensorFrameError(
                f"tensor {_short(name)}: shape {_short(shape)} is not a list of at most "
                f"{MAX_TENSOR_DIMS} non-negative integers"
            )
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise TensorFrameError(f"tensor {_short(name)}: data_offsets {_short(offsets)} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise TensorFrameError(f"tensor {_short(name)}: data_offsets {_short(offsets)} are not ordered")
        if end > data_bytes:
            raise TensorFrameError(
                f"tensor {_short(name)}: data ends at byte {end} but the frame holds {data_bytes}", truncated=True
            )
        expected = math.prod(shape) * DTYPES[dtype][0]
        if end - begin != expected:
            raise TensorFrameError(
                f"tensor {_short(name)}: {end - begin} bytes for shape {shape} of {dtype} (expected {expected})",
                mismatch=True,
            )
        entries[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    return entries


def _refuse_number(text: str) -> int:
    """``parse_int`` for header JSON: at most ``MAX_INT_DIGITS`` digits (offsets and dims fit in uint64)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise TensorFrameError(
            f"safetensors header holds an integer of {len(text)} characters; at most {MAX_INT_DIGITS} digits"
        )
    return int(text)


def _refuse_float(text: str) -> float:
    raise TensorFrameError(f"safetensors header holds a non-integer number {text[:32]!r}")


def _load_header_json(raw: memoryview) -> dict[str, Any]:
    """The header's JSON object, or ``TensorFrameError``: total over any bytes (no RecursionError,
    ValueError from huge integers, or TypeError escapes)."""
    # Nesting deeper than the format needs (object -> tensor entry -> list) is refused before parsing,
    # so the recursive decoder never runs deep.
    data = bytes(raw)
    if _max_nesting(data) > MAX_JSON_NESTING:
        raise TensorFrameError(f"safetensors header nests JSON deeper than {MAX_JSON_NESTING} levels")
    try:
        parsed = json.loads(data, parse_int=_refuse_number, parse_float=_refuse_float, parse_constant=_refuse_float)
    except TensorFrameError:
        raise
    except (
        ValueError,
        RecursionError,
        TypeError,
        OverflowError,
    ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TensorFrameError(f"safetensors header is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(parsed, dict):
        raise TensorFrameError("safetensors header is not a JSON object")
    return parsed


def _max_nesting(data: bytes) -> int:
    """Upper bound of the JSON nesting depth of ``data`` (brackets inside strings are counted too, which
    only over-estimates: a header whose tensor names hold many brackets is refused, never mis-parsed)."""
    brackets = data.translate(None, _NOT_BRACKETS)
    if len(brackets) <= MAX_JSON_NESTING:
        return len(brackets)
    depth = deepest = 0
    for byte in brackets:
        if byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_NESTING:
                    break
        else:
            depth -= 1
    return deepest


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _short(value: Any, limit: int = 80) -> str:
    """repr of a peer's value, cut to ``limit`` characters (error messages stay small)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def specs_of(entries: Mapping[str, TensorEntry]) -> list[common_pb2.TensorSpec]:
    return [common_pb2.TensorSpec(name=e.name, dtype=e.dtype, shape=list(e.shape)) for e in entries.values()]


def check_tensor_frame(
    frame: Any, specs: Sequence[common_pb2.TensorSpec], total_bytes: int | None = None
) -> dict[str, TensorEntry]:
    """The frame must hold exactly the tensors of ``specs``, with the same dtypes and shapes. ``total_bytes``: see
    ``parse_header``."""
    entries = parse_header(frame, total_bytes)
    declared = {spec.name: spec for spec in specs}
    if len(declared) != len(specs):
        raise TensorFrameError("the header lists a tensor name twice", mismatch=True)
    missing = sorted(set(declared) - set(entries))
    extra = sorted(set(entries) - set(declared))
    if missing or extra:
        raise TensorFrameError(f"tensors differ from the header: missing {missing}, unexpected {extra}", mismatch=True)
    for name, spec in declared.items():
        entry = entries[name]
        if entry.dtype != spec.dtype or entry.shape != tuple(spec.shape):
            raise TensorFrameError(
                f"tensor {name!r} is {entry.dtype}{list(entry.shape)} "
                f"but the header says {spec.dtype}{list(spec.shape)}",
                mismatch=True,
            )
    return entries


def encode_tensors(
    tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[common_pb2.TensorSpec]]:
    """Serialize numpy arrays or torch tensors to safetensors bytes; returns (bytes, specs for the header)."""
    if not tensors:
        raise ValueError("no tensors to encode")
    if any(type(t).__module__.startswith("torch") for t in tensors.values()):
        import torch
        from safetensors.torch import save

        data = save(
            {
                k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))).contiguous()
                for k, v in tensors.items()
            },
            metadata=dict(metadata) if metadata else None,
        )
    else:
        from safetensors.numpy import save

        for name, array in tensors.items():
            if np.asarray(array).dtype not in _NUMPY_TO_SAFETENSORS:
                raise ValueError(
                    f"tensor {name!r}: numpy dtype {np.asarray(array).dtype} has no safetensors equivalent"
                )
        data = save(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=dict(metadata) if metadata else None
        )
    return data, specs_of(parse_header(data))


def decode_tensors(
    frame: Any, specs: Sequence[common_pb2.TensorSpec] | None = None, *, as_torch: bool = False
) -> dict[str, Any]:
    """Tensors of a checked frame. numpy arrays are read-only zero-copy views of the frame;
    torch tensors (``as_torch=True``, required for BF16) are copies."""
    entries = check_tensor_frame(frame, specs) if specs is not None else parse_header(frame)
    view = byte_view(frame)
    if as_torch:
        import torch

        out = {}
        for name, e in entries.items():
            raw = bytearray(view[e.start : e.end])
            dtype = getattr(torch, DTYPES[e.dtype][2])
            tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            out[name] = tensor.reshape(e.shape)
        return out
    out = {}
    for name, e in entries.items():
        np_dtype = DTYPES[e.dtype][1]
        if np_dtype is None:
            raise TensorFrameError(f"tensor {name!r} is {e.dtype}, which numpy cannot hold; decode with as_torch=True")
        out[name] = np.frombuffer(view[e.start : e.end], dtype=np_dtype).reshape(e.shape)
    return out

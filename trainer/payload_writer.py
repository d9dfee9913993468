"""Write tensors as safetensors bytes into a reused buffer: the bytes ``safetensors.torch.save`` would return,
without a new 400 MiB ``bytes`` object per publish.

Why: on this kind of machine (a 2-vCPU VM) the first touch of fresh memory costs more than the copy itself
(measured: 400 MiB into fresh memory 420-520 ms, into memory written before 30-180 ms), and ``save`` returns new
memory every time. `PayloadPool` keeps the buffers of finished publishes for the next ones.

Layout (the safetensors format, as safetensors 0.8 writes it; ``test_publish`` checks byte equality with the file
``save_pretrained`` writes): 8-byte little-endian header length, the JSON header (compact; ``__metadata__`` first,
then the tensors in data order) padded with spaces to a multiple of 8, then the tensors' bytes back to back. The
data order is safetensors' own (by dtype, then name): it is read from ``save`` on one-element stand-ins, so it
follows the installed version.

Invariants: a buffer handed out by `PayloadPool.acquire` is not handed out again until it is released; a caller
releases it only once nothing reads it any more (for a publish: once the broker acknowledged it).
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from primerl.proto.delta_base import torch_dtype_name
from primerl.proto.digests import PayloadHasher

if TYPE_CHECKING:
    import torch

__all__ = ["PayloadPool", "payload_tensors", "safetensors_layout", "write_safetensors"]


def _data_order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names in the order safetensors stores their data (asked of safetensors itself, on stand-ins)."""
    import torch
    from safetensors.torch import save

    probe = save({name: torch.zeros(1, dtype=t.dtype) for name, t in tensors.items()})
    (length,) = struct.unpack("<Q", probe[:8])
    header = json.loads(probe[8 : 8 + length])
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def safetensors_layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """(the 8-byte length + padded JSON header, [(name, begin, end)] absolute offsets in data order)."""
    if not tensors:
        raise ValueError("no tensors to encode")
    order = _data_order(tensors)
    entries: dict[str, Any] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    spans = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": torch_dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        spans.append((name, offset, offset + size))
        offset += size
    header = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    prefix = struct.pack("<Q", len(header)) + header
    return prefix, [(name, len(prefix) + begin, len(prefix) + end) for name, begin, end in spans]


def write_safetensors(
    tensors: Mapping[str, torch.Tensor],
    buffer: Any,
    prefix: bytes,
    spans: list[tuple[str, int, int]],
    *,
    dtype: torch.dtype | None = None,
    hasher: PayloadHasher | None = None,
) -> memoryview:
    """Fill ``buffer`` (writable, at least the payload's size) with the payload of `safetensors_layout`; returns a
    view of exactly the payload. ``dtype``: floating-point tensors are cast to it in the same copy (the layout must
    then be of the cast tensors): no intermediate copy of the model. ``hasher``: fed the payload's bytes in order,
    each piece right after it was written (while it is in cache), so its digest is the payload's."""
    import torch

    total = spans[-1][2] if spans else len(prefix)
    view = memoryview(buffer)
    if view.nbytes < total:
        raise ValueError(f"buffer of {view.nbytes} bytes is smaller than the {total}-byte payload")
    view[: len(prefix)] = prefix
    if hasher is not None:
        hasher.update(view[: len(prefix)])
    written = len(prefix)
    for name, begin, end in spans:
        if end == begin:
            continue
        if hasher is not None and begin > written:  # padding between tensors (none in safetensors' layout)
            hasher.update(view[written:begin])
        source = tensors[name].detach()
        target = dtype if dtype is not None and source.is_floating_point() else source.dtype
        if (end - begin) % target.itemsize or begin % target.itemsize:
            raise ValueError(f"{name}: bytes {begin}..{end} of the layout do not hold {target} elements")
        destination = torch.frombuffer(buffer, dtype=target, count=(end - begin) // target.itemsize, offset=begin)
        destination.view(source.shape).copy_(source)
        if hasher is not None:
            hasher.update(view[begin:end])
        written = end
    if hasher is not None and total > written:
        hasher.update(view[written:total])
    return view[:total]


class PayloadPool:
    """Byte buffers reused from one publish to the next (at most ``max_idle`` kept while unused)."""

    def __init__(self, max_idle: int = 2):
        self.max_idle = max_idle
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def acquire(self, num_bytes: int, *, pinned: bool = False) -> Any:
        """A buffer of at least ``num_bytes``: an idle one when one is big enough, else a new one. ``pinned``: page-
        locked host memory (a uint8 tensor) that a GPU copies into asynchronously, when CUDA is there; else a
        bytearray. Pinning is slow: pooled, it is paid once, not per publish."""
        import torch

        pinned = pinned and torch.cuda.is_available()
        with self._lock:
            fitting = [b for b in self._idle if len(b) >= num_bytes and isinstance(b, torch.Tensor) == pinned]
            if fitting:
                buffer = min(fitting, key=len)
                self._idle = [b for b in self._idle if b is not buffer]  # by identity (a tensor's == is per element)
                return buffer
        if pinned:
            return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        return bytearray(num_bytes)

    def release(self, buffer: Any) -> None:
        """Give a buffer back: nothing may read or write it any more."""
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=len, reverse=True)
            del self._idle[self.max_idle :]


def payload_tensors(payload: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors payload as torch tensors that VIEW it (valid while its buffer is unchanged)."""
    import torch

    from primerl.proto.tensor_frames import DTYPES, parse_header

    out = {}
    for name, entry in parse_header(payload).items():
        dtype = getattr(torch, DTYPES[entry.dtype][2])
        if entry.end > entry.start:
            tensor = torch.frombuffer(
                payload, dtype=dtype, count=(entry.end - entry.start) // dtype.itemsize, offset=entry.start
            )
        else:
            tensor = torch.empty(0, dtype=dtype)
        out[name] = tensor.reshape(entry.shape)
    return out

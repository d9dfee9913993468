"""What the two weight-delta codecs (``delta_sparse``, ``delta_xor_zlib``) share: `DeltaError`, tensors read as
raw bits, the check of a decoded tensor against its base, and the thread pool that runs one tensor per task."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np

from primerl.proto.tensor_frames import DTYPES, TensorEntry
from primerl.proto.v1 import common_pb2

if TYPE_CHECKING:
    import torch

__all__ = ["DecodeStep", "DeltaError", "checked_base", "map_threads", "raw_bits", "torch_dtype_name"]

# Unsigned integer of each element width: bits are compared, XORed and copied as these (any width, same bits).
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
T = TypeVar("T")
R = TypeVar("R")


class DeltaError(ValueError):
    """A delta that cannot be applied. ``code`` says why, as a wire ``ErrorCode``:
    TENSOR_MISMATCH (names, dtypes or shapes disagree with the header or the base) or MALFORMED_HEADER
    (the header, the compressed data or the positions cannot be read)."""

    def __init__(self, message: str, code: int = common_pb2.ERROR_CODE_TENSOR_MISMATCH):
        super().__init__(message)
        self.code = code


def malformed(message: str) -> DeltaError:
    return DeltaError(message, common_pb2.ERROR_CODE_MALFORMED_HEADER)


class DecodeStep(NamedTuple):
    """One tensor to decode, checked against the header: its base, its data in the payload (SPARSE: the values,
    XOR_ZLIB: the compressed XOR) and, for a SPARSE gaps or mask form, its positions."""

    name: str
    base: torch.Tensor
    data: TensorEntry
    positions: TensorEntry | None = None


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string ("F32", "BF16", ...) of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for st_name, (_, _, torch_name) in DTYPES.items():
        if torch_name == name:
            return st_name
    raise DeltaError(f"dtype {dtype} has no safetensors equivalent")


def raw_bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat numpy array of unsigned integers of the element's width (a view when the
    tensor is contiguous and on the CPU)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    width = flat.element_size()
    return flat.view(torch.uint8).numpy().view(_UINT_OF_WIDTH[width])


def as_torch(bits: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A 1-D numpy array of raw bits as a torch tensor of ``like``'s dtype and shape (sharing its memory)."""
    import torch

    return torch.from_numpy(bits.view(np.uint8)).view(like.dtype).reshape(like.shape)


def fresh_empty(numel: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised 1-D array for a decoded tensor, in memory torch allocates: numpy asks the kernel for huge
    pages on arrays from 4 MiB on, which may first compact memory (a 1B model's first decode took 2.6 s instead of
    0.65 s on a 2-vCPU VM, later ones the same either way)."""
    import torch

    return torch.empty(numel * np.dtype(dtype).itemsize, dtype=torch.uint8).numpy().view(dtype)


def checked_base(decoded_spec: common_pb2.TensorSpec, base: Mapping[str, torch.Tensor]) -> torch.Tensor:
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


def _default_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def map_threads(work: Callable[[T], R], items: list[T], sizes: list[int], num_threads: int | None) -> list[R]:
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

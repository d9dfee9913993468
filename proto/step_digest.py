"""A short digest of one step's training data, logged by the orchestrator when it sends a step and by the
trainer when it has trained it, so that anyone (``make chaos``, an operator) can check from the logs that every
step was trained on exactly the data produced for it.

``data_digest(micro_batches)``: SHA-256 over the micro-batches in order (rank, then micro-batch index), each as
its tensors in name order (name, then the raw bytes); the first 16 hex digits. numpy arrays and torch tensors of
the same values give the same digest, so the producer (numpy) and the trainer (torch) agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DIGEST_HEX_CHARS = 16


def _tensor_bytes(tensor: Any) -> bytes:
    if hasattr(tensor, "detach"):  # torch, imported only by callers that already have it
        import torch

        flat = tensor.detach().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return np.ascontiguousarray(tensor).tobytes()


def data_digest(micro_batches: Sequence[Mapping[str, Any]]) -> str:
    """The digest of a step's micro-batches (module docstring)."""
    digest = hashlib.sha256()
    for tensors in micro_batches:
        digest.update(b"\x00batch")
        for name in sorted(tensors):
            digest.update(name.encode() + b"\x00")
            digest.update(_tensor_bytes(tensors[name]))
    return digest.hexdigest()[:DIGEST_HEX_CHARS]

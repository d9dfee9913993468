"""The digest of a weight update's payload (``WeightUpdateHeader.digest``): the publisher computes it, the broker and
each inference worker check it."""

from __future__ import annotations

import hashlib
from typing import Any


def payload_digest(payload: Any) -> str:
    """SHA-256 hex over a bytes-like payload (what ``WeightUpdateHeader.digest`` holds)."""
    return hashlib.sha256(memoryview(payload)).hexdigest()


__all__ = ["payload_digest"]

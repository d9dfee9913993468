"""Dotted keys (``"teacher.model.name"``) into the raw dict of a config, before validation: read, test, fill in.

A value that is not a table where a table is expected is left alone: validation reports it with its path.
"""

from __future__ import annotations

import copy
from typing import Any


def dotted_get(data: Any, dotted: str) -> Any:
    """The value at ``dotted``, or None when any part of the path is missing."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def dotted_has(data: Any, dotted: str) -> bool:
    """Whether ``dotted`` is set (to anything, None included)."""
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.get(part) if isinstance(data, dict) else None
    return isinstance(data, dict) and last in data


def dotted_set_default(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set a copy of ``value`` at ``dotted`` unless something is there already (a user's explicit value wins)."""
    *parents, last = dotted.split(".")
    for part in parents:
        child = data.setdefault(part, {})
        if not isinstance(child, dict):
            return
        data = child
    data.setdefault(last, copy.deepcopy(value))

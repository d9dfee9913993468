"""Role names on the wire: the ``Role`` enum of ``common.proto`` and the spellings users and configs write."""

from __future__ import annotations

from primerl.proto.v1 import common_pb2

TRAINING_FINISHED_REASON = "training finished"
"""The reason trainer rank 0 deregisters with when its loop ran to ``max_steps``: the broker's end-of-run signal."""


def role_names() -> list[str]:
    return [name for name in common_pb2.Role.keys() if name != "ROLE_UNSPECIFIED"]


def role_from_name(role: int | str) -> int:
    """``"trainer"``, ``"ROLE_TRAINER"`` or ``common_pb2.ROLE_TRAINER`` -> ``common_pb2.ROLE_TRAINER``."""
    if isinstance(role, int):
        return role
    key = role.strip().upper()
    key = key if key.startswith("ROLE_") else f"ROLE_{key}"
    if key == "ROLE_INFER":
        key = "ROLE_INFERENCE"
    if key not in common_pb2.Role.keys():
        raise ValueError(f"unknown role {role!r}; expected one of {[n[5:].lower() for n in role_names()]}")
    return common_pb2.Role.Value(key)


__all__ = ["TRAINING_FINISHED_REASON", "role_from_name", "role_names"]

"""Tiny weight updates for tests that need a policy version in a broker's weight fan-out, without sockets."""

from __future__ import annotations

import hashlib

import numpy as np

from primerl.broker.stored_update import StoredUpdate
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_store import PutResult
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import data_pb2

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA


def tiny_update(
    version: int, kind: int = FULL, base: int = 0, *, lineage: int = 0, lineage_base: int = 0, num_values: int = 16
) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    """(header, payload) of a one-tensor update whose bytes depend on the version and lineage."""
    data, specs = tf.encode_tensors({"w": np.full(num_values, (version + lineage) % 256, dtype=np.uint8)})
    header = data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=kind,
        base_version=base,
        tensors=specs,
        digest=hashlib.sha256(data).hexdigest(),
        payload_bytes=len(data),
        lineage=lineage,
        lineage_base_version=lineage_base,
    )
    return header, data


def publish(fanout: WeightFanout, version: int, kind: int = FULL, base: int = 0, **kwargs) -> PutResult:
    """Store a tiny update through the fan-out, as the weight plane does with a trainer's."""
    return fanout.put_update(StoredUpdate.of(*tiny_update(version, kind, base, **kwargs)))

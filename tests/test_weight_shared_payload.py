"""The inference side of a weight update without copies: the shared payload file (`SharedPayload`, `map_shared`),
the subscriber assembling chunks straight into it, and the worker extension reading tensors in place."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from primerl.inference.shared_payload import SharedPayload, map_shared
from primerl.inference.worker_extension import torch_views
from primerl.proto import tensor_frames as tf
from support.weight_plane import CHUNK_BYTES, RECEIVE_S, make_update


def test_shared_payload_grows_is_reused_and_is_read_in_place(tmp_path):
    with SharedPayload(tmp_path) as staging:
        assert os.stat(staging.path).st_mode & 0o777 == 0o600
        first = staging.buffer(10)
        first[:] = b"0123456789"
        assert staging.holds(first) and not staging.holds(memoryview(b"0123456789"))
        assert bytes(map_shared(staging.path, 10)) == b"0123456789"
        first.release()
        staging.write(b"x" * 100)  # grows
        assert staging.size_bytes == 100 and bytes(map_shared(staging.path, 100)) == b"x" * 100
        staging.write(b"abc")  # fits: same file, same mapping
        assert staging.size_bytes == 100 and bytes(map_shared(staging.path, 3)) == b"abc"
        with pytest.raises(ValueError, match="were announced"):
            map_shared(staging.path, 101)
        path = staging.path
    assert not os.path.exists(path)


def test_torch_views_read_the_frame_without_copying():
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "empty": torch.zeros(0)}
    payload, _ = tf.encode_tensors(tensors)
    buffer = bytearray(payload)
    views = torch_views(memoryview(buffer))
    assert set(views) == set(tensors)
    for name, tensor in tensors.items():
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor)
    entry = tf.parse_header(buffer)["a"]
    buffer[entry.start:entry.start + 4] = np.float32(42.0).tobytes()  # a view: sees the change
    assert views["a"][0, 0].item() == 42.0
    with pytest.raises(tf.TensorFrameError):
        torch_views(memoryview(bytearray(b"\x00" * 4)))


@pytest.fixture
def harness(make_weight_plane):
    """`harness(**WeightPlane keyword arguments)`: a weight plane on loopback (conftest's `make_weight_plane`)."""
    return make_weight_plane


def test_subscriber_assembles_chunks_in_the_given_buffer(harness, tmp_path):
    h = harness()
    staging = SharedPayload(tmp_path)
    buffers: list[memoryview] = []

    def payload_buffer(num_bytes: int) -> memoryview:
        buffers.append(staging.buffer(num_bytes))
        return buffers[-1]

    subscriber = h.subscriber("infer-0", payload_buffer=payload_buffer)
    subscriber.hello()
    for version in (1, 2):
        header, data = make_update(version, num_bytes=5 * CHUNK_BYTES + 123)
        h.publisher().publish(header, data, timeout_s=RECEIVE_S)
        got = subscriber.receive(RECEIVE_S)
        assert got is not None
        received_header, payload = got
        assert received_header.policy_version == version and staging.holds(payload)
        assert bytes(payload) == data and bytes(map_shared(staging.path, len(data))) == data
        subscriber.ack(version, apply_ms=1)
    assert len(buffers) == 2  # one buffer per update, both in the same file
    # An update small enough for one message needs no assembly: it is the received frame itself.
    header, data = make_update(3, num_bytes=100)
    h.publisher().publish(header, data, timeout_s=RECEIVE_S)
    got = subscriber.receive(RECEIVE_S)
    assert got is not None and bytes(got[1]) == data and len(buffers) == 2
    staging.close()

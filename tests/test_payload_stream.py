"""``PayloadStream``, the writer of a streamed FULL update (``trainer/payload_stream.py``): the bytes it writes are the
whole-payload writer's, its progress is what the sender waits for, and its failure reaches the sender. The CUDA case
(asynchronous device-to-host copies into pinned memory) runs where torch sees a GPU; it needs torch only, so it runs
on a GPU machine without the rest of the stack: ``python -m pytest tests/test_payload_stream.py``."""

from __future__ import annotations

import pytest
import torch

from primerl.trainer.hf_state_dict import SAFETENSORS_METADATA
from primerl.trainer.payload_stream import PayloadStream
from primerl.trainer.payload_writer import PayloadPool, safetensors_layout, write_safetensors


def layout(tensors, cast):
    shapes = {
        name: torch.empty(t.shape, dtype=cast if cast is not None and t.is_floating_point() else t.dtype, device="meta")
        for name, t in tensors.items()
    }
    return safetensors_layout(shapes, SAFETENSORS_METADATA)


def whole_payload(tensors, cast) -> bytes:
    """What the whole-payload writer builds of ``tensors`` cast to ``cast`` (on the host)."""
    cast_tensors = {
        k: (v.to(cast) if cast is not None and v.is_floating_point() else v).cpu() for k, v in tensors.items()
    }
    prefix, spans = layout(cast_tensors, None)
    return bytes(write_safetensors(cast_tensors, bytearray(spans[-1][2]), prefix, spans))


def some_tensors(device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(300, 77, generator=generator),
        "a.bias": torch.randn(13, generator=generator),
        "steps": torch.arange(5),
        "t.weight": torch.randn(77, 300, generator=generator).t(),  # not contiguous
    }
    return {name: tensor.to(device) for name, tensor in tensors.items()}


@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["own-dtype", "bf16"])
def test_the_payload_stream_writes_the_bytes_of_the_whole_payload_writer(cast):
    tensors = some_tensors()
    prefix, spans = layout(tensors, cast)
    stream = PayloadStream(tensors, cast, PayloadPool().acquire(spans[-1][2]), prefix, spans)
    stream.wait_for(spans[0][2])
    stream.done()
    assert bytes(stream.view) == whole_payload(tensors, cast)


def test_a_failing_writer_is_raised_to_the_sender():
    tensors = {"w": torch.randn(100)}
    prefix, spans = layout(tensors, None)
    stream = PayloadStream({}, None, PayloadPool().acquire(spans[-1][2]), prefix, spans)  # "w" is missing
    with pytest.raises(RuntimeError, match="writing the weight payload failed"):
        stream.wait_for(spans[-1][2], timeout_s=5)


def test_pooled_buffers_are_reused_by_identity():
    pool = PayloadPool()
    first = pool.acquire(1000)
    pool.release(first)
    assert pool.acquire(900) is first
    assert pool.acquire(900) is not first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["own-dtype", "bf16"])
def test_device_weights_are_copied_into_pinned_memory_and_equal_the_host_build(cast):
    tensors = some_tensors("cuda")
    prefix, spans = layout(tensors, cast)
    pool = PayloadPool()
    buffer = pool.acquire(spans[-1][2], pinned=True)
    assert isinstance(buffer, torch.Tensor) and buffer.is_pinned()
    stream = PayloadStream(tensors, cast, buffer, prefix, spans)
    assert stream.on_device
    stream.wait_for(spans[0][2])
    stream.done()
    assert bytes(stream.view) == whole_payload(tensors, cast)
    pool.release(buffer)
    assert pool.acquire(spans[-1][2], pinned=True) is buffer

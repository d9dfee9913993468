"""A FULL payload written while its first chunks are already on the wire (``weight_broadcast.stream``).

``PayloadStream`` writes the safetensors bytes of ``payload_writer.safetensors_layout`` into a pooled buffer, tensor
by tensor in data order, casting to the serving dtype on the way, and tells the sender how far the bytes are final
(``wait_for(end)``), so chunk k goes out while tensor k+1 is still being copied. The content digest cannot be in the
header then (the bytes do not exist yet): the sender computes it in the pass of each chunk's checksum and sends it
with the last chunk (``Chunk.payload_digest``, a digest that follows).

Two writers, one contract:

- host tensors (CPU training): a writer thread copies (and casts) one tensor after the other; torch's copy releases
  the GIL, so it runs beside the sender's hashing and socket sends;
- device tensors (GPU training): every tensor is cast on the device and copied into the buffer with one
  asynchronous device-to-host copy each, all queued at once on a copy stream that first waits for the training
  stream (the step's parameters are final); the buffer is pinned host memory (``PayloadPool(pinned=True)``), so
  the copies run on the GPU's copy engine while the CPU sends, and a CUDA event per tensor says when its bytes are
  in. No thread.

``done()`` waits until every parameter was read: the optimizer must not change them before (the trainer's weights
job already waits for the whole publish). A writer's failure is raised from ``wait_for`` and ``done``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["PayloadStream", "StreamStalled"]

WAIT_TIMEOUT_S = 300.0
"""Longest ``wait_for`` waits for bytes that no writer delivers (a copy that never finishes)."""


class StreamStalled(TimeoutError):
    """The writer did not deliver the bytes asked for within the wait's bound."""


def _copy_into(buffer: Any, begin: int, end: int, source: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> None:
    """Write ``source`` cast to ``dtype`` into ``buffer[begin:end]`` (host memory: a bytearray or a pinned uint8
    tensor): straight into it when ``begin`` is aligned for ``dtype`` (safetensors lays tensors out that way), else
    through a cast copy viewed as bytes."""
    import torch

    target = (
        buffer[begin:end]
        if isinstance(buffer, torch.Tensor)
        else torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=begin)
    )
    source = source.reshape(-1)
    if begin % dtype.itemsize == 0:
        target.view(dtype).copy_(source, non_blocking=non_blocking)
    else:
        target.copy_(source.to(dtype).contiguous().view(torch.uint8), non_blocking=non_blocking)


class PayloadStream:
    """See the module docstring. ``tensors``: the tensors to publish (host or device, any dtype); ``cast``: the
    dtype floating-point tensors are written in (None: their own); ``buffer``: host memory of at least the
    payload's size (from ``PayloadPool``); ``prefix`` and ``spans``: ``safetensors_layout`` of the cast tensors."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        cast: torch.dtype | None,
        buffer: Any,
        prefix: bytes,
        spans: list[tuple[str, int, int]],
    ):
        self.total = spans[-1][2] if spans else len(prefix)
        if len(buffer) < self.total:
            raise ValueError(f"buffer of {len(buffer)} bytes is smaller than the {self.total}-byte payload")
        self.buffer = buffer
        self.view = memoryview(buffer.numpy() if hasattr(buffer, "numpy") else buffer)[: self.total]
        self.view[: len(prefix)] = prefix
        self._tensors = tensors
        self._cast = cast
        self._spans = [span for span in spans if span[2] > span[1]]
        self._ends = [end for _, _, end in self._spans]
        self._written = len(prefix)  # bytes final from the start (host writer)
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._events: list[Any] = []  # device writer: one CUDA event per span, in order
        self._thread: threading.Thread | None = None
        self.on_device = any(t.device.type == "cuda" for t in tensors.values())
        self.write_s = 0.0  # host writer: time spent copying (device writer: until the last copy was queued)
        self.started_s = time.perf_counter()
        if self.on_device:
            self._queue_device_copies()
        else:
            self._thread = threading.Thread(target=self._write_host, name="payload-writer", daemon=True)
            self._thread.start()

    def _target_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self._cast if self._cast is not None and tensor.is_floating_point() else tensor.dtype

    def _write_host(self) -> None:
        try:
            for name, begin, end in self._spans:
                source = self._tensors[name].detach()
                if source.device.type != "cpu":
                    source = source.to("cpu")
                _copy_into(self.buffer, begin, end, source, self._target_dtype(source), non_blocking=False)
                with self._cond:
                    self._written = end
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the sender's thread, raised there
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self.write_s = time.perf_counter() - self.started_s

    def _queue_device_copies(self) -> None:
        import torch

        device = next(t.device for t in self._tensors.values() if t.device.type == "cuda")
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the step's parameters are final
        with torch.cuda.stream(stream):
            for name, begin, end in self._spans:
                source = self._tensors[name].detach()
                dtype = self._target_dtype(source)
                if source.device.type == "cuda" and source.dtype != dtype:
                    source = source.to(dtype)  # cast on the device: half the bytes cross the bus
                _copy_into(self.buffer, begin, end, source, dtype, non_blocking=source.device.type == "cuda")
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)
        self.write_s = time.perf_counter() - self.started_s

    def wait_for(self, end: int, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Return once the payload's first ``end`` bytes are final; raises the writer's error, or ``StreamStalled``."""
        deadline_s = time.monotonic() + timeout_s
        if self.on_device:
            # The span holding byte end-1 and every one before it are done when its event is (one stream, in order).
            index = bisect.bisect_left(self._ends, end)
            if index < len(self._events):
                event = self._events[index]
                while not event.query():
                    if time.monotonic() > deadline_s:
                        raise StreamStalled(f"device-to-host copies did not deliver {end} bytes in {timeout_s} s")
                    time.sleep(0.0005)
            return
        with self._cond:
            while self._written < end and self._error is None:
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise StreamStalled(f"the payload writer delivered {self._written} of {end} bytes in {timeout_s} s")
                self._cond.wait(left_s)
            if self._error is not None:
                raise RuntimeError(f"writing the weight payload failed: {self._error}") from self._error

    def done(self, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Every byte is written (every parameter read); raises the writer's error."""
        self.wait_for(self.total, timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)

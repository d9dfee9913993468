"""``InPlaceTransfer``: one chunked weight update received straight into a caller's buffer (the inference worker's
shared payload file), for ``WeightSubscriber`` with a ``payload_sink``; and ``PayloadSink``, what that caller
provides: where the payload goes, and word of each chunk that landed, so it can start loading before the last.

The content digest (``header.digest``: XXH3-128, or SHA-256 from older publishers) is computed chunk by chunk as the
bytes land, so the whole update's digest is known when its last chunk is in, without another pass over the
payload. The broker forwards chunks before it has checked that digest (cut-through): what the sink is told is
received, not verified; the caller compares ``digest`` with the header before serving anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from primerl.proto import framing
from primerl.proto.digests import hasher_for
from primerl.proto.v1 import data_pb2


class PayloadSink(Protocol):
    """Where a chunked update's payload is written as it arrives. One transfer at a time, every call from the
    subscriber's thread: ``begin_payload``, ``payload_progress`` after each chunk, then ``end_payload`` once."""

    def begin_payload(self, header: data_pb2.WeightUpdateHeader, num_bytes: int) -> memoryview:
        """A writable buffer of exactly ``num_bytes`` for the payload of the update ``header`` announces."""
        ...

    def payload_progress(self, num_bytes: int) -> None:
        """The buffer's first ``num_bytes`` hold the payload's first bytes, as received (not yet verified)."""
        ...

    def end_payload(self, complete: bool) -> None:
        """The transfer is over: every byte is in (True), or it was dropped and never will be (False)."""
        ...


class BufferSink:
    """A ``PayloadSink`` from a function that returns the buffer (``payload_buffer(num_bytes)``), told nothing else."""

    def __init__(self, payload_buffer: Callable[[int], memoryview]):
        self._payload_buffer = payload_buffer

    def begin_payload(self, header: data_pb2.WeightUpdateHeader, num_bytes: int) -> memoryview:
        return self._payload_buffer(num_bytes)

    def payload_progress(self, num_bytes: int) -> None:
        pass

    def end_payload(self, complete: bool) -> None:
        pass


class InPlaceTransfer:
    """The one chunked update being received straight into a sink's buffer: the same checks as
    ``chunked_transfer.ChunkAssembler`` (chunks in order, one header, the declared size, time bounds), without its
    intermediate buffer. ``digest`` is the payload's digest once the last chunk is in. Expired (``expired``) when it
    is open longer than ``timeout_s`` or got no chunk for ``stall_timeout_s``."""

    def __init__(self, first: framing.Message, sink: PayloadSink, timeout_s: float, stall_timeout_s: float):
        chunk = first.envelope.chunk
        buffer = sink.begin_payload(first.header, chunk.total_bytes)
        if buffer.nbytes != chunk.total_bytes:
            sink.end_payload(complete=False)
            raise ValueError(f"the payload sink gave {buffer.nbytes} bytes for a {chunk.total_bytes}-byte transfer")
        self.first = first
        self.key = (first.envelope.sender, chunk.transfer_id)
        self.sink = sink
        self.buffer = buffer
        self.num_bytes = 0
        self.next_index = 0
        now_s = time.monotonic()
        self.deadline_s = now_s + timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.last_chunk_s = now_s
        self.digest: str | None = None
        self._hasher = hasher_for(first.header.digest)
        self._open = True

    def expired(self, now_s: float) -> str | None:
        """Why this transfer is over its time bounds at ``now_s`` (None: it is not)."""
        if now_s > self.deadline_s:
            return "open too long"
        if now_s - self.last_chunk_s > self.stall_timeout_s:
            return f"no chunk for {now_s - self.last_chunk_s:.1f} s"
        return None

    def drop(self) -> None:
        """Abandon the transfer: the sink learns it will never be complete."""
        if self._open:
            self._open = False
            self.sink.end_payload(complete=False)

    def add(self, message: framing.Message) -> framing.Message | None:
        """Write one chunk; the whole message once the last one is in, else None. ``BadChunk`` when it does not
        continue this transfer (the transfer is then dropped: call nothing more on it)."""
        try:
            return self._add(message)
        except framing.FramingError:
            self.drop()
            raise

    def _add(self, message: framing.Message) -> framing.Message | None:
        chunk, first = message.envelope.chunk, self.first.envelope
        if chunk.index != self.next_index:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: expected chunk {self.next_index}, got {chunk.index}")
        if chunk.count != first.chunk.count or chunk.total_bytes != first.chunk.total_bytes:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} changes the count or total size")
        if message.type != self.first.type or message.envelope.header != first.header:
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunk {chunk.index} carries a different header")
        piece = message.payload[0]
        end = self.num_bytes + piece.nbytes
        if end > self.buffer.nbytes:
            raise framing.BadChunk(
                f"transfer {chunk.transfer_id}: chunks exceed the declared {self.buffer.nbytes} bytes"
            )
        self.buffer[self.num_bytes : end] = piece
        self._hasher.update(self.buffer[self.num_bytes : end])
        self.num_bytes = end
        self.next_index += 1
        self.last_chunk_s = time.monotonic()
        self.sink.payload_progress(end)
        if self.next_index < chunk.count:
            return None
        if self.num_bytes != self.buffer.nbytes:
            raise framing.TruncatedMessage(
                f"transfer {chunk.transfer_id}: {self.num_bytes} of {self.buffer.nbytes} bytes arrived"
            )
        whole = framing.Message(type=message.type, header=self.first.header, envelope=first, payload=[self.buffer])
        framing.check_tensor_payload(whole)
        self.digest = self._hasher.hexdigest()
        self._open = False
        self.sink.end_payload(complete=True)
        return whole

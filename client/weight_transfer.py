"""``InPlaceTransfer``: one chunked weight update received straight into a caller's buffer (the inference worker's
shared payload file), for ``WeightSubscriber`` with ``payload_buffer``."""

from __future__ import annotations

import time

from primerl.proto import framing


class InPlaceTransfer:
    """The one chunked update being received straight into a caller's buffer (``WeightSubscriber`` with
    ``payload_buffer``): the same checks as ``chunked_transfer.ChunkAssembler`` (chunks in order, one header, the
    declared size, a time bound), without its intermediate ``bytearray``."""

    def __init__(self, first: framing.Message, buffer: memoryview, timeout_s: float):
        chunk = first.envelope.chunk
        if buffer.nbytes != chunk.total_bytes:
            raise ValueError(f"payload_buffer gave {buffer.nbytes} bytes for a {chunk.total_bytes}-byte transfer")
        self.first = first
        self.key = (first.envelope.sender, chunk.transfer_id)
        self.buffer = buffer
        self.num_bytes = 0
        self.next_index = 0
        self.deadline_s = time.monotonic() + timeout_s

    def add(self, message: framing.Message) -> framing.Message | None:
        """Write one chunk; the whole message once the last one is in, else None. ``BadChunk`` when it does not
        continue this transfer."""
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
            raise framing.BadChunk(f"transfer {chunk.transfer_id}: chunks exceed the declared {self.buffer.nbytes} bytes")
        self.buffer[self.num_bytes:end] = piece
        self.num_bytes = end
        self.next_index += 1
        if self.next_index < chunk.count:
            return None
        if self.num_bytes != self.buffer.nbytes:
            raise framing.TruncatedMessage(f"transfer {chunk.transfer_id}: {self.num_bytes} of {self.buffer.nbytes} "
                                           "bytes arrived")
        whole = framing.Message(type=message.type, header=self.first.header, envelope=first, payload=[self.buffer])
        framing.check_tensor_payload(whole)
        return whole

"""``InPlaceTransfer``: one chunked weight update received straight into a caller's buffer (the inference worker's
shared payload file), for ``WeightSubscriber`` with a ``payload_sink``; and ``PayloadSink``, what that caller
provides: where the payload goes, and word of each chunk that landed, so it can start loading before the last.

The content digest (``header.digest``: XXH3-128, or SHA-256 from older publishers) is computed chunk by chunk as the
bytes land, so the whole update's digest is known when its last chunk is in, without another pass over the
payload. The broker forwards chunks before it has checked that digest (cut-through): what the sink is told is
received, not verified; the caller compares ``digest`` with the header before serving anything.

``ChunkRelay``: a worker's sockets in a relay chain (it forwards each chunk it receives to the next worker).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from primerl.proto import chunked_transfer, framing
from primerl.proto.digests import hasher_for
from primerl.proto.v1 import data_pb2
from primerl.runtime.addresses import url_host
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import (
    CREDENTIALS_REFUSED_STATUS,
    ZAP_ENDPOINT,
    RunTokenServer,
    apply_run_token,
    zap_reply,
    zap_request,
)
from primerl.runtime.zmq_sockets import configure_socket

log = get_logger(__name__)


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

    def adopt_payload(self, header: data_pb2.WeightUpdateHeader, path: str, payload: memoryview) -> memoryview:
        """The same-host road: the payload lies whole and final in the shared segment file ``path``, mapped
        read-only as ``payload`` (valid until the next update). Returns where the update is to be read from:
        ``payload`` itself (read in place), or a buffer of the sink's it was copied into. Not yet verified."""
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

    def adopt_payload(self, header: data_pb2.WeightUpdateHeader, path: str, payload: memoryview) -> memoryview:
        """Copied into the buffer (the function's caller reads it there)."""
        buffer = self._payload_buffer(payload.nbytes)
        buffer[:] = payload
        return buffer


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
        # Copied and hashed block by block: the hash reads each block while the copy left it in cache.
        for start in range(0, piece.nbytes, framing.FUSED_BLOCK_BYTES):
            stop = min(piece.nbytes, start + framing.FUSED_BLOCK_BYTES)
            block = self.buffer[self.num_bytes + start : self.num_bytes + stop]
            block[:] = piece[start:stop]
            self._hasher.update(block)
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
        chunked_transfer.settle_payload_digest(self.first.header, chunk)
        whole = framing.Message(type=message.type, header=self.first.header, envelope=first, payload=[self.buffer])
        framing.check_tensor_payload(whole)
        self.digest = self._hasher.hexdigest()
        self._open = False
        self.sink.end_payload(complete=True)
        return whole


RELAY_HWM = 8
"""Chunks a relay keeps queued for the next worker."""
RELAY_SEND_WAIT_S = 1.0
"""How long a relay waits for the next worker to take a chunk when ``RELAY_HWM`` are queued (e.g. while the connection
comes up); past it the relay of that transfer stops (the broker sends that worker the update once the relay timeout
passes)."""
MAX_RELAY_TARGETS = 4
"""Connections to next workers a relay keeps open (the oldest is closed beyond this)."""
MAX_BROKEN_RELAYS = 16
ZAP_POLL_MS = 200
"""How often the relay's handshake thread looks whether it is to stop."""


class ChunkRelay:
    """A worker's part in a relay chain (``Envelope.relay_hops``, broker ``fanout = "chain"``): a PULL socket bound on
    ``host`` (a free port; ``endpoint`` is what the worker announces in HELLO) where the worker before it sends, and
    PUSH connections to the worker after it. ``forward`` sends a received chunk message on, frames unchanged, never
    blocking for more than ``RELAY_SEND_WAIT_S``: a next worker that takes no more chunks gets no more of that
    transfer.

    With ``run_token`` the token is checked at the handshake too, as on the broker's planes: the relay's sockets
    live in a context of their own whose ZAP handler, a thread of the relay's, admits only peers presenting the
    token (PLAIN), and the PUSH connections present it; a peer without it is refused before it can make this
    worker buffer a byte, whatever the subscriber's thread is doing. Only messages that passed ``framing.decode``
    (checksum, run token) are forwarded. Not thread-safe: the subscriber's thread owns it."""

    def __init__(
        self,
        context: zmq.Context,
        host: str,
        worker_id: str,
        *,
        max_message_bytes: int,
        run_token: str | None = None,
    ):
        self.worker_id = worker_id
        self.run_token = run_token or None
        self._token_server = RunTokenServer(self.run_token) if self.run_token else None
        self._own_context = self._token_server is not None  # one ZAP handler per context: the relay's own
        self._context = zmq.Context() if self._own_context else context
        self.num_refused = 0
        self._zap: zmq.Socket | None = None
        self._zap_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.socket = configure_socket(self._context.socket(zmq.PULL), max_message_bytes=max_message_bytes, linger_ms=0)
        try:
            if self._token_server is not None:
                self._zap = self._context.socket(zmq.ROUTER)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
                self._token_server.apply(self.socket)
                self.socket.zap_domain = b"primerl-relay"
            port = self.socket.bind_to_random_port(f"tcp://{url_host(host)}")
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"cannot bind the weight relay socket on {host!r}: {exc} (set weight_relay_host to an address of "
                "this machine)"
            ) from exc
        self.endpoint = f"tcp://{url_host(host)}:{port}"
        if self._zap is not None:
            self._zap_thread = threading.Thread(target=self._answer_handshakes, name="relay-handshakes", daemon=True)
            self._zap_thread.start()
        self._targets: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()
        self._broken: collections.deque[str] = collections.deque(maxlen=MAX_BROKEN_RELAYS)
        self.num_forwarded_bytes = 0

    def next_hop(self, message: framing.Message) -> str | None:
        """The endpoint this worker forwards ``message`` to (None: it is the last hop, or not in the chain)."""
        hops = message.envelope.relay_hops
        place = next((i for i, hop in enumerate(hops) if hop.worker_id == self.worker_id), None)
        if place is None or place + 1 >= len(hops):
            return None
        endpoint = hops[place + 1].endpoint
        return endpoint if endpoint.startswith(("tcp://", "ipc://")) else None

    def forward(self, message: framing.Message, frames: list[Any]) -> bool:
        """Send ``frames`` (the message as received) to the next hop; True when it went on its way."""
        if message.type != data_pb2.WEIGHT_UPDATE or not message.envelope.relay_hops:
            return False
        endpoint = self.next_hop(message)
        transfer_id = message.envelope.chunk.transfer_id
        if endpoint is None or transfer_id in self._broken:
            return False
        target = self._target(endpoint)
        try:
            try:
                target.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not target.poll(int(RELAY_SEND_WAIT_S * 1000), zmq.POLLOUT):
                    raise
                target.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._broken.append(transfer_id)
            log.warning(
                "the next worker of the weight relay takes no more chunks; it will get the update from the broker",
                next_hop=endpoint,
                transfer_id=transfer_id,
                chunk=message.envelope.chunk.index,
            )
            return False
        self.num_forwarded_bytes += sum(len(frame) for frame in frames[3:])
        return True

    def _target(self, endpoint: str) -> zmq.Socket:
        target = self._targets.get(endpoint)
        if target is None:
            while len(self._targets) >= MAX_RELAY_TARGETS:
                self._targets.popitem(last=False)[1].close(linger=0)
            target = self._context.socket(zmq.PUSH)
            target.setsockopt(zmq.SNDHWM, RELAY_HWM)
            target.setsockopt(zmq.LINGER, 0)
            if self.run_token:
                apply_run_token(target, self.run_token, self.worker_id)
            target.connect(endpoint)
            self._targets[endpoint] = target
        else:
            self._targets.move_to_end(endpoint)
        return target

    def _answer_handshakes(self) -> None:
        """The relay's ZAP handler (its own thread, owning ``_zap`` until ``close``): admit the peers that present
        the run token, refuse the others."""
        assert self._zap is not None and self._token_server is not None
        while not self._stopping.is_set():
            if not self._zap.poll(ZAP_POLL_MS):
                continue
            frames = self._zap.recv_multipart()
            request = zap_request(frames)
            if request is None:
                continue
            _, _, address, mechanism, credentials = request
            refusal = self._token_server.authorize(mechanism, credentials)
            if refusal is None:
                zap_reply(self._zap, frames, 200, "OK")
                continue
            self.num_refused += 1
            if self.num_refused == 1 or self.num_refused % 100 == 0:
                log.warning(
                    f"weight relay connection refused at the handshake: {refusal}",
                    peer=address.decode(errors="replace"),
                    refused=self.num_refused,
                    hint="every worker of a relay chain needs the run token ([broker] run_token or PRIMERL_RUN_TOKEN)",
                )
            zap_reply(self._zap, frames, CREDENTIALS_REFUSED_STATUS, refusal)

    def close(self) -> None:
        for target in self._targets.values():
            target.close(linger=0)
        self._targets.clear()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.socket.close(linger=0)
        if self._zap_thread is not None:
            self._stopping.set()
            self._zap_thread.join()
            self._zap_thread = None
        if self._zap is not None:
            self._zap.close(linger=0)
            self._zap = None
        if self._own_context:
            self._context.term()
            self._own_context = False

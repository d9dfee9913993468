"""Clients of the broker's rollout stream: ``RolloutProducer`` (the orchestrator) and ``RolloutConsumer``
(one per trainer rank).

Each client owns one DEALER socket and must be used from one thread. Every call takes a timeout and
fails with a typed error (``RolloutRefused``, ``RolloutTimeout``) instead of hanging. Retries happen only
here, at the IO edge: a send is repeated when the broker asked to wait (BACKPRESSURE, after
``retry_after_ms``) or when no reply came within ``resend_interval_s`` (the broker may have restarted;
resends are idempotent by batch id), always within the caller's timeout.

Sockets, bounded waits, reply checks and auth come from ``client.dealer.DealerClient``; sizes from ``limits``
(the broker's, ``BrokerLimits.frames`` of its ``RegisterResponse``). A batch bigger than the broker accepts
is refused here at once (``RolloutRefused``, OVERSIZED) instead of costing the connection.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from primerl.client.dealer import DealerClient
from primerl.proto import framing
from primerl.proto.batch_ids import default_batch_id
from primerl.proto.data_plane_limits import DEFAULT_BROKER_LIMITS
from primerl.proto.tensor_frames import decode_tensors, encode_tensors
from primerl.proto.units import MiB
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger
from primerl.runtime.wire_security import CurveClient

log = get_logger("primerl.client.rollouts")

DEFAULT_WINDOW = 8
DEFAULT_MAX_INFLIGHT_BYTES = 512 * MiB


class RolloutStreamError(RuntimeError):
    """A rollout-stream call failed. ``code`` is an ErrorCode (UNSPECIFIED when none applies)."""

    def __init__(self, message: str, code: int = common_pb2.ERROR_CODE_UNSPECIFIED):
        super().__init__(message)
        self.code = code


class RolloutRefused(RolloutStreamError):
    """The broker refused the message; resending it unchanged will not help."""


class FetchStopped(RolloutStreamError):
    """``fetch_step`` gave up because its ``stop_event`` was set."""


class RolloutTimeout(RolloutStreamError, TimeoutError):
    """No (successful) answer within the timeout: broker down, unreachable, or its queue stayed full."""


def pack_batch(
    step: int,
    rank: int,
    micro_batch_index: int,
    num_micro_batches: int,
    tensors: Mapping[str, Any],
    *,
    batch_id: str | None = None,
    num_samples: int = 0,
    num_tokens: int | None = None,
    min_policy_version: int = 0,
    max_policy_version: int = 0,
    num_loss_tokens_global: int = 0,
) -> tuple[data_pb2.RolloutBatchHeader, bytes]:
    """A micro-batch's header and safetensors payload, ready for ``RolloutProducer.send_batch``."""
    payload, specs = encode_tensors(tensors)
    if num_tokens is None:
        input_ids = tensors.get("input_ids")
        num_tokens = int(input_ids.shape[-1]) if input_ids is not None else 0
    header = data_pb2.RolloutBatchHeader(
        step=step,
        rank=rank,
        micro_batch_index=micro_batch_index,
        num_micro_batches=num_micro_batches,
        num_samples=num_samples,
        num_tokens=num_tokens,
        min_policy_version=min_policy_version,
        max_policy_version=max_policy_version,
        tensors=specs,
        batch_id=batch_id or default_batch_id(step, rank, micro_batch_index),
        num_loss_tokens_global=num_loss_tokens_global,
    )
    return header, payload


class _RolloutClient(DealerClient):
    """A DEALER client of the rollout plane: watches for a refusal at the handshake and reconnects after it."""

    MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH  # a full broker refuses at the handshake: reopen after a pause
    plane = "rollout"

    def _on_monitor_events(self, events: Sequence[int], deadline_s: float) -> bool:
        """Refused at the handshake: reopen (``_reopen_after_refusal``); the wait ends so that the caller resends."""
        if not events:
            return False
        self._reopen_after_refusal(deadline_s)
        return True

    def _refused_at_handshake(self, detail: common_pb2.ErrorDetail) -> Exception:
        return RolloutRefused(detail.message, detail.code)

    def _unreachable_hint(self) -> str:
        if not self.num_handshake_refusals:
            return self.timeout_hint
        return (
            f"; the broker refused this connection {self.num_handshake_refusals} time(s) at the handshake because it "
            f"had as many rollout peers as it admits: raise broker.max_rollout_connections or stop idle clients"
        )

    def _send_by(self, frames: list[Any], deadline_s: float) -> None:
        if self.is_closed:
            raise RolloutStreamError("the client is closed")
        if not self._send(frames, deadline_s):
            raise RolloutTimeout(
                f"cannot send to the broker at {self.endpoint}: its queue stays full or it is "
                f"unreachable{self._unreachable_hint()}"
            )

    @staticmethod
    def _error_of(message: framing.Message) -> RolloutRefused:
        error = message.header.error
        return RolloutRefused(
            f"broker refused {data_pb2.MessageType.Name(message.header.refused_type)}: "
            f"{common_pb2.ErrorCode.Name(error.code) if error.code in common_pb2.ErrorCode.values() else error.code}: "
            f"{error.message}",
            error.code,
        )


@dataclass
class _InFlight:
    """One batch of ``send_batches`` between its first send and its durable ack."""

    position: int
    batch_id: str
    header_bytes: bytes
    payload: Any
    checksum: int
    num_bytes: int
    deadline_s: float
    resend_at_s: float = 0.0
    # Set while the broker told us to wait: resend at this time (not before).
    retry_at_s: float | None = None
    message_ids: set[str] = field(default_factory=set)
    last_refusal: str = ""
    generation: int = 0  # the client's socket generation of the last send


class RolloutProducer(_RolloutClient):
    """Sends rollout micro-batches to the broker and waits until each one is spooled (durable).

    ``send_batches`` keeps a window of batches in flight (sent, durable ack not yet back) so that the broker
    always has the next batch waiting and can spool several with one group commit; ``send_batch`` is the
    same with a window of one.
    """

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None = None,
        sender: str = "orchestrator",
        *,
        context: zmq.Context | None = None,
        resend_interval_s: float = 5.0,
        limits: framing.Limits | None = None,
        curve: CurveClient | None = None,
    ):
        """``limits``: the broker's (``BrokerLimits.frames``; default: a broker's defaults). ``curve``: CURVE
        credentials (``BrokerClientConfig.curve_client()``) for a broker that encrypts its planes."""
        super().__init__(
            endpoint, auth_token, sender, context=context, limits=limits or DEFAULT_BROKER_LIMITS.frames, curve=curve
        )
        self.resend_interval_s = resend_interval_s
        self.num_backpressure_waits = 0
        # This producer incarnation, for producer batch ids (``proto.batch_ids.producer_batch_id``): the broker
        # serves a step only from one incarnation's whole set.
        self.producer_id = uuid.uuid4().hex[:16]
        log.info("rollout producer started", producer=self.producer_id, endpoint=endpoint)

    def send_batch(
        self, header: data_pb2.RolloutBatchHeader, payload: Any, timeout_s: float = 60.0
    ) -> data_pb2.RolloutAck:
        """Send one batch; returns its durable ack. While the broker's queue is full, waits the time the
        broker says and resends. Raises ``RolloutRefused`` (a clear error from the broker) or
        ``RolloutTimeout`` (no durable ack within ``timeout_s``)."""
        return self.send_batches([(header, payload)], window=1, timeout_s=timeout_s)[0]

    def send_batches(
        self,
        batches: Iterable[tuple[data_pb2.RolloutBatchHeader, Any]],
        *,
        window: int = DEFAULT_WINDOW,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        timeout_s: float = 60.0,
    ) -> list[data_pb2.RolloutAck]:
        """Send batches ``(header, payload)`` with up to ``window`` of them (and ``max_inflight_bytes`` of
        payload; at least one) in flight; returns their durable acks in input order.

        Each batch must get its durable ack within ``timeout_s`` of its first send (``RolloutTimeout``
        otherwise). A batch the broker tells to wait (BACKPRESSURE) stays in the window and is resent after
        the broker's ``retry_after_ms``; a batch without any answer for ``resend_interval_s`` is resent
        (resends are idempotent by batch id). The first refusal (``RolloutRefused``, naming the batch) ends
        the call: batches still in flight may or may not have been spooled, and resending them is safe.
        ``batches`` is consumed lazily, and each payload must not change until its ack is back.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        source = iter(batches)
        acks: list[data_pb2.RolloutAck | None] = []
        inflight: dict[str, _InFlight] = {}  # batch id -> its state
        by_message: dict[str, _InFlight] = {}  # message id of every send -> its batch
        exhausted = False
        while True:
            if not exhausted:
                exhausted = self._fill_window(source, acks, inflight, by_message, window, max_inflight_bytes, timeout_s)
            if not inflight:
                return acks  # type: ignore[return-value]  # every slot is filled once nothing is in flight
            message = self._recv(self._resend_due(inflight, by_message, timeout_s))
            if message is not None:
                self._take_reply(message, acks, inflight, by_message)

    def _fill_window(
        self,
        source: Iterator[tuple[data_pb2.RolloutBatchHeader, Any]],
        acks: list[data_pb2.RolloutAck | None],
        inflight: dict[str, _InFlight],
        by_message: dict[str, _InFlight],
        window: int,
        max_inflight_bytes: int,
        timeout_s: float,
    ) -> bool:
        """Send the next batches of ``source`` while the window has room; True once ``source`` is exhausted."""
        while len(inflight) < window and (
            not inflight or sum(e.num_bytes for e in inflight.values()) < max_inflight_bytes
        ):
            try:
                header, payload = next(source)
            except StopIteration:
                return True
            entry = self._new_inflight(len(acks), header, payload, timeout_s)
            if entry.batch_id in inflight:
                raise ValueError(f"batch {entry.batch_id!r} appears twice among the batches in flight")
            acks.append(None)
            inflight[entry.batch_id] = entry
            self._send_inflight(entry, by_message)
        return False

    def _resend_due(self, inflight: dict[str, _InFlight], by_message: dict[str, _InFlight], timeout_s: float) -> float:
        """Resend each batch that is due (its BACKPRESSURE wait is over, no answer came for ``resend_interval_s``,
        or the socket is new); `RolloutTimeout` for one past its deadline. Returns when the next one is due."""
        now_s = time.monotonic()
        for entry in list(inflight.values()):
            if now_s >= entry.deadline_s:
                raise RolloutTimeout(
                    f"batch {entry.batch_id!r} got no durable ack from {self.endpoint} within {timeout_s} s"
                    f"{'; last answer: ' + entry.last_refusal if entry.last_refusal else ''}"
                    f"{self._unreachable_hint()}",
                    common_pb2.ERROR_CODE_BACKPRESSURE if entry.last_refusal else common_pb2.ERROR_CODE_UNSPECIFIED,
                )
            due_s = entry.retry_at_s if entry.retry_at_s is not None else entry.resend_at_s
            if now_s >= due_s or entry.generation != self.generation:
                self._send_inflight(entry, by_message)
        return min(
            min(e.deadline_s, e.retry_at_s if e.retry_at_s is not None else e.resend_at_s) for e in inflight.values()
        )

    def _take_reply(
        self,
        message: framing.Message,
        acks: list[data_pb2.RolloutAck | None],
        inflight: dict[str, _InFlight],
        by_message: dict[str, _InFlight],
    ) -> None:
        """A reply to a batch in flight: its durable ack ends it, BACKPRESSURE sets when to resend it, and any other
        refusal raises `RolloutRefused`; late answers to earlier calls are ignored."""
        reply_to = message.envelope.in_reply_to
        entry = by_message.get(reply_to)
        if message.type == data_pb2.ERROR:
            if reply_to and entry is None:
                return  # an answer to an earlier call
            raise (
                self._error_of(message)
                if entry is None
                else RolloutRefused(f"batch {entry.batch_id!r}: {self._error_of(message)}", message.header.error.code)
            )
        if message.type != data_pb2.ROLLOUT_ACK or entry is None or inflight.get(entry.batch_id) is not entry:
            return  # a late answer to an earlier call, or to a batch already acked
        ack = message.header
        if not ack.HasField("error") or ack.error.code == common_pb2.ERROR_CODE_UNSPECIFIED:
            if not ack.durable:
                raise RolloutStreamError(f"broker acked batch {entry.batch_id!r} without making it durable")
            acks[entry.position] = ack
            del inflight[entry.batch_id]
            for message_id in entry.message_ids:
                by_message.pop(message_id, None)
            return
        if ack.error.code != common_pb2.ERROR_CODE_BACKPRESSURE:
            raise RolloutRefused(f"broker refused batch {entry.batch_id!r}: {ack.error.message}", ack.error.code)
        self.num_backpressure_waits += 1
        entry.last_refusal = ack.error.message
        entry.retry_at_s = time.monotonic() + max(0.005, ack.error.retry_after_ms / 1000)

    def _new_inflight(
        self, position: int, header: data_pb2.RolloutBatchHeader, payload: Any, timeout_s: float
    ) -> _InFlight:
        """Serialize the header and compute the checksum once; every (re)send reuses them."""
        if not header.batch_id:
            named = data_pb2.RolloutBatchHeader()
            named.CopyFrom(header)
            named.batch_id = default_batch_id(header.step, header.rank, header.micro_batch_index)
            header = named
        header_bytes = header.SerializeToString(deterministic=True)
        view = memoryview(getattr(payload, "buffer", payload))
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        if view.nbytes > self.limits.max_frame_bytes:
            raise RolloutRefused(
                f"batch {header.batch_id!r} is {view.nbytes} bytes; the broker accepts at most "
                f"{self.limits.max_frame_bytes} (broker.max_rollout_message_bytes): send smaller micro-batches",
                common_pb2.ERROR_CODE_OVERSIZED,
            )
        checksum = framing.compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [view])
        deadline_s = time.monotonic() + timeout_s
        return _InFlight(position, header.batch_id, header_bytes, payload, checksum, view.nbytes, deadline_s)

    def _send_inflight(self, entry: _InFlight, by_message: dict[str, _InFlight]) -> None:
        message_id = uuid.uuid4().hex
        entry.message_ids.add(message_id)
        by_message[message_id] = entry
        frames = framing.encode_raw(
            data_pb2.ROLLOUT_BATCH,
            entry.header_bytes,
            [entry.payload],
            checksum=entry.checksum,
            auth_token=self.auth_token or "",
            sender=self.sender,
            message_id=message_id,
        )
        self._send_by(frames, entry.deadline_s)
        entry.retry_at_s = None
        entry.resend_at_s = time.monotonic() + self.resend_interval_s
        entry.generation = self.generation


class RolloutConsumer(_RolloutClient):
    """Fetches one trainer rank's micro-batches of a step, with credit-based flow control."""

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None = None,
        worker_id: str = "trainer-0",
        rank: int = 0,
        credits: int = 4,
        *,
        context: zmq.Context | None = None,
        request_interval_s: float = 1.0,
        as_torch: bool = False,
        limits: framing.Limits | None = None,
        curve: CurveClient | None = None,
    ):
        """``limits``: the broker's (``BrokerLimits.frames``; default: a broker's defaults). ``curve``: CURVE
        credentials (``BrokerClientConfig.curve_client()``) for a broker that encrypts its planes."""
        if credits < 1:
            raise ValueError(f"credits must be >= 1, got {credits}")
        super().__init__(
            endpoint, auth_token, worker_id, context=context, limits=limits or DEFAULT_BROKER_LIMITS.frames, curve=curve
        )
        self.worker_id = worker_id
        self.rank = rank
        self.credits = credits
        self.request_interval_s = request_interval_s
        self.as_torch = as_torch
        self._said_hello = False

    def hello(self, timeout_s: float = 10.0) -> None:
        """Introduce this rank to the broker (starts a fresh session there) and wait for its answer."""
        deadline_s = time.monotonic() + timeout_s
        hello = data_pb2.Hello(worker_id=self.worker_id, role=common_pb2.ROLE_TRAINER, rank=self.rank)
        message_ids: set[str] = set()
        while True:
            now_s = time.monotonic()
            if now_s >= deadline_s:
                raise RolloutTimeout(
                    f"no answer to HELLO from the broker at {self.endpoint} within {timeout_s} s"
                    f"{self._unreachable_hint()}"
                )
            message_id = uuid.uuid4().hex
            message_ids.add(message_id)
            self._send_by(self._encode(data_pb2.HELLO, hello, message_id=message_id), deadline_s)
            wait_until_s = min(deadline_s, now_s + self.request_interval_s)
            while time.monotonic() < wait_until_s:
                message = self._recv(wait_until_s)
                if message is None:
                    break
                if message.envelope.in_reply_to not in message_ids:
                    continue
                if message.type == data_pb2.ERROR:
                    raise self._error_of(message)
                if message.type == data_pb2.HELLO:
                    self._said_hello = True
                    return

    def fetch_step(
        self,
        step: int,
        timeout_s: float = 60.0,
        *,
        stop_event: threading.Event | None = None,
        on_wait: Callable[[int, int | None], None] | None = None,
    ) -> list[tuple[data_pb2.RolloutBatchHeader, dict[str, Any]]]:
        """All micro-batches of ``step`` for this rank, ordered by micro_batch_index, as (header, tensors).
        ``stop_event``: set it (e.g. from a signal handler) to give up within about a second (``FetchStopped``).
        ``on_wait(num_received, num_expected)``: called about every ``request_interval_s`` while nothing
        arrives (to log what is awaited, or to give up by raising).

        numpy tensors are read-only zero-copy views of the received frames (torch copies with
        ``as_torch=True``). A batch received twice (e.g. after a broker restart) is kept once.
        """
        deadline_s = time.monotonic() + timeout_s
        if not self._said_hello:
            self.hello(timeout_s)
        received: dict[int, tuple[data_pb2.RolloutBatchHeader, dict[str, Any]]] = {}
        num_expected: int | None = None
        request_ids: set[str] = set()

        def request() -> tuple[float, int]:
            nonlocal request_generation
            message_id = uuid.uuid4().hex
            request_ids.add(message_id)
            header = data_pb2.RolloutRequest(step=step, rank=self.rank, credits=self.credits)
            self._send_by(self._encode(data_pb2.ROLLOUT_REQUEST, header, message_id=message_id), deadline_s)
            request_generation = self.generation
            return time.monotonic() + self.request_interval_s, self.credits

        request_generation = self.generation
        resend_at_s, outstanding = request()
        while num_expected is None or len(received) < num_expected:
            if stop_event is not None and stop_event.is_set():
                raise FetchStopped(f"step {step} rank {self.rank}: stopped while waiting for micro-batches")
            now_s = time.monotonic()
            if now_s >= deadline_s:
                raise RolloutTimeout(
                    f"step {step} rank {self.rank}: {len(received)} of "
                    f"{num_expected if num_expected is not None else '?'} micro-batches within {timeout_s} s"
                    f"{self._unreachable_hint()}"
                )
            if now_s >= resend_at_s or outstanding <= 0 or self.generation != request_generation:
                # Nothing for a while (the broker may have restarted and forgotten the request), or the
                # credit is used up: ask again. A request replaces the previous one, never adds to it.
                resend_at_s, outstanding = request()
            message = self._recv(min(deadline_s, resend_at_s))
            if message is None:
                if on_wait is not None:
                    on_wait(len(received), num_expected)
                continue
            if message.type == data_pb2.ERROR:
                if message.envelope.in_reply_to and message.envelope.in_reply_to not in request_ids:
                    continue
                raise self._error_of(message)
            header = message.header
            if message.type == data_pb2.ROLLOUT_BATCH:
                if (header.step, header.rank) != (step, self.rank):
                    continue  # left over from an earlier step
                outstanding -= 1
                resend_at_s = time.monotonic() + self.request_interval_s
                num_expected = header.num_micro_batches
                if header.micro_batch_index not in received:
                    received[header.micro_batch_index] = (
                        header,
                        decode_tensors(message.payload[0], header.tensors, as_torch=self.as_torch),
                    )
            elif message.type == data_pb2.ROLLOUT_STEP_DONE and (header.step, header.rank) == (step, self.rank):
                num_expected = header.num_micro_batches
                if len(received) < num_expected:
                    # The broker thinks it sent everything but some never arrived: asking again for a
                    # finished step makes it start this session over and send them all.
                    resend_at_s, outstanding = request()
        return [received[index] for index in sorted(received)]

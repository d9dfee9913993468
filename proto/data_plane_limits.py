"""The broker's data-plane limits, as both ends know them: ``BrokerLimits`` (``framing.Limits`` and the weight
chunk size), derived from ``broker.max_message_bytes``, and carried to every worker in
``RegisterResponse.limits`` (``primerl.v1.DataPlaneLimits``).

One payload frame (a rollout micro-batch, one weight chunk) is at most ``max_message_bytes``: libzmq's
``MAXMSGSIZE`` applies per frame, so a bigger frame costs its sender the connection. A whole message may exceed
it by ``ENVELOPE_ALLOWANCE_BYTES`` (the fixed frames and the envelope). Weight updates travel as chunks of
``weight_chunk_bytes`` (``broker.weight_chunk_bytes``, at most the frame limit): the broker sends chunks of that
size, and a publisher's chunks must not be larger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from primerl.proto import framing
from primerl.proto.units import MiB
from primerl.proto.v1 import control_pb2

ENVELOPE_ALLOWANCE_BYTES = 1 * MiB
"""Room for the fixed frames and the envelope next to one frame of payload."""
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB
"""``broker.max_message_bytes`` by default; what clients assume of a broker that does not say."""


@dataclass(frozen=True)
class BrokerLimits:
    """What the broker's data planes accept and send (``frames``) and the payload bytes of a weight chunk."""

    frames: framing.Limits
    weight_chunk_bytes: int

    @classmethod
    def for_max_message_bytes(
        cls,
        max_message_bytes: int,
        *,
        max_payload_frames: int = framing.DEFAULT_LIMITS.max_payload_frames,
        max_transfer_bytes: int = framing.DEFAULT_LIMITS.max_transfer_bytes,
        weight_chunk_bytes: int | None = None,
    ) -> BrokerLimits:
        """The limits of a broker whose ``max_message_bytes`` (and payload-frame and transfer bounds, and weight
        chunk size: None, the frame limit) are these."""
        frames = framing.Limits(
            max_frame_bytes=max_message_bytes,
            max_message_bytes=max_message_bytes + ENVELOPE_ALLOWANCE_BYTES,
            max_envelope_bytes=ENVELOPE_ALLOWANCE_BYTES,
            max_payload_frames=max_payload_frames,
            max_transfer_bytes=max_transfer_bytes,
        )
        return cls(frames, weight_chunk_bytes=min(weight_chunk_bytes or max_message_bytes, max_message_bytes))

    def to_proto(self) -> control_pb2.DataPlaneLimits:
        """``DataPlaneLimits`` holds every field of ``framing.Limits`` under the same name, and the chunk size."""
        return control_pb2.DataPlaneLimits(**asdict(self.frames), weight_chunk_bytes=self.weight_chunk_bytes)

    @classmethod
    def from_registration(cls, registration: control_pb2.RegisterResponse | None) -> BrokerLimits:
        """The limits a broker sent with its ``RegisterResponse``; ``DEFAULT_BROKER_LIMITS`` when it sent none (a
        broker before the field)."""
        if registration is None or not registration.HasField("limits"):
            return DEFAULT_BROKER_LIMITS
        message = registration.limits
        frames = framing.Limits(**{limit.name: getattr(message, limit.name) for limit in fields(framing.Limits)})
        return cls(frames, weight_chunk_bytes=message.weight_chunk_bytes)


DEFAULT_BROKER_LIMITS = BrokerLimits.for_max_message_bytes(DEFAULT_MAX_MESSAGE_BYTES)

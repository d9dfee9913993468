"""The weight plane's inference-worker side, without sockets: which ROUTER connection speaks for which worker, and
their HELLOs and WEIGHT_ACKs fed to the fan-out core and answered (``WeightReplies``)."""

from __future__ import annotations

from collections.abc import Callable

from primerl.broker.log_limits import RateLimitedLog
from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_intake import BROKER_SENDER
from primerl.broker.weight_members import Joined
from primerl.broker.weight_relay import valid_relay_endpoint
from primerl.broker.weight_replies import WeightReplies
from primerl.broker.weight_segments import SharedSegments
from primerl.proto import framing
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.runtime.log_setup import get_logger

log = get_logger(__name__)

OnApplied = Callable[[str, int], None]
IsRegistered = Callable[[str], bool]


class WeightSubscribers:
    """Run by the plane's IO thread. ``on_applied(worker_id, policy_version)`` is called whenever a worker
    acknowledges an applied version (or declares one in HELLO); it must be quick and thread-safe.

    ``is_registered(worker_id)``: whether the registry holds that worker alive (None: every worker counts as
    registered). Only a registered worker is put in a relay chain: after a broker restart the workers' subscribers
    say HELLO under their old ids until their control clients have registered again, and such an id, whose
    subscriber is about to close, would break every chain it is planned into (each waits ``weight_relay_timeout_s``
    to heal). It is still a member, sent its updates by the broker itself."""

    def __init__(
        self,
        fanout: WeightFanout,
        replies: WeightReplies,
        segments: SharedSegments,
        on_applied: OnApplied | None,
        is_registered: IsRegistered | None = None,
    ):
        self.is_registered = is_registered
        self.fanout = fanout
        self.replies = replies
        self.segments = segments
        self.on_applied = on_applied
        self._guard_log = RateLimitedLog(log)
        # The connection each subscribed worker said HELLO on last, and the worker id of each such connection.
        self.peers: dict[str, bytes] = {}
        self._worker_ids: dict[bytes, str] = {}

    def is_worker(self, identity: bytes) -> bool:
        """The connection said HELLO as an inference worker."""
        return identity in self._worker_ids

    def hello(self, identity: bytes, message: framing.Message) -> None:
        hello: data_pb2.Hello = message.header
        if hello.role != common_pb2.ROLE_INFERENCE:
            log.debug(
                "hello from a non-inference peer", role=framing.role_name(hello.role), worker_id=hello.worker_id[:128]
            )
            return
        if not hello.worker_id:
            self.replies.refuse(identity, message, common_pb2.ERROR_CODE_MALFORMED_HEADER, "HELLO needs a worker_id")
            return
        worker_id = hello.worker_id
        version = hello.policy_version if hello.HasField("policy_version") else None
        lineage = hello.lineage if version is not None else 0
        self._answer_hello(identity, message)
        previous_id = self._worker_ids.get(identity)
        if previous_id is not None and previous_id != worker_id:  # this connection now speaks for another worker
            self.drop(previous_id)
            self.fanout.forget(previous_id, reason="", count=False)
        reconnected = self.peers.get(worker_id, identity) != identity
        relay_endpoint = hello.relay_endpoint
        if relay_endpoint and not valid_relay_endpoint(relay_endpoint):
            self._guard_log.warning(
                "bad relay endpoint",
                "HELLO names a relay endpoint that is not tcp://host:port or ipc://path (at most 256 characters); "
                "the broker sends this worker its updates itself",
                worker_id=worker_id[:128],
                relay_endpoint=relay_endpoint[:128],
            )
            relay_endpoint = ""
        if relay_endpoint and self.is_registered is not None and not self.is_registered(worker_id):
            relay_endpoint = ""  # not (or no longer) registered: the broker sends it its updates (class docstring)
        outcome = self.fanout.hello(
            worker_id,
            version,
            lineage,
            reconnected=reconnected,
            relay_endpoint=relay_endpoint,
            host_id=hello.host_id[:64],
        )
        if outcome is Joined.FULL:
            self.replies.refuse(
                identity,
                message,
                common_pb2.ERROR_CODE_BACKPRESSURE,
                f"the broker serves at most {self.fanout.max_workers} weight subscribers",
                in_reply_to="",
                retry_after_ms=5000,
            )
            return
        if outcome is Joined.GONE:
            self._guard_log.warning(
                "gone worker",
                "HELLO from a worker the registry lost or saw leave: no pushes until it registers again",
                worker_id=worker_id[:128],
            )
            return
        self.drop(worker_id)
        self.peers[worker_id], self._worker_ids[identity] = identity, worker_id
        if outcome is not Joined.REPEATED and version is not None:
            self._notify_applied(worker_id, version)

    def _answer_hello(self, identity: bytes, message: framing.Message) -> None:
        """Every HELLO gets a WEIGHT_ACK from the broker with the latest version and lineage: the subscriber's
        keep-alive doubles as its check that the broker is there."""
        latest = self.fanout.latest()
        ack = data_pb2.WeightAck(
            policy_version=latest.version, worker_id=BROKER_SENDER, applied=True, lineage=latest.lineage
        )
        self.replies.ack(identity, ack, message.envelope.message_id)

    def ack(self, identity: bytes, message: framing.Message) -> None:
        ack: data_pb2.WeightAck = message.header
        worker_id = self._worker_ids.get(identity)
        taken = (
            None
            if worker_id is None
            else self.fanout.ack(worker_id, ack.policy_version, ack.lineage, applied=ack.applied, error=ack.error)
        )
        if taken is None:
            self.replies.refuse(
                identity,
                message,
                common_pb2.ERROR_CODE_UNKNOWN_WORKER,
                "WEIGHT_ACK from a peer that has not said HELLO (or was forgotten): send HELLO first",
            )
            return
        self.segments.acknowledged(worker_id, ack.policy_version, ack.applied)
        if taken and ack.applied:
            self._notify_applied(worker_id, ack.policy_version)

    def _notify_applied(self, worker_id: str, version: int) -> None:
        if self.on_applied is None:
            return
        try:
            self.on_applied(worker_id, version)
        except Exception:
            log.exception("on_applied callback failed", worker_id=worker_id, policy_version=version)

    def drop(self, worker_id: str) -> None:
        """Forget the connection ``worker_id`` said HELLO on (the fan-out decides about the worker itself)."""
        identity = self.peers.pop(worker_id, None)
        if identity is not None and self._worker_ids.get(identity) == worker_id:
            del self._worker_ids[identity]

    def gone(self, worker_id: str) -> None:
        """The peer of ``worker_id`` disconnected: it leaves the fan-out until its next HELLO."""
        self.drop(worker_id)
        self.fanout.forget(worker_id, reason="peer disconnected")

    def drop_departed(self) -> None:
        """Connections of workers the fan-out no longer holds (forgotten, gone): their next HELLO maps them again."""
        members = set(self.fanout.member_ids())
        for worker_id in [w for w in self.peers if w not in members]:
            self.drop(worker_id)

"""A weight plane on loopback for tests (`WeightPlaneHarness`): the broker's `WeightPlane` on port 0 over a
`WeightStore`, with publishers, subscribers and raw DEALER sockets that close with it, and small updates to send.
`conftest.py`'s `make_weight_plane` starts them and closes them after the test."""

from __future__ import annotations

import threading

import numpy as np
import zmq

from primerl.broker.weight_fanout import WeightFanout
from primerl.broker.weight_intake import IntakeBounds
from primerl.broker.weight_plane import WeightPlane
from primerl.broker.weight_store import WeightStore
from primerl.client.weight_publisher import WeightPublisher
from primerl.client.weights import WeightSubscriber
from primerl.proto import tensor_frames as tf
from primerl.proto.data_plane_limits import BrokerLimits
from primerl.proto.v1 import data_pb2
from primerl.runtime.zmq_sockets import connect_dealer

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
TOKEN = "run-secret"
CHUNK_BYTES = 64 * 1024
LIMITS = BrokerLimits.for_max_message_bytes(1 << 20).frames
RECEIVE_S = 10.0
FANOUT_KEYS = ("ack_timeout_s", "max_retries", "max_workers", "fanout", "relay_timeout_s")  # WeightFanout's
BOUNDS_KEYS = tuple(IntakeBounds.__dataclass_fields__)  # IntakeBounds' fields


def make_update(version: int, kind: int = FULL, base: int = 0, num_bytes: int = 4096, **fields):
    """(header, payload) of an update holding one uint8 tensor "w" of `num_bytes` random bytes (seeded by
    `version`)."""
    rng = np.random.default_rng(version)
    data, specs = tf.encode_tensors({"w": rng.integers(0, 255, num_bytes, dtype=np.uint8)})
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=kind, base_version=base, tensors=specs, **fields)
    return header, data


class FakeBroker:
    """A bare ROUTER standing in for the broker's weight plane: it admits ``sender`` presenting ``TOKEN`` at the
    handshake (a PLAIN server, with zmq.auth's ZAP handler on ``context``), and the test drives every message."""

    def __init__(self, context: zmq.Context, sender: str):
        from zmq.auth.thread import ThreadAuthenticator

        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_plain(domain="*", passwords={sender: TOKEN})
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.plain_server = True
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")

    def close(self) -> None:
        self.router.close(linger=0)
        self._authenticator.stop()


class WeightPlaneHarness:
    """A started `WeightPlane` (run token `TOKEN`, chunks of `CHUNK_BYTES`); `applied` lists the
    (worker id, version) acknowledgements it reported."""

    def __init__(self, **plane_kwargs):
        self.context = zmq.Context()
        self.store = WeightStore(max_deltas=plane_kwargs.pop("max_deltas", 16))
        self.applied: list[tuple[str, int]] = []
        self._applied_lock = threading.Lock()
        fanout_kwargs = {key: plane_kwargs.pop(key) for key in FANOUT_KEYS if key in plane_kwargs}
        bounds = IntakeBounds(**{key: plane_kwargs.pop(key) for key in BOUNDS_KEYS if key in plane_kwargs})
        self.plane = WeightPlane(
            WeightFanout(self.store, **fanout_kwargs),
            self.context,
            "127.0.0.1",
            0,
            LIMITS,
            TOKEN,
            CHUNK_BYTES,
            on_applied=self._on_applied,
            intake_bounds=bounds,
            **plane_kwargs,
        )
        self.port = self.plane.start()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._clients: list = []

    def _on_applied(self, worker_id: str, version: int) -> None:
        with self._applied_lock:
            self.applied.append((worker_id, version))

    def publisher(self, token: str | None = TOKEN) -> WeightPublisher:
        publisher = WeightPublisher(self.endpoint, token, "trainer", CHUNK_BYTES, context=self.context, limits=LIMITS)
        self._clients.append(publisher)
        return publisher

    def subscriber(self, worker_id: str, token: str | None = TOKEN, **kwargs) -> WeightSubscriber:
        subscriber = WeightSubscriber(self.endpoint, token, worker_id, context=self.context, limits=LIMITS, **kwargs)
        self._clients.append(subscriber)
        return subscriber

    def dealer(self) -> zmq.Socket:
        socket = connect_dealer(
            self.context, self.endpoint, max_message_bytes=LIMITS.max_frame_bytes, run_token=TOKEN, sender="raw"
        )
        self._clients.append(socket)
        return socket

    def close(self) -> None:
        for client in self._clients:
            client.close(linger=0) if isinstance(client, zmq.Socket) else client.close()
        assert self.plane.stop(5.0)
        self.context.destroy(linger=0)

"""The broker's resident memory under adversarial inputs with a valid CRC, at its defaults (with a run token).

Per round: 4 messages of 4 x 16 MiB with a wrong token on each socket, 8 accepted 2 MiB rollout batches (then
backpressure), and 8 half-open weight transfers of 16 MiB chunks from 8 connections. Prints the broker's RSS after
each. Usage, from the repository root: .venv/bin/python tests/scripts/broker_memory_adversarial.py [rounds]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.daemons import BrokerProcess  # noqa: E402

from primerl.client.rollouts import RolloutProducer, RolloutStreamError, pack_batch  # noqa: E402
from primerl.proto import chunked_transfer, framing  # noqa: E402
from primerl.proto import tensor_frames as tf  # noqa: E402
from primerl.proto.units import MiB  # noqa: E402
from primerl.proto.v1 import data_pb2  # noqa: E402
from primerl.runtime.wire_security import apply_run_token

TOKEN = "adversarial-token"


def main(num_rounds: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="broker-memory-"))
    broker = BrokerProcess(tmp, tmp / "spool", "--run-token", TOKEN, "--prometheus.enabled", "false")
    context = zmq.Context()

    def rss_mib() -> float:
        return broker.rss_bytes() / MiB

    def dealer(port: int) -> zmq.Socket:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, 5000)
        apply_run_token(socket, TOKEN, "adversary")  # past the handshake: what a peer with the token can do
        socket.connect(f"tcp://127.0.0.1:{port}")
        return socket

    print(f"start: broker RSS {rss_mib():.0f} MiB", flush=True)
    try:
        for round_index in range(num_rounds):
            unauthenticated = framing.encode(
                data_pb2.HELLO, data_pb2.Hello(), [b"x" * (16 * MiB)] * 4, auth_token="wrong"
            )
            for port in (broker.ports["rollout_port"], broker.ports["weight_port"]):
                socket = dealer(port)
                for _ in range(4):
                    socket.send_multipart(unauthenticated)
                time.sleep(0.5)
                socket.close(linger=0)
            print(f"round {round_index}: unauthenticated 4 x 16 MiB: RSS {rss_mib():.0f} MiB", flush=True)
            rollout = f"tcp://127.0.0.1:{broker.ports['rollout_port']}"
            with RolloutProducer(rollout, TOKEN, sender=f"adversary-{round_index}") as producer:
                for rank in range(8):
                    header, payload = pack_batch(
                        10 + round_index, rank, 0, 1, {"input_ids": np.full((2 * MiB) // 8, rank, np.int64)}
                    )
                    try:
                        producer.send_batch(header, payload, timeout_s=3)
                    except (RolloutStreamError, TimeoutError) as exc:
                        print(f"  {type(exc).__name__}: {str(exc)[:100]}")
                        break
            print(f"round {round_index}: rollout batches: RSS {rss_mib():.0f} MiB", flush=True)
            payload, specs = tf.encode_tensors({"w": np.zeros((48 * MiB) // 4, np.float32)})
            header = data_pb2.WeightUpdateHeader(
                policy_version=5 + round_index,
                kind=data_pb2.WEIGHT_UPDATE_KIND_FULL,
                tensors=specs,
                payload_bytes=len(payload),
                digest="xxh3-128:" + "0" * 32,
            )
            sockets = []
            for index in range(8):
                socket = dealer(broker.ports["weight_port"])
                chunks = chunked_transfer.encode_chunked(
                    data_pb2.WEIGHT_UPDATE,
                    header,
                    payload,
                    chunk_bytes=16 * MiB,
                    transfer_id=f"t{round_index}-{index}",
                    sender=f"adversary{index}",
                    auth_token=TOKEN,
                )
                socket.send_multipart(next(iter(chunks)))
                sockets.append(socket)
            time.sleep(1)
            print(f"round {round_index}: 8 half-open transfers: RSS {rss_mib():.0f} MiB", flush=True)
            for socket in sockets:
                socket.close(linger=0)
        time.sleep(3)
        print(f"end: broker RSS {rss_mib():.0f} MiB", flush=True)
    finally:
        context.destroy(linger=0)
        print("broker exit status", broker.stop())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)

"""A relaying weight subscriber as its own process, for tests of relay fan-out against a real broker process:
a ``WeightSubscriber`` with a relay socket that receives updates, checks each one's digest, acknowledges it and
writes one JSON line per event to ``--out``: ``{"chunk": n}`` after each chunk landed, ``{"version": v, "ok": ..}``
per update. ``--chunk-delay-s`` makes it a slow worker (the test SIGKILLs it mid-relay). ``--grpc-address``:
register with the broker first, as WORKER_ID (the name), and subscribe under the id the broker gives (a broker
relays only through registered workers); the first line of OUT is then ``{"worker_id": id}``.

    python tests/scripts/relay_subscriber.py ENDPOINT TOKEN WORKER_ID OUT [--chunk-delay-s S] [--run-s S]
                                             [--hello-when PATH] [--grpc-address HOST:PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import time


class Sink:
    def __init__(self, out, delay_s: float):
        self.out, self.delay_s, self.num_chunks = out, delay_s, 0
        self.buffer = bytearray()

    def begin_payload(self, header, num_bytes):
        self.buffer = bytearray(num_bytes)
        return memoryview(self.buffer)

    def payload_progress(self, num_bytes):
        self.num_chunks += 1
        self.out.write(json.dumps({"chunk": self.num_chunks, "bytes": num_bytes, "t": time.monotonic()}) + "\n")
        self.out.flush()
        time.sleep(self.delay_s)

    def end_payload(self, complete):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("token")
    parser.add_argument("worker_id")
    parser.add_argument("out")
    parser.add_argument("--chunk-delay-s", type=float, default=0.0)
    parser.add_argument("--run-s", type=float, default=60.0)
    parser.add_argument("--hello-when", default=None, help="say HELLO once this file exists (the test orders joins)")
    parser.add_argument("--grpc-address", default=None, help="register with the broker there first")
    args = parser.parse_args()
    worker_id = args.worker_id
    if args.grpc_address:
        from primerl.client.control import ControlClient
        from primerl.runtime.config_common import BrokerClientConfig

        config = BrokerClientConfig(address=args.grpc_address, run_token=args.token)
        control = ControlClient(config, "inference", worker_id)
        control.start_heartbeats()
        while control.worker_id is None:
            time.sleep(0.05)
        worker_id = control.worker_id
        with open(args.out, "a") as out:
            out.write(json.dumps({"worker_id": worker_id}) + "\n")

    from primerl.client.weights import WeightSubscriber
    from primerl.proto.digests import payload_digest
    from primerl.runtime.log_setup import configure_logging

    configure_logging("inference", "relay-test", level="warning")
    with open(args.out, "a") as out:
        sink = Sink(out, args.chunk_delay_s)
        subscriber = WeightSubscriber(
            args.endpoint,
            args.token,
            worker_id,
            payload_sink=sink,
            relay_host="127.0.0.1",
            hello_interval_s=0.5,
            stall_timeout_s=2.0,
        )
        while args.hello_when and not os.path.exists(args.hello_when):
            time.sleep(0.02)
        subscriber.hello()
        out.write(json.dumps({"relay_endpoint": subscriber.relay.endpoint}) + "\n")
        out.flush()
        deadline = time.monotonic() + args.run_s
        try:
            while time.monotonic() < deadline:
                got = subscriber.receive(0.2)
                if got is None:
                    continue
                header, payload = got
                # a whole (unchunked) update is not hashed as it lands: hash it here, as the inference worker does
                ok = (subscriber.received_digest or payload_digest(payload)) == header.digest
                subscriber.ack(header.policy_version)
                out.write(json.dumps({"version": header.policy_version, "ok": ok, "t": time.monotonic()}) + "\n")
                out.flush()
        finally:
            subscriber.close()


if __name__ == "__main__":
    main()

"""A relaying weight subscriber for chaos runs (``python scripts/chaos/relay_worker.py ENDPOINT WORKER_ID``, the run
token in ``$PRIMERL_RUN_TOKEN``): it joins the broker's relay chains (``broker.weight_fanout = "chain"``) like an
inference worker without vLLM, checks each update's digest, acknowledges it, and logs JSON lines (``relay worker
ready``, ``relay worker applied``). ``--forward-delay-s`` makes its hop to the next worker a slow link for the
updates up to ``--slow-until-version``: it logs ``relay worker holding`` when such an update's first chunk arrives
and forwards each chunk that long after it arrived, so that a kill on that line finds it in the middle of relaying
the update, whatever the machine's load. With ``--grpc-address`` it first registers with the broker as an inference
worker named WORKER_ID and heartbeats (a broker puts only registered workers in relay chains) and subscribes under
the id the broker gave. It exits 0 on SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone


def say(event: str, level: str = "info", **fields) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    print(json.dumps({"event": event, "level": level, "timestamp": stamp, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("endpoint")
    parser.add_argument("worker_id")
    parser.add_argument("--forward-delay-s", type=float, default=0.0)
    parser.add_argument("--slow-until-version", type=int, default=0)
    parser.add_argument("--relay-host", default="127.0.0.1", help="the address its relay socket binds")
    parser.add_argument("--grpc-address", default=None, help="the broker's gRPC address: register there first")
    args = parser.parse_args(argv)
    worker_id, control = args.worker_id, None
    if args.grpc_address:
        from primerl.client.control import ControlClient
        from primerl.runtime.config_common import BrokerClientConfig

        config = BrokerClientConfig(address=args.grpc_address, run_token=os.environ.get("PRIMERL_RUN_TOKEN"))
        control = ControlClient(config, "inference", args.worker_id)
        worker_id = control.register().worker_id
        control.start_heartbeats()

    from primerl.client.weights import WeightSubscriber
    from primerl.proto.digests import payload_digest
    from primerl.proto.v1 import data_pb2

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    subscriber = WeightSubscriber(
        args.endpoint,
        os.environ.get("PRIMERL_RUN_TOKEN"),
        worker_id,
        payload_buffer=lambda num_bytes: memoryview(bytearray(num_bytes)),
        relay_host=args.relay_host,
        hello_interval_s=1.0,
    )
    relay = subscriber.relay
    assert relay is not None
    if args.forward_delay_s > 0:
        forward = relay.forward

        def slow_forward(message, frames):
            relayed = message.type == data_pb2.WEIGHT_UPDATE and relay.next_hop(message) is not None
            version = message.header.policy_version if relayed else 0
            if relayed and version <= args.slow_until_version:
                if message.envelope.chunk.index == 0:
                    say("relay worker holding", worker_id=args.worker_id, policy_version=version)
                time.sleep(args.forward_delay_s)
            return forward(message, frames)

        relay.forward = slow_forward  # type: ignore[method-assign]
    try:
        subscriber.hello()
        say("relay worker ready", worker_id=args.worker_id, relay_endpoint=relay.endpoint)
        while not stopping:
            got = subscriber.receive(0.2)
            if got is None:
                continue
            header, payload = got
            ok = (subscriber.received_digest or payload_digest(payload)) == header.digest
            subscriber.ack(header.policy_version, applied=ok)
            say("relay worker applied", worker_id=args.worker_id, policy_version=header.policy_version, digest_ok=ok)
    finally:
        subscriber.close()
        if control is not None:
            control.deregister("stopped")
            control.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

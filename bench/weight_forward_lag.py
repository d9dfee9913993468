#!/usr/bin/env python
"""What the broker adds to a weight transfer: its forward lag against the whole transfer.

    .venv/bin/python bench/weight_forward_lag.py [MIB]      # default 1852 MiB: the 1B bf16 model's payload

A ``WeightPublisher`` (this process, 64 MiB chunks as the trainer sends) -> the broker's ``WeightPlane`` (this
process, its own IO thread) -> a ``WeightSubscriber`` in another process; four FULL updates of MIB random bytes.
Per update: the publisher's ack, when the subscriber holds the whole update, and the plane's ``forward_lag_s``
(``primerl_broker_weight_forward_lag_seconds``: from the update's last byte into the broker, when it is stored, to
its last chunk handed to the worker's socket) as a share of the transfer. The subscriber's time after the ack is
the last chunk on the wire plus the subscriber's own check and copy.
"""

import multiprocessing as mp
import sys
import time

import numpy as np
import zmq

MB = int(sys.argv[1]) if len(sys.argv) > 1 else 1852


def sub_main(endpoint, conn):
    import zmq

    from primerl.client.weights import WeightSubscriber
    from primerl.proto.data_plane_limits import BrokerLimits

    lim = BrokerLimits.for_max_message_bytes(256 << 20)
    ctx = zmq.Context()
    sub = WeightSubscriber(endpoint, "tok", "w0", context=ctx, limits=lim.frames)
    sub.hello()
    conn.send("ready")
    while True:
        got = sub.receive(120)
        if got is None:
            break
        sub.ack(got[0].policy_version)
        conn.send(("got", got[0].policy_version, time.time()))
        if got[0].policy_version >= 4:
            break
    sub.close()
    ctx.destroy(0)


if __name__ == "__main__":
    from primerl.broker.weight_fanout import WeightFanout
    from primerl.broker.weight_plane import WeightPlane
    from primerl.broker.weight_store import WeightStore
    from primerl.client.weight_publisher import WeightPublisher
    from primerl.proto import tensor_frames as tf
    from primerl.proto.data_plane_limits import BrokerLimits
    from primerl.proto.v1 import data_pb2
    from primerl.runtime.log_setup import configure_logging

    configure_logging("bench", "bench", level="warning")
    lim = BrokerLimits.for_max_message_bytes(256 << 20)
    ctx = zmq.Context()
    plane = WeightPlane(WeightFanout(WeightStore()), ctx, "127.0.0.1", 0, lim.frames, "tok", lim.weight_chunk_bytes)
    port = plane.start()
    ep = f"tcp://127.0.0.1:{port}"
    a, b = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=sub_main, args=(ep, b))
    p.start()
    assert a.recv() == "ready"
    time.sleep(1)
    data, specs = tf.encode_tensors({"w": np.random.default_rng(0).integers(0, 255, MB << 20, dtype=np.uint8)})
    pub = WeightPublisher(ep, "tok", "trainer", 64 << 20, context=ctx, limits=lim.frames)
    for v in (1, 2, 3, 4):
        header = data_pb2.WeightUpdateHeader(policy_version=v, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
        t0 = time.time()
        pub.publish(header, data, timeout_s=300)
        t_ack = time.time()
        tag, ver, t_got = a.recv()
        st = plane.status()
        transfer = t_got - t0
        print(
            f"v{v}: ack {t_ack - t0:.2f} s, subscriber has it {transfer:.2f} s, broker forward lag "
            f"{st.forward_lag_s * 1000:.0f} ms (v{st.forward_lag_version}) = "
            f"{st.forward_lag_s / transfer:.1%} of the transfer",
            flush=True,
        )
    p.join(60)
    pub.close()
    plane.stop()
    ctx.destroy(0)

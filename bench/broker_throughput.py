#!/usr/bin/env python
"""Broker throughput versus raw pyzmq PUSH->PULL on loopback, measured side by side in one run.

    .venv/bin/python bench/broker_throughput.py [--sizes-mib 1 16 64] [--receivers 1 4] [--repeats 3]
                                                 [--quick] [--markdown PATH]

For each message size S and receiver count N:

(a) raw: pyzmq PUSH->PULL over TCP 127.0.0.1, one PUSH socket per receiver. "stream": K messages of S bytes
    to each receiver (K = max(1, 64 // S_MiB), so every measurement moves ~64 MiB per receiver); "single":
    one message of S bytes to each of the N receivers (N separate raw sends).
(b) relay: the broker's rollout stream, orchestrator ``RolloutProducer.send_batches`` (a window of
    ``--window`` batches in flight) -> broker ``RolloutPlane`` (which spools every batch, fsynced with a
    group commit, before acking it) -> trainer ``RolloutConsumer`` per rank: K micro-batches of S bytes per
    rank, time until every rank has its step. Compared with raw "stream". Measured twice: with the spool on
    disk (``--spool-dir``, default the system temp dir) and on tmpfs (/dev/shm, where fsync costs nothing),
    which separates the disk's cost from the broker's own overhead. ``--no-shm`` skips the second.
(c) fan-out: trainer ``WeightPublisher`` -> broker ``WeightPlane`` -> N ``WeightSubscriber``: one FULL update
    of S bytes, time from the start of ``publish`` (which computes the SHA-256) until every subscriber holds
    the whole update (CRC-checked per chunk; SHA-256-checked too with ``--verify-digest``)
    ("stored": when the broker's ack reached the publisher; "phase": the rest). Compared with raw "single".

Placement (the machine has 2 cores): the broker runs in its own process (as the daemon does), every
receiver (PULL socket, trainer rank, inference worker) in its own process, and the sender (raw PUSH,
producer, publisher) in this process. Processes rather than threads because that is how the roles are
deployed, and because 4 subscribers plus a publisher in threads would share one GIL for their Python
parts. With 6 processes on 2 cores both sides pay the same scheduling; the numbers are medians of
``--repeats`` measurements after a warm-up. Times are taken in this process; receivers report completion
over a pipe (~0.1 ms).

The broker uses the default config's message limit (256 MiB) unless ``--chunk-mib`` is given, so a weight
update up to that size travels as one chunk.

``--fanout star chain`` measures only the weight fan-out, star versus relay (chain) side by side, to
``--receivers`` workers (default 4) that relay: one update of each ``--sizes-mib`` in chunks of ``--chunk-mib``
(default 8), per mode a fresh broker process. It prints the payload bytes the broker sent / the payload (counted by
the broker: ``bytes_out_total``, what ``primerl_broker_weight_bytes_pushed_total`` exports; target 1.0 in chain
mode) and the pipelining: how long after the first worker the last one holds the update, in chunk-times (one
chunk-time = the first worker's time per chunk; target <= 3).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Section, Stats, target_line  # noqa: E402

from primerl.proto.batch_ids import default_batch_id
from primerl.proto.units import MiB

TOKEN = "bench-token"
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB
REPLY_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------------------------------
# payloads


def rollout_batch(step: int, rank: int, index: int, count: int, size_bytes: int):
    """A packed micro-batch whose safetensors payload is about ``size_bytes``."""
    import numpy as np

    from primerl.client.rollouts import pack_batch

    bytes_per_token = 8 + 8 + 1 + 4 + 4 + 4 + 8
    n = max(1, size_bytes // bytes_per_token)
    rng = np.random.default_rng(step * 1000 + rank * 100 + index)
    tensors = {
        "input_ids": rng.integers(0, 50_000, n, dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64),
        "loss_mask": np.ones(n, dtype=np.bool_),
        "advantages": rng.standard_normal(n).astype(np.float32),
        "inference_logprobs": -rng.random(n).astype(np.float32),
        "temperatures": np.ones(n, dtype=np.float32),
        "policy_versions": np.full(n, step, dtype=np.int64),
    }
    return pack_batch(step, rank, index, count, tensors, num_samples=1)


def weight_update(version: int, size_bytes: int):
    import numpy as np

    from primerl.proto import tensor_frames as tf
    from primerl.proto.v1 import data_pb2

    rng = np.random.default_rng(version)
    data, specs = tf.encode_tensors({"model.weight": rng.integers(0, 255, size_bytes - 128, dtype=np.uint8)})
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
    return header, data


# ---------------------------------------------------------------------------------------------------------
# child processes


def broker_main(conn, spool_dirs: list[str], max_message_bytes: int, chunk_bytes: int, fanout: str = "star") -> None:
    """The broker: weight plane and one rollout plane per spool directory, each with its own IO thread."""
    import zmq

    from primerl.runtime.log_setup import configure_logging

    configure_logging("broker", "bench", level="warning")

    from primerl.broker.weight_fanout import WeightFanout
    from primerl.broker.weight_plane import WeightPlane
    from primerl.broker.weight_store import WeightStore
    from primerl.proto.data_plane_limits import BrokerLimits

    # One context per plane, as the broker has (broker.service): each plane's connection gate is its context's ZAP
    # handler, and a context has one.
    contexts = [zmq.Context()]
    limits = BrokerLimits.for_max_message_bytes(max_message_bytes).frames
    weight_plane = WeightPlane(
        WeightFanout(WeightStore(), fanout=fanout), contexts[0], "127.0.0.1", 0, limits, TOKEN, chunk_bytes
    )
    info: dict[str, Any] = {"weight_port": weight_plane.start()}
    rollout_planes = []
    try:
        from primerl.broker.rollout_plane import RolloutPlane
        from primerl.broker.rollout_queue import RolloutQueue
        from primerl.broker.spool import RolloutSpool

        info["rollout_ports"] = []
        for spool_dir in spool_dirs:
            queue = RolloutQueue(RolloutSpool(spool_dir), max_batches=4096, max_bytes=4 << 30)
            contexts.append(zmq.Context())
            rollout_planes.append(RolloutPlane(queue, contexts[-1], "127.0.0.1", 0, limits, TOKEN))
            info["rollout_ports"].append(rollout_planes[-1].start())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which measures the weight path only
        info["rollout_error"] = f"{type(exc).__name__}: {exc}"
    conn.send(info)
    try:
        while True:
            if not conn.poll(600):
                break
            command = conn.recv()
            if command[0] == "release":
                conn.send(rollout_planes[command[1]].release_through(command[2]))
            elif command[0] == "status":
                conn.send(weight_plane.status())
            else:
                break
    except EOFError:
        pass
    finally:
        weight_plane.stop(5.0)
        for rollout_plane in rollout_planes:
            rollout_plane.stop(5.0)
            rollout_plane.queue.close()
        for context in contexts:
            context.destroy(linger=0)


def receiver_main(conn, index: int, max_message_bytes: int, verify_digest: bool) -> None:
    """One receiver: a raw PULL socket, a trainer rank, or an inference worker, as the parent commands."""
    import zmq

    from primerl.runtime.log_setup import configure_logging

    configure_logging(f"receiver-{index}", "bench", level="warning")

    from primerl.client.rollouts import RolloutConsumer
    from primerl.client.weights import WeightSubscriber
    from primerl.proto.data_plane_limits import BrokerLimits
    from primerl.proto.digests import payload_digest

    context = zmq.Context()
    limits = BrokerLimits.for_max_message_bytes(max_message_bytes).frames
    pull = None
    consumers: dict[int, Any] = {}
    subscriber = None
    try:
        while True:
            if not conn.poll(600):
                break
            command, *args = conn.recv()
            if command == "raw_bind":
                pull = context.socket(zmq.PULL)
                pull.setsockopt(zmq.LINGER, 0)
                pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
                conn.send(pull.bind_to_random_port("tcp://127.0.0.1"))
            elif command == "raw":
                (count,) = args
                conn.send("ready")
                num_bytes = 0
                for _ in range(count):
                    if not pull.poll(REPLY_TIMEOUT_S * 1000):
                        raise TimeoutError("raw receiver got nothing")
                    num_bytes += len(pull.recv(copy=False))
                conn.send(("done", num_bytes))
            elif command == "relay_join":
                plane, endpoint, rank = args
                consumers[plane] = RolloutConsumer(
                    endpoint, TOKEN, f"trainer-{rank}", rank, credits=4, context=context, limits=limits
                )
                consumers[plane].hello(timeout_s=30)
                conn.send("ok")
            elif command == "relay":
                plane, step = args
                conn.send("ready")
                batches = consumers[plane].fetch_step(step, timeout_s=REPLY_TIMEOUT_S)
                num_bytes = sum(sum(t.nbytes for t in tensors.values()) for _, tensors in batches)
                conn.send(("done", num_bytes))
            elif command == "weight_join":
                (endpoint,) = args
                subscriber = WeightSubscriber(endpoint, TOKEN, f"infer-{index}", context=context, limits=limits)
                subscriber.hello(None)
                conn.send("ok")
            elif command == "weight":
                (final_version,) = args
                conn.send("ready")
                num_bytes = 0
                while True:
                    got = subscriber.receive(REPLY_TIMEOUT_S)
                    if got is None:
                        raise TimeoutError(f"subscriber {index} got no update")
                    header, payload = got
                    num_bytes += payload.nbytes
                    if verify_digest and payload_digest(payload) != header.digest:  # as a worker's PolicyUpdater would
                        raise ValueError(f"subscriber {index}: v{header.policy_version} failed its SHA-256 check")
                    subscriber.ack(header.policy_version)
                    if header.policy_version >= final_version:
                        break
                conn.send(("done", num_bytes))
            elif command == "weight_leave":
                subscriber.close()
                subscriber = None
                conn.send("ok")
            else:
                break
    except EOFError:
        pass
    finally:
        for client in (*consumers.values(), subscriber):
            if client is not None:
                client.close()
        if pull is not None:
            pull.close(linger=0)
        context.destroy(linger=0)


class TimingSink:
    """A ``PayloadSink`` into a plain buffer that notes when the first and the last byte of a transfer landed."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.first_s = self.last_s = 0.0
        self.num_chunks = 0

    def begin_payload(self, header, num_bytes: int) -> memoryview:
        if len(self.buffer) != num_bytes:
            self.buffer = bytearray(num_bytes)
        self.first_s, self.num_chunks = 0.0, 0
        return memoryview(self.buffer)

    def payload_progress(self, num_bytes: int) -> None:
        now_s = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this machine
        self.first_s = self.first_s or now_s
        self.last_s = now_s
        self.num_chunks += 1

    def end_payload(self, complete: bool) -> None:
        pass


def relay_receiver_main(conn, index: int, max_message_bytes: int, endpoint: str, relay: bool) -> None:
    """One inference worker for ``--fanout``: a ``WeightSubscriber`` with a relay socket and a ``TimingSink``; per
    update it reports (first byte s, whole s, chunks, bytes, digest ok, bytes it forwarded)."""
    import zmq

    from primerl.runtime.log_setup import configure_logging

    configure_logging(f"receiver-{index}", "bench", level="warning")

    from primerl.client.weights import WeightSubscriber
    from primerl.proto.data_plane_limits import BrokerLimits

    context = zmq.Context()
    limits = BrokerLimits.for_max_message_bytes(max_message_bytes).frames
    sink = TimingSink()
    subscriber = WeightSubscriber(
        endpoint,
        TOKEN,
        f"infer-{index}",
        context=context,
        limits=limits,
        payload_sink=sink,
        relay_host="127.0.0.1" if relay else None,
    )
    try:
        subscriber.hello(None)
        conn.send("ok")
        while True:
            if not conn.poll(600):
                break
            command, *args = conn.recv()
            if command != "weight":
                break
            (version,) = args
            conn.send("ready")
            while True:
                got = subscriber.receive(REPLY_TIMEOUT_S)
                if got is None:
                    raise TimeoutError(f"subscriber {index} got no update")
                header, payload = got
                subscriber.ack(header.policy_version)
                if header.policy_version >= version:
                    break
            forwarded = subscriber.relay.num_forwarded_bytes if subscriber.relay is not None else 0
            ok = subscriber.received_digest == header.digest
            conn.send(("done", sink.first_s, sink.last_s, sink.num_chunks, payload.nbytes, ok, forwarded))
    except EOFError:
        pass
    finally:
        subscriber.close()
        context.destroy(linger=0)


def fanout_compare(args, spawn) -> int:
    """``--fanout``: star versus chain to ``--receivers`` relaying workers, side by side (module docstring)."""
    import zmq

    from primerl.client.weight_publisher import WeightPublisher
    from primerl.proto.data_plane_limits import BrokerLimits

    num_receivers = max(args.receivers)
    chunk_bytes = (args.chunk_mib or 8) * MiB
    max_message_bytes = max(DEFAULT_MAX_MESSAGE_BYTES, chunk_bytes + MiB)
    limits = BrokerLimits.for_max_message_bytes(max_message_bytes).frames
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    context = zmq.Context()
    version = 0
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for mode in args.fanout:
            processes, conns = [], []

            def start(target, *target_args):
                parent_conn, child_conn = spawn.Pipe()
                process = spawn.Process(target=target, args=(child_conn, *target_args), daemon=True)
                process.start()
                processes.append(process)
                conns.append(parent_conn)
                return parent_conn

            spool = tempfile.mkdtemp(prefix="primerl-bench-")
            publisher = None
            try:
                broker = start(broker_main, [], max_message_bytes, chunk_bytes, mode)
                info = expect(broker, 60)
                endpoint = f"tcp://127.0.0.1:{info['weight_port']}"
                receivers = [
                    start(relay_receiver_main, i, max_message_bytes, endpoint, True) for i in range(num_receivers)
                ]
                for receiver in receivers:
                    assert expect(receiver, 60) == "ok"
                publisher = WeightPublisher(endpoint, TOKEN, "trainer", chunk_bytes, context=context, limits=limits)
                for size_mib in args.sizes_mib:
                    version += 1
                    header, payload = weight_update(version, size_mib * MiB)
                    before = ask(broker, ("status",)).bytes_out_total
                    for receiver in receivers:
                        receiver.send(("weight", version))
                    for receiver in receivers:
                        assert expect(receiver) == "ready"
                    start_s = time.monotonic()
                    publisher.publish(header, payload, timeout_s=REPLY_TIMEOUT_S)
                    done = [expect(receiver) for receiver in receivers]
                    status = ask(broker, ("status",))
                    assert all(d[5] for d in done), "a worker's payload failed its digest check"
                    firsts = sorted(done, key=lambda d: d[2])
                    head, last = firsts[0], firsts[-1]
                    chunk_s = (head[2] - head[1]) / max(1, head[3] - 1)
                    if repeat > 0:
                        results.setdefault((mode, size_mib), []).append(
                            {
                                "sent_ratio": (status.bytes_out_total - before) / len(payload),
                                "first_s": head[2] - start_s,
                                "last_s": last[2] - start_s,
                                "lag_s": last[2] - head[2],
                                "chunk_s": chunk_s,
                                "lag_chunks": (last[2] - head[2]) / chunk_s if chunk_s > 0 else float("inf"),
                                "chunks": head[3],
                                "forwarded_ratio": sum(d[6] for d in done) / len(payload),
                            }
                        )
            finally:
                if publisher is not None:
                    publisher.close()
                for conn in conns:
                    try:
                        conn.send(("stop",))
                    except (BrokenPipeError, OSError):
                        pass
                for process in processes:
                    process.join(10)
                    if process.is_alive():
                        process.terminate()
                        process.join(5)
                shutil.rmtree(spool, ignore_errors=True)
    context.destroy(linger=0)
    print()
    print(
        f"Weight fan-out, star vs relay chain, to {num_receivers} relaying workers (separate processes), loopback TCP, "
        f"{os.cpu_count()} cores, load {' '.join(load)} at the start; chunk {chunk_bytes // MiB} MiB; "
        f"medians of {args.repeats} after a warm-up"
    )
    print(
        "  sent/payload = payload bytes the broker sent / payload (counted by the broker; chain target 1.0); "
        "first/last = publish start -> first/last worker holds it; lag = last - first, in chunk-times of the first "
        "worker (chain target <= 3)"
    )
    print(
        f"{'mode':>6} {'size':>6} {'chunks':>6} {'sent/payload':>12} {'relayed/payload':>15} {'first s':>8} "
        f"{'last s':>8} {'lag s':>7} {'chunk s':>8} {'lag chunks':>10}  target"
    )
    for (mode, size_mib), rows in results.items():
        m = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        if mode == "chain":
            met = m["sent_ratio"] <= 1.0 + 1e-9 and m["lag_chunks"] <= 3.0
            verdict = "met" if met else "missed"
            spread = f" (lag chunks {min(r['lag_chunks'] for r in rows):.2f}-{max(r['lag_chunks'] for r in rows):.2f})"
        else:
            verdict, spread = "-", ""
        print(
            f"{mode:>6} {size_mib:>4}Mi {m['chunks']:>6.0f} {m['sent_ratio']:>12.3f} {m['forwarded_ratio']:>15.3f} "
            f"{m['first_s']:>8.3f} {m['last_s']:>8.3f} {m['lag_s']:>7.3f} {m['chunk_s']:>8.4f} "
            f"{m['lag_chunks']:>10.2f}  {verdict}{spread}"
        )
    return 0


# ---------------------------------------------------------------------------------------------------------
# parent


def ask(conn, message: Any, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
    conn.send(message)
    return expect(conn, timeout_s)


def expect(conn, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from a bench process within {timeout_s} s")
    return conn.recv()


def run_timed(conns: list, command: tuple, send: Any) -> tuple[float, int, Any]:
    """Command the receivers, wait until ready, run ``send()`` and time until every receiver is done."""
    for conn in conns:
        conn.send(command)
    for conn in conns:
        assert expect(conn) == "ready"
    start = time.perf_counter()
    extra = send()
    num_bytes = 0
    for conn in conns:
        tag, received = expect(conn)
        assert tag == "done"
        num_bytes += received
    return time.perf_counter() - start, num_bytes, (extra - start if isinstance(extra, float) else None)


@dataclass
class Row:
    size_mib: int
    receivers: int
    count: int
    raw_stream_s: float
    raw_single_s: float
    relay_s: float | None
    relay_shm_s: float | None
    fanout_s: float
    fanout_stored_s: float
    samples: dict[str, list[float]] = field(default_factory=dict)  # every kept repeat, per measurement

    def ratios(self, numerator: str, denominator: str) -> Stats:
        """Per-repeat ratio of two measurements taken back to back in the same repeat."""
        stats = Stats()
        for top, bottom in zip(self.samples.get(numerator, []), self.samples.get(denominator, [])):
            stats.add(top / bottom)
        return stats

    def mbps(self, seconds: float, count: int) -> float:
        return self.size_mib * MiB * self.receivers * count / seconds / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--chunk-mib", type=int, default=None, help="weight chunk size (default: the message limit, 256 MiB)"
    )
    parser.add_argument(
        "--spool-dir", default=None, help="parent of the spool directory (default: the system temp dir)"
    )
    parser.add_argument("--verify-digest", action="store_true", help="subscribers check the SHA-256 themselves too")
    parser.add_argument("--window", type=int, default=8, help="rollout batches the producer keeps in flight")
    parser.add_argument("--no-shm", action="store_true", help="skip the relay with the spool on /dev/shm")
    parser.add_argument(
        "--no-relay", action="store_true", help="skip the rollout relay (b): raw sends and fan-out only"
    )
    parser.add_argument("--quick", action="store_true", help="16 and 64 MiB only, 1 repeat (trying the harness)")
    parser.add_argument("--markdown", type=Path, default=None, help="write a RESULTS.md section there")
    parser.add_argument(
        "--fanout",
        nargs="+",
        choices=("star", "chain"),
        default=None,
        help="measure only the weight fan-out in these modes, side by side (default chunk 8 MiB, 4 receivers)",
    )
    args = parser.parse_args(argv)
    if args.fanout:
        if args.receivers == [1, 4]:
            args.receivers = [4]
        if args.sizes_mib == [1, 16, 64]:
            args.sizes_mib = [64]
        return fanout_compare(args, mp.get_context("spawn"))
    if args.quick:
        args.sizes_mib, args.repeats = [16, 64], 1
    if args.repeats < 1 or min(args.sizes_mib) < 1 or min(args.receivers) < 1 or args.window < 1:
        parser.error("--repeats, --sizes-mib, --receivers and --window must be >= 1")
    max_message_bytes = max(DEFAULT_MAX_MESSAGE_BYTES, max(args.sizes_mib) * MiB + MiB)  # + a batch header
    chunk_bytes = (args.chunk_mib * MiB) if args.chunk_mib else max_message_bytes
    max_receivers = max(args.receivers)
    spool_parent = tempfile.mkdtemp(prefix="primerl-bench-", dir=args.spool_dir)
    spool_dirs = [os.path.join(spool_parent, "spool")]
    shm_parent = None
    if not args.no_shm and os.path.isdir("/dev/shm"):
        shm_parent = tempfile.mkdtemp(prefix="primerl-bench-", dir="/dev/shm")
        spool_dirs.append(os.path.join(shm_parent, "spool"))
    started = time.perf_counter()

    import zmq

    from primerl.client.rollouts import RolloutProducer
    from primerl.runtime.log_setup import configure_logging

    configure_logging("bench", "bench", level="warning")
    from primerl.client.weight_publisher import WeightPublisher
    from primerl.proto.data_plane_limits import BrokerLimits

    spawn = mp.get_context("spawn")
    processes: list = []
    conns: list = []

    def start(target, *target_args):
        parent_conn, child_conn = spawn.Pipe()
        process = spawn.Process(target=target, args=(child_conn, *target_args), daemon=True)
        process.start()
        processes.append(process)
        conns.append(parent_conn)
        return parent_conn

    context = zmq.Context()
    pushes: list = []
    producers: list = []
    publisher = None
    rows: list[Row] = []
    try:
        broker = start(broker_main, spool_dirs, max_message_bytes, chunk_bytes)
        receivers = [start(receiver_main, i, max_message_bytes, args.verify_digest) for i in range(max_receivers)]
        info = expect(broker, 60)
        relay_available = "rollout_error" not in info and not args.no_relay
        if not relay_available and not args.no_relay:
            print(f"rollout relay not measured: {info['rollout_error']}", file=sys.stderr)
        limits = BrokerLimits.for_max_message_bytes(max_message_bytes).frames
        weight_endpoint = f"tcp://127.0.0.1:{info['weight_port']}"

        for receiver in receivers:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://127.0.0.1:{ask(receiver, ('raw_bind',))}")
            pushes.append(push)
        producers = []
        if relay_available:
            for plane, port in enumerate(info["rollout_ports"]):
                rollout_endpoint = f"tcp://127.0.0.1:{port}"
                producers.append(
                    RolloutProducer(rollout_endpoint, TOKEN, "orchestrator", context=context, limits=limits)
                )
                for rank, receiver in enumerate(receivers):
                    assert ask(receiver, ("relay_join", plane, rollout_endpoint, rank)) == "ok"
        publisher = WeightPublisher(weight_endpoint, TOKEN, "trainer", chunk_bytes, context=context, limits=limits)

        step = 0
        version = 0
        for num_receivers in args.receivers:
            active = receivers[:num_receivers]
            for subscriber in active:
                assert ask(subscriber, ("weight_join", weight_endpoint)) == "ok"
            for size_mib in args.sizes_mib:
                size = size_mib * MiB
                count = max(1, 64 // size_mib)
                raw_payload = rollout_batch(0, 0, 0, 1, size)[1]
                batches = [
                    [rollout_batch(0, rank, i, count, size) for i in range(count)] for rank in range(num_receivers)
                ]
                update = weight_update(1, size)
                samples: dict[str, list[float]] = {
                    "stream": [],
                    "single": [],
                    "relay": [],
                    "relay_shm": [],
                    "fanout": [],
                    "stored": [],
                }
                for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
                    keep = repeat > 0

                    def raw_send(n: int) -> None:
                        for _ in range(n):
                            for push in pushes[:num_receivers]:
                                push.send(raw_payload, copy=False)

                    seconds, _, _ = run_timed(active, ("raw", count), lambda: raw_send(count))
                    if keep:
                        samples["stream"].append(seconds)
                    seconds, _, _ = run_timed(active, ("raw", 1), lambda: raw_send(1))
                    if keep:
                        samples["single"].append(seconds)

                    for plane, producer in enumerate(producers):
                        step += 1

                        def relay_send() -> None:
                            def stream():
                                for index in range(count):
                                    for rank in range(num_receivers):
                                        header, payload = batches[rank][index]
                                        header.step = step
                                        header.batch_id = default_batch_id(step, rank, index)
                                        yield header, payload

                            producer.send_batches(stream(), window=args.window, timeout_s=REPLY_TIMEOUT_S)

                        seconds, _, _ = run_timed(active, ("relay", plane, step), relay_send)
                        ask(broker, ("release", plane, step))
                        if keep:
                            samples["relay" if plane == 0 else "relay_shm"].append(seconds)

                    version += 1
                    header, payload = update
                    header.policy_version = version
                    header.digest = ""

                    def publish() -> float:
                        publisher.publish(header, payload, timeout_s=REPLY_TIMEOUT_S)
                        return time.perf_counter()

                    seconds, _, stored = run_timed(active, ("weight", version), publish)
                    if keep:
                        samples["fanout"].append(seconds)
                        samples["stored"].append(stored)
                median = {key: statistics.median(values) if values else None for key, values in samples.items()}
                row = Row(
                    size_mib,
                    num_receivers,
                    count,
                    median["stream"],
                    median["single"],
                    median["relay"],
                    median["relay_shm"],
                    median["fanout"],
                    median["stored"],
                    samples,
                )
                rows.append(row)
                print(f"  measured {size_mib} MiB x {num_receivers} receivers", file=sys.stderr, flush=True)
            for subscriber in active:
                assert ask(subscriber, ("weight_leave",)) == "ok"
        print_table(rows, relay_available, args, chunk_bytes, time.perf_counter() - started)
        if args.markdown:
            write_markdown(args.markdown, argv, rows, args, chunk_bytes, time.perf_counter() - started)
        return 0
    finally:
        for client in (*producers, publisher):
            if client is not None:
                client.close()
        for push in pushes:
            push.close(linger=0)
        for conn in conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)
        context.destroy(linger=0)
        shutil.rmtree(spool_parent, ignore_errors=True)
        if shm_parent is not None:
            shutil.rmtree(shm_parent, ignore_errors=True)


def print_table(rows: list[Row], relay_available: bool, args, chunk_bytes: int, total_s: float) -> None:
    print()
    print(
        f"primerl broker throughput, loopback TCP, {os.cpu_count()} cores; medians of {args.repeats} after a warm-up; "
        f"weight chunk {chunk_bytes // MiB} MiB; subscriber SHA-256 check {'on' if args.verify_digest else 'off'}"
    )
    print()
    print(
        f"Rollout relay (K messages per receiver; producer window {args.window}; MB/s = bytes delivered to all "
        "receivers / time)  target: ratio >= 0.8"
    )
    print(
        "  raw = pyzmq PUSH->PULL, one hop; disk = through the broker, spool on disk (fsync per group before the ack); "
        "shm = the same with the spool on /dev/shm (no disk cost: the broker's own overhead)"
    )
    print(
        f"{'size':>6} {'recv':>4} {'K':>3} {'raw MB/s':>10} {'disk MB/s':>10} {'ratio':>6} "
        f"{'shm MB/s':>10} {'ratio':>6}"
    )
    for row in rows:
        raw = row.mbps(row.raw_stream_s, row.count)
        cells = []
        for seconds in (row.relay_s, row.relay_shm_s):
            if relay_available and seconds is not None:
                broker = row.mbps(seconds, row.count)
                cells.append(f"{broker:>10.0f} {broker / raw:>6.2f}")
            else:
                cells.append(f"{'n/a':>10} {'n/a':>6}")
        print(f"{row.size_mib:>4}Mi {row.receivers:>4} {row.count:>3} {raw:>10.0f} {cells[0]} {cells[1]}")
    print()
    print(
        "Weight fan-out (one update; raw: N separate sends; broker: publish start -> every receiver holds it)  "
        "target: ratio <= 1.5"
    )
    print("  stored = when the publisher had the broker's ack; phase = broker s - stored (the broker's fan-out alone)")
    print(
        f"{'size':>6} {'recv':>4} {'raw s':>8} {'broker s':>9} {'ratio':>6} {'stored s':>9} {'phase s':>8} "
        f"{'phase ratio':>12}"
    )
    for row in rows:
        phase_s = row.fanout_s - row.fanout_stored_s
        print(
            f"{row.size_mib:>4}Mi {row.receivers:>4} {row.raw_single_s:>8.4f} {row.fanout_s:>9.4f} "
            f"{row.fanout_s / row.raw_single_s:>6.2f} {row.fanout_stored_s:>9.4f} {phase_s:>8.4f} "
            f"{phase_s / row.raw_single_s:>12.2f}"
        )
    print()
    print(f"total bench time {total_s:.1f} s")


RELAY_TARGET_SHM = 0.8
RELAY_TARGET_DISK = 0.5
FANOUT_TARGET = 1.5


def write_markdown(path: Path, argv: list[str] | None, rows: list[Row], args, chunk_bytes: int, total_s: float) -> None:
    """The part-d section: relay and fan-out against raw pyzmq, every ratio paired within its repeat."""
    section = Section("d. Broker relay and fan-out (bench/broker_throughput.py)", argv)
    section.line(
        f"Loopback TCP; broker, receivers and sender in separate processes; {args.repeats} repeat(s) after a "
        f"warm-up, cells are median (min–max); each ratio is taken within one repeat (raw and broker back to "
        f"back), then summarised. Weight chunk {chunk_bytes // MiB} MiB; producer window {args.window}; "
        f"total {total_s:.0f} s."
    )
    section.line()
    section.line(
        "Rollout relay: K batches of S per receiver (K = 64 // S), orchestrator `RolloutProducer` -> broker "
        "(spooled and fsynced by group commit before the ack) -> one trainer `RolloutConsumer` per receiver; "
        "raw = pyzmq PUSH->PULL. Ratio = raw time / relay time (1 = as fast as raw)."
    )
    section.line()
    relay_rows = []
    worst = {"relay": None, "relay_shm": None}
    for row in rows:
        raw = Stats([row.mbps(s, row.count) for s in row.samples.get("stream", [])])
        cells = [f"{row.size_mib} MiB", str(row.receivers), str(row.count), raw.cell(3)]
        for key in ("relay", "relay_shm"):
            speed = Stats([row.mbps(s, row.count) for s in row.samples.get(key, [])])
            ratio = row.ratios("stream", key)
            if len(ratio):
                worst[key] = ratio.median if worst[key] is None else min(worst[key], ratio.median)
            cells += [speed.cell(3), ratio.cell(2)]
        relay_rows.append(cells)
    section.table(
        ["S", "receivers", "K", "raw MB/s", "disk spool MB/s", "disk ratio", "tmpfs spool MB/s", "tmpfs ratio"],
        relay_rows,
    )
    section.line(
        "Weight fan-out: one FULL update of S, trainer `WeightPublisher` -> broker -> N `WeightSubscriber`s, "
        "from the start of `publish` (SHA-256 included) until every subscriber holds it; raw = N separate "
        "pyzmq sends of S. Stored = the publisher has the broker's ack; phase = the rest (the fan-out alone)."
    )
    section.line()
    fan_rows = []
    headline = None
    for row in rows:
        ratio = row.ratios("fanout", "single")
        phase = Stats([f - s for f, s in zip(row.samples.get("fanout", []), row.samples.get("stored", []))])
        fan_rows.append(
            [
                f"{row.size_mib} MiB",
                str(row.receivers),
                Stats(row.samples.get("single", [])).cell(3),
                Stats(row.samples.get("fanout", [])).cell(3),
                ratio.cell(2),
                Stats(row.samples.get("stored", [])).cell(3),
                phase.cell(3),
            ]
        )
        if row.size_mib == 64 and row.receivers == 4 and len(ratio):
            headline = ratio.median
    section.table(["S", "receivers", "raw s", "broker s", "ratio", "stored s", "phase s"], fan_rows)
    section.line(
        target_line(
            "d: relay, spool on tmpfs, lowest median ratio over the rows", worst["relay_shm"], ">=", RELAY_TARGET_SHM
        )
    )
    section.line(
        target_line(
            "d: relay, spool on disk, lowest median ratio over the rows", worst["relay"], ">=", RELAY_TARGET_DISK
        )
    )
    section.line(
        target_line(
            "d: fan-out 64 MiB x 4 receivers, broker / raw sends",
            headline,
            "<=",
            FANOUT_TARGET,
            "" if headline is not None else "(run with 64 MiB and 4 receivers)",
        )
    )
    section.line()
    section.write(path)
    print(section.text())


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The broker's memory under a flood of rollout batches (`make bench` part d).

    .venv/bin/python bench/broker_flood.py [--producers 1 4 16] [--batch-mib 32] [--seconds 8] [--repeats 2] [--quick] \
        [--markdown PATH]

For each producer count N, a fresh ``primerl-broker`` process (spool on disk, ``--max-queue-batches``
``--queue-batches``, read cache ``--read-cache-mib``, rollout high-water mark ``--rollout-hwm``, defaults
``--max-rollout-connections``, defaults otherwise) is flooded by N producer processes.
Each producer has its own ZeroMQ DEALER connection and sends
valid, signed ``ROLLOUT_BATCH`` messages of ``--batch-mib`` MiB (distinct batch ids, steps inside the run's
window) as fast as its socket lets it, never waiting for an ack, reading and dropping whatever comes back
(acks, BACKPRESSURE). Nobody consumes, so the queue fills to its bound and everything after that is refused.
The broker's resident memory is sampled every 20 ms (``/proc/PID/status`` VmRSS) and its peak read at the end
(VmHWM, the kernel's own high-water mark).

Bound: what the configuration lets the broker hold, whatever N: the idle broker's RSS (measured before the flood)
+ the queue's bytes (``min(queue_batches x batch, max_queue_bytes)``: batches are spooled to disk, but their
pages may stay resident) + the read cache + a fixed allowance for the messages the broker is working on
(``--allowance-mib``, default ``max_group_bytes`` + ``max_rollout_message_bytes``: the group of batches being
spooled and one message being decoded).
The table shows the peak against that bound for each N, how many producers the broker admitted (it refuses
connections past ``max_rollout_connections`` at the ZeroMQ handshake; a refused producer never gets a reply),
and what libzmq's per-connection buffers (``rollout_hwm`` + 1 messages per admitted producer) may add, so a
peak that grows with N is visible as such.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Section, Stats, fmt, machine_load  # noqa: E402

from primerl.proto.units import MiB  # noqa: E402

TOKEN = "flood-token"
BIN = Path(sys.executable).parent


def proc_status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def per_connection_mib(num_connections: int, rollout_hwm: int, batch_mib: int) -> int:
    """What libzmq may hold for the connections at worst: per admitted connection, ``rollout_hwm`` queued
    messages in the ROUTER's pipe plus one in the connection's decoder."""
    return num_connections * (rollout_hwm + 1) * batch_mib


def start_broker(work: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, dict, Path]:
    ready = work / "ready.json"
    log_path = work / "broker.log"
    cmd = [
        str(BIN / "primerl-broker"),
        "--grpc-port",
        "0",
        "--rollout-port",
        "0",
        "--weight-port",
        "0",
        "--spool-dir",
        str(work / "spool"),
        "--run-token",
        TOKEN,
        "--prometheus.enabled",
        "false",
        "--max-queue-batches",
        str(args.queue_batches),
        "--read-cache-bytes",
        str(args.read_cache_mib * MiB),
        "--rollout-hwm",
        str(args.rollout_hwm),
        "--max-rollout-connections",
        str(args.max_rollout_connections),
        "--ready-file",
        str(ready),
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"the broker did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)
    time.sleep(0.2)
    return proc, json.loads(ready.read_text()), log_path


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def distinct_batches(queue_batches: int, num_producers: int) -> int:
    """How many distinct batches each producer cycles through: together more than the queue holds (so it fills
    and refuses), each at least 2, and no more than needed (16 producers encoding 32 MiB batches share 2 cores)."""
    return queue_batches // num_producers + 2


def producer(
    endpoint: str,
    index: int,
    batch_bytes: int,
    num_distinct: int,
    seconds: float,
    ready: mp.Queue,
    go,
    result: mp.Queue,
) -> None:
    """Encode ``num_distinct`` signed batches, wait for ``go``, then send them round and round as fast as the
    socket takes them for ``seconds``, reading and dropping every reply; count sends and replies.

    The batches are encoded before the start so that the flood is not paced by this process's packing and
    CRC (16 producers share 2 cores with the broker); after the queue is full every resend is refused anyway."""
    import numpy as np
    import zmq

    from primerl.client.rollouts import pack_batch
    from primerl.proto import framing
    from primerl.runtime.wire_security import apply_run_token

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 100)
    apply_run_token(socket, TOKEN, "flood")
    socket.connect(endpoint)
    tensor = np.zeros(batch_bytes // 8, dtype=np.int64)
    messages = []
    for number in range(num_distinct):
        header, payload = pack_batch(
            1 + number % 4, index, number, 1_000_000, {"input_ids": tensor}, batch_id=f"flood-{index}-{number}"
        )
        messages.append(
            framing.encode(framing.data_pb2.ROLLOUT_BATCH, header, [payload], auth_token=TOKEN, sender=f"flood-{index}")
        )
    sent = replies = 0
    ready.put(index)
    go.wait(120)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                socket.send_multipart(messages[sent % num_distinct], copy=False)
                sent += 1
            except zmq.Again:
                pass  # the connection's high-water mark: the broker is not reading; try again
            while socket.poll(0):
                socket.recv_multipart()
                replies += 1
    finally:
        context.destroy(linger=0)
        result.put((index, sent, replies))


def flood(num_producers: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="primerl-flood-", dir=args.spool_parent) as tmp:
        work = Path(tmp)
        proc, ports, log_path = start_broker(work, args)
        try:
            time.sleep(0.5)
            idle_kib = proc_status_kib(proc.pid, "VmRSS") or 0
            samples: list[int] = []
            stop_sampling = threading.Event()

            def sample() -> None:
                while not stop_sampling.is_set():
                    value = proc_status_kib(proc.pid, "VmRSS")
                    if value is not None:
                        samples.append(value)
                    time.sleep(0.02)

            context = mp.get_context("spawn")
            result: mp.Queue = context.Queue()
            ready: mp.Queue = context.Queue()
            go = context.Event()
            endpoint = f"tcp://127.0.0.1:{ports['rollout_port']}"
            workers = [
                context.Process(
                    target=producer,
                    args=(
                        endpoint,
                        i,
                        args.batch_mib * MiB,
                        distinct_batches(args.queue_batches, num_producers),
                        args.seconds,
                        ready,
                        go,
                        result,
                    ),
                )
                for i in range(num_producers)
            ]
            for worker in workers:
                worker.start()
            for _ in workers:  # every producer connected with its batches encoded: start them together
                ready.get(timeout=120)
            idle_kib = proc_status_kib(proc.pid, "VmRSS") or idle_kib
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            go.set()
            counts = [result.get(timeout=args.seconds + 120) for _ in workers]
            for worker in workers:
                worker.join(timeout=30)
            time.sleep(1.0)  # what the broker still holds once the producers are gone
            stop_sampling.set()
            sampler.join()
            alive = proc.poll() is None
            peak_kib = proc_status_kib(proc.pid, "VmHWM") or (max(samples) if samples else 0)
            end_kib = proc_status_kib(proc.pid, "VmRSS") or 0
        finally:
            stop(proc)
        log_text = log_path.read_text(errors="replace")
    return {
        "producers": num_producers,
        "idle_mib": idle_kib / 1024,
        "peak_mib": peak_kib / 1024,
        "sampled_peak_mib": (max(samples) if samples else 0) / 1024,
        "sampled_median_mib": (sorted(samples)[len(samples) // 2] if samples else 0) / 1024,
        "end_mib": end_kib / 1024,
        "sent": sum(c[1] for c in counts),
        "replies": sum(c[2] for c in counts),
        "alive": alive,
        "admitted": sum(1 for c in counts if c[2] > 0),
        "tracebacks": log_text.count("Traceback"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batch-mib", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0, help="flood duration per producer count")
    parser.add_argument("--repeats", type=int, default=2, help="floods per producer count (a fresh broker each)")
    parser.add_argument("--queue-batches", type=int, default=8, help="the broker's max_queue_batches")
    parser.add_argument("--read-cache-mib", type=int, default=256, help="the broker's read_cache_bytes, MiB")
    parser.add_argument("--rollout-hwm", type=int, default=4, help="the broker's rollout_hwm (its default: 4)")
    parser.add_argument(
        "--max-rollout-message-mib",
        "--max-message-mib",
        dest="max_message_mib",
        type=int,
        default=64,
        help="the broker's max_rollout_message_bytes (its default: 64); --max-message-mib is the old name",
    )
    parser.add_argument(
        "--max-rollout-connections", type=int, default=4, help="the broker's max_rollout_connections (its default: 16)"
    )
    parser.add_argument(
        "--allowance-mib",
        type=int,
        default=None,
        help="fixed allowance of the bound (default: max_group_bytes + max_rollout_message_bytes)",
    )
    parser.add_argument("--spool-parent", default=None, help="where the spool goes (default: the temp dir)")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="5 s per producer count, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats = 5.0, 1
    allowance = (
        args.allowance_mib if args.allowance_mib is not None else 256 + args.max_message_mib
    )  # max_group_bytes default: 256 MiB
    queue_mib = min(args.queue_batches * args.batch_mib, 2048)  # max_queue_bytes default: 2 GiB
    load_before = machine_load()
    results: dict[int, list[dict]] = {n: [] for n in args.producers}
    for _ in range(args.repeats):
        for n in args.producers:
            outcome = flood(n, args)
            results[n].append(outcome)
            print(
                f"[flood] {n} producers: peak {outcome['peak_mib']:.0f} MiB (idle {outcome['idle_mib']:.0f}), "
                f"sampled median {outcome['sampled_median_mib']:.0f}, sent {outcome['sent']}, "
                f"replies {outcome['replies']}, alive {outcome['alive']}",
                flush=True,
            )

    section = Section("d. The broker's memory under a flood of rollout batches", argv)
    section.line(f"Machine load before the first flood: {load_before}.")
    section.line()
    section.line(
        f"A fresh `primerl-broker` per row (spool on disk, `max_queue_batches` {args.queue_batches}, read cache "
        f"{args.read_cache_mib} MiB, `rollout_hwm` {args.rollout_hwm}, `max_rollout_connections` "
        f"{args.max_rollout_connections}, `max_rollout_message_bytes` "
        f"{args.max_message_mib} MiB), N producer processes, each its own connection, sending signed "
        f"{args.batch_mib} MiB batches as fast as their sockets take them for {args.seconds:.0f} s, nobody "
        "consuming. Peak = the broker's VmHWM. Bound = idle RSS + queue "
        f"({queue_mib} MiB) + read cache ({args.read_cache_mib} MiB) + allowance ({allowance} MiB, "
        "`max_group_bytes` + `max_rollout_message_bytes` by default: the group of batches being spooled and "
        "one message being decoded). Producers start together once all are connected with their batches "
        "encoded."
    )
    section.line()
    rows = []
    verdicts = []
    for n in args.producers:
        peak, idle = Stats(), Stats()
        for outcome in results[n]:
            peak.add(outcome["peak_mib"])
            idle.add(outcome["idle_mib"])
        bound = idle.median + queue_mib + args.read_cache_mib + allowance
        admitted = Stats()
        for outcome in results[n]:
            admitted.add(outcome["admitted"])
        per_connection = per_connection_mib(min(n, args.max_rollout_connections), args.rollout_hwm, args.batch_mib)
        alive = all(o["alive"] for o in results[n])
        met = peak.max <= bound and alive
        verdicts.append(met)
        rows.append(
            [
                str(n),
                peak.cell(0),
                fmt(bound, 0),
                "met" if met else "missed",
                admitted.cell(0),
                fmt(idle.median, 0),
                fmt(per_connection, 0),
                "yes" if peak.max <= bound + per_connection else "no",
                str(sum(o["sent"] for o in results[n])),
                str(sum(o["replies"] for o in results[n])),
                "yes" if alive else "**no**",
                str(sum(o["tracebacks"] for o in results[n])),
            ]
        )
    section.table(
        [
            "producers",
            "peak RSS, MiB",
            "bound, MiB",
            "verdict",
            "admitted",
            "idle RSS, MiB",
            "min(N, max_rollout_connections) x (rollout_hwm + 1) x batch, MiB",
            "within bound + that",
            "batches sent",
            "replies",
            "broker alive",
            "tracebacks in log",
        ],
        rows,
    )
    section.line(
        f"- **{'met' if all(verdicts) else 'missed'}** d: peak RSS within the configured bound for "
        f"{', '.join(str(n) for n in args.producers)} producers"
    )
    section.line()
    section.line(
        "libzmq buffers up to `rollout_hwm` messages per connection in the ROUTER's pipe and one more in the "
        "connection's decoder before the broker reads any of them, so without a limit on connections the peak "
        "grows with N (before the limit existed, at 534dd3a: 553 / 907 / 1,362 MiB for 1 / 4 / 16 producers). "
        "The broker admits at most `max_rollout_connections` peers at the ZeroMQ handshake "
        "(`broker/connection_gate.py`) and refuses the others before they can send a byte; 'admitted' counts "
        "the producers that got any reply. So the per-connection term is at most "
        "`max_rollout_connections` x (`rollout_hwm` + 1) x message size, whatever N."
    )
    section.line()
    if args.markdown:
        section.write(args.markdown)
    print(section.text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

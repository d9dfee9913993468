#!/usr/bin/env python
"""A real `primerl-broker` relaying rollout batches without pause, to profile it (`make bench` part d's relay).

    .venv/bin/python bench/broker_relay_load.py SPOOL_DIR [SIZE_MIB] [STEPS] &
    .venv/bin/py-spy record -r 200 -d 10 -f raw --threads -o relay.txt -p $(cat /tmp/relay_broker.pid)
    .venv/bin/python bench/pyspy_summary.py relay.txt --root RolloutPlane._commit_group

A producer process sends STEPS steps of 64 // SIZE_MIB batches of SIZE_MIB (default 1 MiB, 40 steps) with
`RolloutProducer.send_batches`; a consumer process fetches each step with `RolloutConsumer`; the broker (its
pid in /tmp/relay_broker.pid, its log in /tmp/relay_broker.log) spools every batch in SPOOL_DIR. Prints the
relayed MiB/s. Not part of `make bench` (part d measures the ratios); this is the load to attach a profiler to.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from primerl.proto.units import MiB

TOKEN = "relay-load"
REPO = Path(__file__).resolve().parent.parent
PID_FILE = Path("/tmp/relay_broker.pid")
LOG_FILE = Path("/tmp/relay_broker.log")


def produce(endpoint: str, num_steps: int, batches_per_step: int, batch_bytes: int) -> None:
    from primerl.client.rollouts import RolloutProducer, pack_batch

    tensor = np.zeros(batch_bytes // 8, dtype=np.int64)
    with RolloutProducer(endpoint, TOKEN, "orchestrator") as producer:
        for step in range(1, num_steps + 1):
            batches = (
                pack_batch(step, 0, index, batches_per_step, {"input_ids": tensor}) for index in range(batches_per_step)
            )
            producer.send_batches(batches, window=8, timeout_s=120)


def consume(endpoint: str, num_steps: int, result: mp.Queue) -> None:
    from primerl.client.rollouts import RolloutConsumer

    with RolloutConsumer(endpoint, TOKEN, "trainer-0", 0, credits=8) as consumer:
        started_s = time.monotonic()
        num_batches = sum(len(consumer.fetch_step(step, timeout_s=120)) for step in range(1, num_steps + 1))
        result.put((num_batches, time.monotonic() - started_s))


def start_broker(spool_dir: str) -> tuple[subprocess.Popen, str]:
    ready = Path(spool_dir).with_suffix(".ready.json")
    ready.unlink(missing_ok=True)
    with open(LOG_FILE, "w") as log:
        broker = subprocess.Popen(
            [
                str(REPO / ".venv" / "bin" / "primerl-broker"),
                "--grpc-port",
                "0",
                "--rollout-port",
                "0",
                "--weight-port",
                "0",
                "--spool-dir",
                spool_dir,
                "--run-token",
                TOKEN,
                "--prometheus.enabled",
                "false",
                "--max-queue-batches",
                "64",
                "--ready-file",
                str(ready),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline_s = time.monotonic() + 60
    while not ready.exists():
        if broker.poll() is not None or time.monotonic() > deadline_s:
            raise SystemExit(f"the broker did not start: see {LOG_FILE}")
        time.sleep(0.05)
    time.sleep(0.3)
    return broker, f"tcp://127.0.0.1:{json.loads(ready.read_text())['rollout_port']}"


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    spool_dir = sys.argv[1]
    size_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    num_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    broker, endpoint = start_broker(spool_dir)
    PID_FILE.write_text(str(broker.pid))
    print(f"broker pid {broker.pid}", flush=True)
    try:
        context = mp.get_context("spawn")
        result: mp.Queue = context.Queue()
        consumer = context.Process(target=consume, args=(endpoint, num_steps, result))
        producer = context.Process(target=produce, args=(endpoint, num_steps, max(1, 64 // size_mib), size_mib * MiB))
        consumer.start()
        producer.start()
        num_batches, seconds = result.get(timeout=600)
        producer.join()
        consumer.join()
        print(
            f"relayed {num_batches} batches of {size_mib} MiB in {seconds:.2f} s: "
            f"{num_batches * size_mib / seconds:.0f} MiB/s"
        )
    finally:
        broker.terminate()
        broker.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

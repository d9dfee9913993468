"""Atomic steps through the real path: a real `primerl-broker` process, producer processes that send a step with the
orchestrator's own send path (``orchestrator.step_send.send_step`` over a real ``RolloutProducer``), real trainer
``RolloutConsumer``s.

The first producer incarnation is killed by the fault point ``PRIMERL_FAULT_ORCHESTRATOR_EXIT_AFTER_ACKS`` after k of
the step's n micro-batches are durable (every time, not by chance); the broker is SIGKILLed and restarted on the same
spool; a second incarnation makes the step again with other data. Every trainer rank gets the step whole from the
second incarnation only: its batch ids name that one producer and the data digests of what each rank fetched are
the ones that incarnation logged for the step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.daemons import BrokerProcess

from primerl.client.rollouts import RolloutConsumer, RolloutTimeout
from primerl.orchestrator.step_send import FAULT_EXIT_AFTER_ACKS_ENV, FAULT_EXIT_AFTER_ACKS_FILE_ENV
from primerl.proto import telemetry
from primerl.proto.batch_ids import parse_producer_batch_id
from primerl.proto.step_digest import data_digest

pytestmark = pytest.mark.slow

NUM_RANKS, NUM_MICRO_BATCHES, STEP = 2, 4, 1

# One orchestrator incarnation's send of a step: argv = endpoint, step, seed, report path.
PRODUCER = r"""
import json, sys
import numpy as np
from primerl.client.rollouts import RolloutProducer, pack_batch
from primerl.orchestrator.step_send import send_step
from primerl.proto.step_digest import data_digest

endpoint, step, seed, report = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
num_ranks, num_micro_batches = %d, %d
def tensors(r, i):
    return {"input_ids": np.arange(seed + 10 * r + i, seed + 10 * r + i + 64, dtype=np.int64)}
per_rank = [[tensors(r, i) for i in range(num_micro_batches)] for r in range(num_ranks)]
messages = [pack_batch(step, r, i, num_micro_batches, t) for r in range(num_ranks) for i, t in enumerate(per_rank[r])]
with RolloutProducer(endpoint, resend_interval_s=0.5) as producer:
    with open(report, "w") as handle:  # before the send: the fault point kills this process during it
        json.dump({"producer": producer.producer_id, "digests": [data_digest(b) for b in per_rank]}, handle)
    send_step(producer, step, messages, outage_s=60, backpressure_timeout_s=60)
print("step sent", flush=True)
""" % (NUM_RANKS, NUM_MICRO_BATCHES)


def run_producer(tmp_path: Path, endpoint: str, seed: int, name: str, env: dict[str, str]) -> tuple[int, dict]:
    report = tmp_path / f"{name}.json"
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, endpoint, str(STEP), str(seed), str(report)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        try:
            rc = process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            pytest.fail(f"producer {name} did not finish:\n{log_path.read_text()[-3000:]}")
    return rc, {**json.loads(report.read_text()), "log": log_path.read_text()}


def fetch(endpoint: str, rank: int, timeout_s: float, worker: str) -> list:
    with RolloutConsumer(endpoint, worker_id=worker, rank=rank, request_interval_s=0.3) as consumer:
        return consumer.fetch_step(STEP, timeout_s=timeout_s)


@pytest.fixture
def processes():
    started: list[BrokerProcess] = []
    yield started
    for broker in started:
        if broker.process.poll() is None:
            broker.stop()


def test_a_step_is_trained_from_one_orchestrator_incarnation(tmp_path, processes):
    spool = tmp_path / "spool"
    broker = BrokerProcess(tmp_path, spool)
    processes.append(broker)
    k = 5  # rank 0 whole (4), rank 1 one of four: the window where a mix used to happen
    rc, first = run_producer(
        tmp_path, broker.rollout_endpoint, 1000, "first", {FAULT_EXIT_AFTER_ACKS_ENV: f"{k}@{STEP}"}
    )
    assert rc == -signal.SIGKILL, first["log"][-3000:]
    assert telemetry.FAULT_ORCHESTRATOR_EXIT in first["log"] and "step sent" not in first["log"]
    spooled = sorted(p.name for p in spool.glob("*.rbatch"))
    assert len(spooled) == k, "the broker holds exactly the k acked micro-batches"

    # The broker dies too and comes back on the same spool: the partial set is still there, and not served.
    broker.kill()
    broker = BrokerProcess(tmp_path, spool)
    processes.append(broker)
    for rank in range(NUM_RANKS):
        with pytest.raises(RolloutTimeout):
            fetch(broker.rollout_endpoint, rank, 2.0, f"early-trainer-{rank}")

    rc, second = run_producer(tmp_path, broker.rollout_endpoint, 5000, "second", {})
    sent_at = time.monotonic()
    assert rc == 0 and "step sent" in second["log"], second["log"][-3000:]
    assert second["producer"] != first["producer"]

    def check(endpoint: str, worker: str) -> None:
        for rank in range(NUM_RANKS):
            batches = fetch(endpoint, rank, 20.0, f"{worker}-{rank}")
            assert [h.micro_batch_index for h, _ in batches] == list(range(NUM_MICRO_BATCHES))
            producers = {parse_producer_batch_id(h.batch_id).producer for h, _ in batches}
            assert producers == {second["producer"]}, f"rank {rank} got batches of {producers}"
            assert data_digest([tensors for _, tensors in batches]) == second["digests"][rank]
            assert data_digest([tensors for _, tensors in batches]) != first["digests"][rank]

    check(broker.rollout_endpoint, "trainer")
    print(f"atomic steps: every rank had the step whole {time.monotonic() - sent_at:.2f} s after the remake was sent")
    # The first incarnation's partial set is gone from the disk; after another restart the step is still the
    # second incarnation's, whole.
    assert len(list(spool.glob("*.rbatch"))) == NUM_RANKS * NUM_MICRO_BATCHES
    broker.kill()
    broker = BrokerProcess(tmp_path, spool)
    processes.append(broker)
    check(broker.rollout_endpoint, "restarted-trainer")
    # A late resend of the first incarnation (a zombie) is acked and not kept.
    rc, zombie = run_producer(tmp_path, broker.rollout_endpoint, 1000, "zombie", {})
    assert rc == 0
    check(broker.rollout_endpoint, "after-zombie-trainer")
    assert broker.stop() == 0


def test_the_fault_point_armed_by_a_file_fires_only_once_the_file_is_there(tmp_path, processes):
    """The chaos harness arms the fault point of a running orchestrator by writing k into a file: no file, a normal
    send; a file, k micro-batches acked, the file consumed, SIGKILL."""
    broker = BrokerProcess(tmp_path, tmp_path / "spool")
    processes.append(broker)
    trigger = tmp_path / "fault"
    env = {FAULT_EXIT_AFTER_ACKS_FILE_ENV: str(trigger)}
    rc, plain = run_producer(tmp_path, broker.rollout_endpoint, 1000, "unarmed", env)
    assert rc == 0 and "step sent" in plain["log"], plain["log"][-3000:]
    broker.kill()
    (tmp_path / "second").mkdir()
    broker = BrokerProcess(tmp_path / "second", tmp_path / "second" / "spool")
    processes.append(broker)
    trigger.write_text("3\n")
    rc, armed = run_producer(tmp_path, broker.rollout_endpoint, 2000, "armed", env)
    assert rc == -signal.SIGKILL and telemetry.FAULT_ORCHESTRATOR_EXIT in armed["log"], armed["log"][-3000:]
    assert "num_acked=3" in armed["log"] or '"num_acked": 3' in armed["log"]
    assert not trigger.exists()
    assert len(list((tmp_path / "second" / "spool").glob("*.rbatch"))) == 3

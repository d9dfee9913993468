"""Sending one packed step to the broker, through broker outages, and the ``step sent`` line that names its data.

    send_step(producer, step, messages, outage_s=120, backpressure_timeout_s=1800, stop_event=stop)
    log_step_sent(step, packed)     # once every micro-batch is durable: one line per rank, with its data digest

Sending (on the orchestrator's send thread):
- ``RolloutProducer.send_batches`` runs in attempts of ``SEND_ATTEMPT_S``. An attempt that ends because the
  broker kept answering "wait" (``RolloutTimeout`` with ERROR_CODE_BACKPRESSURE: the trainer is behind) is
  normal flow control: the step is sent again, for up to ``backpressure_timeout_s`` in all (then
  ``TimeoutError``). An attempt that got no answer at all is a broker outage: it is retried through
  ``retry_through_outage`` (``waiting for the broker`` every 5 s), for up to ``outage_s`` (then
  ``BrokerOutageExceeded``). Every retry sends the whole step again: resends are idempotent by batch id (the
  broker acks a batch it already spooled, or whose step is committed, without a second copy).
- ``stop_event`` set: the wait ends with ``OutageStopped``.

Atomic steps: every batch goes out under a producer batch id (``proto.batch_ids.producer_batch_id``) naming this
process's producer incarnation (``RolloutProducer.producer_id``) and the step's number of ranks. The broker serves a
step only from one incarnation's whole set, so an orchestrator killed half-way through a step's send and the one
restarted after it never mix their rollouts in one step: the restarted one's whole set replaces the partial one.

Fault injection (tests only): ``PRIMERL_FAULT_ORCHESTRATOR_EXIT_AFTER_ACKS=k`` (or ``k@step``) makes the process
send only the first ``k`` micro-batches of the first step it sends (or of ``step``), wait for their durable acks,
and kill itself with SIGKILL, so a test hits the window between a step's first and last ack every time.
``PRIMERL_FAULT_ORCHESTRATOR_EXIT_AFTER_ACKS_FILE=PATH`` arms the same fault from outside a running process (the
chaos harness): once a file is at PATH, the next step's send reads ``k`` from it, deletes it and does the same.

``step sending`` and ``step sent`` (events; fields ``step``, ``rank``, ``num_micro_batches``, ``data_digest``): one
line per trainer rank, logged before the first send and after the broker has made all of the step's micro-batches
durable. An orchestrator killed between the two leaves its step spooled (wholly or in part) with only ``step
sending`` on record; the one restarted after it makes that step again. The broker keeps the first incarnation's set
when it was whole, else the restarted one's, so the data trained for that step is the one a ``step sending`` line of
exactly one incarnation names. ``data_digest`` is
``primerl.proto.step_digest.data_digest`` over that rank's micro-batch tensors in index order: the numpy arrays
that were encoded into the payloads, i.e. the values the trainer decodes (the trainer logs the same digest over
what it trained, so logs can show every step was trained on the data produced for it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.client.outage import OutageStopped, OutageWatch, retry_through_outage
from primerl.proto import telemetry
from primerl.proto.batch_ids import default_batch_id, producer_batch_id
from primerl.proto.packing import PackedMicroBatch
from primerl.proto.step_digest import data_digest
from primerl.runtime.log_setup import get_logger

if TYPE_CHECKING:
    from primerl.client.rollouts import RolloutProducer
    from primerl.proto.v1 import data_pb2

log = get_logger("primerl.orchestrator.send")

SEND_ATTEMPT_S = 5.0
"""One attempt at a step: without any answer from the broker for this long, the broker counts as unreachable."""
RESEND_INTERVAL_S = 2.0
"""The producer resends a batch that got no answer after this long (within an attempt)."""
FAULT_EXIT_AFTER_ACKS_ENV = "PRIMERL_FAULT_ORCHESTRATOR_EXIT_AFTER_ACKS"
FAULT_EXIT_AFTER_ACKS_FILE_ENV = "PRIMERL_FAULT_ORCHESTRATOR_EXIT_AFTER_ACKS_FILE"
_fault_armed = True  # the fault fires once per process


def send_step(
    producer: RolloutProducer,
    step: int,
    messages: Sequence[tuple[data_pb2.RolloutBatchHeader, bytes]],
    *,
    outage_s: float,
    backpressure_timeout_s: float,
    stop_event: threading.Event | None = None,
    attempt_s: float = SEND_ATTEMPT_S,
) -> None:
    """Send one step's micro-batches until every one is durable (module docstring)."""
    from primerl.client.rollouts import RolloutTimeout
    from primerl.proto.v1 import common_pb2

    started_s = time.monotonic()
    messages = with_producer_ids(messages, producer.producer_id)
    _maybe_exit_after_acks(producer, step, messages)

    def attempt() -> None:
        while True:
            try:
                producer.send_batches(messages, timeout_s=attempt_s)
                return
            except RolloutTimeout as exc:
                if exc.code != common_pb2.ERROR_CODE_BACKPRESSURE:
                    raise  # no answer: an outage (retried by retry_through_outage)
                watch.ok()  # the broker answers; it only asks us to wait
                if time.monotonic() - started_s >= backpressure_timeout_s:
                    raise TimeoutError(
                        f"the broker kept step {step} waiting (back-pressure: the trainer is behind) "
                        f"for more than rollout_timeout_s = {backpressure_timeout_s:g} s: {exc}"
                    ) from None
                if stop_event is not None and stop_event.is_set():
                    raise OutageStopped(f"stopped while the broker kept step {step} waiting") from None

    watch = OutageWatch(f"the broker to take step {step}", outage_s, worker="orchestrator")
    retry_through_outage(attempt, watch, (RolloutTimeout,), stop_event=stop_event)


def with_producer_ids(
    messages: Sequence[tuple[data_pb2.RolloutBatchHeader, bytes]], producer: str
) -> list[tuple[data_pb2.RolloutBatchHeader, bytes]]:
    """The step's batches under producer batch ids (module docstring); a batch that already has an id other than
    the default one keeps it."""
    from primerl.proto.v1 import data_pb2

    num_ranks = len({header.rank for header, _ in messages})
    tagged = []
    for header, payload in messages:
        if header.batch_id and header.batch_id != default_batch_id(header.step, header.rank, header.micro_batch_index):
            tagged.append((header, payload))
            continue
        named = data_pb2.RolloutBatchHeader()
        named.CopyFrom(header)
        named.batch_id = producer_batch_id(header.step, header.rank, header.micro_batch_index, num_ranks, producer)
        tagged.append((named, payload))
    return tagged


def _maybe_exit_after_acks(
    producer: RolloutProducer, step: int, messages: Sequence[tuple[data_pb2.RolloutBatchHeader, bytes]]
) -> None:
    """The test-only fault point of the module docstring."""
    global _fault_armed
    spec = os.environ.get(FAULT_EXIT_AFTER_ACKS_ENV, "").strip()
    trigger = os.environ.get(FAULT_EXIT_AFTER_ACKS_FILE_ENV, "")
    if not spec and trigger:
        try:
            spec = Path(trigger).read_text().strip()
        except OSError:  # not armed (no file)
            return
        Path(trigger).unlink(missing_ok=True)
        _fault_armed = True
    if not spec or not _fault_armed:
        return
    count, _, at_step = spec.partition("@")
    try:
        num_acks, fault_step = int(count), int(at_step) if at_step else None
    except ValueError:
        raise ValueError(f"{FAULT_EXIT_AFTER_ACKS_ENV}={spec!r}: expected k or k@step (integers)") from None
    if fault_step is not None and fault_step != step:
        return
    _fault_armed = False
    producer.send_batches(list(messages)[:num_acks], timeout_s=60.0)
    log.warning(
        telemetry.FAULT_ORCHESTRATOR_EXIT,
        step=step,
        num_acked=min(num_acks, len(messages)),
        num_micro_batches=len(messages),
        producer=producer.producer_id,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def rank_digests(per_rank: Sequence[Sequence[PackedMicroBatch]]) -> list[str]:
    """The data digest of each rank's micro-batches (``PackedMicroBatch.tensors``, in index order)."""
    return [data_digest([batch.tensors for batch in batches]) for batches in per_rank]


def log_step_data(
    event: str, step: int, per_rank: Sequence[Sequence[PackedMicroBatch]], digests: Sequence[str]
) -> None:
    """One ``step sending`` or ``step sent`` line per rank (module docstring)."""
    for rank, (batches, digest) in enumerate(zip(per_rank, digests)):
        log.info(event, step=step, rank=rank, num_micro_batches=len(batches), data_digest=digest)


def log_step_sent(step: int, per_rank: Sequence[Sequence[PackedMicroBatch]]) -> None:
    """One ``step sent`` line per rank (module docstring)."""
    log_step_data(telemetry.STEP_SENT, step, per_rank, rank_digests(per_rank))


__all__ = [
    "FAULT_EXIT_AFTER_ACKS_ENV",
    "FAULT_EXIT_AFTER_ACKS_FILE_ENV",
    "RESEND_INTERVAL_S",
    "SEND_ATTEMPT_S",
    "log_step_data",
    "log_step_sent",
    "rank_digests",
    "send_step",
    "with_producer_ids",
]

"""The orchestrator's send thread (`primerl.orchestrator.batch_sender`): order, durability before on_sent, a
bounded queue, errors raised in the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from primerl.orchestrator.batch_sender import BatchSender, BatchSenderClosed


def test_steps_are_sent_in_order_and_on_sent_follows_each_send():
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def send(step: int, item: str) -> None:
        assert item == f"batches of {step}"
        time.sleep(0.01)
        with lock:
            events.append(("sent", step))

    sender = BatchSender(send, max_pending=2)
    for step in range(1, 7):
        sender.put(step, f"batches of {step}", lambda _s, step=step: events.append(("durable", step)), timeout_s=5)
    sender.flush(timeout_s=5)
    assert events == [(kind, step) for step in range(1, 7) for kind in ("sent", "durable")]
    assert sender.num_unsent == 0 and sender.last_send_s > 0
    assert sender.close(timeout_s=5)


def test_put_blocks_while_the_queue_is_full_and_reports_the_wait():
    release = threading.Event()
    started = threading.Event()

    def send(step: int, item: object) -> None:
        started.set()
        assert release.wait(10)

    sender = BatchSender(send, max_pending=1)
    assert sender.put(1, None, lambda _s: None, timeout_s=5) < 0.5  # taken by the thread at once
    assert started.wait(5)
    assert sender.put(2, None, lambda _s: None, timeout_s=5) < 0.5  # waits in the queue
    with pytest.raises(TimeoutError, match="no room"):
        sender.put(3, None, lambda _s: None, timeout_s=0.3)  # the queue holds one step: a third must wait
    threading.Timer(0.3, release.set).start()
    waited = sender.put(3, None, lambda _s: None, timeout_s=5)
    assert waited >= 0.2
    sender.flush(timeout_s=5)
    assert sender.num_unsent == 0
    assert sender.close(timeout_s=5)


def test_a_send_error_is_raised_in_the_callers_thread_and_later_steps_are_not_sent():
    sent: list[int] = []
    durable: list[int] = []

    def send(step: int, item: object) -> None:
        if step == 2:
            raise ValueError("the broker refused the batches of step 2")
        sent.append(step)

    sender = BatchSender(send, max_pending=4)
    for step in (1, 2, 3):
        sender.put(step, None, lambda _s, step=step: durable.append(step), timeout_s=5)
    with pytest.raises(ValueError, match="refused the batches of step 2"):
        sender.flush(timeout_s=5)
    assert sent == [1] and durable == [1]  # step 2 never counted as durable, step 3 never sent
    with pytest.raises(BatchSenderClosed):
        sender.check()
    with pytest.raises(BatchSenderClosed):
        sender.put(4, None, lambda _s: None, timeout_s=1)
    assert sender.close(timeout_s=1)


def test_an_on_sent_error_stops_the_thread_too():
    sender = BatchSender(lambda step, item: None, max_pending=1)

    def on_sent(_send_s: float) -> None:
        raise OSError("disk full while saving the state")

    sender.put(1, None, on_sent, timeout_s=5)
    with pytest.raises(OSError, match="disk full"):
        sender.flush(timeout_s=5)


def test_flush_times_out_and_bad_arguments_are_value_errors():
    release = threading.Event()
    sender = BatchSender(lambda step, item: release.wait(10), max_pending=1)
    sender.put(1, None, lambda _s: None, timeout_s=5)
    with pytest.raises(TimeoutError, match="not sent"):
        sender.flush(timeout_s=0.2)
    release.set()
    sender.flush(timeout_s=5)
    assert sender.close(timeout_s=5)
    with pytest.raises(ValueError, match="max_pending"):
        BatchSender(lambda step, item: None, max_pending=0)


def test_a_blocked_put_ends_when_the_orchestrator_stops():
    """While the send thread waits (e.g. through a broker outage) a full queue blocks `put`; once `should_stop()`
    turns true (SIGTERM, the broker ended the run) `put` gives up within a poll and the step is not counted."""
    from primerl.orchestrator.batch_sender import SendInterrupted

    release = threading.Event()
    stop = threading.Event()
    sender = BatchSender(lambda step, item: release.wait(10), max_pending=1)
    sender.put(1, None, lambda _s: None, timeout_s=5)
    sender.put(2, None, lambda _s: None, timeout_s=5)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(SendInterrupted, match="step 3"):
        sender.put(3, None, lambda _s: None, timeout_s=30, should_stop=stop.is_set)
    assert 0.2 < time.monotonic() - started < 2
    assert sender.num_unsent == 2
    release.set()
    sender.flush(timeout_s=5)
    assert sender.close(timeout_s=5)

"""The trainer's IO threads (primerl.trainer.step_io): order, failures that stop the line, prefetch, shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from primerl.client.rollouts import FetchStopped
from primerl.trainer.step_io import StepIOThread, StepPrefetcher, TrainerIOError


def test_jobs_run_in_submission_order_and_close_drains_them():
    io = StepIOThread(max_pending=2)
    done: list[int] = []

    def job(i: int):
        def run():
            time.sleep(0.01 * (5 - i))  # later jobs are quicker: order must still hold
            done.append(i)
            return i * 10

        return run

    tickets = [io.submit(f"job {i}", job(i)) for i in range(5)]
    assert tickets[1].wait(5.0) == 10
    io.close(10.0)
    assert done == [0, 1, 2, 3, 4]
    assert [t.result for t in tickets] == [0, 10, 20, 30, 40]


def test_a_failed_checkpoint_is_never_followed_by_its_commit_and_surfaces_typed():
    io = StepIOThread()
    ran: list[str] = []

    def checkpoint():
        ran.append("checkpoint")
        raise OSError("disk full")

    checkpoint_ticket = io.submit("checkpoint step 10", checkpoint)
    commit_ticket = io.submit("commit step 10", lambda: ran.append("commit"))
    with pytest.raises(TrainerIOError, match="checkpoint step 10.*disk full") as info:
        commit_ticket.wait(5.0)
    assert isinstance(info.value.__cause__, OSError)
    assert ran == ["checkpoint"]  # the commit did not run
    with pytest.raises(TrainerIOError):
        checkpoint_ticket.wait(1.0)
    with pytest.raises(TrainerIOError):  # the compute loop sees it at its next check or submit
        io.check()
    with pytest.raises(TrainerIOError):
        io.submit("publish step 11", lambda: ran.append("publish"))
    with pytest.raises(TrainerIOError):
        io.close(5.0)
    assert ran == ["checkpoint"]


def test_close_without_raising_still_stops_the_thread():
    io = StepIOThread()
    io.submit("bad", lambda: 1 / 0)
    io.close(5.0, raise_error=False)
    assert not io.alive()


def test_a_ticket_wait_is_bounded():
    io = StepIOThread()
    release = threading.Event()
    ticket = io.submit("slow publish", lambda: release.wait(10.0))
    with pytest.raises(TrainerIOError, match="not done within"):
        ticket.wait(0.3)
    release.set()
    ticket.wait(5.0)
    io.close(5.0)


def test_prefetcher_fetches_ahead_in_order_and_decodes_off_the_compute_thread():
    fetched: list[int] = []
    decode_threads: set[str] = set()

    def fetch(step: int, halt: threading.Event) -> list:
        fetched.append(step)
        return [step, step]

    def decode(raw: list) -> list:
        decode_threads.add(threading.current_thread().name)
        return [x * 2 for x in raw]

    prefetcher = StepPrefetcher(fetch, decode, 3, 6)
    first = prefetcher.get(3, timeout_s=5.0)
    assert first.step == 3 and first.micro_batches == [6, 6]
    deadline = time.monotonic() + 5.0
    while len(fetched) < 2 and time.monotonic() < deadline:  # step 4 is fetched while step 3 "computes"
        time.sleep(0.01)
    assert fetched[:2] == [3, 4]
    assert [prefetcher.get(s, timeout_s=5.0).micro_batches for s in (4, 5, 6)] == [[8, 8], [10, 10], [12, 12]]
    assert threading.current_thread().name not in decode_threads
    prefetcher.close()


def test_prefetcher_hands_the_fetch_error_to_the_compute_loop():
    def fetch(step: int, halt: threading.Event) -> list:
        if step == 2:
            raise ValueError("micro-batch lacks tensors")
        return [step]

    prefetcher = StepPrefetcher(fetch, list, 1, 5)
    assert prefetcher.get(1, timeout_s=5.0).micro_batches == [1]
    with pytest.raises(ValueError, match="lacks tensors"):
        prefetcher.get(2, timeout_s=5.0)
    prefetcher.close()


def test_stop_event_and_close_end_a_fetch_that_waits_for_data():
    halted = threading.Event()

    def fetch(step: int, halt: threading.Event) -> list:
        while not halt.wait(0.05):
            pass
        halted.set()
        raise FetchStopped("stopped")

    prefetcher = StepPrefetcher(fetch, list, 1, 3)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(FetchStopped):
        prefetcher.get(1, timeout_s=30.0, stop_event=stop)
    prefetcher.close(5.0)
    assert halted.is_set()


def test_prefetcher_get_times_out():
    prefetcher = StepPrefetcher(lambda step, halt: halt.wait(30.0) and [], list, 1, 1)
    with pytest.raises(TimeoutError):
        prefetcher.get(1, timeout_s=0.3)
    prefetcher.close(5.0)

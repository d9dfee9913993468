"""Unit tests of the rollout queue (pure logic over a spool in a temporary directory)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from primerl.broker.rollout_queue import RolloutQueue
from primerl.broker.rollout_results import (
    Accepted,
    Backpressure,
    Delivery,
    Duplicate,
    Refused,
    Stale,
    StepDone,
)
from primerl.broker.spool import RolloutSpool
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, data_pb2

A, B = b"session-a", b"session-b"


def batch(step: int, rank: int, index: int, num: int = 3, n: int = 8, batch_id: str | None = None):
    payload, specs = tf.encode_tensors({"input_ids": np.full(n, step * 100 + rank * 10 + index, dtype=np.int64)})
    header = data_pb2.RolloutBatchHeader(
        step=step,
        rank=rank,
        micro_batch_index=index,
        num_micro_batches=num,
        tensors=specs,
        batch_id=f"{step}:{rank}:{index}" if batch_id is None else batch_id,
    )
    return header, payload


def make_queue(tmp_path, max_batches: int = 100, max_bytes: int = 1 << 30, **kwargs) -> RolloutQueue:
    return RolloutQueue(RolloutSpool(tmp_path / "spool"), max_batches, max_bytes, **kwargs)


def offer_step(queue: RolloutQueue, step: int, rank: int = 0, num: int = 3) -> None:
    for index in range(num):
        assert isinstance(queue.offer(*batch(step, rank, index, num)), Accepted)


def test_offer_then_request_respects_credits_and_order(tmp_path):
    queue = make_queue(tmp_path)
    for index in (2, 0, 1):
        assert isinstance(queue.offer(*batch(1, 0, index)), Accepted)
    first = queue.request(A, 1, 0, credits=2)
    assert first.batch_ids == ("1:0:0", "1:0:1") and first.step_done is None
    second = queue.request(A, 1, 0, credits=5)
    assert second.batch_ids == ("1:0:2",) and second.step_done == StepDone(1, 0, 3)
    header, payload = queue.spool.get("1:0:2")
    assert header.micro_batch_index == 2 and bytes(payload) == batch(1, 0, 2)[1]


def test_exactly_once_per_session_within_a_step(tmp_path):
    queue = make_queue(tmp_path)
    offer_step(queue, 1)
    seen = []
    for credits in (1, 0, 1, 1):
        delivery = queue.request(A, 1, 0, credits=credits)
        seen.extend(delivery.batch_ids)
    assert seen == ["1:0:0", "1:0:1", "1:0:2"] and delivery.step_done == StepDone(1, 0, 3)
    # Asking for a finished step again means the trainer went back (restarted): it all comes again.
    assert queue.request(A, 1, 0, credits=8).batch_ids == ("1:0:0", "1:0:1", "1:0:2")
    # Another session (another consumer) gets its own copy.
    assert queue.request(B, 1, 0, credits=10).batch_ids == ("1:0:0", "1:0:1", "1:0:2")


def test_only_the_requested_step_and_rank(tmp_path):
    queue = make_queue(tmp_path)
    offer_step(queue, 1, rank=0, num=2)
    offer_step(queue, 1, rank=1, num=2)
    offer_step(queue, 2, rank=0, num=2)
    assert queue.request(A, 1, 1, credits=10).batch_ids == ("1:1:0", "1:1:1")
    assert queue.request(B, 2, 0, credits=10).batch_ids == ("2:0:0", "2:0:1")


def test_pending_request_is_served_as_batches_arrive(tmp_path):
    queue = make_queue(tmp_path)
    empty = queue.request(A, 4, 1, credits=2)
    assert isinstance(empty, Delivery) and not empty
    assert queue.status().num_pending_requests == 1
    result = queue.offer(*batch(4, 1, 1, num=3))
    assert isinstance(result, Accepted)
    assert [d.batch_ids for d in result.deliveries] == [("4:1:1",)] and result.deliveries[0].session_id == A
    assert queue.offer(*batch(4, 0, 0, num=3)).deliveries == ()  # other rank: nobody waits for it
    assert queue.offer(*batch(4, 1, 0, num=3)).deliveries[0].batch_ids == ("4:1:0",)
    # Credits used up: the third batch waits for the next request.
    assert queue.offer(*batch(4, 1, 2, num=3)).deliveries == ()
    assert queue.status().num_pending_requests == 0
    last = queue.request(A, 4, 1, credits=2)
    assert last.batch_ids == ("4:1:2",) and last.step_done == StepDone(4, 1, 3)


def test_step_done_comes_with_the_last_batch_from_offer(tmp_path):
    queue = make_queue(tmp_path)
    queue.request(A, 1, 0, credits=8)
    deliveries = [queue.offer(*batch(1, 0, i, num=2)).deliveries for i in range(2)]
    assert deliveries[0][0].step_done is None
    assert deliveries[1][0].step_done == StepDone(1, 0, 2)


def test_redelivery_to_a_restarted_trainer_from_step_k_plus_1(tmp_path):
    queue = make_queue(tmp_path)
    for step in (1, 2, 3):
        offer_step(queue, step, num=2)
    for step in (1, 2, 3):
        assert queue.request(A, step, 0, credits=8).step_done is not None
    queue.release_through(1)  # the trainer checkpointed step 1, then crashed during step 3
    # Same connection asking for a finished step again: a restart, so everything comes again.
    assert queue.request(A, 2, 0, credits=8).batch_ids == ("2:0:0", "2:0:1")
    assert queue.request(A, 3, 0, credits=8).batch_ids == ("3:0:0", "3:0:1")
    # A new session (HELLO of the restarted worker on a new connection) gets them too.
    queue.open_session(B, "trainer-0")
    assert queue.request(B, 2, 0, credits=8).batch_ids == ("2:0:0", "2:0:1")
    # A committed step is gone, with a clear error.
    refused = queue.request(B, 1, 0, credits=8)
    assert isinstance(refused, Refused) and refused.code == common_pb2.ERROR_CODE_NOT_FOUND


def test_hello_restarts_a_session_mid_step(tmp_path):
    queue = make_queue(tmp_path)
    offer_step(queue, 1, num=3)
    assert queue.request(A, 1, 0, credits=2).batch_ids == ("1:0:0", "1:0:1")
    queue.open_session(A, "trainer-0")
    assert queue.request(A, 1, 0, credits=8).batch_ids == ("1:0:0", "1:0:1", "1:0:2")


def test_hello_of_same_worker_closes_its_old_session(tmp_path):
    queue = make_queue(tmp_path)
    queue.open_session(A, "trainer-0")
    queue.request(A, 1, 0, credits=2)
    queue.open_session(B, "trainer-0")
    assert queue.status().num_sessions == 1
    assert queue.offer(*batch(1, 0, 0)).deliveries == ()  # A's pending request went with it


def test_forget_delivery_gives_the_batch_again(tmp_path):
    queue = make_queue(tmp_path)
    offer_step(queue, 1, num=2)
    assert queue.request(A, 1, 0, credits=8).step_done is not None
    queue.forget_delivery(A, "1:0:1")  # could not be sent
    again = queue.request(A, 1, 0, credits=8)
    assert again.batch_ids == ("1:0:1",) and again.step_done == StepDone(1, 0, 2)


def test_duplicate_offer_is_acked_without_a_second_copy(tmp_path):
    queue = make_queue(tmp_path)
    assert isinstance(queue.offer(*batch(1, 0, 0)), Accepted)
    assert isinstance(queue.offer(*batch(1, 0, 0)), Duplicate)
    assert queue.status().num_batches == 1


def test_missing_batch_id_gets_the_default(tmp_path):
    queue = make_queue(tmp_path)
    result = queue.offer(*batch(3, 1, 2, batch_id=""))
    assert isinstance(result, Accepted) and result.batch_id == "3:1:2"
    assert queue.spool.get("3:1:2")[0].batch_id == "3:1:2"


def test_inconsistent_batches_are_refused(tmp_path):
    queue = make_queue(tmp_path)
    queue.offer(*batch(1, 0, 0, num=3))
    wrong_count = queue.offer(*batch(1, 0, 1, num=4))
    other_id_same_slot = queue.offer(*batch(1, 0, 0, num=3, batch_id="custom"))
    index_too_big = queue.offer(*batch(2, 0, 5, num=3))
    for result in (wrong_count, other_id_same_slot, index_too_big):
        assert isinstance(result, Refused) and result.code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    assert queue.status().num_batches == 1


def test_backpressure_by_count(tmp_path):
    queue = make_queue(tmp_path, max_batches=2, retry_after_ms=75)
    offer_step(queue, 1, num=2)
    full = queue.offer(*batch(2, 0, 0))
    assert isinstance(full, Backpressure) and full.retry_after_ms == 75 and "2 of 2 batches" in full.reason
    assert queue.status().num_batches == 2 and queue.status().num_backpressured == 1
    assert queue.release_through(1) == 2
    assert isinstance(queue.offer(*batch(2, 0, 0)), Accepted)


def test_batches_the_trainer_asked_for_do_not_count_against_the_bound(tmp_path):
    """Commits come only at checkpoints: consumed steps must not block the producer until then."""
    queue = make_queue(tmp_path, max_batches=2)
    offer_step(queue, 1, num=2)
    assert isinstance(queue.offer(*batch(2, 0, 0)), Backpressure)  # nobody asked yet: 2 ahead
    assert queue.request(A, 1, 0, credits=8).step_done is not None
    status = queue.status()
    assert (status.num_batches, status.num_ahead_batches, status.frontier_step) == (2, 0, 1)
    offer_step(queue, 2, num=2)
    assert isinstance(queue.offer(*batch(3, 0, 0)), Backpressure)  # step 2 is ahead now
    assert queue.request(A, 2, 0, credits=8).step_done is not None
    offer_step(queue, 3, num=2)
    assert queue.status().num_batches == 6  # all kept on disk until the commit
    assert queue.release_through(2) == 4 and queue.status().num_batches == 2


def test_a_batch_of_a_step_the_trainer_asks_for_is_taken_however_full_the_queue(tmp_path):
    """Step 1 has 3 micro-batches but only 2 fit before any trainer asks; once the trainer asks for step 1, later
    steps fill the queue; the last batch of step 1 must still get in, or step 1 never completes (a deadlock that
    a windowed producer hit: tests/test_rollout_plane.py::test_windowed_producer_waits_through_backpressure)."""
    queue = make_queue(tmp_path, max_batches=2)
    assert isinstance(queue.offer(*batch(1, 0, 0, num=3)), Accepted)
    assert isinstance(queue.offer(*batch(1, 0, 1, num=3)), Accepted)
    assert isinstance(queue.offer(*batch(1, 0, 2, num=3)), Backpressure)  # nobody asked yet: 2 ahead
    queue.request(A, 1, 0, credits=8)
    assert isinstance(queue.offer(*batch(2, 0, 0, num=2)), Accepted)
    assert isinstance(queue.offer(*batch(2, 0, 1, num=2)), Accepted)
    assert isinstance(queue.offer(*batch(3, 0, 0, num=2)), Backpressure)  # steps ahead are still bounded
    assert isinstance(queue.offer(*batch(1, 0, 2, num=3)), Accepted)
    assert queue.request(A, 1, 0, credits=8).step_done is not None


def test_the_bound_holds_however_the_requested_steps_move(tmp_path):
    """Requests that jump ahead by ``max_step_lead`` three times leave batches behind that nobody asks for: they
    still count, so no more than ``max_batches`` wait for a trainer at any time (a fuzz found 24 with 8)."""
    queue = make_queue(tmp_path, max_batches=8, max_step_lead=1024)
    accepted = 0
    for jump in (1, 2, 3):
        step = 1024 * jump - 1
        assert isinstance(queue.request(A, step, 0, credits=1), Delivery)
        for index in range(8):
            accepted += isinstance(queue.offer(*batch(step + 1, 0, index, num=8)), Accepted)
    assert accepted == 8
    status = queue.status()
    assert status.num_ahead_batches == 8 and status.frontier_step == 3071
    # A batch of the step a trainer asks for now is still always taken, and given at once.
    delivered = queue.offer(*batch(3071, 0, 0, num=1))
    assert isinstance(delivered, Accepted) and delivered.deliveries[0].batch_ids == ("3071:0:0",)
    # Only a session given the waiting batches (those of step 1024, the first taken) frees the bound.
    assert isinstance(queue.offer(*batch(3073, 0, 0, num=1)), Backpressure)
    assert len(queue.request(B, 1024, 0, credits=8).batch_ids) == 8
    assert isinstance(queue.offer(*batch(3073, 0, 0, num=1)), Accepted)


def test_backpressure_by_bytes(tmp_path):
    header, payload = batch(1, 0, 0, n=64)
    one = 24 + len(header.SerializeToString()) + len(payload)
    queue = make_queue(tmp_path, max_batches=100, max_bytes=2 * one + 10)
    assert isinstance(queue.offer(*batch(1, 0, 0, n=64)), Accepted)
    assert isinstance(queue.offer(*batch(1, 0, 1, n=64)), Accepted)
    assert isinstance(queue.offer(*batch(1, 0, 2, n=64)), Backpressure)
    assert queue.status().num_bytes <= queue.max_bytes
    too_big = queue.offer(*batch(5, 0, 0, n=4096))
    assert isinstance(too_big, Refused) and too_big.code == common_pb2.ERROR_CODE_OVERSIZED


def test_batch_of_a_committed_step_is_acked_as_stale(tmp_path):
    queue = make_queue(tmp_path)
    offer_step(queue, 1, num=1)
    queue.release_through(1)
    result = queue.offer(*batch(1, 0, 0, num=1))
    assert isinstance(result, Stale) and result.committed_step == 1
    assert queue.status().num_batches == 0


def test_release_is_idempotent_and_survives_reload(tmp_path):
    queue = make_queue(tmp_path)
    for step in (1, 2, 3):
        offer_step(queue, step, num=2)
    assert queue.release_through(2) == 4
    assert queue.release_through(2) == 0 and queue.release_through(1) == 0
    status = queue.status()
    assert (status.num_batches, status.committed_step, status.lowest_step) == (2, 2, 3)
    queue.close()
    reloaded = make_queue(tmp_path)
    assert reloaded.status().num_batches == 2 and reloaded.status().committed_step == 2
    assert reloaded.request(A, 3, 0, credits=8).batch_ids == ("3:0:0", "3:0:1")


def test_sessions_are_bounded(tmp_path):
    queue = make_queue(tmp_path, max_sessions=3)
    for i in range(10):
        queue.request(bytes([i]), 1, 0, credits=1)
    assert queue.status().num_sessions == 3


def test_concurrent_release_and_offer(tmp_path):
    queue = make_queue(tmp_path, max_batches=4)
    errors = []

    def produce():
        try:
            step, index = 1, 0
            while step <= 30:
                result = queue.offer(*batch(step, 0, index, num=2))
                if isinstance(result, Backpressure):
                    continue
                assert isinstance(result, (Accepted, Stale)), result
                index += 1
                if index == 2:
                    step, index = step + 1, 0
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    thread = threading.Thread(target=produce)
    thread.start()
    committed = 0
    while thread.is_alive() and committed < 30:
        status = queue.status()
        assert status.num_batches <= 4
        if status.highest_step is not None and status.lowest_step is not None:
            committed = status.lowest_step
            queue.release_through(committed)
    thread.join(10)
    assert not thread.is_alive() and not errors


def test_bad_capacities_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_batches"):
        make_queue(tmp_path, max_batches=0)


# ---------------------------------------------------------------------------------------------------
# group commit


def test_offer_many_decides_in_order_and_spools_the_group(tmp_path):
    from primerl.broker.rollout_results import OfferItem

    queue = make_queue(tmp_path, max_batches=3)
    queue.open_session(A)
    assert queue.request(A, 1, 0, credits=8).batch_ids == ()
    items = [
        OfferItem(*batch(1, 0, 0)),  # the step the session waits for: not ahead of the trainers
        OfferItem(*batch(2, 0, 0)),
        OfferItem(*batch(2, 0, 0)),  # a resend inside the group
        OfferItem(*batch(2, 0, 1, batch_id="other")),
        OfferItem(*batch(2, 0, 1)),
        OfferItem(*batch(2, 0, 2)),
        OfferItem(*batch(3, 0, 0)),
    ]
    outcome = queue.offer_many(items)
    kinds = [type(r) for r in outcome.results]
    # slot 1 of step 2 goes to "other", 2:0:1 may not take it; the bound (3 ahead of step 1) stops 3:0:0
    assert kinds == [Accepted, Accepted, Duplicate, Accepted, Refused, Accepted, Backpressure]
    assert [d.batch_ids for d in outcome.deliveries] == [("1:0:0",)]
    assert queue.status().num_batches == 4 and len(list((tmp_path / "spool").glob("*.rbatch"))) == 4


def test_offer_many_keeps_nothing_when_the_spool_fails(tmp_path, monkeypatch):
    from primerl.broker.rollout_results import OfferItem
    from primerl.broker.spool import SpoolError

    queue = make_queue(tmp_path)

    def fail(records):
        raise SpoolError("disk full")

    monkeypatch.setattr(queue.spool, "put_many", fail)
    with pytest.raises(SpoolError):
        queue.offer_many([OfferItem(*batch(1, 0, i)) for i in range(3)])
    monkeypatch.undo()
    status = queue.status()
    assert (status.num_batches, status.num_accepted, status.highest_step) == (0, 0, None)
    assert all(
        isinstance(r, Accepted) for r in queue.offer_many([OfferItem(*batch(1, 0, i)) for i in range(3)]).results
    )

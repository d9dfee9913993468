"""Atomic steps at the rollout queue: a step is served from exactly one producer incarnation's whole set.

Unit tests over a real spool in a temporary directory (the daemons' path is tests/test_atomic_steps_e2e.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from primerl.broker.rollout_queue import RolloutQueue
from primerl.broker.rollout_results import Accepted, Duplicate, OfferItem, Refused, StepDone, Superseded
from primerl.broker.spool import RolloutSpool
from primerl.orchestrator.step_send import with_producer_ids
from primerl.proto import tensor_frames as tf
from primerl.proto.batch_ids import parse_producer_batch_id, producer_batch_id
from primerl.proto.v1 import common_pb2, data_pb2

T = b"trainer-session"


def batch(step: int, rank: int, index: int, num: int, num_ranks: int, producer: str | None, value: int = 0):
    payload, specs = tf.encode_tensors({"input_ids": np.full(8, value, dtype=np.int64)})
    batch_id = producer_batch_id(step, rank, index, num_ranks, producer) if producer else f"{step}:{rank}:{index}"
    header = data_pb2.RolloutBatchHeader(
        step=step, rank=rank, micro_batch_index=index, num_micro_batches=num, tensors=specs, batch_id=batch_id
    )
    return header, payload


def step_batches(step: int, producer: str, num: int = 3, num_ranks: int = 2, value: int = 0):
    return [batch(step, r, i, num, num_ranks, producer, value) for r in range(num_ranks) for i in range(num)]


def make_queue(spool_dir, **kwargs) -> RolloutQueue:
    return RolloutQueue(RolloutSpool(spool_dir), 1000, 1 << 30, **kwargs)


def producers_of(batch_ids) -> set[str]:
    return {parse_producer_batch_id(b).producer for b in batch_ids}


def fetch_all(queue: RolloutQueue, session: bytes, step: int, num_ranks: int = 2) -> dict[int, tuple]:
    return {rank: queue.request(session, step, rank, credits=64) for rank in range(num_ranks)}


def test_batch_id_round_trip_and_bad_producer():
    parsed = parse_producer_batch_id(producer_batch_id(7, 1, 2, 4, "abc123"))
    assert (parsed.step, parsed.rank, parsed.micro_batch_index, parsed.num_ranks, parsed.producer) == (
        7,
        1,
        2,
        4,
        "abc123",
    )
    assert parse_producer_batch_id("7:1:2") is None and parse_producer_batch_id("7:1:2/4@a b") is None
    with pytest.raises(ValueError, match="producer"):
        producer_batch_id(1, 0, 0, 1, "no spaces")
    with pytest.raises(ValueError, match="below num_ranks"):
        producer_batch_id(1, 2, 0, 2, "p")


def test_partial_set_is_not_served_and_is_dropped_when_another_incarnation_completes(tmp_path):
    queue = make_queue(tmp_path / "spool")
    old = step_batches(1, "old", value=1)
    for item in old[:4]:  # rank 0 whole, rank 1 one of three: the old orchestrator died here
        assert isinstance(queue.offer(*item), Accepted)
    # A trainer asking now gets nothing: the step is not whole from any incarnation.
    pending = fetch_all(queue, T, 1)
    assert all(not d.batch_ids and d.step_done is None for d in pending.values())
    new = step_batches(1, "new", value=2)
    group = queue.offer_many([OfferItem(h, p) for h, p in new])
    assert all(isinstance(r, Accepted) for r in group.results)
    # The pending requests are served from the new incarnation only, whole.
    served = {d.session_id: d for d in group.deliveries}
    assert set(served) == {T}
    ids = [b for d in group.deliveries for b in d.batch_ids]
    ids += [b for rank in range(2) for b in queue.request(T, 1, rank, credits=64).batch_ids]
    assert producers_of(ids) == {"new"} and len(set(ids)) == 6
    # The old partial set is gone from the spool, and its resends are acked without being kept.
    assert {e.batch_id for e in queue.spool.entries()} == {h.batch_id for h, _ in new}
    assert isinstance(queue.offer(*old[4]), Superseded)
    assert isinstance(queue.offer(*old[0]), Superseded)
    status = queue.status()
    assert status.num_superseded == 4 + 2 and status.num_batches == 6


def test_whole_set_of_the_first_incarnation_wins_over_a_remade_step(tmp_path):
    queue = make_queue(tmp_path / "spool")
    for item in step_batches(1, "first", value=1):
        assert isinstance(queue.offer(*item), Accepted)
    for item in step_batches(1, "second", value=2):
        result = queue.offer(*item)
        assert isinstance(result, Superseded) and result.owner == "first"
    ids = [b for d in fetch_all(queue, T, 1).values() for b in d.batch_ids]
    assert producers_of(ids) == {"first"} and len(ids) == 6


def test_incarnations_completing_in_one_group_keep_only_the_first_whole(tmp_path):
    queue = make_queue(tmp_path / "spool")
    a, b = step_batches(1, "a", num=2, num_ranks=1), step_batches(1, "b", num=2, num_ranks=1)
    interleaved = [a[0], b[0], b[1], a[1]]  # b completes first
    group = queue.offer_many([OfferItem(h, p) for h, p in interleaved])
    assert [type(r) for r in group.results] == [Accepted, Accepted, Accepted, Superseded]
    assert {e.batch_id for e in queue.spool.entries()} == {h.batch_id for h, _ in b}


def test_ownership_survives_a_broker_restart(tmp_path):
    spool_dir = tmp_path / "spool"
    queue = make_queue(spool_dir)
    for item in step_batches(1, "old", value=1)[:2]:
        queue.offer(*item)
    for item in step_batches(2, "old", value=1)[:5]:  # step 2: partial from "old"
        queue.offer(*item)
    for item in step_batches(1, "new", value=2):  # step 1: whole from "new"
        queue.offer(*item)
    queue.close()
    again = make_queue(spool_dir)
    # Step 1 is still "new"'s (the old partial set was deleted), step 2 is still waiting for a whole set.
    ids = [b for d in fetch_all(again, T, 1).values() for b in d.batch_ids]
    assert producers_of(ids) == {"new"} and len(ids) == 6
    assert isinstance(again.offer(*step_batches(1, "old")[3]), Superseded)
    assert all(not d.batch_ids for d in fetch_all(again, b"other", 2).values())
    # The old incarnation's last batch (a resend after the restart) completes step 2 from "old".
    group = again.offer_many([OfferItem(*step_batches(2, "old", value=1)[5])])
    assert isinstance(group.results[0], Accepted)
    ids = [b for d in fetch_all(again, b"third", 2).values() for b in d.batch_ids]
    assert producers_of(ids) == {"old"} and len(ids) == 6


def test_a_crash_between_spooling_two_whole_sets_and_dropping_one_is_healed_at_load(tmp_path):
    """Two whole sets of a step on disk (the broker died before deleting the later one): one is kept whole."""
    spool_dir = tmp_path / "spool"
    spool = RolloutSpool(spool_dir)
    spool.load()
    for header, payload in step_batches(1, "x") + step_batches(1, "y"):
        spool.put(header.batch_id, header.SerializeToString(), payload)
    spool.close()
    queue = make_queue(spool_dir)
    assert producers_of(e.batch_id for e in queue.spool.entries()) == {"x"}
    ids = [b for d in fetch_all(queue, T, 1).values() for b in d.batch_ids]
    assert producers_of(ids) == {"x"} and len(ids) == 6


def test_commit_drops_candidates_and_ownership(tmp_path):
    queue = make_queue(tmp_path / "spool")
    for item in step_batches(1, "a")[:3]:
        queue.offer(*item)
    for item in step_batches(2, "a"):
        queue.offer(*item)
    queue.release_through(2)
    assert queue.spool.num_batches == 0 and queue.status().lowest_step is None
    assert queue.offer(*step_batches(2, "b")[0]).__class__.__name__ == "Stale"


def test_mixed_and_inconsistent_ids_are_refused(tmp_path):
    queue = make_queue(tmp_path / "spool")
    queue.offer(*batch(1, 0, 0, 2, 1, None))
    refused = queue.offer(*batch(1, 0, 1, 2, 1, "p"))
    assert isinstance(refused, Refused) and "without one" in refused.message
    queue.offer(*batch(2, 0, 0, 2, 1, "p"))
    refused = queue.offer(*batch(2, 0, 1, 2, 1, None))
    assert isinstance(refused, Refused) and "holds batches with one" in refused.message
    header, payload = batch(3, 0, 0, 2, 1, "p")
    header.batch_id = producer_batch_id(4, 0, 0, 1, "p")  # names another step than the header
    refused = queue.offer(header, payload)
    assert isinstance(refused, Refused) and refused.code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    queue.offer(*batch(5, 0, 0, 2, 2, "p"))
    refused = queue.offer(*batch(5, 1, 0, 2, 3, "p"))
    assert isinstance(refused, Refused) and "ranks" in refused.message
    assert isinstance(queue.offer(*batch(5, 0, 0, 2, 2, "p")), Duplicate)


def test_with_producer_ids_names_every_batch_of_the_step():
    messages = [batch(3, r, i, 2, 2, None) for r in range(2) for i in range(2)]
    tagged = with_producer_ids(messages, "inc1")
    parsed = [parse_producer_batch_id(h.batch_id) for h, _ in tagged]
    assert all(p is not None and p.num_ranks == 2 and p.producer == "inc1" for p in parsed)
    assert [(p.rank, p.micro_batch_index) for p in parsed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert messages[0][0].batch_id == "3:0:0"  # the caller's headers are left as they were
    custom = batch(3, 0, 0, 1, 1, None)
    custom[0].batch_id = "my-own-id"
    assert with_producer_ids([custom], "inc1")[0][0].batch_id == "my-own-id"


def test_step_done_after_serving_the_whole_set(tmp_path):
    queue = make_queue(tmp_path / "spool")
    for item in step_batches(4, "a", num=2, num_ranks=1):
        queue.offer(*item)
    delivery = queue.request(T, 4, 0, credits=8)
    assert delivery.step_done == StepDone(4, 0, 2) and producers_of(delivery.batch_ids) == {"a"}


def test_a_step_held_whole_refuses_a_set_packed_otherwise(tmp_path):
    """Another run's spool (a step held whole, packed otherwise) is refused, as a disagreeing batch always was."""
    queue = make_queue(tmp_path / "spool")
    for item in step_batches(1, "old-run", num=2, num_ranks=1):
        queue.offer(*item)
    refused = queue.offer(*step_batches(1, "new-run", num=3, num_ranks=1)[0])
    assert isinstance(refused, Refused) and "already held whole from producer 'old-run'" in refused.message
    refused = queue.offer(*step_batches(1, "new-run", num=2, num_ranks=2)[0])
    assert isinstance(refused, Refused) and "2 ranks" in refused.message

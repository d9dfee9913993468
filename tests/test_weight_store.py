"""WeightStore: version ordering, delta base checks, digests, plans for new/behind/current workers, chain bounds."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from primerl.broker.weight_store import WeightStore
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import common_pb2, data_pb2
from primerl.proto.weight_refusals import WeightUpdateRefused

FULL = data_pb2.WEIGHT_UPDATE_KIND_FULL
LORA = data_pb2.WEIGHT_UPDATE_KIND_LORA
DELTA = data_pb2.WEIGHT_UPDATE_KIND_DELTA


def update(version: int, kind: int = FULL, base: int = 0, num_values: int = 16, digest: str | None = None):
    data, specs = tf.encode_tensors({"w": np.full(num_values, version, dtype=np.uint8)})
    header = data_pb2.WeightUpdateHeader(
        policy_version=version,
        kind=kind,
        base_version=base,
        tensors=specs,
        digest=hashlib.sha256(data).hexdigest() if digest is None else digest,
        payload_bytes=len(data),
    )
    return header, data


def put(store: WeightStore, version: int, kind: int = FULL, base: int = 0, **kwargs):
    return store.put(*update(version, kind, base, **kwargs))


def versions(plan) -> list[int]:
    return [u.policy_version for u in plan]


def refused(store: WeightStore, version: int, kind: int = FULL, base: int = 0, **kwargs) -> WeightUpdateRefused:
    before = store.status()
    with pytest.raises(WeightUpdateRefused) as info:
        put(store, version, kind, base, **kwargs)
    after = store.status()
    assert (after.latest_version, after.snapshot_version, after.num_deltas, after.num_bytes) == (
        before.latest_version,
        before.snapshot_version,
        before.num_deltas,
        before.num_bytes,
    ), "a refusal changed the store"
    return info.value


def test_empty_store_plans_nothing():
    store = WeightStore()
    assert store.latest_version is None and store.latest() is None
    assert store.plan_for(None) == [] and store.plan_for(3) == []
    status = store.status()
    assert (status.latest_version, status.snapshot_version, status.num_deltas, status.num_bytes) == (None, None, 0, 0)


def test_first_full_update_any_version_then_strictly_increasing():
    store = WeightStore()
    result = put(store, 0)
    assert result.update.policy_version == 0 and not result.full_required
    # The same update again (a publisher that lost the ack) is acknowledged and changes nothing; other bytes
    # under the same version are refused.
    again = put(store, 0)
    assert again.duplicate and again.update is result.update and store.status().num_accepted == 1
    assert refused(store, 0, num_values=17).code == common_pb2.ERROR_CODE_OUT_OF_ORDER
    put(store, 5)
    error = refused(store, 4)
    assert error.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and "not newer" in str(error)
    assert store.latest_version == 5


def test_delta_needs_the_latest_version_as_base():
    store = WeightStore()
    error = refused(store, 2, DELTA, base=1)
    assert error.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and "FULL" in str(error)
    put(store, 1)
    assert refused(store, 3, DELTA, base=0).code == common_pb2.ERROR_CODE_OUT_OF_ORDER
    assert refused(store, 1, DELTA, base=1).code == common_pb2.ERROR_CODE_OUT_OF_ORDER  # not newer than its base
    put(store, 2, DELTA, base=1)
    assert refused(store, 3, DELTA, base=1).code == common_pb2.ERROR_CODE_OUT_OF_ORDER  # base is no longer the latest
    put(store, 3, DELTA, base=2)
    assert store.status().num_deltas == 2 and store.latest_version == 3


def test_bad_or_missing_digest_and_inconsistent_headers_are_refused():
    store = WeightStore()
    put(store, 1)
    assert refused(store, 2, digest="00" * 32).code == common_pb2.ERROR_CODE_BAD_DIGEST
    assert refused(store, 2, digest="").code == common_pb2.ERROR_CODE_BAD_DIGEST
    header, data = update(2)
    header.payload_bytes += 1
    with pytest.raises(WeightUpdateRefused) as info:
        store.put(header, data)
    assert info.value.code == common_pb2.ERROR_CODE_TRUNCATED
    header, data = update(2, kind=data_pb2.WEIGHT_UPDATE_KIND_UNSPECIFIED)
    with pytest.raises(WeightUpdateRefused) as info:
        store.put(header, data)
    assert info.value.code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    assert refused(store, 2, FULL, base=1).code == common_pb2.ERROR_CODE_MALFORMED_HEADER
    assert store.status().num_refused == 5 and store.latest_version == 1


def test_digest_is_case_insensitive_and_can_be_precomputed():
    store = WeightStore()
    header, data = update(1)
    header.digest = header.digest.upper()
    store.put(header, data)
    header, data = update(2)
    store.put(header, data, computed_digest=hashlib.sha256(data).hexdigest())
    with pytest.raises(WeightUpdateRefused):
        header, data = update(3)
        store.put(header, data, computed_digest="ff" * 32)


def test_check_header_refuses_early_without_payload():
    store = WeightStore()
    put(store, 4)
    header, _ = update(3)
    with pytest.raises(WeightUpdateRefused) as info:
        store.check_header(header)
    assert info.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER
    store.check_header(update(5)[0])
    store.check_header(update(5, DELTA, base=4)[0])


def test_plans_for_new_behind_current_and_chain_workers():
    store = WeightStore()
    put(store, 1)
    for version in (2, 3, 4):
        put(store, version, DELTA, base=version - 1)
    assert versions(store.plan_for(None)) == [1, 2, 3, 4]  # new worker: snapshot then deltas
    assert versions(store.plan_for(0)) == [1, 2, 3, 4]  # behind the snapshot
    assert versions(store.plan_for(1)) == [2, 3, 4]  # at the snapshot
    assert versions(store.plan_for(3)) == [4]  # on the chain
    assert store.plan_for(4) == []  # current
    assert store.plan_for(9) == []  # ahead (the broker restarted and holds less): nothing older is pushed
    kinds = [u.kind for u in store.plan_for(None)]
    assert kinds == [FULL, DELTA, DELTA, DELTA]


def test_new_full_snapshot_clears_the_chain():
    store = WeightStore()
    put(store, 1)
    put(store, 2, DELTA, base=1)
    put(store, 3)
    status = store.status()
    assert (status.snapshot_version, status.num_deltas, status.latest_version) == (3, 0, 3)
    assert versions(store.plan_for(2)) == [3]  # was on the old chain: gets the new snapshot
    assert versions(store.plan_for(1)) == [3]


def test_lora_adapter_is_the_snapshot_of_a_lora_run():
    store = WeightStore()
    put(store, 1, LORA)
    put(store, 2, DELTA, base=1)
    assert store.status().snapshot_kind == "LORA"
    assert versions(store.plan_for(None)) == [1, 2]
    put(store, 3, LORA)
    assert versions(store.plan_for(2)) == [3] and store.status().num_deltas == 0
    assert refused(store, 3, LORA, num_values=17).code == common_pb2.ERROR_CODE_OUT_OF_ORDER


def test_delta_chain_count_bound_asks_for_a_full_update():
    store = WeightStore(max_deltas=2)
    assert not put(store, 1).full_required
    assert not put(store, 2, DELTA, base=1).full_required
    assert put(store, 3, DELTA, base=2).full_required  # chain is now full: the ack tells the trainer
    error = refused(store, 4, DELTA, base=3)
    assert error.code == common_pb2.ERROR_CODE_BACKPRESSURE and error.full_required and "FULL" in str(error)
    assert error.detail().retry_after_ms == 0
    assert not put(store, 4).full_required  # the same version as FULL is accepted
    assert versions(store.plan_for(None)) == [4]


def test_delta_chain_byte_bound():
    header, data = update(2, DELTA, base=1, num_values=100)
    store = WeightStore(max_delta_bytes=2 * len(data) + len(data) // 2)
    put(store, 1)
    assert not put(store, 2, DELTA, base=1, num_values=100).full_required
    assert put(store, 3, DELTA, base=2, num_values=100).full_required  # another one of this size would not fit
    assert refused(store, 4, DELTA, base=3, num_values=100).full_required
    # a smaller delta still fits
    assert put(store, 4, DELTA, base=3, num_values=4).update.policy_version == 4


def test_no_deltas_allowed():
    store = WeightStore(max_deltas=0)
    assert put(store, 1).full_required
    assert refused(store, 2, DELTA, base=1).full_required


def test_status_counts_bytes_and_payload_is_kept_read_only_without_copy():
    store = WeightStore()
    header, data = update(1, num_values=64)
    buffer = bytearray(data)
    result = store.put(header, buffer)
    assert result.update.payload.readonly and result.update.payload.obj is buffer
    put(store, 2, DELTA, base=1, num_values=8)
    status = store.status()
    assert status.num_bytes == len(data) + len(update(2, DELTA, 1, num_values=8)[1])
    assert (status.num_deltas, status.num_accepted, status.snapshot_kind) == (1, 2, "FULL")


def test_invalid_bounds_are_refused():
    with pytest.raises(ValueError):
        WeightStore(max_deltas=-1)
    with pytest.raises(ValueError):
        WeightStore(max_delta_bytes=-1)


def test_concurrent_puts_and_plans_stay_consistent():
    store = WeightStore(max_deltas=1000)
    put(store, 0)
    errors: list[BaseException] = []

    def reader():
        try:
            for _ in range(300):
                plan = store.plan_for(None)
                got = versions(plan)
                assert got == list(range(got[0], got[0] + len(got))), got
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for version in range(1, 200):
        put(store, version, DELTA, base=version - 1)
    for thread in threads:
        thread.join(10)
    assert not errors and store.latest_version == 199


# ---- lineages: a rollback is a first-class event ---------------------------------------------------------------


def lineage_update(version: int, lineage: int, kind: int = FULL, base: int = 0, lineage_base: int = 0, fill: int = 0):
    header, data = update(version, kind, base, num_values=16 + fill)
    header.lineage, header.lineage_base_version = lineage, lineage_base
    return header, data


def test_newer_lineage_full_replaces_the_chain_even_at_a_version_held():
    """Trainer A published v1..v3 (FULL, deltas); trainer B resumed at v2 publishes v3 again: accepted as a
    rollback, A's chain is gone, late joiners get B's v3, and A's late updates are refused."""
    store = WeightStore()
    store.put(*lineage_update(1, 10))
    store.put(*lineage_update(2, 10, DELTA, base=1))
    store.put(*lineage_update(3, 10, DELTA, base=2))
    header, data = lineage_update(3, 20, lineage_base=2, fill=1)
    result = store.put(header, data)
    assert (result.previous_lineage, result.rolled_back_from, result.duplicate) == (10, 3, False)
    status = store.status()
    assert (
        status.latest_version,
        status.lineage,
        status.lineage_base_version,
        status.num_deltas,
        status.num_rollbacks,
    ) == (3, 20, 2, 0, 1)
    assert [(u.policy_version, u.lineage) for u in store.plan_for(None)] == [(3, 20)]
    assert bytes(store.latest().payload) == data
    # A's v4 (delta or FULL) comes late: refused, store unchanged.
    for late in (lineage_update(4, 10, DELTA, base=3), lineage_update(4, 10)):
        before = store.status()
        with pytest.raises(WeightUpdateRefused) as info:
            store.put(*late)
        assert info.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and "superseded" in str(info.value)
        assert store.status().latest_version == before.latest_version == 3 and store.lineage == 20
    # B goes on with deltas of its own lineage.
    store.put(*lineage_update(4, 20, DELTA, base=3, lineage_base=2))
    assert versions(store.plan_for(3, 20)) == [4]


def test_a_new_lineage_starts_with_a_full_update_and_may_move_back_several_versions():
    store = WeightStore()
    for version in (1, 2, 3, 4, 5):
        store.put(*lineage_update(version, 10))
    with pytest.raises(WeightUpdateRefused) as info:
        store.put(*lineage_update(6, 20, DELTA, base=5))
    assert info.value.code == common_pb2.ERROR_CODE_OUT_OF_ORDER and "starts with a FULL" in str(info.value)
    result = store.put(*lineage_update(3, 20, lineage_base=2, fill=2))  # checkpoint 2, versions 3..5 rolled back
    assert result.rolled_back_from == 5 and store.latest_version == 3
    # Without a newer lineage, the old rule holds: a FULL must be newer than the latest.
    with pytest.raises(WeightUpdateRefused):
        store.put(*lineage_update(3, 20, fill=3))
    # A new lineage above the latest (a trainer resumed from its newest checkpoint) is no rollback.
    result = store.put(*lineage_update(4, 30, lineage_base=3))
    assert (result.previous_lineage, result.rolled_back_from) == (20, None)


def test_plans_by_lineage():
    """A worker of an older lineage gets the snapshot whatever its version number; one of a newer lineage (the
    broker lost it) gets nothing; lineage 0 plans by version as before."""
    store = WeightStore()
    store.put(*lineage_update(3, 20, lineage_base=2))
    store.put(*lineage_update(4, 20, DELTA, base=3, lineage_base=2))
    assert versions(store.plan_for(3, 10)) == [3, 4]  # holds A's rolled-back v3
    assert versions(store.plan_for(7, 10)) == [3, 4]  # holds A's v7, far past the rollback point
    assert versions(store.plan_for(3, 20)) == [4]
    assert versions(store.plan_for(4, 20)) == []
    assert versions(store.plan_for(9, 30)) == []  # a newer lineage than the broker's: never moved back
    assert versions(store.plan_for(3, 0)) == [4] and versions(store.plan_for(None, 0)) == [3, 4]


def test_a_resend_of_the_latest_update_is_acknowledged_not_stored_twice():
    store = WeightStore()
    store.put(*lineage_update(1, 10))
    header, data = lineage_update(2, 10, DELTA, base=1)
    store.put(header, data)
    store.check_header(header)  # the first chunk of a resend is not refused
    again = store.put(header, data)
    assert again.duplicate and store.status().num_deltas == 1 and store.status().num_accepted == 2

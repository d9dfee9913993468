"""Unit tests of the rollout spool: durable batch files, reload, torn and damaged files, commit marker."""

from __future__ import annotations

import os

import numpy as np
import pytest
import structlog

from primerl.broker import spool as spool_module
from primerl.broker.spool import BatchGone, RolloutSpool, SpoolCorruption, SpoolError
from primerl.broker.spool_format import PREFIX_BYTES, batch_file_name
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import data_pb2
from primerl.runtime import durable_files


def make_batch(step: int = 1, rank: int = 0, index: int = 0, num: int = 2, n: int = 16) -> tuple[bytes, bytes, str]:
    payload, specs = tf.encode_tensors({"input_ids": np.arange(n, dtype=np.int64) + 100 * step + 10 * rank + index})
    batch_id = f"{step}:{rank}:{index}"
    header = data_pb2.RolloutBatchHeader(
        step=step, rank=rank, micro_batch_index=index, num_micro_batches=num, tensors=specs, batch_id=batch_id
    )
    return header.SerializeToString(), payload, batch_id


@pytest.fixture
def spool(tmp_path) -> RolloutSpool:
    s = RolloutSpool(tmp_path / "spool")
    s.load()
    return s


def test_put_get_round_trip_and_sizes(spool):
    header_bytes, payload, batch_id = make_batch()
    assert spool.put(batch_id, header_bytes, payload) is True
    header, data = spool.get(batch_id)
    assert header.batch_id == batch_id and header.step == 1
    assert bytes(data) == payload
    assert spool.num_batches == 1
    assert spool.num_bytes == PREFIX_BYTES + len(header_bytes) + len(payload)
    assert (spool.directory / batch_file_name(batch_id)).stat().st_size == spool.num_bytes


def test_put_is_idempotent(spool):
    header_bytes, payload, batch_id = make_batch()
    assert spool.put(batch_id, header_bytes, payload) is True
    assert spool.put(batch_id, header_bytes, payload) is False
    assert spool.num_batches == 1
    assert len(list(spool.directory.glob("*.rbatch"))) == 1


def test_put_refuses_header_with_other_batch_id(spool):
    header_bytes, payload, _ = make_batch()
    with pytest.raises(ValueError, match="batch_id"):
        spool.put("other", header_bytes, payload)


def test_use_before_load_is_an_error(tmp_path):
    header_bytes, payload, batch_id = make_batch()
    with pytest.raises(SpoolError, match="load"):
        RolloutSpool(tmp_path).put(batch_id, header_bytes, payload)


def test_delete_and_reload(tmp_path, spool):
    ids = []
    for index in range(3):
        header_bytes, payload, batch_id = make_batch(index=index, num=3)
        spool.put(batch_id, header_bytes, payload)
        ids.append(batch_id)
    assert spool.delete([ids[0], "never-there"]) == 1
    with pytest.raises(BatchGone):
        spool.get(ids[0])
    spool.close()
    reloaded = RolloutSpool(spool.directory)
    index = reloaded.load()
    assert sorted(index) == ids[1:]
    assert reloaded.num_bytes == spool.num_bytes
    _, data = reloaded.get(ids[2])
    assert bytes(data) == make_batch(index=2, num=3)[1]


def test_torn_temp_file_is_ignored_and_removed(spool):
    header_bytes, payload, batch_id = make_batch()
    spool.put(batch_id, header_bytes, payload)
    torn = spool.directory / f".{batch_file_name('1:0:1')}.123.456.tmp"
    torn.write_bytes(b"PRMLRB01" + b"\x00" * 7)  # a crash in the middle of a write
    spool.close()
    with structlog.testing.capture_logs() as logs:
        index = RolloutSpool(spool.directory).load()
    assert list(index) == [batch_id]
    assert not torn.exists()
    assert any("partly written" in entry["event"] for entry in logs)


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "bad_magic", "garbage"])
def test_damaged_file_is_quarantined_with_a_log_line(spool, damage):
    header_bytes, payload, batch_id = make_batch()
    good_header, good_payload, good_id = make_batch(index=1)
    spool.put(batch_id, header_bytes, payload)
    spool.put(good_id, good_header, good_payload)
    path = spool.directory / batch_file_name(batch_id)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        raw[-3] ^= 0xFF  # renamed but torn/damaged on a disk that lied: only the CRC can tell
    elif damage == "truncate":
        raw = raw[: len(raw) - 5]
    elif damage == "bad_magic":
        raw[:8] = b"NOTASPOL"
    else:
        raw = bytearray(os.urandom(7))
    path.write_bytes(bytes(raw))
    spool.close()
    with structlog.testing.capture_logs() as logs:
        index = RolloutSpool(spool.directory).load()
    assert list(index) == [good_id]
    assert not path.exists()
    quarantined = list((spool.directory / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(path.name)
    assert [e for e in logs if e["event"] == "spool: damaged batch file quarantined" and e["log_level"] == "error"]


def test_damage_after_load_is_caught_on_read(spool):
    header_bytes, payload, batch_id = make_batch()
    spool.put(batch_id, header_bytes, payload)
    path = spool.directory / batch_file_name(batch_id)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(SpoolCorruption, match="CRC"):
        spool.get(batch_id)
    assert spool.num_batches == 0 and spool.num_bytes == 0
    with pytest.raises(BatchGone):
        spool.get(batch_id)


def test_committed_marker_survives_reload_and_drops_committed_leftovers(spool):
    for step in (1, 2, 3):
        header_bytes, payload, batch_id = make_batch(step=step, num=1)
        spool.put(batch_id, header_bytes, payload)
    spool.set_committed_step(2)  # a crash right after the marker, before the deletes
    spool.close()
    reloaded = RolloutSpool(spool.directory)
    assert list(reloaded.load()) == ["3:0:0"]
    assert reloaded.committed_step == 2
    assert len(list(spool.directory.glob("*.rbatch"))) == 1


def test_put_with_given_crc_matches_computed(spool, tmp_path):
    from primerl.proto.framing import compute_checksum

    header_bytes, payload, batch_id = make_batch()
    crc = compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [payload])
    spool.put(batch_id, header_bytes, memoryview(payload), crc32=crc)
    other = RolloutSpool(tmp_path / "other")
    other.load()
    other.put(batch_id, header_bytes, payload)
    assert (spool.directory / batch_file_name(batch_id)).read_bytes() == (
        other.directory / batch_file_name(batch_id)
    ).read_bytes()


def test_two_spools_never_share_a_directory(spool):
    with pytest.raises(SpoolError, match="in use"):
        RolloutSpool(spool.directory).load()
    spool.close()  # as when the owning process dies, even by SIGKILL
    RolloutSpool(spool.directory).load()


WRITER = r"""
import sys
import numpy as np
from primerl.broker.spool import RolloutSpool
from primerl.proto import tensor_frames as tf
from primerl.proto.v1 import data_pb2

spool = RolloutSpool(sys.argv[1])
spool.load()
payload, specs = tf.encode_tensors({"x": np.arange(64 * 1024, dtype=np.int64)})  # 512 KiB per batch
for index in range(100_000):
    batch_id = f"1:0:{index}"
    header = data_pb2.RolloutBatchHeader(
        step=1, micro_batch_index=index, num_micro_batches=100_000, tensors=specs, batch_id=batch_id
    )
    spool.put(batch_id, header.SerializeToString(), payload)
    print(batch_id, flush=True)  # the "ack": only after put returned
"""


def test_sigkill_during_writes_keeps_every_acked_batch(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    directory = tmp_path / "spool"
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        deadline = time.monotonic() + 20
        while len(acked) < 20 and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith("1:0:"):
                acked.append(line.strip())
        process.send_signal(signal.SIGKILL)  # in the middle of the next write
    finally:
        process.kill()
        process.wait(10)
    acked += [line.strip() for line in process.stdout.read().splitlines() if line.startswith("1:0:")]
    process.stdout.close()
    assert len(acked) >= 20
    with structlog.testing.capture_logs() as logs:
        index = RolloutSpool(directory).load()
    assert set(acked) <= set(index)  # at most one more: written but killed before its ack was printed
    assert len(index) - len(acked) <= 1
    assert not list(directory.glob("*.tmp")) and not (directory / "quarantine").exists()
    assert not [e for e in logs if e["log_level"] == "error"]


# ---------------------------------------------------------------------------------------------------
# group commit and the read cache


def test_put_many_writes_a_group_durably_and_skips_repeats(spool, monkeypatch):
    batches = [make_batch(index=i, num=4) for i in range(3)]
    assert spool.put(batches[0][2], batches[0][0], batches[0][1])
    dir_fsyncs = []
    real_fsync_dir = durable_files.fsync_dir
    monkeypatch.setattr(durable_files, "fsync_dir", lambda d: (dir_fsyncs.append(d), real_fsync_dir(d)))
    records = [(b, h, p, None) for h, p, b in batches] + [(batches[1][2], batches[1][0], batches[1][1], None)]
    assert spool.put_many(records) == [False, True, True, False]  # already spooled; new; new; repeat in the group
    assert len(dir_fsyncs) == 1  # one directory fsync for the whole group
    assert not list(spool.directory.glob("*.tmp"))
    reloaded = RolloutSpool(spool.directory)
    spool.close()
    index = reloaded.load()
    assert set(index) == {b for _, _, b in batches}
    for header_bytes, payload, batch_id in batches:
        assert reloaded.get(batch_id)[1].tobytes() == payload


def test_put_many_checks_every_record_before_writing(spool):
    good, bad = make_batch(index=0), make_batch(index=1)
    with pytest.raises(ValueError):
        spool.put_many([(good[2], good[0], good[1], None), ("other-id", bad[0], bad[1], None)])
    assert spool.num_batches == 0 and not list(spool.directory.glob("*.rbatch"))


def test_put_many_disk_failure_indexes_nothing_and_leaves_no_temp_files(spool, monkeypatch):
    batches = [make_batch(index=i) for i in range(2)]
    real_fsync = os.fsync

    def failing_fsync(fd):
        real_fsync(fd)
        raise OSError(5, "I/O error")

    monkeypatch.setattr(spool_module.os, "fsync", failing_fsync)
    with pytest.raises(SpoolError):
        spool.put_many([(b, h, p, None) for h, p, b in batches])
    monkeypatch.undo()
    assert (
        spool.num_batches == 0 and not list(spool.directory.glob("*.tmp")) and not list(spool.directory.glob(".*.tmp"))
    )


def test_get_record_serves_from_the_cache_and_falls_back_to_disk(tmp_path):
    spool = RolloutSpool(tmp_path / "spool", cache_max_bytes=3000)
    spool.load()
    batches = [make_batch(index=i, num=4, n=256) for i in range(3)]  # ~2 KiB payload each: one fits the cache
    for header_bytes, payload, batch_id in batches:
        spool.put(batch_id, header_bytes, payload)
    assert 0 < spool.num_cached_bytes <= 3000
    for header_bytes, payload, batch_id in batches:  # the newest from memory, older ones from disk
        got_header, got_payload, crc = spool.get_record(batch_id)
        assert (got_header, got_payload.tobytes()) == (header_bytes, payload)
        assert crc == spool_module.compute_checksum(data_pb2.ROLLOUT_BATCH, header_bytes, [payload])
    spool.delete([batches[-1][2]])
    assert spool.num_cached_bytes == 0
    with pytest.raises(BatchGone):
        spool.get_record(batches[-1][2])
    spool.close()

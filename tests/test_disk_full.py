"""A full disk, on real small filesystems (a tmpfs mounted for the test; skipped, saying why, where mounting is not
allowed):

- the broker's spool (a real `primerl-broker` process): batches that do not fit are answered back-pressure with a
  clear reason (never an error that ends the orchestrator), nothing on disk is torn or left half-written, the broker
  serves on; once space is freed the waiting producer's batch is taken; a commit on a disk too full even for the
  commit marker still releases the step; a restart on the full disk loads the spool whole;
- the trainer's checkpoint directory: a clear error naming the checkpoint kept, the previous checkpoint whole and
  loadable, nothing of the failed one left, no commit after it (the trainer's IO line); the next save works once
  space is freed.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.daemons import BrokerProcess

from primerl.client.control import ControlClient
from primerl.client.rollouts import RolloutConsumer, RolloutProducer, RolloutTimeout, pack_batch
from primerl.proto import telemetry
from primerl.proto.v1 import common_pb2
from primerl.runtime.config_common import BrokerClientConfig
from primerl.trainer.checkpoint import (
    CheckpointDiskFull,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from primerl.trainer.step_io import StepIOThread, TrainerIOError

BATCH_ELEMENTS = 8192  # 64 KiB of int64 per micro-batch


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); this test runs as another user")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode(errors='replace').strip()}")


def unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    mounted: list[Path] = []

    def make(name: str, size: str) -> Path:
        path = tmp_path / name
        mount_tmpfs(path, size)
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        unmount(path)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill(path: Path, leave_bytes: int) -> Path:
    """A filler file that leaves about ``leave_bytes`` free (0: as full as it gets)."""
    filler = path / "filler"
    chunk = b"\0" * 65536
    with open(filler, "ab", buffering=0) as handle:
        while free_bytes(path) > leave_bytes:
            want = min(len(chunk), max(4096, free_bytes(path) - leave_bytes))
            try:
                handle.write(chunk[:want])
            except OSError:
                break
    return filler


def tensors_for(step: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(step, step + BATCH_ELEMENTS, dtype=np.int64)}


def send(producer: RolloutProducer, step: int, timeout_s: float):
    return producer.send_batch(*pack_batch(step, 0, 0, 1, tensors_for(step)), timeout_s=timeout_s)


@pytest.mark.slow
def test_a_full_spool_disk_gives_backpressure_and_heals(tmp_path, small_fs):
    fs = small_fs("spoolfs", "4m")
    spool = fs / "spool"
    broker = BrokerProcess(tmp_path, spool, "--max-queue-batches", "64")
    try:
        filler = fill(fs, leave_bytes=300 * 1024)
        accepted: list[int] = []
        with RolloutProducer(broker.rollout_endpoint, resend_interval_s=0.5) as producer:
            step = 0
            with pytest.raises(RolloutTimeout) as waited:
                for step in range(1, 40):
                    send(producer, step, timeout_s=3.0)
                    accepted.append(step)
            full_step = step
            assert 2 <= len(accepted) < 39
            # Back-pressure (resent until the timeout), with the reason: never a refusal that ends the sender.
            assert waited.value.code == common_pb2.ERROR_CODE_BACKPRESSURE
            assert "disk full" in str(waited.value) and "free space" in str(waited.value)
            assert broker.process.poll() is None
            assert not [p.name for p in spool.iterdir() if p.name.endswith(".tmp")], "no half-written file left"
            assert telemetry.SPOOL_DISK_FULL in broker.log_tail(20000)

            # Space comes back: the batch that waited is taken at its next resend.
            result: dict = {}

            def resend() -> None:
                try:
                    result["ack"] = send(producer, full_step, timeout_s=30.0)
                    result["at"] = time.monotonic()
                except Exception as exc:  # reported by the assert below
                    result["error"] = exc

            sender = threading.Thread(target=resend)
            sender.start()
            time.sleep(1.3)
            assert "ack" not in result, "nothing is taken while the disk is still full"
            freed_at = time.monotonic()
            filler.unlink()
            sender.join(40)
            assert "ack" in result and result["ack"].durable, result
            heal_s = result["at"] - freed_at
            assert heal_s < 10.0
            print(f"spool disk full: batch taken {heal_s:.2f} s after space was freed")
            accepted.append(full_step)

        # Everything acked is whole: a trainer gets it all, with the data sent.
        with RolloutConsumer(broker.rollout_endpoint, worker_id="trainer-0", rank=0) as consumer:
            for step in accepted:
                [(header, tensors)] = consumer.fetch_step(step, timeout_s=20)
                np.testing.assert_array_equal(tensors["input_ids"], tensors_for(step)["input_ids"])

        # A disk too full even for the commit marker: the commit still releases the step (its batches go first).
        filler = fill(fs, leave_bytes=0)
        trainer = ControlClient(BrokerClientConfig(address=broker.grpc_address), "trainer", "trainer-0")
        try:
            trainer.register()
            committed = trainer.commit_step(accepted[1])
            assert (committed.last_committed_step, committed.num_batches_released) == (accepted[1], 2)
        finally:
            trainer.close()
        assert (spool / "COMMITTED").read_text().strip() == str(accepted[1])
        assert telemetry.SPOOL_COMMIT_ON_FULL_DISK in broker.log_tail(20000)

        # A restart on the full disk loads the spool whole: the remaining steps are served.
        broker.kill()
        broker = BrokerProcess(tmp_path, spool, "--max-queue-batches", "64")
        with RolloutConsumer(broker.rollout_endpoint, worker_id="trainer-1", rank=0) as consumer:
            for step in accepted[2:]:
                [(header, tensors)] = consumer.fetch_step(step, timeout_s=20)
                np.testing.assert_array_equal(tensors["input_ids"], tensors_for(step)["input_ids"])
        assert not (spool / "quarantine").exists()
    finally:
        if broker.process.poll() is None:
            broker.stop()


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_full_checkpoint_disk_keeps_the_previous_checkpoint(small_fs):
    root = small_fs("ckptfs", "1m") / "checkpoints"
    model, optimizer = _model()

    def save(step: int):
        return save_checkpoint(root, step, model=model, optimizer=optimizer, scheduler=None, extra_state={"step": step})

    save(1)
    used = sum(p.stat().st_size for p in (root / "step_1").iterdir())
    filler = fill(root.parent, leave_bytes=used // 2)
    io = StepIOThread()
    committed: list[int] = []
    io.submit("checkpoint step 2", lambda: save(2))
    ticket = io.submit("commit step 2", lambda: committed.append(2))
    with pytest.raises(TrainerIOError) as failed:
        ticket.wait(30)
    io.close(raise_error=False)
    cause = failed.value.__cause__
    assert isinstance(cause, CheckpointDiskFull), repr(cause)
    message = str(cause)
    assert "no space left" in message and "step_1 is kept" in message and str(root) in message
    assert committed == [], "no commit follows a checkpoint that failed"
    assert list_checkpoints(root) == [1]
    assert sorted(p.name for p in root.iterdir()) == ["step_1"], "nothing of the failed checkpoint is left"
    fresh, fresh_optimizer = torch.nn.Linear(8, 8), None
    assert load_checkpoint(root, model=fresh, optimizer=fresh_optimizer, scheduler=None) == {"step": 1}
    torch.testing.assert_close(fresh.weight, model.weight)
    filler.unlink()
    save(2)
    assert list_checkpoints(root) == [1, 2]


def test_the_queue_on_a_full_disk_keeps_nothing_of_a_group_and_tells_every_batch_to_wait(small_fs):
    """A group that would have made one incarnation's set whole (and superseded another's batch) fails for lack of
    space: every batch of it waits, the spool is as before; with space back the same group goes through."""
    from primerl.broker.rollout_queue import RolloutQueue
    from primerl.broker.rollout_results import Accepted, Backpressure, OfferItem, Superseded
    from primerl.broker.spool import RolloutSpool
    from primerl.proto.batch_ids import producer_batch_id

    fs = small_fs("queuefs", "1m")
    queue = RolloutQueue(RolloutSpool(fs / "spool"), 100, 1 << 30)

    def item(producer: str, index: int) -> OfferItem:
        header, payload = pack_batch(1, 0, index, 2, tensors_for(index))
        header.batch_id = producer_batch_id(1, 0, index, 1, producer)
        return OfferItem(header, payload)

    assert isinstance(queue.offer(item("a", 0).header, item("a", 0).payload), Accepted)
    before = sorted(p.name for p in (fs / "spool").iterdir())
    filler = fill(fs, leave_bytes=16 * 1024)
    group = [item("b", 0), item("b", 1), item("a", 1)]
    results = queue.offer_many(group).results
    assert all(isinstance(r, Backpressure) and "disk full" in r.reason for r in results), results
    assert sorted(p.name for p in (fs / "spool").iterdir()) == before, "nothing written, nothing left half-written"
    status = queue.status()
    assert (status.num_disk_full, status.num_superseded, status.num_batches) == (3, 0, 1)
    filler.unlink()
    results = queue.offer_many(group).results
    assert [type(r) for r in results] == [Accepted, Accepted, Superseded]
    assert sorted(e.batch_id for e in queue.spool.entries()) == [producer_batch_id(1, 0, i, 1, "b") for i in (0, 1)]
    queue.close()


def test_the_trainer_exits_1_with_one_line_when_its_checkpoint_disk_is_full():
    """The IO thread's failure reaches the trainer's entry point as `TrainerIOError` from `CheckpointDiskFull`: one
    error line and exit 1 (a restart resumes from the checkpoint kept once there is room), no traceback."""
    from primerl.cli.trainer import _exit_status_of

    class Log:
        def __init__(self):
            self.lines = []

        def error(self, event, **fields):
            self.lines.append((event, fields))

    log = Log()
    try:
        try:
            raise CheckpointDiskFull(28, "no space for checkpoint step_3; step_2 is kept")
        except CheckpointDiskFull as full:
            raise TrainerIOError("trainer IO job 'checkpoint step 3' failed") from full
    except TrainerIOError as exc:
        assert _exit_status_of(exc, log) == 1
    assert [event for event, _ in log.lines] == ["trainer cannot continue: no space for its checkpoint"]
    assert "step_2 is kept" in log.lines[0][1]["error"]
    with pytest.raises(RuntimeError):  # anything else is still raised with its traceback
        _exit_status_of(RuntimeError("other"), log)
    assert _exit_status_of(ValueError("a bad setting"), log) == 2  # a config or data problem: one line, exit 2
    assert log.lines[-1][0] == "trainer cannot continue"

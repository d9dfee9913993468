"""The same-host road of weight updates (docs/weight-updates.md, "Same host"): the trainer's shared-memory segments
and their drain contract, the checks a reader makes, and a real broker handing same-host workers a descriptor
while a worker that cannot map it (or says no host) gets the bytes; a SIGKILLed trainer leaves no segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.daemons import BrokerProcess
from support.probes import wait_until

from primerl.client.weights import WeightSubscriber
from primerl.configs.trainer import ModelConfig
from primerl.proto import shared_segment
from primerl.proto.host_identity import host_id
from primerl.proto.shared_segment import (
    SegmentError,
    SegmentPool,
    mark_released,
    open_segment,
    remove_stale_segments,
    segment_directory,
)
from primerl.proto.v1 import data_pb2
from primerl.trainer.model import load_model
from primerl.trainer.publish import PolicyPublisher

CHUNK_BYTES = 1 << 20


def _segments_of(pool_prefix: str) -> list[str]:
    return sorted(p.name for p in segment_directory().glob(f"{pool_prefix}*"))


def test_a_segment_is_written_again_only_once_its_readers_drained_or_after_the_drain_bound():
    pool = SegmentPool("drain-test", max_segments=2, drain_timeout_s=0.3)
    try:
        first = pool.acquire(64)
        first.view(64)[:] = b"a" * 64
        descriptor = first.publish(64)
        pool.give_back(first)
        reader = open_segment(descriptor, 64, writable_control=True)  # the broker's mapping
        second = pool.acquire(64)
        assert second is not first  # the first one is still read
        second.publish(64)
        pool.give_back(second)
        # Both in use and neither released: the third acquire waits, then retires the oldest.
        started = time.monotonic()
        third = pool.acquire(64)
        assert 0.25 <= time.monotonic() - started < 5
        assert pool.num_retired == 1 and not os.path.exists(descriptor.path)
        assert bytes(reader.payload) == b"a" * 64  # a retired segment's reader keeps its bytes
        pool.give_back(third, read=False)
        reader.close()
        # Released by the broker: reused at once, no new file.
        fourth = pool.acquire(64)
        descriptor = fourth.publish(64)
        pool.give_back(fourth)
        names = _segments_of(pool.prefix)
        mapped = open_segment(descriptor, 64, writable_control=True)
        mark_released(mapped)
        mapped.close()
        started = time.monotonic()
        assert pool.acquire(64) is fourth and time.monotonic() - started < 0.2
        assert _segments_of(pool.prefix) == names and len(names) <= 2
    finally:
        pool.close()
    assert _segments_of(pool.prefix) == []


def test_a_reader_refuses_segments_of_another_host_another_file_or_another_generation(tmp_path):
    pool = SegmentPool("checks")
    try:
        segment = pool.acquire(16)
        segment.view(16)[:] = bytes(range(16))
        descriptor = segment.publish(16)
        assert bytes(open_segment(descriptor, 16).payload) == bytes(range(16))
        elsewhere = data_pb2.SharedSegment(path=descriptor.path, host_id="0" * 32, generation=descriptor.generation)
        with pytest.raises(SegmentError, match="another host"):
            open_segment(elsewhere, 16)
        stranger = tmp_path / "primerl-seg-x-1-1"
        stranger.write_bytes(b"\0" * 8192)
        with pytest.raises(SegmentError, match="not a segment file"):
            open_segment(data_pb2.SharedSegment(path=str(stranger), host_id=host_id(), generation=1), 16)
        with pytest.raises(SegmentError, match="generation"):
            open_segment(data_pb2.SharedSegment(path=descriptor.path, host_id=host_id(), generation=7), 16)
        with pytest.raises(SegmentError, match="fewer than"):
            open_segment(descriptor, 1 << 20)
        os.chmod(descriptor.path, 0o644)
        with pytest.raises(SegmentError, match="private"):
            open_segment(descriptor, 16)
        os.chmod(descriptor.path, 0o600)
        assert os.stat(descriptor.path).st_mode & 0o777 == 0o600
    finally:
        pool.close()


def test_the_host_identity_differs_across_network_namespaces():
    """A network-namespace "host" (make multihost) shares /dev/shm but is another host: the bytes travel there."""
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("needs root and iproute2's ip netns")
    name = f"pshm{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        code = "from primerl.proto.host_identity import host_id; print(host_id())"
        other = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)
    assert same == host_id() and len(same) == 32
    assert other and other != same


def _receive(subscriber: WeightSubscriber, version: int, timeout_s: float = 20.0) -> tuple:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = subscriber.receive(0.5)
        if got is not None and got[0].policy_version == version:
            return got[0], bytes(got[1]), subscriber.received_digest
    raise AssertionError(f"no v{version} within {timeout_s} s")


def _stepped(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)


def test_same_host_workers_get_a_descriptor_others_the_bytes_and_segments_are_reused(tiny_model, make_broker):
    harness = make_broker(stop_grace_s=0)
    plane = harness.service.weight_plane
    model = load_model(ModelConfig(name=str(tiny_model)))
    with (
        PolicyPublisher(harness.weight_endpoint, None, "trainer", CHUNK_BYTES, "full", "tiny", run_id="r1") as trainer,
        WeightSubscriber(harness.weight_endpoint, None, "local") as local,
        WeightSubscriber(harness.weight_endpoint, None, "remote", shared_memory=False) as remote,
    ):
        assert trainer.transport == "shared_memory"
        local.hello()
        remote.hello()
        wait_until(lambda: len(plane.worker_versions()) == 2, 10, "both workers joined")
        prefix = trainer._places._segments.prefix
        for version in range(1, 6):
            _stepped(model, version)
            result = trainer.publish(model, version, timeout_s=30)
            stored = bytes(harness.service.weight_store.latest().payload)
            assert result.kind == "full" and result.payload_bytes == len(stored)
            for worker in (local, remote):
                header, payload, digest = _receive(worker, version)
                assert payload == stored and not header.HasField("shared_segment")
                assert digest == (header.digest if worker is local else None)  # computed as it was copied
                worker.ack(version)
            assert len(_segments_of(prefix)) <= 2  # drained segments are written again, none piles up
        status = plane.status()
        assert local.num_shared_updates == 5 and remote.num_shared_updates == 0
        assert status.num_descriptors_sent == 5
        # The broker sent the payload bytes to the remote worker only.
        assert status.bytes_out_total >= 5 * len(stored) > status.bytes_out_total - len(stored)
        wait_until(lambda: plane.status().num_segments_released >= 4, 10, "segments released")
        assert trainer._places._segments.num_retired == 0
    assert _segments_of(prefix) == []


def test_a_worker_that_cannot_map_a_segment_is_sent_the_bytes(tiny_model, make_broker, monkeypatch):
    harness = make_broker(stop_grace_s=0)
    model = load_model(ModelConfig(name=str(tiny_model)))

    def refuse(*args, **kwargs):
        raise SegmentError("no such /dev/shm here")

    monkeypatch.setattr("primerl.client.weights.open_segment", refuse)
    with (
        PolicyPublisher(harness.weight_endpoint, None, "trainer", CHUNK_BYTES, "full", "tiny") as trainer,
        WeightSubscriber(harness.weight_endpoint, None, "container") as worker,
    ):
        worker.hello()
        wait_until(lambda: harness.service.weight_plane.worker_versions(), 10, "the worker joined")
        trainer.publish(model, 1, timeout_s=30)
        header, payload, digest = _receive(worker, 1)
        assert payload == bytes(harness.service.weight_store.latest().payload) and digest is None
        worker.ack(1)
        _stepped(model, 2)
        trainer.publish(model, 2, timeout_s=30)
        assert _receive(worker, 2)[1] == bytes(harness.service.weight_store.latest().payload)
        assert worker.num_shared_updates == 0


def test_a_broker_that_cannot_map_the_trainers_segment_gets_the_bytes(tiny_model, make_broker, monkeypatch):
    harness = make_broker(stop_grace_s=0)
    model = load_model(ModelConfig(name=str(tiny_model)))
    publish = shared_segment.Segment.publish

    def elsewhere(self, num_bytes):
        descriptor = publish(self, num_bytes)
        descriptor.host_id = "f" * 32  # as a trainer on another host would say
        return descriptor

    monkeypatch.setattr(shared_segment.Segment, "publish", elsewhere)
    with PolicyPublisher(harness.weight_endpoint, None, "trainer", CHUNK_BYTES, "full", "tiny") as trainer:
        prefix = trainer._places._segments.prefix
        assert trainer.publish(model, 1, timeout_s=30).ack.applied
        assert trainer.transport == "socket" and trainer._places._segments is None
        assert _segments_of(prefix) == []
        _stepped(model, 2)
        assert trainer.publish(model, 2, timeout_s=30).ack.applied
    assert harness.service.weight_store.latest_version == 2


def test_a_hung_reader_holds_its_segment_until_the_drain_bound_and_the_run_goes_on(tiny_model, make_broker):
    """A same-host worker that takes the descriptor and never acknowledges: the trainer writes other segments,
    then retires the held one after its drain bound; every update is still stored and served to a live worker."""
    harness = make_broker(stop_grace_s=0)
    model = load_model(ModelConfig(name=str(tiny_model)))
    with (
        PolicyPublisher(harness.weight_endpoint, None, "trainer", CHUNK_BYTES, "full", "tiny") as trainer,
        WeightSubscriber(harness.weight_endpoint, None, "hung") as hung,
        WeightSubscriber(harness.weight_endpoint, None, "live") as live,
    ):
        trainer._places._segments.drain_timeout_s = 0.5
        hung.hello()
        live.hello()
        wait_until(lambda: len(harness.service.weight_plane.worker_versions()) == 2, 10, "both joined")
        for version in range(1, 5):
            _stepped(model, version)
            trainer.publish(model, version, timeout_s=30)
            if version == 1:
                _receive(hung, 1)  # mapped and copied, never acknowledged
            _, payload, _ = _receive(live, version)
            assert payload == bytes(harness.service.weight_store.latest().payload)
            live.ack(version)
        assert trainer._places._segments.num_retired >= 1


def test_a_sigkilled_trainer_leaves_no_segment_behind(tmp_path):
    """A trainer killed mid-run never unlinks its segments: the broker's sweep (and the next trainer) removes
    those whose writer is dead."""
    script = textwrap.dedent(
        """
        import sys, time
        from primerl.proto.shared_segment import SegmentPool
        pool = SegmentPool("killed")
        for _ in range(2):
            segment = pool.acquire(1 << 20)
            segment.publish(1 << 20)
        print(pool.prefix, flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        prefix = child.stdout.readline().strip()
        assert len(_segments_of(prefix)) == 2
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    removed = remove_stale_segments()
    assert {p.name for p in removed} >= set(_segments_of(prefix)) or _segments_of(prefix) == []
    assert _segments_of(prefix) == []


def test_the_broker_process_sweeps_the_segments_of_a_sigkilled_trainer(tmp_path):
    """Through a real primerl-broker: a trainer process publishes over shared memory and is SIGKILLed; its
    segments are gone within the broker's sweep interval."""
    broker = BrokerProcess(tmp_path, tmp_path / "spool")
    endpoint = f"tcp://127.0.0.1:{broker.ports['weight_port']}"
    script = textwrap.dedent(
        f"""
        import numpy as np, time
        from primerl.client.weight_publisher import WeightPublisher
        from primerl.proto import tensor_frames
        from primerl.proto.shared_segment import SegmentPool
        from primerl.proto.v1 import data_pb2
        pool = SegmentPool("swept")
        data, specs = tensor_frames.encode_tensors({{"w": np.arange(4096, dtype=np.float32)}})
        segment = pool.acquire(len(data))
        segment.view(len(data))[:] = data
        header = data_pb2.WeightUpdateHeader(policy_version=1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
        from primerl.proto.digests import payload_digest
        header.digest = payload_digest(data)
        with WeightPublisher({endpoint!r}, None, "trainer", 1 << 20) as publisher:
            publisher.publish(header, data, 20, shared=segment.publish(len(data)))
        print(pool.prefix, flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        prefix = child.stdout.readline().strip()
        assert prefix and len(_segments_of(prefix)) == 1
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        wait_until(lambda: _segments_of(prefix) == [], 15, "the broker removed the dead trainer's segment")
    finally:
        if child.poll() is None:
            child.kill()
        broker.stop()

"""Limits before buffering: declared transfer sizes, open-transfer memory, per-publisher transfers, stalls."""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest

from primerl.configs.broker import BrokerConfig
from primerl.proto import chunked_transfer, framing
from primerl.proto import tensor_frames as tf
from primerl.proto.units import GiB
from primerl.proto.v1 import data_pb2


def _first_chunk(total_bytes: int, transfer_id: str, sender: str = "pub") -> framing.Message:
    header = data_pb2.WeightUpdateHeader(policy_version=1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL)
    chunk = data_pb2.Chunk(transfer_id=transfer_id, index=0, count=4, total_bytes=total_bytes)
    frames = framing.encode(data_pb2.WEIGHT_UPDATE, header, [b"\1" * 16], chunk=chunk, sender=sender)
    return framing.decode(frames)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_declared_size_above_the_limit_is_refused_at_the_first_chunk():
    limits = framing.Limits(max_transfer_bytes=64 << 20)
    assembler = chunked_transfer.ChunkAssembler(limits=limits)
    with pytest.raises(framing.OversizedFrame):
        assembler.add(_first_chunk(65 << 20, "t"))
    assert assembler.num_open_transfers == 0


def test_a_first_chunk_declaring_a_gib_does_not_take_a_gib():
    assembler = chunked_transfer.ChunkAssembler(
        limits=framing.Limits(max_transfer_bytes=2 * GiB), max_open_bytes=2 * GiB
    )
    before = _rss_kib()
    assert assembler.add(_first_chunk(GiB, "big")) is None
    grown_mib = (_rss_kib() - before) / 1024
    assert grown_mib < 64, f"RSS grew by {grown_mib:.0f} MiB for 16 bytes received"


def test_open_transfer_bytes_are_bounded_and_refused_as_busy():
    assembler = chunked_transfer.ChunkAssembler(limits=framing.Limits(max_transfer_bytes=GiB), max_open_bytes=GiB)
    assembler.add(_first_chunk(700 << 20, "a", sender="one"))
    with pytest.raises(framing.Busy) as info:
        assembler.add(_first_chunk(400 << 20, "b", sender="two"))
    assert info.value.detail().retry_after_ms > 0
    assert assembler.num_open_transfers == 1


def test_a_publisher_new_transfer_replaces_its_half_open_one_and_others_are_not_blocked():
    assembler = chunked_transfer.ChunkAssembler(max_open_transfers=2, max_open_per_publisher=1)
    assembler.add(_first_chunk(1 << 20, "a1", sender="attacker"), publisher=b"x")
    assembler.add(_first_chunk(1 << 20, "a2", sender="attacker"), publisher=b"x")
    assert assembler.num_open_transfers == 1 and assembler.is_open(("attacker", "a2"))
    assembler.add(_first_chunk(1 << 20, "t1", sender="trainer"), publisher=b"y")  # not blocked
    assert assembler.is_open(("trainer", "t1"))


def test_a_stalled_transfer_expires_after_the_stall_timeout():
    assembler = chunked_transfer.ChunkAssembler(timeout_s=300, stall_timeout_s=5)
    assembler.add(_first_chunk(1 << 20, "s"))
    transfer = next(iter(assembler._transfers.values()))
    assert assembler.expire(transfer.last_chunk_s + 4) == []
    assert assembler.expire(transfer.last_chunk_s + 6) == ["s"]


def test_chunked_transfer_still_joins_with_lazy_buffers():
    tensors = {"w": np.arange(600_000, dtype=np.float32)}
    payload, specs = tf.encode_tensors(tensors)
    header = data_pb2.WeightUpdateHeader(policy_version=1, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL, tensors=specs)
    assembler = chunked_transfer.ChunkAssembler()
    whole = None
    for frames in chunked_transfer.encode_chunked(data_pb2.WEIGHT_UPDATE, header, payload, chunk_bytes=1 << 20):
        whole = assembler.add(framing.decode(frames))
    assert whole is not None and bytes(whole.payload[0]) == payload


def test_too_many_payload_frames_are_refused():
    frames = framing.encode(data_pb2.HELLO, data_pb2.Hello(), [b"x"] * 9)
    with pytest.raises(framing.OversizedFrame):
        framing.decode(frames, limits=framing.Limits(max_payload_frames=8))


def test_default_transfer_limits_fit_the_machine():
    config = BrokerConfig()
    from primerl.configs.broker import physical_memory_bytes

    assert config.resolved_max_transfer_bytes <= physical_memory_bytes() // 4
    assert config.resolved_max_open_transfer_bytes <= physical_memory_bytes() // 4


def test_without_a_token_the_broker_binds_loopback_unless_told_and_warns(tmp_path, monkeypatch):
    import io

    from pydantic import ValidationError

    from primerl.broker.service import BrokerService
    from primerl.runtime.log_setup import configure_logging

    stream = io.StringIO()  # its own log stream: earlier tests may have pointed logging elsewhere
    configure_logging("broker", stream=stream)

    monkeypatch.delenv("PRIMERL_RUN_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="allow_remote_without_token"):
        BrokerConfig(host="0.0.0.0")
    assert BrokerConfig(host="0.0.0.0", allow_remote_without_token=True).run_token is None
    service = BrokerService(BrokerConfig(grpc_port=0, rollout_port=0, weight_port=0, spool_dir=tmp_path / "spool"))
    service.start()
    service.stop(grace_s=0)
    assert "no run_token" in stream.getvalue()


def test_rollout_hwm_reaches_the_pipes_of_accepted_peers():
    """libzmq copies a socket's options into its listener at bind: RCVHWM set afterwards never reached a peer
    (a never-read ROUTER then buffered 21 messages of 4 MiB from one peer instead of a handful)."""
    import zmq

    from primerl.runtime.zmq_sockets import bind_router

    def messages_taken(rcv_hwm: int) -> int:
        context = zmq.Context()
        try:
            _, port = bind_router(context, "127.0.0.1", 0, max_message_bytes=8 << 20, hwm=16, rcv_hwm=rcv_hwm)
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.SNDHWM, 1)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            payload = b"x" * (4 << 20)
            sent, deadline = 0, time.monotonic() + 3
            while time.monotonic() < deadline and sent < 64:
                try:
                    dealer.send(payload, zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    time.sleep(0.05)
            return sent
        finally:
            context.destroy(linger=0)

    small, large = messages_taken(1), messages_taken(16)
    assert small <= 8, small  # 1 in the pipe, 1 being decoded, 1 in the dealer, the rest in kernel buffers
    assert large >= small + 10, (small, large)


def test_a_token_from_the_environment_lets_a_remote_broker_config_load_and_stays_out_of_written_files(tmp_path):
    """`primerl rl ... --broker.host 0.0.0.0 --dry-run --write DIR` with the token in $PRIMERL_RUN_TOKEN only: the
    configs load (the daemons get the token from the same variable) and no written file holds it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    primerl = Path(sys.executable).parent / "primerl"
    argv = [
        str(primerl),
        "rl",
        "@",
        "examples/reverse_text_rl.toml",
        "--broker.host",
        "0.0.0.0",
        "--dry-run",
        "--write",
        str(tmp_path),
    ]
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PRIMERL_RUN_TOKEN"}
    refused = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "needs credentials" in refused.stderr, refused.stderr
    written = subprocess.run(
        argv, cwd=root, env=env | {"PRIMERL_RUN_TOKEN": "tok-from-env"}, capture_output=True, text=True, timeout=120
    )
    assert written.returncode == 0, written.stderr
    files = sorted(tmp_path.glob("*.toml"))
    assert {f.name for f in files} >= {"broker.toml", "trainer.toml", "orchestrator.toml", "inference.toml"}
    assert not any("tok-from-env" in f.read_text() or "run_token" in f.read_text() for f in files)

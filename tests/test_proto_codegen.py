"""The generated code in proto/v1 is exactly what scripts/gen_proto.py produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_regenerating_changes_nothing():
    pytest.importorskip("grpc_tools")
    result = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_check_detects_a_stale_file(tmp_path, monkeypatch):
    pytest.importorskip("grpc_tools")
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    copy = tmp_path / "v1"
    copy.mkdir()
    for path in gen_proto.committed_files():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "data_pb2.py").write_text((copy / "data_pb2.py").read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(gen_proto, "OUTPUT_DIR", copy)
    assert gen_proto.check() == ["data_pb2.py"]


def test_control_messages_round_trip():
    from primerl.proto.v1 import common_pb2, control_pb2

    status = control_pb2.RunStatus(
        run_id="r1",
        trainer_step=5,
        last_committed_step=4,
        latest_policy_version=5,
        workers=[
            control_pb2.WorkerInfo(
                worker_id="w",
                role=common_pb2.ROLE_INFERENCE,
                policy_version=4,
                state=control_pb2.WORKER_STATE_ALIVE,
                capabilities={"lora": "true"},
            )
        ],
        queues=[control_pb2.QueueStatus(name="rollouts", num_items=3, capacity_items=64)],
        last_metrics={"train/loss": 0.25},
        recent_errors=["infer-0: boom"],
    )
    parsed = control_pb2.RunStatus.FromString(status.SerializeToString())
    assert parsed == status
    assert parsed.workers[0].HasField("policy_version") and not parsed.workers[0].HasField("trainer_step")


def test_every_rpc_is_documented():
    """Each RPC in control.proto says who calls it and which errors it returns (STYLE.md, contracts first)."""
    text = (REPO_ROOT / "proto" / "primerl" / "v1" / "control.proto").read_text()
    from primerl.proto.v1 import control_pb2

    for method in control_pb2.DESCRIPTOR.services_by_name["Broker"].methods:
        lines = text[: text.index(f"rpc {method.name}(")].splitlines()[:-1]
        comment = []
        while lines and lines[-1].strip().startswith("//"):
            comment.insert(0, lines.pop())
        block = "\n".join(comment)
        assert "Caller:" in block and "Errors:" in block, f"rpc {method.name} lacks its caller or errors"

"""Contracts in ``proto/`` that are not protobuf messages: the env-worker protocol, the ready file."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

from primerl.orchestrator.trajectory import SamplingParams
from primerl.proto import env_protocol
from primerl.proto.ready_file import READY_FILE_NAMES, read_ready_file, ready_file_path, write_ready_file

ROOT = Path(__file__).resolve().parent.parent
REMOTE = ("orchestrator", "envs", "remote")  # the scripts that run in the env interpreters
ENV_SIDE = ("classic_rollouts", "lean_trims")  # the modules of primerl the env worker imports


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_env_protocol_is_stdlib_only_and_the_env_side_imports_only_it_of_primerl():
    """The env worker runs where primerl is not installed: it may reach only these modules of primerl."""
    assert {name.split(".")[0] for name in _imports(ROOT / "proto" / "env_protocol.py")} <= set(sys.stdlib_module_names)
    for module in ("classic_worker.py", "classic_rollouts.py", "lean_trims.py"):
        primerl_imports = {name for name in _imports(ROOT.joinpath(*REMOTE, module)) if name.startswith("primerl")}
        allowed = {"primerl.proto.env_protocol", *(f"primerl.orchestrator.envs.remote.{m}" for m in ENV_SIDE)}
        assert primerl_imports <= allowed, module


def test_the_env_worker_runs_without_primerl_in_the_wheel_layout(tmp_path):
    """An installed wheel has primerl/orchestrator/envs/remote/ and primerl/proto/: the env worker finds its
    primerl modules there, with no primerl importable (``-S``: no site-packages) and nothing on sys.path."""
    package = tmp_path / "site-packages" / "primerl"
    for parts in (
        (*REMOTE, "classic_worker.py"),
        *((*REMOTE, f"{m}.py") for m in ENV_SIDE),
        ("proto", "env_protocol.py"),
    ):
        target = package.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT.joinpath(*parts), target)
    requests = env_protocol.request_line(1, env_protocol.OP_PING) + env_protocol.request_line(2, "fly")
    done = subprocess.run(
        [sys.executable, "-S", str(package.joinpath(*REMOTE, "classic_worker.py"))],
        input=requests,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    pong, refusal = (json.loads(line) for line in done.stdout.splitlines())
    assert pong["result"]["protocol_version"] == env_protocol.PROTOCOL_VERSION
    assert refusal["error"]["type"] == env_protocol.ERROR_BAD_REQUEST


def test_the_orchestrators_sampling_params_are_the_protocols_sampling_keys():
    assert tuple(SamplingParams().to_wire()) == env_protocol.SAMPLING_KEYS


def test_protocol_lines():
    assert json.loads(env_protocol.request_line(7, env_protocol.OP_CANCEL, {"target_id": 3})) == {
        "id": 7,
        "op": "cancel",
        "target_id": 3,
    }
    assert env_protocol.request_line(1, env_protocol.OP_PING).endswith("\n")
    assert json.loads(env_protocol.result_line("a", {"x": 1})) == {"id": "a", "ok": True, "result": {"x": 1}}
    assert json.loads(env_protocol.error_line(None, env_protocol.ERROR_BAD_REQUEST, "no")) == {
        "id": None,
        "ok": False,
        "error": {"type": "bad_request", "message": "no"},
    }


def test_ready_file_round_trip(tmp_path):
    path = ready_file_path(tmp_path / "run", "broker")
    assert path.name == READY_FILE_NAMES["broker"] == "broker.ready.json"
    assert read_ready_file(path) is None
    write_ready_file(path, "broker", {"grpc_port": 1234, "run_id": "r"})
    ready = read_ready_file(path)
    assert ready == {"grpc_port": 1234, "run_id": "r", "role": "broker", "pid": ready["pid"]} and ready["pid"] > 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_the_broker_refuses_micro_batches_outside_the_schema(tmp_path):
    """At intake (``RolloutQueue``): a tensor the schema does not name, or of another dtype or shape, is a
    malformed header; what the orchestrator packs passes."""
    import numpy as np

    from primerl.broker.rollout_queue import RolloutQueue
    from primerl.broker.rollout_results import Accepted, Refused
    from primerl.broker.spool import RolloutSpool
    from primerl.proto import tensor_frames
    from primerl.proto.micro_batch import TENSOR_DTYPES
    from primerl.proto.v1 import common_pb2, data_pb2

    queue = RolloutQueue(RolloutSpool(tmp_path / "spool"), 100, 1 << 30)

    def offer(index, tensors):
        payload, specs = tensor_frames.encode_tensors(tensors)
        header = data_pb2.RolloutBatchHeader(
            step=1, rank=0, micro_batch_index=index, num_micro_batches=4, tensors=specs, batch_id=f"b{index}"
        )
        return queue.offer(header, payload)

    packed = {name: np.zeros(4, dtype=dtype) for name, dtype in TENSOR_DTYPES.items()}
    assert isinstance(offer(0, packed), Accepted)
    for index, tensors in enumerate(
        [
            {"rewards": np.zeros(4, np.float32)},
            {"advantages": np.zeros(4, np.float64)},
            {"input_ids": np.zeros((2, 2), np.int64)},
        ],
        start=1,
    ):
        refused = offer(index, tensors)
        assert isinstance(refused, Refused) and refused.code == common_pb2.ERROR_CODE_MALFORMED_HEADER, refused

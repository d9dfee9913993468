"""``scripts/gpu_check``, the trainer-side checks for a GPU machine: without CUDA it says so in one line and exits 0;
its readers of ``bench/publish_side.py``'s output and pytest's summary match what those print; and its whole flow
runs on the CPU (``--device cpu``, slow), so a GPU run is not spent finding a broken script."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check"


def load_script():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    loader.exec_module(module)
    return module


gpu_check = load_script()


def run_script(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a machine that has one
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env
    )


def test_without_cuda_it_prints_one_line_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run_script("--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout == gpu_check.NO_CUDA_LINE + "\n"
    assert not out.exists()


def test_the_publish_side_reader_reads_the_bench_output():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import publish_side
    finally:
        sys.path.remove(str(REPO / "bench"))
    rows = {
        "whole": {"payload_bytes": [1942e6] * 2, "publish_s": [1.5, 1.7], "zmq_s": [1.0, 1.1]},
        "streamed": {"payload_bytes": [1942e6] * 2, "publish_s": [1.2, 1.3], "zmq_s": [1.0, 1.0]},
    }
    args = argparse.Namespace(model="1b", train_dtype="bf16", device="cuda", chunk_mib=64, repeats=2)
    update = (  # one line of publish_side.measure()'s progress, as it prints it
        "  streamed v3   measured: 1852.1 MiB, publish->ack   1.20 s (1.62 GB/s), raw zmq 1.01 s [build=40 send=1150]"
    )
    parsed = gpu_check.parse_publish_side("\n".join([update, *publish_side.table(rows, args)]))
    assert set(parsed["modes"]) == {"whole", "streamed"}
    assert parsed["modes"]["whole"]["publish_to_ack_s"] == {"min": 1.5, "median": 1.6, "max": 1.7}
    assert parsed["modes"]["streamed"]["gb_per_s"] == pytest.approx(1942e6 / 1.25 / 1e9, abs=0.01)
    assert parsed["streamed_over_whole_paired"] == [0.8, 0.76]
    assert parsed["updates"] == [
        {
            "mode": "streamed",
            "version": 3,
            "measured": True,
            "payload_mib": 1852.1,
            "publish_to_ack_s": 1.2,
            "gb_per_s": 1.62,
            "raw_zmq_s": 1.01,
            "phases_ms": {"build": 40.0, "send": 1150.0},
        }
    ]


def test_the_carried_wheels_keep_pyproject_bounds():
    lines = gpu_check.requirement_lines()
    assert len(lines) == len(gpu_check.CARRIED)
    for expected in ("pyzmq>=26", "structlog>=24.1", "pydantic>=2.7", "protobuf>=7.35.1", "setuptools>=70"):
        assert expected in lines


@pytest.mark.slow
def test_the_whole_flow_runs_on_the_cpu(tmp_path):
    """Broker, trainer and subscriber on the tiny model (2 steps), then the pytest step; bench/publish_side.py is
    left out here (its reader is tested above; it runs in a GPU run and in `make bench`)."""
    out = tmp_path / "gpu_check.json"
    result = run_script(
        "--device",
        "cpu",
        "--out",
        str(out),
        "--trainer-steps",
        "2",
        "--publish-model",
        "none",
        "--work-dir",
        str(tmp_path / "work"),
        timeout_s=300,
    )
    report = json.loads(out.read_text())
    assert result.returncode == 0, result.stdout[-3000:] + json.dumps(report["steps"], indent=1)[-3000:]
    assert report["passed"] and report["finished"] and report["device"] == "cpu"
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == ["trainer_tiny", "payload_stream"]
    trainer = steps["trainer_tiny"]
    assert all(trainer["checks"].values()) and trainer["checks"]["tensors_equal_export"]
    assert [v["version"] for v in trainer["figures"]["versions"]] == [1, 2]
    assert trainer["figures"]["trainer_model_device"] == "cpu"
    assert steps["payload_stream"]["figures"]["counts"]["failed"] == 0
    assert "PASS trainer_tiny" in result.stdout

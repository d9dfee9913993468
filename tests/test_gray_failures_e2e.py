"""A gray failure through the real path: two real `primerl-infer` daemons (vLLM, the tiny model) joined to an
in-process broker, and the real `primerl-orchestrator` with its env workers. One daemon's vLLM engine-core process
is stopped with SIGSTOP: its HTTP server and heartbeats go on, its engine answers nothing. Within the bound
(`engine_stall_timeout_s` + a heartbeat + a list interval) the orchestrator takes it out of rotation, its groups in
flight go to the other worker and steps keep coming from that one; SIGCONT brings the engine back, the daemon says
so and the orchestrator sends it rollouts again. No step is lost: every step from 1 on is logged as sent, once,
and reaches the broker as sent."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.daemons import InferenceDaemon
from support.inference import TOKEN, start_broker
from support.orchestrator import ENV_FIXTURES, ENV_PYTHON, metric_rows, orchestrator_args

from primerl.client.rollouts import RolloutConsumer
from primerl.proto import telemetry
from primerl.proto.step_digest import data_digest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

STALL_TIMEOUT_S = 3.0
OUT_OF_ROTATION_BOUND_S = 15.0
"""From SIGSTOP to the orchestrator's `inference worker out of rotation`: the stall timeout, a probe interval, a
heartbeat (0.2 s), the orchestrator's list interval (1 s), with room for a loaded 2-core machine."""
BACK_BOUND_S = 15.0


def engine_core_pid(daemon_pid: int) -> int:
    """The vLLM engine-core child of the daemon we started (found through /proc, never by name machine-wide)."""
    children: set[int] = set()
    for task in Path(f"/proc/{daemon_pid}/task").iterdir():
        children.update(int(pid) for pid in (task / "children").read_text().split())
    for pid in sorted(children):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "EngineCore" in cmdline:
            return pid
    raise AssertionError(f"no EngineCore child of {daemon_pid} among {sorted(children)}")


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_for_line(process: subprocess.Popen, path: Path, pattern: str, timeout_s: float, after: int = 0) -> float:
    """Wait until `pattern` shows in `path` past offset `after`; the time it was seen."""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, path.read_text(errors="replace")[after:]):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {pattern!r} within {timeout_s} s:\n{path.read_text(errors='replace')[-5000:]}")
        time.sleep(0.05)
    return time.monotonic()


def steps_sent(text: str) -> list[tuple[int, str]]:
    return [
        (int(re.search(r"\bstep=(\d+)", line).group(1)), re.search(r"data_digest=(\w+)", line).group(1))
        for line in text.splitlines()
        if telemetry.STEP_SENT in line
    ]


def requests_served(url: str) -> float:
    """vLLM's count of finished requests on the daemon at `url` (its /metrics)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def test_a_stalled_engine_is_taken_out_of_rotation_and_put_back(tmp_path, tiny_model):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    started_s = time.monotonic()
    broker = start_broker(tmp_path / "spool", max_queue_batches=256)
    daemons: dict[str, InferenceDaemon] = {}
    stopped_pid: int | None = None
    process: subprocess.Popen | None = None
    try:

        def start(name: str) -> None:
            daemons[name] = InferenceDaemon(
                tmp_path,
                tiny_model,
                broker.grpc_address,
                TOKEN,
                "--broker.connect-timeout-s",
                "30",
                "--engine-stall-timeout-s",
                str(STALL_TIMEOUT_S),
                name=name,
            )

        threads = [threading.Thread(target=start, args=(name,)) for name in ("infer-a", "infer-b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(daemons) == ["infer-a", "infer-b"], "a daemon did not start (see above)"
        stalled, other = daemons["infer-a"], daemons["infer-b"]
        log_path = tmp_path / "orchestrator.log"
        with open(log_path, "w") as log_file:
            process = subprocess.Popen(
                orchestrator_args(
                    tiny_model,
                    broker,
                    tmp_path / "out",
                    "reverse-text",
                    "--max-async-level",
                    "400",
                    "--max-steps",
                    "400",
                ),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN, "PYTHONPATH": str(ENV_FIXTURES)},
            )
        wait_for_line(process, log_path, rf"{telemetry.STEP_SENT} .*step=2\b", 240)
        served_before = requests_served(stalled.url)
        assert served_before > 0  # both workers took rollouts before the stall

        stopped_pid = engine_core_pid(stalled.pid)
        os.kill(stopped_pid, signal.SIGSTOP)
        stopped_s = time.monotonic()
        served_by_other = requests_served(other.url)
        offset = len(log_path.read_text(errors="replace"))
        out_s = wait_for_line(
            process, log_path, telemetry.INFERENCE_WORKER_OUT_OF_ROTATION, OUT_OF_ROTATION_BOUND_S, offset
        )
        assert process_state(stopped_pid) == "T"  # still stopped: found while the engine makes no progress
        # steps keep coming, from the other worker alone
        out_offset = len(log_path.read_text(errors="replace"))
        sent_before = {step for step, _ in steps_sent(log_path.read_text(errors="replace")[:out_offset])}
        wait_for_line(process, log_path, rf"{telemetry.STEP_SENT} .*step={max(sent_before) + 3}\b", 60)
        assert requests_served(other.url) > served_by_other  # those steps came from the other worker
        with broker.client() as client:
            not_serving = [
                w.address.rstrip("/")
                for w in client.list_workers()
                if w.capabilities.get(telemetry.SERVING_CAPABILITY) == "false"
            ]
        assert not_serving == [stalled.url.rstrip("/")], not_serving
        health = httpx.get(f"{stalled.url}/health", timeout=10)
        assert health.status_code == 503 and "did not answer a probe" in health.text, health.text

        os.kill(stopped_pid, signal.SIGCONT)
        continued_s = time.monotonic()
        stopped_pid = None
        offset = len(log_path.read_text(errors="replace"))
        back_s = wait_for_line(process, log_path, telemetry.INFERENCE_WORKER_BACK_IN_ROTATION, BACK_BOUND_S, offset)
        # rollouts go to it again: its engine finishes new requests
        deadline = time.monotonic() + 60
        served_after_s = None
        base = requests_served(stalled.url)
        while time.monotonic() < deadline:
            if requests_served(stalled.url) > base:
                served_after_s = time.monotonic()
                break
            time.sleep(0.2)
        assert httpx.get(f"{stalled.url}/health", timeout=10).status_code == 200
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(60)
        print(
            f"\ngray failure: out of rotation {out_s - stopped_s:.1f} s after SIGSTOP "
            f"(engine_stall_timeout_s = {STALL_TIMEOUT_S:g}), back {back_s - continued_s:.1f} s after SIGCONT, "
            f"serving rollouts again {(served_after_s or float('nan')) - continued_s:.1f} s after it; "
            f"test {time.monotonic() - started_s:.0f} s"
        )
        text = log_path.read_text(errors="replace")
        assert returncode == 0, text[-4000:]
        assert served_after_s is not None, "the recovered worker served no rollout within 60 s of SIGCONT"
        assert out_s - stopped_s <= OUT_OF_ROTATION_BOUND_S
        assert text.count(telemetry.INFERENCE_WORKER_OUT_OF_ROTATION) == 1, text[-4000:]
        assert text.count(telemetry.ROLLOUT_GROUP_RETRIED) >= 1 or telemetry.INFERENCE_WORKER_LEFT in text
        # no step lost or sent twice: 1..last, each once, and what the broker holds is what was sent
        sent = steps_sent(text)
        steps = [step for step, _ in sent]
        assert steps == list(range(1, len(steps) + 1)), steps
        rows = [r["step"] for r in metric_rows(tmp_path / "out")]
        assert rows == list(range(1, len(rows) + 1)) and set(steps) <= set(rows), (rows, steps)
        with RolloutConsumer(broker.rollout_endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
            for step, digest in sent[:3] + sent[-3:]:
                fetched = consumer.fetch_step(step, timeout_s=60)
                assert data_digest([tensors for _, tensors in fetched]) == digest
        stalled_log = daemons["infer-a"].log_path.read_text(errors="replace")
        assert stalled_log.count(telemetry.INFERENCE_ENGINE_STALLED) >= 1, stalled_log[-4000:]
        assert telemetry.INFERENCE_ENGINE_RECOVERED in stalled_log, stalled_log[-4000:]
        assert telemetry.INFERENCE_ENGINE_STALLED not in daemons["infer-b"].log_path.read_text(errors="replace")
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)  # never leave a stopped process behind
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        for daemon in daemons.values():
            daemon.stop()
        broker.stop()

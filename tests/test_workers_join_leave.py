"""Inference workers join and leave a running run (issue 17), through the real path: an in-process broker bound
to 0.0.0.0, real `primerl-infer` daemons on the tiny model, the real `primerl-orchestrator` with real env workers,
and this test as the trainer (it publishes FULL v1 and DELTA v2 with the trainer's publisher and fetches each
step's batch, which paces the orchestrator: it runs at most a few steps ahead of the fetches).

Distinct loopback addresses stand for distinct machines: the orchestrator dials the broker at 127.0.0.3 and so
gets its ZeroMQ endpoints at 127.0.0.3 (a wildcard bind hands out the wildcard; the client substitutes the host
it dialed); worker C binds 0.0.0.0 and advertises 127.0.0.2, which the orchestrator's env workers then dial.

Scenario: workers A and B serve; A is killed (SIGKILL) mid-run, the run goes on on B; DELTA v2 is published;
C joins, gets the latest full snapshot first (FULL v1, then DELTA v2), and gets rollouts once it serves v2;
B is stopped (SIGTERM) and the run ends on C. Checked: every step's batch arrives, rollouts of the workers that
went away are retried (``rollout/retried`` > 0) and not counted as errors, the join/leave log events and
``inference/join_to_serving_s``, C served rollouts, and the broker lists C alone at v2 at the end.

The weight fan-out part alone (a joining worker gets the snapshot before any delta, and only the latest LoRA
adapter) is checked fast, without vLLM, at the end of this file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.broker import BrokerHarness
from support.daemons import InferenceDaemon
from support.inference import AUTH, TOKEN
from support.orchestrator import ENV_FIXTURES, ENV_PYTHON, metric_rows, orchestrator_args
from support.probes import wait_until

from primerl.client.rollouts import RolloutConsumer
from primerl.proto import telemetry
from primerl.proto.v1.control_pb2 import WORKER_STATE_ALIVE as ALIVE
from primerl.proto.v1.control_pb2 import WORKER_STATE_LEFT as LEFT
from primerl.proto.v1.control_pb2 import WORKER_STATE_LOST as LOST

MAX_STEPS = 16
STEP_TIMEOUT_S = 240.0


def _start_infer(tmp: Path, model: Path, broker_address: str, name: str, *extra: str) -> InferenceDaemon:
    return InferenceDaemon(
        tmp,
        model,
        broker_address,
        TOKEN,
        "--broker.connect-timeout-s",
        "30",
        *extra,
        env={"TMPDIR": str(tmp)},
        name=name,
    )


def _requests_served(url: str) -> float:
    """Completed requests of a vLLM server (its ``vllm:request_success_total`` counters)."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


def _log_lines(path: Path, event: str) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if event in line]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")
def test_workers_leave_and_join_a_running_run(tiny_model, tmp_path):
    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    from primerl.configs.trainer import ModelConfig
    from primerl.trainer.model import load_model
    from primerl.trainer.publish import PolicyPublisher

    broker = BrokerHarness(
        tmp_path / "spool",
        host="0.0.0.0",
        run_token=TOKEN,
        heartbeat_interval_s=0.2,
        max_queue_batches=2,
        run_id="join-leave",
    )
    port = broker.endpoints.grpc_port
    daemons: dict[str, InferenceDaemon] = {}
    orchestrator = None
    publisher = None
    log_path = tmp_path / "orchestrator.log"
    received: dict[int, int] = {}
    try:
        model = load_model(ModelConfig(name=str(tiny_model)))
        publisher = PolicyPublisher(
            broker.weight_endpoint,
            TOKEN,
            "trainer",
            broker.service.chunk_bytes,
            kind="delta",
            policy_name="policy",
            delta_policy="always",
        )
        assert publisher.publish(model, 1).kind == "full"
        daemons["A"] = _start_infer(tmp_path, tiny_model, f"127.0.0.1:{port}", "infer-a")
        daemons["B"] = _start_infer(tmp_path, tiny_model, f"127.0.0.1:{port}", "infer-b", "--server.host", "0.0.0.0")
        with broker.client() as client:
            wait_until(
                lambda: sorted(w.policy_version for w in client.list_workers(role="inference")) == [1, 1],
                60,
                "A and B at v1",
            )
        # B binds every interface and advertises the interface that routes to the broker (loopback here)
        assert daemons["B"].ready["advertised_url"].startswith("http://127.0.0.1:"), daemons["B"].ready

        args = orchestrator_args(
            tiny_model,
            broker,
            tmp_path / "out",
            "reverse-text",
            "--max-async-level",
            "50",
            "--max-steps",
            str(MAX_STEPS),
            "--sampling.max-tokens",
            "32",
        )
        args[args.index("--broker.address") + 1] = f"127.0.0.3:{port}"
        with open(log_path, "w") as log_file:
            orchestrator = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN, "PYTHONPATH": str(ENV_FIXTURES)},
            )
        with RolloutConsumer(
            f"tcp://127.0.0.1:{broker.endpoints.rollout_port}", auth_token=TOKEN, worker_id="trainer-0", rank=0
        ) as consumer:

            def fetch(step: int) -> None:
                batches = consumer.fetch_step(step, timeout_s=STEP_TIMEOUT_S)
                received[step] = len(batches)

            for step in (1, 2):
                fetch(step)
            served_a = _requests_served(daemons["A"].url)
            assert served_a > 0 and _requests_served(daemons["B"].url) > 0  # both took rollouts
            daemons["A"].kill()  # SIGKILL mid-run: its rollouts fail to connect and are retried on B
            for step in (3, 4, 5):
                fetch(step)
            # the chain is now FULL v1 + DELTA v2: a joining worker must get v1's snapshot before the delta
            assert publisher.publish(model, 2).kind == "delta"
            daemons["C"] = _start_infer(
                tmp_path,
                tiny_model,
                f"127.0.0.2:{port}",
                "infer-c",
                "--server.host",
                "0.0.0.0",
                "--server.advertise-host",
                "127.0.0.2",
            )
            assert daemons["C"].ready["advertised_url"].startswith("http://127.0.0.2:")
            with broker.client() as client:
                wait_until(
                    lambda: any(
                        w.address.startswith("http://127.0.0.2:") and w.policy_version == 2
                        for w in client.list_workers(role="inference")
                    ),
                    60,
                    "C to serve v2",
                )
            # The orchestrator runs a few steps ahead of the fetches (2 batches queued at the broker, 2 steps at
            # its send thread): it goes on now, sees C and spreads over B and C; the last steps are C's alone.
            for step in (6, 7, 8, 9):
                fetch(step)
            daemons["B"].stop()  # SIGTERM: it deregisters (LEFT); its groups in flight are retried on C
            for step in range(10, MAX_STEPS + 1):
                fetch(step)
        assert orchestrator.wait(120) == 0, log_path.read_text()[-4000:]
        served_c = _requests_served(daemons["C"].url)
        with broker.client() as client:
            alive = client.list_workers(role="inference")
            gone = {w.name: w.state for w in client.list_workers(role="inference", include_gone=True)}
    finally:
        if orchestrator is not None and orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.wait(10)
        for daemon in daemons.values():
            daemon.stop()
        if publisher is not None:
            publisher.close()  # unlinks its shared-memory segments
        broker.stop()

    text = log_path.read_text(errors="replace")
    rows = metric_rows(tmp_path / "out")
    retried = sum(row.get("rollout/retried", 0) for row in rows)
    errors = sum(row.get(telemetry.ROLLOUT_ERRORS, 0) for row in rows)
    join_s = [row["inference/join_to_serving_s"] for row in rows if "inference/join_to_serving_s" in row]
    c_log = daemons["C"].log_path.read_text(errors="replace")
    applied = [
        (kind, int(version))
        for kind, version in re.findall(
            r"weight update live.*?kind=WEIGHT_UPDATE_KIND_(\w+) policy_version=(\d+)", c_log
        )
    ]
    summary = {
        "received": received,
        "retried": retried,
        "errors": errors,
        "join_to_serving_s": join_s,
        "served_by_c": served_c,
        "joined": len(_log_lines(log_path, telemetry.INFERENCE_WORKER_JOINED)),
        "left": len(_log_lines(log_path, telemetry.INFERENCE_WORKER_LEFT)),
        "gone": gone,
    }
    print("\njoin/leave run:", json.dumps({k: v for k, v in summary.items() if k != "gone"}))
    assert sorted(received) == list(range(1, MAX_STEPS + 1)) and all(received.values()), summary
    assert retried > 0 and errors == 0, summary
    assert summary["joined"] == 3 and summary["left"] == 2, summary  # A, B, C joined; A and B left
    assert len(join_s) >= 1 and all(0 < s < 300 for s in join_s), summary
    assert served_c > 0, summary
    assert [w.address for w in alive] == [daemons["C"].ready["advertised_url"]] and alive[0].policy_version == 2
    assert sorted(gone.values()) == sorted([LOST, LEFT, ALIVE]), gone  # A killed, B stopped, C serving
    assert re.search(r"inference worker caught up.*join_to_serving_s=", c_log), c_log[-3000:]
    assert applied == [("FULL", 1), ("DELTA", 2)], (applied, c_log[-3000:])  # the snapshot first
    assert telemetry.ROLLOUT_GROUP_RETRIED in text and "Traceback" not in text


# -- the weight fan-out alone: what a worker that joins late is sent ----------------------------------------------


def _joiner_receives(broker: BrokerHarness, name: str) -> list[tuple[str, int]]:
    """Register an inference worker, say HELLO holding nothing but the base (version 0, as a fresh primerl-infer
    does) and return (kind, version) of every update it is sent, acknowledging each."""
    from primerl.client.weights import WeightSubscriber
    from primerl.proto.v1 import data_pb2

    client = broker.client("inference", name)
    client.address = f"http://127.0.0.9:1/{name}"
    client.wait_ready(10)
    worker_id = client.register().worker_id
    received = []
    with WeightSubscriber(broker.weight_endpoint, TOKEN, worker_id) as subscriber:
        subscriber.hello(0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            update = subscriber.receive(0.5)
            if update is None:
                if received:
                    break
                continue
            header, _ = update
            received.append(
                (
                    data_pb2.WeightUpdateKind.Name(header.kind).removeprefix("WEIGHT_UPDATE_KIND_"),
                    int(header.policy_version),
                )
            )
            subscriber.ack(int(header.policy_version))
    client.close()
    return received


def _update(version: int, kind: str, base: int = 0):
    from support.weight_updates import tiny_update

    from primerl.proto.v1 import data_pb2

    header, payload = tiny_update(version, data_pb2.WeightUpdateKind.Value(f"WEIGHT_UPDATE_KIND_{kind}"), base)
    if kind == "LORA":
        header.adapter_config_json = '{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}'
    return header, payload


def test_a_joining_worker_gets_the_latest_full_snapshot_before_any_delta(tmp_path):
    broker = BrokerHarness(tmp_path / "spool", run_token=TOKEN)
    try:
        for update in (_update(1, "FULL"), _update(2, "DELTA", 1), _update(3, "DELTA", 2)):
            broker.publish(*update)
        assert _joiner_receives(broker, "late-1") == [("FULL", 1), ("DELTA", 2), ("DELTA", 3)]
        broker.publish(*_update(4, "FULL"))  # a new snapshot: the chain starts again there
        broker.publish(*_update(5, "DELTA", 4))
        assert _joiner_receives(broker, "late-2") == [("FULL", 4), ("DELTA", 5)]
    finally:
        broker.stop()


def test_a_joining_worker_of_a_lora_run_gets_only_the_latest_adapter(tmp_path):
    broker = BrokerHarness(tmp_path / "spool", run_token=TOKEN)
    try:
        for version in (1, 2, 3):
            broker.publish(*_update(version, "LORA"))
        assert _joiner_receives(broker, "late-lora") == [("LORA", 3)]
    finally:
        broker.stop()

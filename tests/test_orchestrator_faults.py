"""The orchestrator's fault handling, piece by piece: failed rollouts counted by kind and a run whose
rollouts all fail stopped with one clear error; the worker list and the step sends riding through a real broker
restart (an in-process ``BrokerService`` stopped and started again on the same ports); the ``step sent`` digest
computed over exactly the tensor values the trainer decodes."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import structlog
from support.broker import BrokerHarness
from support.probes import wait_until as wait_for

from primerl.client.broker_errors import BrokerUnavailable
from primerl.client.control import ControlClient
from primerl.client.outage import BrokerOutageExceeded
from primerl.client.rollouts import RolloutConsumer, RolloutProducer
from primerl.orchestrator.endpoints import EndpointWatcher
from primerl.orchestrator.packing import to_broker_batches
from primerl.orchestrator.rollout_failures import RolloutFailures, RolloutsFailing, is_unreachable, kind_name
from primerl.orchestrator.samples import TrainingSample
from primerl.orchestrator.step_send import log_step_sent, rank_digests, send_step
from primerl.proto import telemetry
from primerl.proto.packing import pack_samples
from primerl.proto.step_digest import data_digest
from primerl.proto.tensor_frames import decode_tensors
from primerl.proto.v1 import common_pb2
from primerl.runtime.config_common import BrokerClientConfig

TOKEN = "faults-token"
CONTEXT_ERROR = (
    "BadRequestError: Error code: 400 - This model's maximum context length is 16 tokens. However, "
    "your request has 41 input tokens."
)


# ----------------------------------------------------------------------------------------- failed rollouts
def test_each_kind_is_logged_once_and_reported_and_counted():
    reported: list[str] = []
    failures = RolloutFailures(8, report=reported.append, hint_values={"seq_len": 16})
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            failures.failed("BadRequestError", CONTEXT_ERROR)
        failures.failed("ScoringError", "reward function raised ValueError")
        failures.succeeded()
        failures.failed("BadRequestError", "another one")
    lines = [entry for entry in logs if entry["event"] == telemetry.ROLLOUT_FAILED]
    assert [(e["kind"], e["count"]) for e in lines] == [("BadRequestError", 1), ("ScoringError", 1)]
    assert "maximum context length is 16" in lines[0]["error"] and "raise seq_len" in lines[0]["hint"]
    assert reported == [
        f"{telemetry.ROLLOUT_FAILED} (BadRequestError): {CONTEXT_ERROR}",
        "rollout failed (ScoringError): reward function raised ValueError",
    ]
    assert failures.counts == {"BadRequestError": 4, "ScoringError": 1}
    assert failures.consecutive == 1  # the success ended the first streak
    failures.check()


def test_a_step_of_consecutive_failures_stops_with_the_cause_and_the_fix():
    failures = RolloutFailures(8, hint_values={"seq_len": 16})
    failures.failed("EnvRequestTimeout", "rollout request 3 passed its deadline", num_rollouts=2)
    for _ in range(5):
        failures.failed("BadRequestError", CONTEXT_ERROR)
        failures.check()
    failures.failed("BadRequestError", CONTEXT_ERROR)
    with pytest.raises(RolloutsFailing) as raised:
        failures.check()
    message = str(raised.value)
    assert message.startswith(
        "8 rollouts in a row failed (a step needs 8), 6 of them with BadRequestError (also EnvRequestTimeout x2)"
    )
    assert "maximum context length is 16 tokens" in message
    assert "seq_len (= 16)" in message and "raise seq_len" in message


def test_an_unknown_failure_still_says_what_failed():
    failures = RolloutFailures(1)
    failures.failed("Weird Error/kind", "something odd")
    with pytest.raises(RolloutsFailing, match="1 of them with Weird_Error_kind: something odd. Fix: the first"):
        failures.check()
    assert kind_name("a b/c") == "a_b_c"
    with pytest.raises(ValueError):
        RolloutFailures(0)


UNREACHABLE_ERROR = (
    "reverse-text: ModelError: <- APIConnectionError: Connection error. <- ConnectError: [Errno 111] Connection refused"
)


@pytest.mark.parametrize(
    "error",
    [
        UNREACHABLE_ERROR,
        "reverse-text: ModelError: <- APITimeoutError: Request timed out. <- ConnectTimeout: "
        "<- ConnectionTimeoutError: Connection timeout to host http://127.0.0.1:8000/v1/chat/completions",
        "reverse-text: ModelError: <- InternalServerError: Error code: 503 - Service Unavailable",
        # the request aborted by a server shutting down (seen when `scancel` signals every process of a worker)
        "reverse-text: ModelError: <- ValidationError: 1 validation error for ChatCompletion\nchoices.0.finish_reason\n"
        "  Input should be 'stop', 'length', 'tool_calls', 'content_filter' or 'function_call' [type=literal_error, "
        "input_value='abort', input_type=str]",
    ],
)
def test_failures_of_a_server_that_is_down_or_restarting_count_as_unreachable(error):
    assert is_unreachable("ModelError", error)


def test_a_server_that_answers_with_an_error_is_not_unreachable():
    assert not is_unreachable("BadRequestError", CONTEXT_ERROR)
    assert not is_unreachable("ScoringError", "reward function 'x' raised ValueError: bad")


def test_an_unreachable_inference_server_is_waited_for_not_counted_in_the_streak():
    """Rollouts refused while the only inference worker restarts are not a step of failures: the orchestrator
    waits (saying so every 5 s), the clock restarts at the next success, and past the budget it stops."""
    now = [100.0]
    failures = RolloutFailures(4, inference_outage_s=60, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        assert failures.failed("ModelError", UNREACHABLE_ERROR, num_rollouts=40) is True
        assert failures.failed("BadRequestError", CONTEXT_ERROR) is False
        assert failures.consecutive == 1 and failures.counts["ModelError"] == 40
        for _ in range(12):  # 60 s of waiting, checked every 5 s
            now[0] += 5
            failures.check()
        failures.succeeded()
        assert failures.unreachable_since is None and failures.consecutive == 0
        failures.failed("ModelError", UNREACHABLE_ERROR)
        now[0] += 61
        with pytest.raises(RolloutsFailing, match="no inference worker answered for 61 s .*Connection refused"):
            failures.check()
    events = [e["event"] for e in logs]
    assert events.count(telemetry.ROLLOUT_FAILED) == 2  # ModelError and BadRequestError, once each
    assert (
        events.count(telemetry.WAITING_FOR_AN_INFERENCE_WORKER) == 12
        and events.count(telemetry.INFERENCE_WORKER_BACK) == 1
    )
    assert "waiting for it up to 60 s" in next(e["hint"] for e in logs if e.get("kind") == "ModelError")


# ------------------------------------------------------------------------------------------------ broker
class Broker(BrokerHarness):
    """The in-process broker (`support.broker`) whose clients are the orchestrator's."""

    def client(self, role: str = "orchestrator", name: str = "orchestrator", outage_s: float = 120.0) -> ControlClient:
        return super().client(role, name, outage_s=outage_s)


@pytest.fixture
def broker(tmp_path):
    broker = Broker(
        tmp_path / "spool", stop_grace_s=0.5, run_token=TOKEN, heartbeat_interval_s=0.2, run_id="faults-test"
    )
    try:
        yield broker
    finally:
        broker.stop()


def samples(num: int, seed: int = 0) -> list[TrainingSample]:
    rng = random.Random(seed)
    result = []
    for index in range(num):
        prompt, completion = rng.randint(3, 12), rng.randint(2, 20)
        length = prompt + completion
        result.append(
            TrainingSample(
                token_ids=[rng.randrange(1, 500) for _ in range(length)],
                loss_mask=[False] * prompt + [True] * completion,
                inference_logprobs=[0.0] * prompt + [-rng.random() * 3 for _ in range(completion)],
                temperatures=[1.0] * length,
                policy_versions=[0] * length,
                advantage=rng.uniform(-1, 1),
                group_id=f"g{index // 4}",
                example_id=index // 4,
                env_id="toy",
                rollout_id=index % 4,
                num_completion_tokens=completion,
            )
        )
    return result


def test_the_digest_is_over_the_values_the_trainer_decodes():
    packed = pack_samples(samples(24), seq_len=64, num_ranks=2)
    messages = to_broker_batches(5, packed)
    decoded: dict[int, list[dict]] = {0: [], 1: []}
    for header, payload in messages:  # what a trainer rank gets, in index order
        decoded[header.rank].append(decode_tensors(payload))
    digests = rank_digests(packed.per_rank)
    assert digests == [data_digest(decoded[0]), data_digest(decoded[1])]
    assert digests[0] != digests[1]
    import torch  # the trainer's side holds torch tensors of the same values

    as_torch = [{name: torch.from_numpy(np.array(t)) for name, t in batch.items()} for batch in decoded[1]]
    assert data_digest(as_torch) == digests[1]
    with structlog.testing.capture_logs() as logs:
        log_step_sent(5, packed.per_rank)
    lines = [e for e in logs if e["event"] == telemetry.STEP_SENT]
    assert [(e["step"], e["rank"], e["num_micro_batches"], e["data_digest"]) for e in lines] == [
        (5, rank, len(packed.per_rank[rank]), digests[rank]) for rank in (0, 1)
    ]


def test_a_step_is_sent_through_a_broker_restart(broker):
    """The broker is down when the send starts and comes back 4 s later: the send waits (saying so every 5 s),
    then every micro-batch is durable, and a trainer rank fetches exactly what was packed."""
    with broker.client() as control:
        control.wait_ready(10)
        registration = control.register()
    packed = pack_samples(samples(16, seed=1), seq_len=64, num_ranks=1)
    messages = to_broker_batches(1, packed)
    broker.stop()
    restarter = threading.Timer(4.0, broker.start)
    restarter.start()
    producer = RolloutProducer(registration.rollout_endpoint, auth_token=TOKEN, resend_interval_s=1.0)
    try:
        started = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            send_step(producer, 1, messages, outage_s=60, backpressure_timeout_s=60, attempt_s=2.0)
        elapsed_s = time.monotonic() - started
    finally:
        restarter.join()
        producer.close()
    assert 3.5 < elapsed_s < 30
    waits = [e for e in logs if e["event"] == telemetry.WAITING_FOR_THE_BROKER]
    assert waits and waits[0]["waiting_for"] == "the broker to take step 1"
    assert any(e["event"] == telemetry.BROKER_BACK for e in logs)
    with RolloutConsumer(broker.rollout_endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
        fetched = consumer.fetch_step(1, timeout_s=30)
    assert data_digest([tensors for _, tensors in fetched]) == rank_digests(packed.per_rank)[0]


def test_a_send_gives_up_past_the_outage_budget(broker):
    with broker.client() as control:
        control.wait_ready(10)
        registration = control.register()
    messages = to_broker_batches(1, pack_samples(samples(4), seq_len=64))
    broker.stop()
    producer = RolloutProducer(registration.rollout_endpoint, auth_token=TOKEN, resend_interval_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(BrokerOutageExceeded, match="waiting for the broker to take step 1"):
            send_step(producer, 1, messages, outage_s=3, backpressure_timeout_s=60, attempt_s=1.0)
        assert time.monotonic() - started < 10
        stop = threading.Event()
        stop.set()
        from primerl.client.outage import OutageStopped

        with pytest.raises(OutageStopped):  # a stopping orchestrator does not wait out the budget
            send_step(producer, 1, messages, outage_s=60, backpressure_timeout_s=60, attempt_s=1.0, stop_event=stop)
    finally:
        producer.close()


def test_the_worker_list_rides_through_a_broker_restart(broker):
    """The orchestrator's worker list keeps the last known inference workers while the broker is down, picks the
    worker up again after the restart (the worker re-registers), and gives up past the budget."""
    infer = ControlClient(
        BrokerClientConfig(address=broker.grpc_address, run_token=TOKEN),
        "inference",
        "infer-0",
        address="http://127.0.0.1:9/",
    )
    orchestrator = broker.client(outage_s=4)
    infer.wait_ready(10)
    orchestrator.wait_ready(10)
    infer.register()
    orchestrator.register()
    infer.start_heartbeats(lambda: {"policy_version": 0})
    watcher = EndpointWatcher(
        lambda: orchestrator.list_workers(common_pb2.ROLE_INFERENCE),
        outage_s=4,
        healable=(BrokerUnavailable,),
        interval_s=0.2,
    )
    watcher.start()
    try:
        generation, workers = wait_for(lambda: watcher.snapshot()[1] and watcher.snapshot(), 10, "the first list")
        assert [(w.base_url, w.policy_version, w.name) for w in workers.values()] == [
            ("http://127.0.0.1:9/v1", 0, "infer-0")
        ]
        broker.stop()
        time.sleep(1.5)
        watcher.check()  # still within the budget
        assert watcher.snapshot()[1] == workers  # the last list stays
        broker.start()
        wait_for(
            lambda: watcher.snapshot()[0] > generation + 1 and watcher.snapshot()[1],
            20,
            "the worker list after the restart",
        )
        broker.stop()
        with pytest.raises(BrokerOutageExceeded):
            wait_for(lambda: watcher.check(), 30, "the budget to run out")
    finally:
        watcher.stop()
        infer.close()
        orchestrator.close()

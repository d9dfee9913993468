"""The orchestrator scores the student's rollouts with a teacher: the answer's prompt logprobs become
``teacher_logprobs`` aligned with the loss mask; failures of a real local HTTP server (503, a closed connection,
a 400, no answer in time, nothing listening) are retried and then fail the group with a ``teacher_*`` kind; the
rollout scheduler keeps scorings in flight beside rollouts and counts failed scorings like failed rollouts. Slow:
a real ``primerl-infer`` as the teacher (by URL, and as the broker lists it) gives the logprobs of a transformers
float32 forward pass; and the real ``primerl-orchestrator`` with a real student and teacher ships micro-batches
whose teacher_logprobs match the student's inference logprobs (same model)."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from support.probes import free_port, wait_until

from primerl.configs.orchestrator import OrchestratorConfig, TeacherConfig
from primerl.orchestrator.endpoints import WorkerEndpoint
from primerl.orchestrator.env_sampler import EnvSampler
from primerl.orchestrator.rollout_failures import RolloutFailures, RolloutsFailing
from primerl.orchestrator.rollout_scheduler import RolloutScheduler
from primerl.orchestrator.samples import TrainingSample
from primerl.orchestrator.teacher_client import (
    TeacherMismatch,
    TeacherRefused,
    TeacherTimeout,
    TeacherUnreachable,
    teacher_logprobs_from_answer,
)
from primerl.orchestrator.teacher_scoring import TeacherScorer
from primerl.orchestrator.teacher_stage import TeacherStage
from primerl.orchestrator.trajectory import Rollout, RolloutGroup, Turn
from primerl.proto import telemetry

TOKEN = "teacher-test-token"


def fake_logprob(token_id: int, position: int) -> float:
    """What the test teacher answers for token ``token_id`` at ``position``."""
    return -0.01 * token_id - 0.001 * position


def vllm_answer(token_ids: list[int], *, shift: int = 0) -> dict[str, Any]:
    """A ``/v1/completions`` answer shaped like vLLM's (``prompt_logprobs``: None, then {id: {logprob, rank}})."""
    entries: list[Any] = [None]
    for position, token_id in enumerate(token_ids[1:], start=1):
        entries.append(
            {str(token_id + shift): {"logprob": fake_logprob(token_id, position), "rank": 3, "decoded_token": "x"}}
        )
    return {
        "object": "text_completion",
        "model": "teacher",
        "choices": [{"index": 0, "text": "a", "prompt_logprobs": entries, "prompt_token_ids": None}],
    }


class TeacherServer:
    """A real HTTP server on 127.0.0.1 speaking the teacher's two routes; ``mode`` says how it answers:
    ``ok``, ``503``, ``400``, ``close`` (closes the connection without an answer), ``slow`` (answers after
    ``delay_s``), ``wrong_token``. Records the requests (path, Authorization header, body)."""

    def __init__(self, mode: str = "ok", delay_s: float = 0.0):
        self.mode, self.delay_s = mode, delay_s
        self.requests: list[tuple[str, str, Any]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                server.requests.append((self.path, self.headers.get("Authorization", ""), None))
                self._answer(200, {"object": "list", "data": [{"id": "served-teacher"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, self.headers.get("Authorization", ""), body))
                if server.mode == "close":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if server.mode == "slow":
                    time.sleep(server.delay_s)
                if server.mode == "503":
                    return self._answer(503, {"error": "overloaded"})
                if server.mode == "400":
                    return self._answer(400, {"error": {"message": "This model's maximum context length is 8"}})
                self._answer(200, vllm_answer(body["prompt"], shift=int(server.mode == "wrong_token")))

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, client_address: None  # a client that hung up: expected here
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def posts(self) -> list[Any]:
        return [body for path, _, body in self.requests if body is not None]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[Any]:
    started: list[TeacherServer] = []

    def start(mode: str = "ok", delay_s: float = 0.0) -> TeacherServer:
        started.append(TeacherServer(mode, delay_s))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def sample(token_ids: list[int], loss_mask: list[bool], rollout_id: int = 0) -> TrainingSample:
    n = len(token_ids)
    return TrainingSample(token_ids, loss_mask, [0.0] * n, [1.0] * n, [0] * n, rollout_id=rollout_id)


def scorer_for(*urls: str, **fields: Any) -> TeacherScorer:
    return TeacherScorer(TeacherConfig(base_url=list(urls), **fields), run_token=TOKEN)


# -- the answer and the sample -------------------------------------------------------------------------------


def test_answer_becomes_teacher_logprobs_at_loss_positions_only():
    token_ids, mask = [7, 8, 9, 10, 11], [False, False, True, True, False]
    values = teacher_logprobs_from_answer(vllm_answer(token_ids), token_ids, mask)
    assert values == [0.0, 0.0, fake_logprob(9, 2), fake_logprob(10, 3), 0.0]


@pytest.mark.parametrize(
    "answer, message",
    [
        ({"choices": []}, "no choices"),
        ({"choices": [{"text": "a"}]}, "no prompt_logprobs"),
        (vllm_answer([7, 8, 9]), "3 prompt logprobs for a sample of 4 tokens"),
        (vllm_answer([7, 8, 9, 10], shift=1), "not the sample's token 8"),
        ({"choices": [{"prompt_logprobs": [None, {"8": {"logprob": float("nan")}}, None, None]}]}, "not finite"),
        ({"choices": [{"prompt_logprobs": [None] * 4}]}, "not a {token_id: logprob} map"),
        ({"choices": [{**vllm_answer([7, 8, 9, 10])["choices"][0], "prompt_token_ids": [7, 8, 9, 11]}]}, "other token"),
    ],
)
def test_an_answer_that_does_not_fit_the_sample_is_refused(answer, message):
    with pytest.raises(TeacherMismatch, match=message.replace("{", r"\{").replace("}", r"\}")):
        teacher_logprobs_from_answer(answer, [7, 8, 9, 10], [False, True, True, True])


def test_teacher_config_keys_and_prime_rl_alias(monkeypatch):
    base = {"model": {"name": "m"}, "env": [{"id": "e"}], "batch_size": 4, "rollouts_per_example": 2}
    config = OrchestratorConfig.model_validate(
        {
            **base,
            "teacher_model": {"client": {"base_url": ["http://t:8000/v1"], "timeout": 5}, "model": {"name": "big"}},
        }
    )
    assert config.teacher == TeacherConfig(model="big", base_url=["http://t:8000/v1"], timeout_s=5)
    assert OrchestratorConfig.model_validate({**base, "teacher": {"base_url": "http://t:1"}}).teacher.base_url == [
        "http://t:1"
    ]
    assert OrchestratorConfig.model_validate(base).teacher is None
    with pytest.raises(ValueError, match="set twice"):
        OrchestratorConfig.model_validate({**base, "teacher": {}, "teacher_model": {"model": {"name": "x"}}})
    with pytest.raises(ValueError, match="must start with http"):
        TeacherConfig(base_url=["t:8000"])
    monkeypatch.delenv("TEACHER_KEY_FOR_TEST", raising=False)
    with pytest.raises(ValueError, match="teacher.api_key_var"):
        TeacherScorer(TeacherConfig(base_url=["http://t:1"], api_key_var="TEACHER_KEY_FOR_TEST"))


# -- requests to a real local HTTP server ----------------------------------------------------------------------


def test_a_group_is_scored_with_the_run_token_and_the_listed_model(servers):
    server = servers("ok")
    scorer = scorer_for(server.url)
    samples = [sample([5, 6, 7, 8], [False, False, True, True]), sample([5, 6, 9], [False, True, True], 1)]
    try:
        result = scorer.submit(samples).result(timeout=10)
        metrics = scorer.take_metrics()
    finally:
        scorer.close()
    assert result == [[0.0, 0.0, fake_logprob(7, 2), fake_logprob(8, 3)], [0.0, fake_logprob(6, 1), fake_logprob(9, 2)]]
    gets = [path for path, _, body in server.requests if body is None]
    assert gets == ["/v1/models"]  # the model is asked once per endpoint
    assert {auth for _, auth, _ in server.requests} == {f"Bearer {TOKEN}"}
    assert sorted(b["prompt"] for b in server.posts()) == [[5, 6, 7, 8], [5, 6, 9]]
    assert all(
        b["model"] == "served-teacher"
        and b["max_tokens"] == 1
        and b["prompt_logprobs"] == 0
        and b["temperature"] == 1.0
        for b in server.posts()
    )
    assert metrics["teacher/requests"] == 2 and metrics["teacher/errors"] == 0 and metrics["teacher/retried"] == 0
    assert metrics["teacher/request_s"] > 0 and metrics["teacher/inflight"] == 0


@pytest.mark.parametrize(
    "mode, error", [("503", TeacherUnreachable), ("close", TeacherUnreachable), ("slow", TeacherTimeout)]
)
def test_errors_that_can_heal_are_retried_then_fail_the_group(servers, mode, error):
    server = servers(mode, delay_s=2.0)
    scorer = scorer_for(server.url, model="t", max_retries=2, timeout_s=0.3)
    try:
        with structlog.testing.capture_logs() as logs:
            future = scorer.submit([sample([5, 6, 7], [False, True, True])])
            with pytest.raises(error):
                future.result(timeout=30)
        metrics = scorer.take_metrics()
    finally:
        scorer.close()
    assert len(server.posts()) == 3  # one request and two retries
    assert metrics["teacher/requests"] == 3 and metrics["teacher/retried"] == 2 and metrics["teacher/errors"] == 3
    outages = [entry for entry in logs if entry["event"] == telemetry.TEACHER_UNREACHABLE]
    assert len(outages) == (1 if error is TeacherUnreachable else 0)  # once per outage, not per request


def test_a_refusal_that_cannot_heal_is_not_retried(servers):
    server = servers("400")
    scorer = scorer_for(server.url, model="t", max_retries=3)
    try:
        with pytest.raises(TeacherRefused, match="HTTP 400.*maximum context length") as raised:
            scorer.submit([sample([5, 6, 7], [False, True, True])]).result(timeout=10)
    finally:
        scorer.close()
    assert raised.value.kind == "teacher_refused" and len(server.posts()) == 1


def test_a_wrong_token_answer_fails_with_teacher_mismatch(servers):
    server = servers("wrong_token")
    scorer = scorer_for(server.url, model="t")
    try:
        with pytest.raises(TeacherMismatch):
            scorer.submit([sample([5, 6, 7], [False, True, True])]).result(timeout=10)
    finally:
        scorer.close()


def test_a_request_that_fails_goes_to_the_other_endpoint(servers):
    down, up = servers("503"), servers("ok")
    scorer = scorer_for(down.url, up.url, model="t", max_retries=1)
    try:
        results = [scorer.submit([sample([5, 6, 7 + i], [False, True, True])]) for i in range(6)]
        values = [future.result(timeout=20) for future in results]
        metrics = scorer.take_metrics()
    finally:
        scorer.close()
    assert values == [[[0.0, fake_logprob(6, 1), fake_logprob(7 + i, 2)]] for i in range(6)]
    assert len(up.posts()) == 6 and metrics["teacher/retried"] == len(down.posts()) >= 1


def test_nothing_listening_is_teacher_unreachable(servers):
    scorer = scorer_for(f"http://127.0.0.1:{free_port()}", model="t", max_retries=1)
    try:
        with pytest.raises(TeacherUnreachable, match="could not be reached"):
            scorer.submit([sample([5, 6], [False, True])]).result(timeout=20)
    finally:
        scorer.close()


def test_no_teacher_listed_for_timeout_s_is_teacher_unreachable():
    scorer = TeacherScorer(TeacherConfig(model="t", timeout_s=0.5))
    try:
        with pytest.raises(TeacherUnreachable, match="no teacher endpoint was listed for 0.5 s"):
            scorer.submit([sample([5, 6], [False, True])]).result(timeout=10)
        assert scorer.take_metrics()["teacher/retried"] == 0  # the wait was the retry
    finally:
        scorer.close()


def test_a_scoring_waits_for_a_teacher_to_be_listed(servers):
    server = servers("ok")
    scorer = TeacherScorer(TeacherConfig(model="t", timeout_s=30))
    try:
        future = scorer.submit([sample([5, 6], [False, True])])
        time.sleep(0.3)
        assert not future.done()
        scorer.set_endpoints({"t1": server.url})  # the broker lists the teacher (it was still starting)
        assert future.result(timeout=10) == [[0.0, fake_logprob(6, 1)]]
    finally:
        scorer.close()


def test_close_cancels_scorings_under_way(servers):
    server = servers("slow", delay_s=5.0)
    scorer = scorer_for(server.url, model="t", max_inflight=1, timeout_s=30)
    futures = [scorer.submit([sample([5, 6, i], [False, True, True])]) for i in range(4)]
    wait_until(lambda: server.posts(), 5, "the first request")
    started = time.monotonic()
    scorer.close()
    done, _ = concurrent.futures.wait(futures, timeout=10)
    assert len(done) == 4 and time.monotonic() - started < 10
    assert all(f.exception() is not None for f in futures)


# -- the rollout scheduler with a teacher -----------------------------------------------------------------------


def two_turn_rollout(index: int, reward: float) -> Rollout:
    """Two model turns whose second prompt does not extend the first: branching, one sample per turn."""
    turns = [
        Turn([11, 12, 13], [21, 22], [-0.5, -0.5], [1, 1], "stop", False, 0, 0),
        Turn([14, 15], [23, 24, 25], [-0.5] * 3, [1, 1, 1], "stop", False, 0, 0),
    ]
    return Rollout(index, turns, reward, {}, False, None, None, None, [], [], 0.1)


class EnvWorkerAnswering:
    """Stands in for an env worker (a subprocess running verifiers): answers every group at once."""

    num_restarts, max_restarts = 0, 3

    def submit_rollouts(self, example_indices, *, num_rollouts, **kwargs):
        futures = []
        for index in example_indices:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(
                RolloutGroup("e", "train", index, [two_turn_rollout(i, float(i % 2)) for i in range(num_rollouts)])
            )
            futures.append(future)
        return futures

    def cancel(self, future) -> None:
        pass

    def is_alive(self) -> bool:
        return True


class Watcher:
    def __init__(self, workers) -> None:
        self.workers = workers

    def check(self) -> None:
        pass

    def set_fast(self, fast: bool) -> None:
        pass

    def snapshot(self):
        return 1, self.workers


def scheduler_with_teacher(teacher: dict[str, Any], clock=time.monotonic) -> RolloutScheduler:
    config = OrchestratorConfig.model_validate(
        {
            "model": {"name": "m"},
            "env": [{"id": "e"}],
            "batch_size": 4,
            "rollouts_per_example": 2,
            "max_steps": 9,
            "max_inflight": 4,
            "trajectory_strategy": "branching",
            "teacher": teacher,
            "broker": {"run_token": TOKEN},
        }
    )
    stage = TeacherStage(TeacherScorer(config.teacher, run_token=config.broker.run_token))
    scheduler = RolloutScheduler(
        config,
        stop_event=threading.Event(),
        env_clients={"e": EnvWorkerAnswering()},
        sampler=EnvSampler({"e": 10}, {"e": 1.0}, seed=0),
        failures=RolloutFailures(config.batch_size, inference_outage_s=60, clock=clock),
        teacher=stage,
    )
    scheduler.refresh_endpoints(Watcher({"w1": ("http://w1/v1", 0)}))
    return scheduler


def test_the_scheduler_scores_each_turn_before_the_assembler(servers):
    server = servers("ok")
    scheduler = scheduler_with_teacher({"model": "t"})  # no base_url: the teachers the broker lists
    scheduler.teacher.refresh(Watcher({"t1": WorkerEndpoint(f"{server.url}/v1", 0)}))
    try:
        scheduler.dispatch(step=1)
        scheduler.collect(timeout_s=0.01)  # rollouts collected: now with the teacher, not yet in the assembler
        assert len(scheduler.teacher) and scheduler.assembler.take(min_policy_version=0) is None
        deadline = time.monotonic() + 20
        while (batch := scheduler.assembler.take(min_policy_version=0)) is None and time.monotonic() < deadline:
            scheduler.collect(timeout_s=0.5)
        metrics = scheduler.worker_metrics()
    finally:
        scheduler.cancel_all()
    assert batch is not None and not len(scheduler.teacher)
    assert len(batch.samples) == 8  # 4 rollouts x 2 turns
    for s in batch.samples:
        expected = [fake_logprob(t, i) if m and i else 0.0 for i, (t, m) in enumerate(zip(s.token_ids, s.loss_mask))]
        assert s.teacher_logprobs == expected and any(s.loss_mask)
    assert metrics["teacher/requests"] == 8 and metrics["teacher/errors"] == 0
    assert scheduler.counters["groups_done"] == 2 and scheduler.failures.consecutive == 0


def test_a_teacher_that_is_down_fails_groups_as_rollout_errors_without_stopping_the_loop(servers):
    server = servers("503")
    now = [0.0]
    scheduler = scheduler_with_teacher({"model": "t", "base_url": [server.url], "max_retries": 1}, clock=lambda: now[0])
    try:
        with structlog.testing.capture_logs() as logs:
            scheduler.dispatch(step=1)
            deadline = time.monotonic() + 30
            while scheduler.counters["teacher_errors"] < 2 and time.monotonic() < deadline:
                scheduler.collect(timeout_s=0.5)
                scheduler.dispatch(step=1)
        failures = scheduler.failures
        assert scheduler.counters["teacher_errors"] >= 2 and scheduler.assembler.take(min_policy_version=0) is None
        assert scheduler.counters["errors/teacher_unreachable"] == 2 * scheduler.counters["teacher_errors"]
        assert failures.counts["teacher_unreachable"] >= 4 and failures.consecutive == 0  # an outage, not a streak
        assert any(e["event"] == telemetry.ROLLOUT_FAILED and e["kind"] == "teacher_unreachable" for e in logs)
        failures.check()  # within the outage budget: go on waiting
        now[0] = 61.0
        with pytest.raises(RolloutsFailing, match="no teacher answered for 61 s"):
            failures.check()
    finally:
        scheduler.cancel_all()
    assert not len(scheduler.teacher)


def test_a_teacher_that_refuses_fails_groups_into_the_streak(servers):
    server = servers("400")
    scheduler = scheduler_with_teacher({"model": "t", "base_url": [server.url]})
    try:
        scheduler.dispatch(step=1)
        deadline = time.monotonic() + 20
        while scheduler.counters["teacher_errors"] < 2 and time.monotonic() < deadline:
            scheduler.collect(timeout_s=0.5)
        with pytest.raises(RolloutsFailing, match="teacher's context"):
            scheduler.failures.check()  # 4 rollouts failed in a row: a step's worth
    finally:
        scheduler.cancel_all()
    assert scheduler.counters["errors/teacher_refused"] == 4


# -- a real primerl-infer as the teacher --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_a_real_teacher_by_url_and_as_listed_gives_the_logprobs_of_a_float32_forward(
    tmp_path, tiny_model, infer_broker
):
    from support.daemons import InferenceDaemon
    from support.inference import TOKEN as RUN_TOKEN

    from primerl.client.broker_errors import BrokerUnavailable
    from primerl.inference.logprob_check import load_reference_model, reference_logprobs
    from primerl.orchestrator.endpoints import EndpointWatcher
    from primerl.proto.v1 import common_pb2

    daemon = InferenceDaemon(
        tmp_path,
        tiny_model,
        infer_broker.grpc_address,
        RUN_TOKEN,
        "--role",
        "teacher",
        env={"TMPDIR": str(tmp_path)},
        name="teacher",
    )
    scorer = TeacherScorer(TeacherConfig(base_url=[daemon.url], max_inflight=4), run_token=RUN_TOKEN)
    listed = TeacherScorer(TeacherConfig(max_inflight=4), run_token=RUN_TOKEN)  # as the broker lists teachers
    client = infer_broker.client("orchestrator", "teacher-test")
    watcher = EndpointWatcher(
        lambda: client.list_workers(common_pb2.ROLE_TEACHER),
        outage_s=30,
        healable=(BrokerUnavailable,),
        what="teacher workers",
    )
    watcher.start()
    samples = [
        sample([3, 40, 41, 42, 200, 201, 202, 7], [False, False, False, False, True, True, True, True]),
        sample([3, 40, 41, 42, 200, 201, 202, 7, 50, 51, 300, 301], [False] * 10 + [True, True], 1),  # turn 2
        sample(list(range(5, 45)), [False] * 5 + [True] * 35, 2),
    ]
    try:
        scored = scorer.submit(samples).result(timeout=120)
        metrics = scorer.take_metrics()
        _, workers = wait_until(lambda: watcher.snapshot()[1] and watcher.snapshot(), 30, "the broker to list it")
        assert [info.base_url for info in workers.values()] == [f"{daemon.url}/v1"]
        listed.set_endpoints({worker_id: info.base_url for worker_id, info in workers.items()})
        assert listed.submit(samples).result(timeout=120) == scored
    finally:
        watcher.stop()
        client.close()
        for teacher in (scorer, listed):
            teacher.close()
        daemon.stop()
    model = load_reference_model(tiny_model)
    worst = 0.0
    for s, values in zip(samples, scored, strict=True):
        reference = [0.0, *reference_logprobs(model, s.token_ids[:1], s.token_ids[1:])]
        for i, mask in enumerate(s.loss_mask):
            if mask:
                worst = max(worst, abs(values[i] - reference[i]))
            else:
                assert values[i] == 0.0
        assert any(values) and all(math.isfinite(v) for v in values)
    print(f"teacher vs transformers float32: worst |diff| {worst:.2e} over the loss tokens")
    assert worst < 1e-4, worst
    assert metrics["teacher/requests"] == 3 and metrics["teacher/errors"] == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_the_orchestrator_scores_its_rollouts_with_the_teacher_the_broker_lists(tmp_path, tiny_model):
    """Real daemons: an in-process broker, a student primerl-infer, a teacher primerl-infer (--role teacher, the
    same model) and primerl-orchestrator with `[orchestrator.teacher]` and no base_url. Each step's micro-batches
    carry teacher_logprobs equal to the inference logprobs at the loss tokens (same weights, temperature 1)."""
    import os
    import subprocess

    import numpy as np
    from support.broker import BrokerHarness
    from support.daemons import InferenceDaemon
    from support.orchestrator import ENV_FIXTURES, ENV_PYTHON, metric_rows, orchestrator_args

    from primerl.client.rollouts import RolloutConsumer

    if not os.path.exists(ENV_PYTHON):
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    broker = BrokerHarness(tmp_path / "spool", run_token=TOKEN, heartbeat_interval_s=0.2, run_id="teacher-run")
    daemons: list[InferenceDaemon] = []
    orchestrator = None
    log_path = tmp_path / "orchestrator.log"
    steps: dict[int, list] = {}
    try:
        for name, extra in (("student", ()), ("teacher", ("--role", "teacher"))):
            daemons.append(
                InferenceDaemon(
                    tmp_path, tiny_model, broker.grpc_address, TOKEN, *extra, env={"TMPDIR": str(tmp_path)}, name=name
                )
            )
        args = orchestrator_args(
            tiny_model,
            broker,
            tmp_path / "out",
            "reverse-text",
            "--max-async-level",
            "4",
            "--teacher.max-inflight",
            "8",
        )
        with open(log_path, "w") as log_file:
            orchestrator = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN, "PYTHONPATH": str(ENV_FIXTURES)},
            )
        with RolloutConsumer(broker.rollout_endpoint, auth_token=TOKEN, worker_id="trainer-0", rank=0) as consumer:
            for step in (1, 2):
                steps[step] = consumer.fetch_step(step, timeout_s=180)
        assert orchestrator.wait(60) == 0, log_path.read_text()[-4000:]
    finally:
        if orchestrator is not None and orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.wait(10)
        for daemon in daemons:
            daemon.stop()
        broker.stop()
    num_loss_tokens, worst = 0, 0.0
    for batches in steps.values():
        for _, tensors in batches:
            mask = np.asarray(tensors["loss_mask"], dtype=bool)
            teacher = np.asarray(tensors["teacher_logprobs"], dtype=np.float64)
            served = np.asarray(tensors["inference_logprobs"], dtype=np.float64)
            assert not teacher[~mask].any()  # 0.0 wherever there is no loss
            num_loss_tokens += int(mask.sum())
            worst = max(worst, float(np.abs(teacher[mask] - served[mask]).max(initial=0.0)))
    print(f"teacher vs student inference logprobs: worst |diff| {worst:.2e} over {num_loss_tokens} loss tokens")
    assert num_loss_tokens > 0 and worst < 1e-3, (num_loss_tokens, worst)
    rows = metric_rows(tmp_path / "out")
    print(
        "teacher metrics per step:",
        [{k: round(v, 4) for k, v in row.items() if k.startswith("teacher/")} for row in rows],
    )
    assert len(rows) == 2 and all(row["teacher/requests"] > 0 and row["teacher/errors"] == 0 for row in rows)
    assert sum(row["teacher/requests"] for row in rows) >= 16  # every rollout of both steps, at least
    text = log_path.read_text(errors="replace")
    assert telemetry.TEACHER_WORKER_JOINED in text and telemetry.SCORING_ROLLOUTS_WITH_A_TEACHER in text

"""Classic env workers: `envs/remote/classic_worker.py` run by the environments' interpreter (verifiers 0.3.1),
driven by `ClassicEnvClient`: the protocol, rollouts against a fake OpenAI server in this process (canned
completions with token ids, logprobs and policy-version headers), timeouts, cancels, crashes and restarts. With the
real vLLM server: `test_env_worker_vllm.py`; what a rollout becomes for training: `test_orchestrator_samples.py`.

The env interpreter comes from `PRIMERL_ENV_PYTHON` (default `.venv-envs/bin/python`, then `/tmp/vfenv/bin/python`);
it must have `verifiers` and the `reverse-text` example package (`pip install -e examples/reverse_text`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.env_workers import ENV_PYTHON, FIXTURES, SKIP_REASON, FakeOpenAI, make_worker

from primerl.orchestrator.envs.base import EnvRequestError, EnvRequestTimeout, EnvWorkerDied
from primerl.orchestrator.envs.classic import WORKER_SCRIPT, ClassicEnvClient
from primerl.orchestrator.trajectory import SamplingParams
from primerl.proto import telemetry

pytestmark = pytest.mark.skipif(ENV_PYTHON is None, reason=SKIP_REASON)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    yield server
    server.close()


@pytest.fixture(scope="module")
def reverse_worker() -> Iterator[ClassicEnvClient]:
    worker = make_worker("reverse-text", {"num_examples": 20, "num_eval_examples": 5})
    worker.start()
    yield worker
    worker.close()


# ------------------------------------------------------------------------------------------------ protocol


class RawWorker:
    """The worker process driven line by line, to send what ClassicEnvClient never would."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [ENV_PYTHON, str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(FIXTURES)},
        )

    def ask(self, line: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        return self.process.wait(timeout=30)


def test_malformed_requests_get_errors_and_the_worker_keeps_serving() -> None:
    raw = RawWorker()
    try:
        cases = [
            ("not json", None),
            ("[1, 2]", None),
            ('{"op": "ping"}', None),
            ('{"id": true, "op": "ping"}', None),
            ('{"id": 1, "op": "fly"}', 1),
            ('{"id": 2, "op": "examples", "count": 1}', 2),  # nothing loaded yet
            ('{"id": 3, "op": "load"}', 3),
            ('{"id": 4, "op": "load", "env_id": "reverse-text", "args": [1]}', 4),
        ]
        for line, request_id in cases:
            answer = raw.ask(line)
            assert answer["ok"] is False and answer["id"] == request_id, (line, answer)
            assert answer["error"]["type"] == "bad_request", (line, answer)
        assert raw.ask('{"id": 5, "op": "load", "env_id": "reverse-text", "args": {"num_examples": 3}}')["ok"]
        for line in [
            '{"id": 6, "op": "examples", "split": "test", "count": 1}',
            '{"id": 7, "op": "examples", "start": -1, "count": 1}',
            '{"id": 8, "op": "rollout", "example_index": 3, "base_url": "http://x", "model": "m"}',
            '{"id": 9, "op": "rollout", "example_index": 0, "base_url": "http://x", "model": "m", '
            '"sampling": {"temprature": 1.0}}',
            '{"id": 10, "op": "rollout", "example_index": 0, "num_rollouts": 0, "base_url": "http://x", "model": "m"}',
            '{"id": 11, "op": "load", "env_id": "reverse-text-multiturn"}',  # one environment per worker
        ]:
            answer = raw.ask(line)
            assert answer["ok"] is False and answer["error"]["type"] == "bad_request", (line, answer)
        assert (
            "temprature"
            in raw.ask(
                '{"id": 12, "op": "rollout", "example_index": 0, "base_url": "http://x", "model": "m", '
                '"sampling": {"temprature": 1.0}}'
            )["error"]["message"]
        )
        pong = raw.ask('{"id": "last", "op": "ping"}')
        assert pong == {
            "id": "last",
            "ok": True,
            "result": {"protocol_version": 1, "pid": raw.process.pid, "env_id": "reverse-text"},
        }
        assert raw.ask('{"id": 13, "op": "shutdown"}')["ok"]
    finally:
        assert raw.close() == 0


def test_load_and_examples(reverse_worker: ClassicEnvClient) -> None:
    info = reverse_worker.info
    assert info is not None
    assert (info.env_id, info.env_class, info.num_examples, info.num_eval_examples, info.has_eval_dataset) == (
        "reverse-text",
        "SingleTurnEnv",
        20,
        5,
        True,
    )
    train = reverse_worker.examples("train", 0, 3)
    assert [e.index for e in train] == [0, 1, 2]
    for example in train:
        letters = example.prompt[-1]["content"].split(" ")
        assert example.prompt[0]["role"] == "system" and example.prompt[-1]["role"] == "user"
        assert 3 <= len(letters) <= 6 and set(letters) <= set("abcd")
        assert example.answer == " ".join(reversed(letters))
    assert [e.index for e in reverse_worker.examples("train", 18, 5)] == [18, 19]  # clipped at the end
    evals = reverse_worker.examples("eval", 0, 5)
    assert len(evals) == 5 and [e.prompt for e in evals] != [e.prompt for e in train[:5]]
    # deterministic: a second worker sees the same data
    with make_worker("reverse-text", {"num_examples": 20, "num_eval_examples": 5}) as other:
        assert other.examples("train", 0, 3) == train


def test_load_failure_is_reported() -> None:
    worker = make_worker("broken_load_env")
    try:
        with pytest.raises(EnvRequestError, match="broken on purpose"):
            worker.start()
        assert worker.is_alive() and worker.ping()["env_id"] is None
        with pytest.raises(EnvRequestError, match="Could not import 'no-such-env'"):
            worker._call("load", {"env_id": "no-such-env"}, 60.0)
    finally:
        worker.close()


def test_missing_env_python_is_a_clear_error() -> None:
    with pytest.raises(EnvWorkerDied, match="does not exist"):
        ClassicEnvClient("/nonexistent/bin/python", "reverse-text").start()


def test_interpreter_without_verifiers_is_reported() -> None:
    # the main venv has no verifiers (its mcp>=2 conflicts): exactly the mistake this message must explain
    worker = ClassicEnvClient(sys.executable, "reverse-text", start_timeout_s=60.0)
    try:
        with pytest.raises(EnvRequestError, match="verifiers is not importable") as excinfo:
            worker.start()
        assert "verifiers==0.3.1" in str(excinfo.value) and worker.is_alive()
    finally:
        worker.close()


# ------------------------------------------------------------------------------------------------ rollouts


def test_rollouts_capture_tokens_logprobs_headers_and_rewards(
    reverse_worker: ClassicEnvClient, fake: FakeOpenAI
) -> None:
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1, max_tokens=16, stop=("\n\n",), seed=40
    )
    num_before = len(fake.requests)
    group = reverse_worker.submit_rollout(
        2, num_rollouts=3, base_url=fake.base_url, model="reverse", sampling=sampling
    ).result(timeout=60)
    example = reverse_worker.examples("train", 2, 1)[0]
    assert (group.env_id, group.split, group.example_index, group.num_errors) == ("reverse-text", "train", 2, 0)
    for rollout in group.rollouts:
        assert rollout.ok, rollout.error
        assert rollout.reward == 1.0 and rollout.metrics["lcs_reward"] == 1.0 and rollout.metrics["exact_match"] == 1.0
        assert rollout.policy_versions == [7, 8] and rollout.stop_condition == "max_turns_reached"
        (turn,) = rollout.turns
        assert turn.completion_token_ids == [100 + ord(ch) for ch in example.answer] + [2]
        assert turn.completion_logprobs == [-0.25] * len(turn.completion_token_ids)
        assert turn.completion_mask == [1] * len(turn.completion_token_ids)
        assert turn.finish_reason == "stop" and not turn.is_truncated
        assert turn.completion == [{"role": "assistant", "content": example.answer}]
        assert rollout.prompt == example.prompt
    bodies = fake.requests[num_before:]
    assert sorted(b["seed"] for b in bodies) == [40, 41, 42]  # rollout i gets seed + i
    for body in bodies:
        assert body["logprobs"] is True and body["return_token_ids"] is True
        assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"]) == (
            0.7,
            0.9,
            5,
            0.1,
            1.1,
        )
        assert body["max_completion_tokens"] == 16 and body["stop"] == ["\n\n"]


def test_eval_groups_seed_each_example_apart_whatever_the_order(
    reverse_worker: ClassicEnvClient, fake: FakeOpenAI
) -> None:
    """`run_eval_groups` with a sampling seed: example e's rollout i is sampled with rollout_seed_base(seed, e, n) + i,
    the same seeds however many groups run at once (so in whichever order they reach the server)."""
    from primerl.orchestrator.evaluation import run_eval_groups
    from primerl.orchestrator.seeds import rollout_seed_base

    questions = {reverse_worker.examples("eval", index, 1)[0].prompt[-1]["content"]: index for index in range(5)}
    seen = []
    for max_concurrent_groups in (5, 1):
        num_before = len(fake.requests)
        groups, failed = run_eval_groups(
            reverse_worker,
            range(5),
            num_rollouts=2,
            base_url=fake.base_url,
            model="reverse",
            sampling={"temperature": 1.0, "seed": 3},
            max_concurrent_groups=max_concurrent_groups,
            timeout_s=60,
        )
        assert not failed and len(groups) == 5
        by_example = {}
        for body in fake.requests[num_before:]:
            index = questions[[m for m in body["messages"] if m["role"] == "user"][-1]["content"]]
            by_example.setdefault(index, []).append(body["seed"])
        assert {index: sorted(seeds) for index, seeds in by_example.items()} == {
            index: [rollout_seed_base(3, index, 2), rollout_seed_base(3, index, 2) + 1] for index in range(5)
        }
        seen.append(by_example)
    assert len({seed for seeds in seen[0].values() for seed in seeds}) == 10  # no two rollouts share a seed
    assert {i: sorted(s) for i, s in seen[0].items()} == {i: sorted(s) for i, s in seen[1].items()}


def test_many_requests_in_flight_answer_out_of_order(reverse_worker: ClassicEnvClient, fake: FakeOpenAI) -> None:
    async def run() -> list[Any]:
        return await asyncio.gather(
            *(
                reverse_worker.rollout(
                    i % 20, split="train", num_rollouts=4, base_url=fake.base_url, model="reverse", max_concurrent=2
                )
                for i in range(24)
            )
        )

    groups = asyncio.run(run())
    assert [g.example_index for g in groups] == [i % 20 for i in range(24)]
    assert all(r.ok and r.reward == 1.0 for g in groups for r in g.rollouts)
    evals = reverse_worker.submit_rollout(
        4, split="eval", num_rollouts=1, base_url=fake.base_url, model="reverse"
    ).result(timeout=60)
    assert evals.split == "eval" and evals.rollouts[0].prompt == reverse_worker.examples("eval", 4, 1)[0].prompt


def test_submit_rollouts_hands_many_groups_over_at_once_with_timings(
    reverse_worker: ClassicEnvClient, fake: FakeOpenAI
) -> None:
    futures = reverse_worker.submit_rollouts([3, 1, 4, 1, 5], num_rollouts=2, base_url=fake.base_url, model="reverse")
    assert len({f.request_id for f in futures}) == 5  # one request per group, all in one write
    groups = [f.result(timeout=60) for f in futures]
    assert [g.example_index for g in groups] == [3, 1, 4, 1, 5]
    for group in groups:
        assert all(r.ok and r.reward == 1.0 for r in group.rollouts)
        assert set(group.timings) == {"generate_s", "score_s", "encode_s", "total_s"}
        assert group.roundtrip_s is not None and group.roundtrip_s >= group.timings["total_s"]
        assert group.timings["total_s"] >= group.timings["generate_s"] + group.timings["score_s"] >= 0


def test_a_slow_reward_function_moves_scoring_off_the_event_loop(fake: FakeOpenAI) -> None:
    with make_worker("slow_rubric_env", {"num_examples": 4}) as worker:
        first = worker.submit_rollout(0, num_rollouts=2, base_url=fake.base_url, model="reverse").result(60)
        assert all(r.ok and r.reward == 1.0 for r in first.rollouts)
        deadline = time.monotonic() + 10
        while "move to the scoring threads" not in worker.stderr_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "move to the scoring threads" in worker.stderr_tail()
        groups = [
            f.result(60)
            for f in worker.submit_rollouts([1, 2, 0], num_rollouts=2, base_url=fake.base_url, model="reverse")
        ]
        broken, *good = groups
        assert {r.error_type for r in broken.rollouts} == {"ScoringError"}
        assert all("broken for example 1" in r.error for r in broken.rollouts)
        assert all(r.ok and r.reward == 1.0 and r.metrics["slow_reward"] == 0.0 for g in good for r in g.rollouts)
        assert worker.ping()["env_id"] == "slow_rubric_env"


def test_missing_token_ids_is_a_rollout_error(reverse_worker: ClassicEnvClient, fake: FakeOpenAI) -> None:
    group = reverse_worker.submit_rollout(0, num_rollouts=2, base_url=fake.base_url, model="no-tokens").result(60)
    assert group.num_errors == 2
    assert all(r.error_type == "RolloutError" and "token ids" in (r.error or "") for r in group.rollouts)
    assert reverse_worker.is_alive() and reverse_worker.ping()["env_id"] == "reverse-text"


def test_unreachable_server_is_a_rollout_error(reverse_worker: ClassicEnvClient) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    group = reverse_worker.submit_rollout(0, num_rollouts=2, base_url=f"http://127.0.0.1:{port}/v1", model="m").result(
        60
    )
    assert group.num_errors == 2 and all(r.error_type == "ModelError" for r in group.rollouts)


def test_env_exceptions_are_rollout_errors(fake: FakeOpenAI) -> None:
    with make_worker("broken_rubric_env", {"num_examples": 4}) as worker:
        group = worker.submit_rollout(1, num_rollouts=3, base_url=fake.base_url, model="reverse").result(60)
        assert group.num_errors == 3
        assert all(r.error_type == "ScoringError" and "flaky_reward" in (r.error or "") for r in group.rollouts)
        assert worker.ping()["env_id"] == "broken_rubric_env"
    with make_worker("broken_response_env") as worker:
        group = worker.submit_rollout(0, num_rollouts=2, base_url=fake.base_url, model="reverse").result(60)
        assert group.num_errors == 2
        assert all(r.error_type == "RuntimeError" and "broken on purpose" in (r.error or "") for r in group.rollouts)
        again = worker.submit_rollout(1, num_rollouts=1, base_url=fake.base_url, model="reverse").result(60)
        assert again.num_errors == 1 and worker.is_alive()


def test_stdout_prints_do_not_break_the_protocol(fake: FakeOpenAI) -> None:
    with make_worker("print_env", {"num_examples": 4}) as worker:
        group = worker.submit_rollout(0, num_rollouts=2, base_url=fake.base_url, model="reverse").result(60)
        assert group.num_errors == 0 and group.rollouts[0].metrics["chatty_metric"] == 0.5
        assert "hello from load_environment on stdout" in worker.stderr_tail()


def test_timeout_and_cancel(fake: FakeOpenAI) -> None:
    with make_worker("reverse-text", {"num_examples": 4}) as worker:
        started = time.monotonic()
        with pytest.raises(EnvRequestTimeout):
            worker.submit_rollout(0, num_rollouts=1, base_url=fake.base_url, model="slow", timeout_s=1.0).result(
                timeout=10
            )
        assert time.monotonic() - started < 5
        future = worker.submit_rollout(0, num_rollouts=1, base_url=fake.base_url, model="slow")
        time.sleep(0.5)
        worker.cancel(future)
        with pytest.raises(EnvRequestError) as excinfo:
            future.result(timeout=10)
        assert excinfo.value.error_type == "cancelled"
        after = worker.submit_rollout(1, num_rollouts=1, base_url=fake.base_url, model="reverse").result(30)
        assert after.num_errors == 0


def test_a_dead_worker_fails_pending_requests_and_restarts(fake: FakeOpenAI) -> None:
    worker = make_worker("reverse-text", {"num_examples": 4}, max_restarts=1)
    try:
        worker.start()
        future = worker.submit_rollout(0, num_rollouts=1, base_url=fake.base_url, model="slow")
        time.sleep(0.5)
        old_pid = worker.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(EnvWorkerDied, match="exit code -9") as excinfo:
            future.result(timeout=15)
        assert "Last stderr" in str(excinfo.value) and "env worker (protocol 1)" in str(excinfo.value)
        assert not worker.is_alive()
        with pytest.raises(EnvWorkerDied):
            worker.examples("train", 0, 1)
        assert worker.ensure_alive().num_examples == 4 and worker.pid != old_pid
        after = worker.submit_rollout(1, num_rollouts=1, base_url=fake.base_url, model="reverse").result(30)
        assert after.num_errors == 0
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(EnvWorkerDied, match="giving up"):
            worker.ensure_alive()
    finally:
        worker.close()


def test_a_restart_right_after_a_crash_logs_the_exit_code_and_keeps_the_new_process(fake: FakeOpenAI) -> None:
    """Restarted at once after SIGKILL (before the old process's reader has seen its end): the log line names the
    exit code, the old process's requests fail, and nothing of the old process touches the new one."""
    import structlog

    worker = make_worker("reverse-text", {"num_examples": 4}, max_restarts=2)
    try:
        worker.start()
        lost = worker.submit_rollout(0, num_rollouts=1, base_url=fake.base_url, model="slow")
        old_pid = worker.pid
        os.kill(old_pid, signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while worker.exit_code is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with structlog.testing.capture_logs() as logs:
            assert worker.ensure_alive().num_examples == 4
        with pytest.raises(EnvWorkerDied):
            lost.result(timeout=15)
        restarts = [e for e in logs if e["event"] == telemetry.RESTARTING_ENV_WORKER]
        assert [(e["exit_code"], e["pid"], e["num_restarts"]) for e in restarts] == [(-9, old_pid, 1)]
        time.sleep(1.0)  # the old reader and watchdog threads have ended by now
        assert worker.is_alive() and worker.pid != old_pid and worker.exit_code is None
        after = worker.submit_rollout(1, num_rollouts=1, base_url=fake.base_url, model="reverse").result(30)
        assert after.num_errors == 0
    finally:
        worker.close()


def test_model_requests_go_through_aiohttp_in_the_set_up_env_interpreter() -> None:
    """`make setup` installs httpx-aiohttp beside verifiers: without it every model request costs ~7x the CPU. (The
    env interpreter has no primerl: importing classic_worker makes its two primerl modules importable by path.)"""
    probe = subprocess.run(
        [
            ENV_PYTHON,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import classic_worker; "
            "from primerl.orchestrator.envs.remote.classic_rollouts import _http_client_class; "
            "print(_http_client_class().__name__)",
            str(WORKER_SCRIPT.parent),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "HttpxAiohttpClient", probe.stderr

"""Env workers: `env_worker.py` run by the environments' interpreter (verifiers 0.3.1), driven by `EnvWorker`.

The env interpreter comes from `PRIMERL_ENV_PYTHON` (default `.venv-envs/bin/python`, then `/tmp/vfenv/bin/python`);
it must have `verifiers` and the `reverse-text` example package (`pip install -e examples/reverse_text`).
Fast tests run rollouts against a fake OpenAI server in this process (canned completions with token ids,
logprobs and policy-version headers). The slow ones run the real vLLM OpenAI server on the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from primerl.orchestrator.env_client import (
    EnvRequestError,
    EnvRequestTimeout,
    EnvWorker,
    EnvWorkerDied,
    WORKER_SCRIPT,
)
from primerl.orchestrator.trajectory import (
    Rollout,
    SamplingParams,
    Turn,
    branch,
    interleave,
    parse_rollout,
    sampling_from,
    to_samples,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "env_fixtures"
VERSION, VERSION_END = "x-primerl-policy-version", "x-primerl-policy-version-end"


def find_env_python() -> tuple[str | None, str]:
    candidates = [os.environ.get("PRIMERL_ENV_PYTHON")] if os.environ.get("PRIMERL_ENV_PYTHON") else [
        str(ROOT / ".venv-envs/bin/python"), "/tmp/vfenv/bin/python"]
    for candidate in candidates:
        if not Path(candidate).exists():
            continue
        probe = subprocess.run([candidate, "-c", "import verifiers, reverse_text"], capture_output=True, timeout=120)
        if probe.returncode == 0:
            return candidate, ""
        return None, (f"{candidate} cannot import verifiers and reverse_text (build the env venv: verifiers==0.3.1 "
                      f"and `pip install -e examples/reverse_text`): {probe.stderr.decode()[-300:]}")
    return None, f"no env python with verifiers: tried {candidates} (set PRIMERL_ENV_PYTHON)"


ENV_PYTHON, SKIP_REASON = find_env_python()
pytestmark = pytest.mark.skipif(ENV_PYTHON is None, reason=SKIP_REASON)


def make_worker(env_id: str, args: dict[str, Any] | None = None, **kwargs: Any) -> EnvWorker:
    extra_env = {"PYTHONPATH": str(FIXTURES)}
    return EnvWorker(ENV_PYTHON, env_id, args or {}, start_timeout_s=120.0, request_timeout_s=60.0,
                     extra_env=extra_env, **kwargs)


# ------------------------------------------------------------------------------------------- fake OpenAI server


class FakeOpenAI:
    """Chat completions with canned tokens. The model name picks the behaviour:
    `reverse` answers the reversed user string; `no-tokens` omits token ids; `slow` sleeps 30 s first."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real server

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if body["model"] == "slow":
                    time.sleep(30)
                user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
                content = " ".join(reversed(user.split()))
                completion_ids = [100 + ord(ch) for ch in content] + [2]
                prompt_ids = [1] + [100 + ord(ch) for m in body["messages"] for ch in m["content"]]
                choice: dict[str, Any] = {
                    "index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop",
                    "logprobs": {"content": [{"token": "t", "logprob": -0.25, "bytes": None, "top_logprobs": []}
                                             for _ in completion_ids]},
                }
                response: dict[str, Any] = {
                    "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": 0,
                    "model": body["model"], "choices": [choice],
                    "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                              "total_tokens": len(prompt_ids) + len(completion_ids)},
                }
                if body["model"] != "no-tokens":
                    choice["token_ids"] = completion_ids
                    response["prompt_token_ids"] = prompt_ids
                data = json.dumps(response).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header(VERSION, "7")
                self.send_header(VERSION_END, "8")
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the default backlog of 5 resets bursts of connections
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)  # a client that went away is expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    yield server
    server.close()


@pytest.fixture(scope="module")
def reverse_worker() -> Iterator[EnvWorker]:
    worker = make_worker("reverse-text", {"num_examples": 20, "num_eval_examples": 5})
    worker.start()
    yield worker
    worker.close()


# ------------------------------------------------------------------------------------------------ protocol


class RawWorker:
    """The worker process driven line by line, to send what EnvWorker never would."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([ENV_PYTHON, str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        env={**os.environ, "PYTHONPATH": str(FIXTURES)})

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
        assert "temprature" in raw.ask(
            '{"id": 12, "op": "rollout", "example_index": 0, "base_url": "http://x", "model": "m", '
            '"sampling": {"temprature": 1.0}}')["error"]["message"]
        pong = raw.ask('{"id": "last", "op": "ping"}')
        assert pong == {"id": "last", "ok": True, "result": {"protocol_version": 1, "pid": raw.process.pid,
                                                              "env_id": "reverse-text"}}
        assert raw.ask('{"id": 13, "op": "shutdown"}')["ok"]
    finally:
        assert raw.close() == 0


def test_load_and_examples(reverse_worker: EnvWorker) -> None:
    info = reverse_worker.info
    assert info is not None
    assert (info.env_id, info.env_class, info.num_examples, info.num_eval_examples, info.has_eval_dataset) == (
        "reverse-text", "SingleTurnEnv", 20, 5, True)
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
        EnvWorker("/nonexistent/bin/python", "reverse-text").start()


def test_interpreter_without_verifiers_is_reported() -> None:
    # the main venv has no verifiers (its mcp>=2 conflicts): exactly the mistake this message must explain
    worker = EnvWorker(sys.executable, "reverse-text", start_timeout_s=60.0)
    try:
        with pytest.raises(EnvRequestError, match="verifiers is not importable") as excinfo:
            worker.start()
        assert "verifiers==0.3.1" in str(excinfo.value) and worker.is_alive()
    finally:
        worker.close()


# ------------------------------------------------------------------------------------------------ rollouts


def test_rollouts_capture_tokens_logprobs_headers_and_rewards(reverse_worker: EnvWorker, fake: FakeOpenAI) -> None:
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                              max_tokens=16, stop=("\n\n",), seed=40)
    num_before = len(fake.requests)
    group = reverse_worker.submit_rollout(2, num_rollouts=3, base_url=fake.base_url, model="reverse",
                                          sampling=sampling).result(timeout=60)
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
            0.7, 0.9, 5, 0.1, 1.1)
        assert body["max_completion_tokens"] == 16 and body["stop"] == ["\n\n"]


def test_eval_groups_seed_each_example_apart_whatever_the_order(reverse_worker: EnvWorker, fake: FakeOpenAI) -> None:
    """`run_eval_groups` with a sampling seed: example e's rollout i is sampled with rollout_seed_base(seed, e, n) + i,
    the same seeds however many groups run at once (so in whichever order they reach the server)."""
    from primerl.orchestrator.evaluation import run_eval_groups
    from primerl.orchestrator.seeds import rollout_seed_base

    questions = {reverse_worker.examples("eval", index, 1)[0].prompt[-1]["content"]: index for index in range(5)}
    seen = []
    for max_concurrent_groups in (5, 1):
        num_before = len(fake.requests)
        groups, failed = run_eval_groups(reverse_worker, range(5), num_rollouts=2, base_url=fake.base_url,
                                         model="reverse", sampling={"temperature": 1.0, "seed": 3},
                                         max_concurrent_groups=max_concurrent_groups, timeout_s=60)
        assert not failed and len(groups) == 5
        by_example = {}
        for body in fake.requests[num_before:]:
            index = questions[[m for m in body["messages"] if m["role"] == "user"][-1]["content"]]
            by_example.setdefault(index, []).append(body["seed"])
        assert {index: sorted(seeds) for index, seeds in by_example.items()} == {
            index: [rollout_seed_base(3, index, 2), rollout_seed_base(3, index, 2) + 1] for index in range(5)}
        seen.append(by_example)
    assert len({seed for seeds in seen[0].values() for seed in seeds}) == 10  # no two rollouts share a seed
    assert {i: sorted(s) for i, s in seen[0].items()} == {i: sorted(s) for i, s in seen[1].items()}


def test_many_requests_in_flight_answer_out_of_order(reverse_worker: EnvWorker, fake: FakeOpenAI) -> None:
    async def run() -> list[Any]:
        return await asyncio.gather(*(
            reverse_worker.rollout(i % 20, split="train", num_rollouts=4, base_url=fake.base_url, model="reverse",
                                   max_concurrent=2)
            for i in range(24)))

    groups = asyncio.run(run())
    assert [g.example_index for g in groups] == [i % 20 for i in range(24)]
    assert all(r.ok and r.reward == 1.0 for g in groups for r in g.rollouts)
    evals = reverse_worker.submit_rollout(4, split="eval", num_rollouts=1, base_url=fake.base_url,
                                          model="reverse").result(timeout=60)
    assert evals.split == "eval" and evals.rollouts[0].prompt == reverse_worker.examples("eval", 4, 1)[0].prompt


def test_submit_rollouts_hands_many_groups_over_at_once_with_timings(reverse_worker: EnvWorker,
                                                                    fake: FakeOpenAI) -> None:
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
        groups = [f.result(60) for f in worker.submit_rollouts([1, 2, 0], num_rollouts=2, base_url=fake.base_url,
                                                                model="reverse")]
        broken, *good = groups
        assert {r.error_type for r in broken.rollouts} == {"ScoringError"}
        assert all("broken for example 1" in r.error for r in broken.rollouts)
        assert all(r.ok and r.reward == 1.0 and r.metrics["slow_reward"] == 0.0 for g in good for r in g.rollouts)
        assert worker.ping()["env_id"] == "slow_rubric_env"


def test_missing_token_ids_is_a_rollout_error(reverse_worker: EnvWorker, fake: FakeOpenAI) -> None:
    group = reverse_worker.submit_rollout(0, num_rollouts=2, base_url=fake.base_url, model="no-tokens").result(60)
    assert group.num_errors == 2
    assert all(r.error_type == "RolloutError" and "token ids" in (r.error or "") for r in group.rollouts)
    assert reverse_worker.is_alive() and reverse_worker.ping()["env_id"] == "reverse-text"


def test_unreachable_server_is_a_rollout_error(reverse_worker: EnvWorker) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    group = reverse_worker.submit_rollout(0, num_rollouts=2, base_url=f"http://127.0.0.1:{port}/v1",
                                          model="m").result(60)
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
            worker.submit_rollout(0, num_rollouts=1, base_url=fake.base_url, model="slow",
                                  timeout_s=1.0).result(timeout=10)
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
        restarts = [e for e in logs if e["event"] == "restarting env worker"]
        assert [(e["exit_code"], e["pid"], e["num_restarts"]) for e in restarts] == [(-9, old_pid, 1)]
        time.sleep(1.0)  # the old reader and watchdog threads have ended by now
        assert worker.is_alive() and worker.pid != old_pid and worker.exit_code is None
        after = worker.submit_rollout(1, num_rollouts=1, base_url=fake.base_url, model="reverse").result(30)
        assert after.num_errors == 0
    finally:
        worker.close()


# ------------------------------------------------------------------------------------- trajectories (pure)


def make_turn(prompt: list[int], completion: list[int]) -> Turn:
    return Turn(prompt, completion, [-0.5] * len(completion), [1] * len(completion), "stop", False, 1, 1)


def test_interleave_and_branch() -> None:
    turns = [make_turn([1, 2, 3], [4, 5]), make_turn([1, 2, 3, 4, 5, 6, 7], [8]),
             make_turn([1, 2, 3, 4, 5, 6, 7, 8, 9], [10])]
    rollout = Rollout(0, turns, 1.0, {}, False, None, None, None, [], [], 0.0)
    sample = interleave(rollout)
    assert sample is not None
    assert sample.prompt_ids == [1, 2, 3] and sample.completion_ids == [4, 5, 6, 7, 8, 9, 10]
    assert sample.completion_mask == [1, 1, 0, 0, 1, 0, 1]
    assert sample.completion_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5]
    assert to_samples(rollout, "interleaved") == [sample]
    assert [s.completion_ids for s in to_samples(rollout, "branching")] == [[4, 5], [8], [10]]
    rewritten = Rollout(0, [turns[0], make_turn([1, 2, 3, 9, 5, 6], [7])], 1.0, {}, False, None, None, None, [], [],
                        0.0)
    assert interleave(rewritten) is None and to_samples(rewritten, "interleaved") == branch(rewritten)


def test_parse_rollout_turns_broken_payloads_into_errors() -> None:
    good = {"rollout_index": 0, "reward": 0.5, "metrics": {}, "turns": [
        {"prompt_token_ids": [1], "completion_token_ids": [2, 3], "completion_logprobs": [-1.0, -0.5]}]}
    assert parse_rollout(good, "r").ok
    for turn_patch in ({"completion_logprobs": [-1.0]}, {"completion_logprobs": [-1.0, float("nan")]},
                       {"completion_logprobs": [-1.0, 0.5]}, {"completion_token_ids": None},
                       {"completion_mask": [1]}):
        broken = {**good, "turns": [{**good["turns"][0], **turn_patch}]}
        assert parse_rollout(broken, "r").error_type == "MalformedRolloutError", turn_patch
    assert parse_rollout({**good, "turns": []}, "r").error_type == "MalformedRolloutError"
    assert parse_rollout({**good, "reward": None}, "r").error_type == "MalformedRolloutError"
    assert parse_rollout({**good, "error": {"type": "X", "message": "m"}}, "r").error == "m"


def test_sampling_from_config() -> None:
    from primerl.orchestrator.config import SamplingConfig

    params = sampling_from(SamplingConfig(temperature=0.5, stop=["x"], max_tokens=9))
    assert params == SamplingParams(temperature=0.5, stop=("x",), max_tokens=9)
    assert params.to_wire()["stop"] == ["x"]


# --------------------------------------------------------------------------------------- end to end with vLLM

START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("vllm")
    from primerl.trainer.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("vllm-env")
    model_dir = build_tiny_model(tmp / "tiny-model")
    port = free_port()
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(tmp)}
    log_path = tmp / "vllm.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
             "--kv-cache-memory-bytes", str(256 * 2**20), "--port", str(port), "--host", "127.0.0.1"],
            stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
    import httpx

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM server exited {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not ready in {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny", "model_dir": model_dir}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def check_turn_tokens(tokenizer: Any, turn: Turn, prompt_messages: list[dict[str, Any]]) -> None:
    """Logprobs align with the completion, and the prompt is what the chat template gives for the messages."""
    assert len(turn.completion_logprobs) == len(turn.completion_token_ids) == len(turn.completion_mask) > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in turn.completion_logprobs)
    assert set(turn.completion_mask) == {1}
    expected = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert turn.prompt_token_ids == list(expected)
    text = tokenizer.decode(turn.completion_token_ids, skip_special_tokens=True)
    # vLLM holds back a trailing incomplete UTF-8 sequence when a turn is cut at max_tokens
    assert text.rstrip("\ufffd") == turn.completion[0]["content"].rstrip("\ufffd")
    assert (turn.finish_reason == "length") == turn.is_truncated
    if turn.finish_reason == "stop":
        assert turn.completion_token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
@pytest.mark.vllm
def test_single_turn_rollouts_with_vllm(vllm_server: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server["model_dir"])
    with make_worker("reverse-text", {"num_examples": 64}) as worker:
        # No per-request seed: this bare vLLM server keeps chunked prefill on, and on CPU vLLM 0.32 crashes its
        # engine ("CPU Generator does not use offset") when a seeded request's prefill is split across steps,
        # which happens under this load (primerl-infer turns chunked prefill off on CPU, so seeds are safe there).
        sampling = SamplingParams(temperature=1.0, max_tokens=12)
        started = time.monotonic()
        groups = asyncio.run(_gather(worker, range(16), 8, vllm_server, sampling))
        elapsed = time.monotonic() - started
        rollouts = [r for g in groups for r in g.rollouts]
        assert len(rollouts) == 128 and all(r.ok for r in rollouts), [r.error for r in rollouts if not r.ok][:3]
        num_tokens = sum(r.num_completion_tokens for r in rollouts)
        print(f"\nsingle-turn: {len(rollouts)} rollouts, {num_tokens} completion tokens in {elapsed:.2f} s: "
              f"{len(rollouts) / elapsed:.1f} rollouts/s, {num_tokens / elapsed:.0f} tokens/s")
        for group in groups:
            example = worker.examples("train", group.example_index, 1)[0]
            for rollout in group.rollouts:
                assert 0.0 <= rollout.reward <= 1.0 and rollout.metrics["exact_match"] in (0.0, 1.0)
                (turn,) = rollout.turns
                assert rollout.prompt == example.prompt
                check_turn_tokens(tokenizer, turn, example.prompt)
                (sample,) = to_samples(rollout, "interleaved")
                assert sample.prompt_ids + sample.completion_ids == turn.prompt_token_ids + turn.completion_token_ids
        # the rollouts of a group are different samples
        assert all(len({tuple(r.turns[0].completion_token_ids) for r in g.rollouts}) > 1 for g in groups)


@pytest.mark.slow
@pytest.mark.vllm
def test_multi_turn_rollouts_with_vllm(vllm_server: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server["model_dir"])
    with make_worker("reverse-text-multiturn", {"num_examples": 64, "max_turns": 3}) as worker:
        sampling = SamplingParams(temperature=1.0, max_tokens=4)
        started = time.monotonic()
        groups = asyncio.run(_gather(worker, range(8), 8, vllm_server, sampling))
        elapsed = time.monotonic() - started
        rollouts = [r for g in groups for r in g.rollouts]
        assert all(r.ok for r in rollouts), [r.error for r in rollouts if not r.ok][:3]
        print(f"\nmulti-turn: {len(rollouts)} rollouts, {sum(len(r.turns) for r in rollouts)} turns in {elapsed:.2f} s")
        num_interleaved = 0
        for rollout in rollouts:
            assert 0.0 <= rollout.reward <= 1.0 and 1 <= len(rollout.turns) <= 3
            messages = list(rollout.prompt)
            for k, turn in enumerate(rollout.turns):
                check_turn_tokens(tokenizer, turn, messages)
                if k > 0:
                    previous = rollout.turns[k - 1]
                    so_far = previous.prompt_token_ids + previous.completion_token_ids
                    # The template re-renders the previous answer from its text: the prompt extends the tokens
                    # so far exactly when the sampled tokens re-encode to themselves (random tokens may not).
                    stable = tokenizer.encode(tokenizer.decode(previous.completion_token_ids,
                                                               skip_special_tokens=True)) == [
                        t for t in previous.completion_token_ids if t != tokenizer.convert_tokens_to_ids("<|im_end|>")]
                    if stable:
                        assert turn.prompt_token_ids[:len(so_far)] == so_far
                if k + 1 < len(rollout.turns):
                    messages = messages + turn.completion + [rollout.completion[2 * k + 1]]
            samples = to_samples(rollout, "interleaved")
            if len(samples) == 1 and len(rollout.turns) > 1:
                num_interleaved += 1
                (sample,) = samples
                last = rollout.turns[-1]
                assert sample.prompt_ids + sample.completion_ids == last.prompt_token_ids + last.completion_token_ids
                assert sum(sample.completion_mask) == sum(len(t.completion_token_ids) for t in rollout.turns)
                assert len(sample.completion_logprobs) == len(sample.completion_ids)
            assert [s.completion_ids for s in branch(rollout)] == [t.completion_token_ids for t in rollout.turns]
        assert num_interleaved > 0, "no trajectory could be interleaved"


@pytest.mark.slow
@pytest.mark.vllm
def test_broken_rubric_with_vllm_is_counted_and_the_worker_keeps_serving(vllm_server: dict[str, Any]) -> None:
    with make_worker("broken_rubric_env", {"num_examples": 8}) as worker:
        group = worker.submit_rollout(0, num_rollouts=4, sampling=SamplingParams(max_tokens=8),
                                      **_server(vllm_server)).result(120)
        assert group.num_errors == 4 and {r.error_type for r in group.rollouts} == {"ScoringError"}
        assert all(r.turns for r in group.rollouts)  # the tokens are there; only the score is broken
        assert worker.is_alive() and worker.ping()["env_id"] == "broken_rubric_env"


def _server(vllm_server: dict[str, Any]) -> dict[str, Any]:
    return {"base_url": vllm_server["base_url"], "model": vllm_server["model"]}


async def _gather(worker: EnvWorker, indices: Any, group_size: int, vllm_server: dict[str, Any],
                  sampling: SamplingParams) -> list[Any]:
    return list(await asyncio.gather(*(
        worker.rollout(i, num_rollouts=group_size, sampling=sampling, **_server(vllm_server)) for i in indices)))


def test_model_requests_go_through_aiohttp_in_the_set_up_env_interpreter() -> None:
    """`make setup` installs httpx-aiohttp beside verifiers: without it every model request costs ~7x the CPU. (The
    env interpreter has no primerl: importing env_worker makes its two primerl modules importable by path.)"""
    probe = subprocess.run(
        [ENV_PYTHON, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import env_worker; "
         "from primerl.orchestrator.env_rollouts import _http_client_class; print(_http_client_class().__name__)",
         str(WORKER_SCRIPT.parent)],
        capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "HttpxAiohttpClient", probe.stderr

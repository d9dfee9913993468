"""`primerl-infer` as users run it: the real daemon (a child process: vLLM's OpenAI server with primerl's hooks)
on the tiny model, joined to an in-process broker over loopback.

One daemon serves the whole module (starting vLLM's server takes ~20-45 s on 2 cores); the tests run in file
order and build on each other's policy versions: serving and auth first, then updates, the broker restart last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from primerl.broker.config import BrokerConfig
from primerl.client.control import ControlClient
from primerl.broker.service import BrokerService
from primerl.client.weights import WeightPublisher
from primerl.proto.tensor_frames import encode_tensors
from primerl.proto.v1 import control_pb2, data_pb2
from primerl.runtime.config_common import BrokerClientConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

BIN = Path(sys.executable).parent
TOKEN = "test-run-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START_TIMEOUT_S = 240.0
UPDATE_TIMEOUT_S = 60.0
TOLERANCE = 1e-4
PROMPT = "Reverse the string: a b c d"
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
VERSION = "x-primerl-policy-version"
VERSION_END = "x-primerl-policy-version-end"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Broker:
    """An in-process broker that can be stopped and started again on the same ports."""

    def __init__(self, spool_dir: Path):
        self.config = BrokerConfig(host="127.0.0.1", grpc_port=0, rollout_port=0, weight_port=0, spool_dir=spool_dir,
                                   run_token=TOKEN, heartbeat_interval_s=0.2, run_id="infer-test")
        self.service = BrokerService(self.config)
        self.endpoints = self.service.start()
        self.config = self.config.model_copy(update={"grpc_port": self.endpoints.grpc_port,
                                                     "rollout_port": self.endpoints.rollout_port,
                                                     "weight_port": self.endpoints.weight_port})
        self.running = True

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.endpoints.grpc_port}"

    def stop(self) -> None:
        if self.running:
            self.service.stop(grace_s=1.0)
            self.running = False

    def restart(self) -> None:
        """A new broker (empty registry and weight store) on the same ports, as after a crash."""
        self.stop()
        deadline = time.monotonic() + 10
        while True:
            try:
                self.service = BrokerService(self.config)
                self.endpoints = self.service.start()
                break
            except OSError:  # the old sockets may linger for a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.running = True

    def client(self) -> ControlClient:
        return ControlClient(BrokerClientConfig(address=self.grpc_address, run_token=TOKEN), "trainer", "test-observer")

    def inference_worker(self) -> Any:
        with self.client() as client:
            workers = client.list_workers(role="inference")
        return workers[0] if len(workers) == 1 else None

    def publish(self, header: data_pb2.WeightUpdateHeader, payload: bytes) -> data_pb2.WeightAck:
        endpoint = f"tcp://127.0.0.1:{self.endpoints.weight_port}"
        with WeightPublisher(endpoint, TOKEN, "trainer", self.service.chunk_bytes) as publisher:
            return publisher.publish(header, payload, timeout_s=30)


class Daemon:
    """The `primerl-infer` child process; stopped only by the fixture that started it."""

    def __init__(self, tmp: Path, model_dir: Path, broker: Broker):
        self.log_path = tmp / "infer.log"
        ready_file = tmp / "infer-ready.json"
        env = {**os.environ, "PRIMERL_RUN_TOKEN": TOKEN}
        self.log_file = open(self.log_path, "w")
        self.started_s = time.monotonic()
        self.process = subprocess.Popen(
            [str(BIN / "primerl-infer"), "--model.name", str(model_dir), "--model.max-model-len", "512",
             "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--server.port", "0", "--broker.address", broker.grpc_address, "--broker.connect-timeout-s", "30",
             "--ready-file", str(ready_file)],
            stdout=self.log_file, stderr=subprocess.STDOUT, env=env, cwd=tmp,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"primerl-infer did not start:\n{self.log_tail()}")
            time.sleep(0.1)
        self.start_s = time.monotonic() - self.started_s
        self.ready = json.loads(ready_file.read_text())
        self.url = self.ready["base_url"]

    def log_tail(self, num_chars: int = 6000) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_file.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from primerl.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker = Broker(tmp_path_factory.mktemp("spool"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, broker: Broker) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("infer"), tiny_model, broker)
    print(f"\nprimerl-infer ready in {daemon.start_s:.1f} s at {daemon.url}")
    try:
        yield daemon
    finally:
        stop_start_s = time.monotonic()
        code = daemon.stop()
        print(f"primerl-infer stopped in {time.monotonic() - stop_start_s:.1f} s with exit code {code}")


@pytest.fixture(scope="module")
def served() -> dict[str, Path]:
    """The model directory whose weights the worker serves, as the update tests leave it (key "full")."""
    return {}


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=60.0) as client:
        yield client


# ---- helpers ------------------------------------------------------------------------------------------------------


def model_name(http: httpx.Client) -> str:
    return http.get("/v1/models", headers=AUTH).json()["data"][0]["id"]


def greedy_completion(http: httpx.Client, max_tokens: int = 8, model: str | None = None
                      ) -> tuple[httpx.Response, dict[str, Any]]:
    response = http.post("/v1/completions", headers=AUTH, json={
        "model": model or model_name(http), "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
    })
    assert response.status_code == 200, response.text
    return response, response.json()


def tokenize(http: httpx.Client, text: str) -> list[int]:
    response = http.post("/tokenize", headers=AUTH, json={"model": model_name(http), "prompt": text})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def reference_max_diff(http: httpx.Client, model_dir: Path, body: dict[str, Any]) -> float:
    from primerl.inference.logprob_check import reference_logprobs

    choice = body["choices"][0]
    prompt_ids = choice.get("prompt_token_ids") or tokenize(http, PROMPT)
    completion_ids = choice["token_ids"]
    served = choice["logprobs"]["token_logprobs"]
    reference = reference_logprobs(model_dir, prompt_ids, completion_ids, temperature=1.0)
    assert len(served) == len(reference) == len(completion_ids)
    return max(abs(a - b) for a, b in zip(served, reference, strict=True))



def perturbed_model(base_dir: Path, out_dir: Path, seed: int, scale: float = 0.05) -> tuple[Path, dict[str, Any]]:
    """A copy of the tiny model with every weight (the tied embedding too) moved by scale * std * N(0, 1);
    returns (dir, tensors)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(base_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name in sorted(tensors):
        t = tensors[name]
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
        new[name] = (t + scale * (t.float().std() if t.numel() > 1 else 1.0) * noise).contiguous()
    shutil.copytree(base_dir, out_dir)
    save_file(new, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir, new


def full_update(version: int, tensors: dict[str, Any]) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs = encode_tensors(tensors)
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL)
    header.tensors.extend(specs)
    return header, payload


def wait_applied(broker: Broker, version: int, timeout_s: float = UPDATE_TIMEOUT_S) -> float:
    """Seconds until the broker lists the inference worker at `version`."""
    start = time.monotonic()

    def at_version() -> bool:
        worker = broker.inference_worker()
        return worker is not None and worker.HasField("policy_version") and worker.policy_version == version

    wait_for(at_version, timeout_s, f"the broker to list the worker at policy version {version}", interval_s=0.01)
    return time.monotonic() - start


def served_versions(response: httpx.Response) -> tuple[int, int]:
    return int(response.headers[VERSION]), int(response.headers[VERSION_END])


def throughput(http: httpx.Client, num_requests: int = 16, max_tokens: int = 32) -> float:
    """Completion tokens per second over `num_requests` concurrent requests."""
    name = model_name(http)

    def one(i: int) -> int:
        response = http.post("/v1/completions", headers=AUTH, json={
            "model": name, "prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "temperature": 1.0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["completion_tokens"]

    start = time.monotonic()
    with ThreadPoolExecutor(num_requests) as pool:
        tokens = sum(pool.map(one, range(num_requests)))
    return tokens / (time.monotonic() - start)


# ---- serving ------------------------------------------------------------------------------------------------------


def test_health_and_models(daemon: Daemon, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200  # no token needed for liveness probes
    response = http.get("/v1/models", headers=AUTH)
    assert response.status_code == 200
    ids = [card["id"] for card in response.json()["data"]]
    assert ids and ids[0].endswith("tiny")
    assert served_versions(response) == (0, 0)


def test_completion_and_chat_return_token_ids_and_logprobs(http: httpx.Client, tiny_model: Path) -> None:
    response, body = greedy_completion(http)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 8 and len(choice["logprobs"]["token_logprobs"]) == 8
    assert served_versions(response) == (0, 0)
    assert reference_max_diff(http, tiny_model, body) <= TOLERANCE

    chat = http.post("/v1/chat/completions", headers=AUTH, json={
        "model": model_name(http), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "temperature": 1.0, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert len(choice["token_ids"]) == 5 and len(choice["logprobs"]["content"]) == 5
    assert served_versions(chat) == (0, 0)


def test_seeded_requests_under_load_are_honoured_and_do_not_take_the_daemon_down(daemon: Daemon,
                                                                               http: httpx.Client) -> None:
    """vllm-cpu crashes its engine on a seeded request whose prefill is chunked; primerl turns chunked prefill off
    on CPU, so seeds are kept: a seed gives the same tokens alone as among 96 concurrent requests."""
    def seeded(index: int) -> list[int]:
        response = http.post("/v1/completions", headers=AUTH, json={
            "model": model_name(http), "prompt": PROMPT, "max_tokens": 8, "seed": index % 4, "temperature": 1.0,
            "ignore_eos": True, "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    alone = [seeded(seed) for seed in range(4)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        under_load = list(pool.map(seeded, range(96)))
    assert under_load == [alone[index % 4] for index in range(96)]
    assert len({tuple(tokens) for tokens in alone}) > 1  # the seeds reached the sampler
    assert daemon.process.poll() is None
    assert http.get("/health").status_code == 200


def test_streaming_carries_the_versions(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", headers=AUTH, json={
            "model": model_name(http), "prompt": PROMPT, "max_tokens": 4, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers[VERSION] == "0"
        body = response.read().decode()
    assert "data: [DONE]" in body
    assert body.rstrip().endswith(f": {VERSION_END} 0")


def test_auth_is_required_everywhere_but_health(http: httpx.Client) -> None:
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/nonexistent")]:
        assert http.request(method, path).status_code == 401, path
        assert http.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert http.get("/version", headers=AUTH).status_code == 200


def test_dev_and_weight_routes_are_not_reachable(http: httpx.Client) -> None:
    for path in ["/collective_rpc", "/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/sleep", "/wake_up",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update_weights", "/init_weight_transfer_engine",
                 "/scale_elastic_ep", "/start_profile", "/server_info", "/docs", "/openapi.json", "/invocations"]:
        assert http.post(path, json={}).status_code == 401, path
        assert http.post(path, headers=AUTH, json={}).status_code in (404, 405), path


def test_worker_is_registered_with_its_policy_version(daemon: Daemon, broker: Broker) -> None:
    worker = wait_for(broker.inference_worker, 10, "the inference worker in ListWorkers")
    assert worker.address == daemon.url
    assert worker.worker_id == daemon.ready["worker_id"]
    assert worker.capabilities["lora"] == "true" and worker.capabilities["max_lora_rank"] == str(LORA_RANK)
    assert worker.capabilities["dtype"] == "float32" and worker.capabilities["dtype"] == "float32"
    assert worker.state == control_pb2.WORKER_STATE_ALIVE
    wait_for(lambda: broker.inference_worker().HasField("policy_version"), 10, "a heartbeat with the policy version")
    assert broker.inference_worker().policy_version == 0
    with broker.client() as client:
        status = client.get_run_status()
    assert any(w.worker_id == worker.worker_id for w in status.workers)


def test_the_cpu_worker_runs_inside_the_engine_core_process(daemon: Daemon) -> None:
    """vLLM's CPU platform would start a third process for the worker; primerl-infer keeps it in the engine core
    (`PRIMERL_VLLM_CPU_EXECUTOR=uni`, `primerl.inference.vllm_plugin`)."""
    psutil = pytest.importorskip("psutil")
    titles = []
    for child in psutil.Process(daemon.process.pid).children(recursive=True):
        try:
            titles.append(" ".join(child.cmdline()))
        except psutil.NoSuchProcess:
            continue
    assert any("EngineCore" in title for title in titles), titles
    assert not any("Worker" in title for title in titles), titles


# ---- updates ------------------------------------------------------------------------------------------------------


def test_full_update_is_applied_and_served(http: httpx.Client, broker: Broker, tiny_model: Path,
                                           tmp_path: Path) -> None:
    _, before = greedy_completion(http)
    tokens_per_s_before = throughput(http)

    new_dir, tensors = perturbed_model(tiny_model, tmp_path / "v1", seed=1)
    header, payload = full_update(1, tensors)
    ack = broker.publish(header, payload)
    assert ack.applied
    seconds = wait_applied(broker, 1)
    print(f"\nFULL update ({len(payload) / 2**20:.1f} MiB): publish acked -> worker at v1 in ListWorkers: "
          f"{seconds * 1000:.0f} ms")

    response, after = greedy_completion(http)
    assert served_versions(response) == (1, 1)
    served_before = before["choices"][0]["logprobs"]["token_logprobs"]
    served_after = after["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(served_before, served_after)) > 1e-3  # the weights changed
    assert reference_max_diff(http, new_dir, after) <= TOLERANCE
    with broker.client() as client:
        assert client.get_run_status().latest_policy_version == 1

    tokens_per_s_after = throughput(http)
    print(f"throughput (16 concurrent x 32 tokens): {tokens_per_s_before:.0f} tok/s before, "
          f"{tokens_per_s_after:.0f} tok/s after the update")


def test_update_during_requests_keeps_them_going(http: httpx.Client, broker: Broker, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    _, tensors = perturbed_model(tiny_model, tmp_path / "v2", seed=2)
    header, payload = full_update(2, tensors)
    name = model_name(http)

    def long_request(i: int) -> httpx.Response:
        return http.post("/v1/completions", headers=AUTH, json={
            "model": name, "prompt": f"{PROMPT} {i}", "max_tokens": 200, "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_request, i) for i in range(8)]
        time.sleep(0.3)
        broker.publish(header, payload)
        wait_applied(broker, 2)
        responses = [f.result(timeout=120) for f in futures]
    assert all(r.status_code == 200 for r in responses)
    versions = {served_versions(r) for r in responses}
    assert versions <= {(1, 1), (1, 2), (2, 2)}, versions
    assert served_versions(greedy_completion(http)[0]) == (2, 2)


def test_bad_update_is_refused_and_the_old_version_keeps_serving(daemon: Daemon, http: httpx.Client,
                                                                 broker: Broker, tiny_model: Path) -> None:
    from safetensors.torch import load_file

    _, before = greedy_completion(http)
    tensors = load_file(str(tiny_model / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name][:-1].contiguous()  # wrong shape
    header, payload = full_update(3, tensors)
    assert broker.publish(header, payload).applied  # the broker stores it: it does not know the model

    def refusal_reported() -> list[str]:
        with broker.client() as client:
            errors = client.get_run_status().recent_errors
        return [e for e in errors if "refused weight update v3" in e and "TENSOR_MISMATCH" in e]

    # The worker acknowledges v3 as failed and reports why with its next heartbeat.
    assert "model.embed_tokens.weight" in wait_for(refusal_reported, UPDATE_TIMEOUT_S, "the refusal in run status")[0]
    response, after = greedy_completion(http)
    assert served_versions(response) == (2, 2)
    assert after["choices"][0]["logprobs"]["token_logprobs"] == before["choices"][0]["logprobs"]["token_logprobs"]
    assert broker.inference_worker().policy_version == 2
    assert http.get("/health").status_code == 200


def test_metrics_carry_primerl_families_next_to_vllms(daemon: Daemon, http: httpx.Client, broker: Broker) -> None:
    """vLLM's own GET /metrics (run token required) also serves the served policy version and the update counts
    of the tests above (v1 and v2 applied, v3 refused); the broker lists it as the worker's metrics_url."""
    from prometheus_client.parser import text_string_to_metric_families

    assert broker.inference_worker().capabilities["metrics_url"] == f"{daemon.url}/metrics"
    assert http.get("/metrics").status_code == 401
    response = http.get("/metrics", headers=AUTH)
    assert response.status_code == 200
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(response.text) for sample in family.samples}
    primerl = {name: value for (name, _), value in samples.items() if name.startswith("primerl_")}
    print("\n" + "\n".join(f"{name} {value:g}" for name, value in sorted(primerl.items())))
    assert primerl["primerl_inference_policy_version"] == 2
    assert primerl["primerl_inference_weight_updates_applied_total"] == 2
    assert primerl["primerl_inference_weight_updates_refused_total"] == 1
    assert 0 < primerl["primerl_inference_last_update_ms"] < 60_000
    vllm = {name: value for (name, _), value in samples.items() if name.startswith("vllm:")}  # vLLM's own
    print(f"{len(samples)} samples in all; vLLM's include " + ", ".join(
        f"{name} {vllm[name]:g}" for name in ("vllm:num_requests_running", "vllm:generation_tokens_total",
                                              "vllm:prompt_tokens_total") if name in vllm))
    assert vllm["vllm:generation_tokens_total"] > 0 and "vllm:num_requests_running" in vllm
    assert "Avg prompt throughput" not in daemon.log_tail(10**8)  # stats on /metrics, not in the log


def test_survives_a_broker_restart_and_resyncs(daemon: Daemon, http: httpx.Client, broker: Broker,
                                               tiny_model: Path, tmp_path: Path, served: dict[str, Path]) -> None:
    old_worker_id = broker.inference_worker().worker_id
    broker.stop()
    time.sleep(1.0)  # several heartbeats fail meanwhile
    response, _ = greedy_completion(http)  # still serving, still v2
    assert served_versions(response) == (2, 2)

    broker.restart()
    worker = wait_for(broker.inference_worker, 30, "the worker to register with the new broker")
    assert worker.worker_id != old_worker_id and worker.address == daemon.url
    wait_applied(broker, 2, timeout_s=30)  # it told the new broker which version it serves

    new_dir, tensors = perturbed_model(tiny_model, tmp_path / "v4", seed=4)
    header, payload = full_update(4, tensors)
    assert broker.publish(header, payload).applied
    wait_applied(broker, 4)
    response, body = greedy_completion(http)
    assert served_versions(response) == (4, 4)
    assert reference_max_diff(http, new_dir, body) <= TOLERANCE
    assert daemon.process.poll() is None
    served["full"] = new_dir


def test_lora_update_is_served_under_the_policy_name(http: httpx.Client, broker: Broker, tmp_path: Path,
                                                     served: dict[str, Path]) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    if "full" not in served:
        pytest.skip("needs the full weights of the broker-restart test (v4)")
    base_dir = served["full"]
    base = load_file(str(base_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    adapter, merged = {}, dict(base)
    for name in sorted(base):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in LORA_TARGETS:
            continue
        out_features, in_features = base[name].shape
        lora_a = 0.1 * torch.randn(LORA_RANK, in_features, generator=generator)
        lora_b = 0.1 * torch.randn(out_features, LORA_RANK, generator=generator)
        adapter[f"base_model.model.{module}.lora_A.weight"] = lora_a
        adapter[f"base_model.model.{module}.lora_B.weight"] = lora_b
        merged[name] = (base[name] + (LORA_ALPHA / LORA_RANK) * lora_b @ lora_a).contiguous()
    merged_dir = tmp_path / "v5-merged"
    shutil.copytree(base_dir, merged_dir)
    save_file(merged, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})

    payload, specs = encode_tensors(adapter)
    header = data_pb2.WeightUpdateHeader(policy_version=5, kind=data_pb2.WEIGHT_UPDATE_KIND_LORA, policy_name="policy",
                                         adapter_config_json=json.dumps({
                                             "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK,
                                             "lora_alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS),
                                             "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                                             "use_rslora": False, "base_model_name_or_path": str(base_dir)}))
    header.tensors.extend(specs)
    assert broker.publish(header, payload).applied
    wait_applied(broker, 5)

    ids = [card["id"] for card in http.get("/v1/models", headers=AUTH).json()["data"]]
    assert "policy" in ids
    response, body = greedy_completion(http, model="policy")
    assert served_versions(response) == (5, 5)
    assert body["model"] == "policy"
    assert reference_max_diff(http, merged_dir, body) <= TOLERANCE

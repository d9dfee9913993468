#!/usr/bin/env python
"""Completion throughput of `primerl-infer` before and after a FULL weight update (the measurement that
tests/test_inference_server.py printed as "Not a check"; it lives here so the test suite does not pay for it).

    .venv/bin/python bench/serving_throughput.py [--requests 16] [--max-tokens 32] [--repeats 3]

Starts an in-process broker and one `primerl-infer` daemon on the tiny model (`build_tiny_model`, the default
spec; daemon and broker as in bench/weight_update.py), then measures completion tokens per second over
`--requests` concurrent requests of `--max-tokens` tokens each (`ignore_eos`, temperature 1), `--repeats` times
before and after publishing one FULL update (the trainer's `PolicyPublisher`, after one AdamW step), and prints
the median and range of each. An update must not slow serving down: the two medians should be within the
machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_update import (  # noqa: E402
    START_TIMEOUT_S,
    TOKEN,
    Daemon,
    adamw_step,
    load_trainer_model,
    start_broker,
    wait_for,
)

PROMPT = "Reverse the string: a b c d"
APPLY_TIMEOUT_S = 120.0


def tokens_per_s(http, model: str, num_requests: int, max_tokens: int) -> float:
    """Completion tokens per second over `num_requests` concurrent requests."""
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def one(index: int) -> int:
        response = http.post(
            "/v1/completions",
            headers=headers,
            json={
                "model": model,
                "prompt": f"{PROMPT} {index}",
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
            },
        )
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    started_s = time.monotonic()
    with ThreadPoolExecutor(num_requests) as pool:
        tokens = sum(pool.map(one, range(num_requests)))
    return tokens / (time.monotonic() - started_s)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.0f} tok/s (min {min(values):.0f}, max {max(values):.0f})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per measurement")
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="measurements before and after the update")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import httpx

    from primerl.configs.trainer import OptimizerConfig
    from primerl.trainer.optim import build_optimizer
    from primerl.trainer.publish import PolicyPublisher
    from primerl.trainer.tiny_model import build_tiny_model

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serving-throughput-") as tmp:
        tmp_dir = Path(tmp)
        model_dir = build_tiny_model(tmp_dir / "tiny")
        broker = start_broker(tmp_dir / "spool", "serving-throughput")
        daemon = Daemon(tmp_dir / "infer", model_dir, f"127.0.0.1:{broker.endpoints.grpc_port}")
        try:
            wait_for(daemon.poll_ready, START_TIMEOUT_S, "primerl-infer to start", interval_s=0.1)
            print(f"primerl-infer ready in {daemon.start_s:.1f} s")
            with httpx.Client(base_url=daemon.ready["base_url"], timeout=120.0) as http:
                model = http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).json()["data"][0]["id"]
                tokens_per_s(http, model, args.requests, args.max_tokens)  # warm-up, not counted
                before = [tokens_per_s(http, model, args.requests, args.max_tokens) for _ in range(args.repeats)]
                trainer_model = load_trainer_model(model_dir, lora=False)
                adamw_step(trainer_model, build_optimizer(trainer_model, OptimizerConfig(lr=1e-3)), seed=1)
                with PolicyPublisher(
                    f"tcp://127.0.0.1:{broker.endpoints.weight_port}",
                    TOKEN,
                    "bench-trainer",
                    broker.chunk_bytes,
                    kind="full",
                    policy_name="policy",
                ) as publisher:
                    publisher.publish(trainer_model, 1)
                wait_for(
                    lambda: broker.weight_plane.worker_versions().get(daemon.worker_id) == 1,
                    APPLY_TIMEOUT_S,
                    "the worker to apply v1",
                    interval_s=0.01,
                )
                after = [tokens_per_s(http, model, args.requests, args.max_tokens) for _ in range(args.repeats)]
        finally:
            daemon.stop()
            broker.stop(grace_s=1.0)
    print(f"throughput ({args.requests} concurrent x {args.max_tokens} tokens, {args.repeats} repeats)")
    print(f"  before the update: {summary(before)}")
    print(f"  after the update:  {summary(after)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

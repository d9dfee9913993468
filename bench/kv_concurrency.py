"""Adaptive concurrency against a KV-cache target on the 100M model (issue 29's target: reaches and holds the
target within 10 steps, without preemptions), side by side with a fixed number in flight.

    .venv/bin/python bench/kv_concurrency.py [--steps 12] [--kv-mib 128] [--modes adaptive,fixed] [--work-dir DIR]

Each mode is one ``primerl rl`` run of the reverse-text demo shape on the 100M model of ``scale_models.py`` (fp32,
random weights: every rollout generates ``max_tokens``, so KV use follows the number in flight), with the inference
worker's KV cache made small (``[inference] kv_cache_memory_bytes``) so that it, not the CPU, bounds
concurrency. ``adaptive``: ``[orchestrator.concurrency] kv_target = 0.8``; ``fixed``: ``max_inflight`` = the
demand of two batches (what the async bound lets the scheduler keep), no table. Per step it prints the orchestrator
row's ``concurrency/limit``, ``concurrency/kv_usage_max`` (the peak KV use since the previous row) and
``concurrency/preemptions``, then: the first step whose peak reached 0.7, whether every later peak stayed in
[0.6, 0.95], and the preemptions in all. Figures depend on the machine's load: note ``/proc/loadavg`` beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from primerl_runs import PRIMERL, BenchRunError, free_port, run_child  # noqa: E402
from scale_models import ModelPoint, build_point  # noqa: E402

from primerl.proto import telemetry  # noqa: E402

KV_TARGET = 0.8
REACHED = 0.7
HELD = (0.6, 0.95)

CONFIG = """
max_steps = {steps}
seq_len = 256
max_async_level = 1
inference_gpu_ids = [0]
trainer_gpu_ids = [1]

[model]
name = "{model}"

[orchestrator]
batch_size = 32
rollouts_per_example = 4
constant_trainer_batch_size = false   # random weights: most groups carry no signal
{inflight}

[orchestrator.sampling]
max_tokens = 48
temperature = 1.0
seed = 0

[[orchestrator.env]]
id = "reverse-text"

[trainer.optim]
lr = 1e-5

[inference]
enable_lora = false
kv_cache_memory_bytes = {kv_bytes}

[inference.model]
max_model_len = 512

[inference.server]
port = 0
"""


def run_mode(mode: str, model: Path, work_dir: Path, steps: int, kv_mib: int, timeout_s: float) -> list[dict]:
    inflight = (
        f"\n[orchestrator.concurrency]\nkv_target = {KV_TARGET}\ninitial_inflight = 8\npoll_interval_s = 0.5\n"
        if mode == "adaptive"
        else "max_inflight = 64"
    )
    config = work_dir / f"{mode}.toml"
    config.write_text(
        textwrap.dedent(CONFIG).format(steps=steps, model=model, inflight=inflight, kv_bytes=kv_mib * 2**20)
    )
    run_dir = work_dir / mode
    cmd = [str(PRIMERL), "rl", "@", str(config), "--output-dir", str(run_dir), "--no-dashboard"]
    cmd += ["--broker.grpc-port", str(free_port())]
    run_child(cmd, work_dir / f"{mode}.log", timeout_s, f"primerl rl ({mode})")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["role"] == "orchestrator" and telemetry.CONCURRENCY_LIMIT in r]


def summarize(mode: str, rows: list[dict]) -> str:
    lines = [f"{mode}: step  limit  kv_peak  preemptions"]
    for row in rows:
        lines.append(
            f"{mode}: {row['step']:>4}  {row[telemetry.CONCURRENCY_LIMIT]:>5.0f}  "
            f"{row.get(telemetry.CONCURRENCY_KV_USAGE_MAX, float('nan')):>7.3f}  "
            f"{row.get(telemetry.CONCURRENCY_PREEMPTIONS, float('nan')):>11.0f}"
        )
    peaks = [row.get(telemetry.CONCURRENCY_KV_USAGE_MAX) for row in rows]
    reached = next((row["step"] for row, peak in zip(rows, peaks) if peak is not None and peak >= REACHED), None)
    later = [p for row, p in zip(rows, peaks) if reached is not None and row["step"] > reached and p is not None]
    held = bool(later) and all(HELD[0] <= p <= HELD[1] for p in later)
    preemptions = sum(row.get(telemetry.CONCURRENCY_PREEMPTIONS, 0.0) for row in rows)
    lines.append(
        f"{mode}: reached KV >= {REACHED} at step {reached}; later peaks within {list(HELD)}: {held}; "
        f"preemptions in all: {preemptions:.0f}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kv-mib", type=int, default=128, help="the inference worker's KV cache, MiB")
    parser.add_argument("--modes", default="adaptive,fixed")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kv-concurrency-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    model = work_dir / "100m-fp32"
    if not model.exists():
        build_point(model, ModelPoint("100m", "fp32"), None)
    print(f"work dir {work_dir}; load {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    for mode in args.modes.split(","):
        started = time.monotonic()
        try:
            rows = run_mode(mode, model, work_dir, args.steps, args.kv_mib, args.timeout_s)
        except BenchRunError as exc:
            print(f"{mode}: not run: {exc}", flush=True)
            continue
        print(summarize(mode, rows), flush=True)
        print(
            f"{mode}: {time.monotonic() - started:.0f} s wall; load {Path('/proc/loadavg').read_text().split()[:3]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

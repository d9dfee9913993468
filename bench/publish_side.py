#!/usr/bin/env python
"""The trainer side of a weight update: read (device-to-host) + publish to a ``primerl-broker``, streamed or not.

    .venv/bin/python bench/publish_side.py [--model 1b] [--train-dtype bf16|fp32] [--device cpu|cuda]
                                           [--repeats 3] [--chunk-mib 64] [--markdown PATH]

One model of bench part e's family (``scale_models.py``), loaded on ``--device`` in ``--train-dtype``; a
``PolicyPublisher`` publishes FULL updates in bf16 (what inference serves; from fp32 weights that is a cast) to a
``primerl-broker`` subprocess on loopback, until the broker's ack (stored; no inference worker). Two modes,
alternated update by update so both see the same machine: ``whole`` (``weight_broadcast.stream = false``: cast /
copy every tensor into the payload, hash it, then send) and ``streamed`` (the default: chunks go out while later
tensors are still copied; on CUDA the copies are asynchronous device-to-host copies into pinned memory). After
each update, a raw pyzmq PUSH->PULL send of the same number of bytes to another process (``copy=False``).

Printed per mode: payload, publish->ack (min / median / max), the rate in GB/s (payload / publish->ack), and its
ratio to the raw send. Before every update the parameters are scaled by 1 +- 2^-6 (every element changes), as part
e does for models too large for AdamW's state here. Inference is not involved: on a GPU machine without vLLM this is
the part of part e that runs (``--device cuda``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_models import ModelPoint, build_point  # noqa: E402
from weight_update import BrokerProcess, RawBytes, RawZmq, cpu_model_name, nudge_step  # noqa: E402

from primerl.proto.units import MiB  # noqa: E402

MODES = ("whole", "streamed")
TOKEN = "bench-token"


def load_model(model_dir: Path, dtype_name: str, device: str) -> Any:
    from primerl.configs.trainer import ModelConfig
    from primerl.trainer.model import load_model as load

    return load(ModelConfig(name=str(model_dir), optimization_dtype=dtype_name)).to(device)


def gpu_name(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0)


def measure(args: argparse.Namespace, work_dir: Path) -> dict[str, dict[str, list[float]]]:
    import torch

    from primerl.trainer.publish import PolicyPublisher
    from primerl.trainer.tiny_model import build_tiny_model

    point = ModelPoint(args.model, "bf16")
    tokenizer_dir = None if point.uses_build_tiny_model else build_tiny_model(work_dir / "tokenizer-source")
    started = time.monotonic()
    model_dir = build_point(work_dir / point.label, point, tokenizer_dir)
    print(f"built {point.label} in {time.monotonic() - started:.1f} s", flush=True)
    dtype_name = {"bf16": "bfloat16", "fp32": "float32"}[args.train_dtype]
    model = load_model(model_dir, dtype_name, args.device)
    broker = BrokerProcess(work_dir / "broker", "bench-publish-side")
    raw = RawZmq()
    raw_bytes = RawBytes()
    rows: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    publishers: dict[str, Any] = {}
    try:
        broker.wait_ready()
        publishers = {
            mode: PolicyPublisher(
                broker.weight_endpoint,
                TOKEN,
                "bench-trainer",
                args.chunk_mib * MiB,
                kind="full",
                policy_name="policy",
                serving_dtype=torch.bfloat16,
                stream=mode == "streamed",
                lineage=1,
            )
            for mode in MODES
        }
        version = 0
        for round_index in range(args.warmup + args.repeats):
            for mode in MODES if round_index % 2 == 0 else tuple(reversed(MODES)):
                version += 1
                nudge_step(model, version)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                result = publishers[mode].publish(model, version, timeout_s=600)
                publish_s = time.perf_counter() - start
                zmq_s = raw.send_ms(raw_bytes.view(result.payload_bytes)) / 1000.0
                label = "measured" if round_index >= args.warmup else "warm-up"
                phases = " ".join(f"{k}={v:.0f}" for k, v in result.phases_ms.items())
                print(
                    f"  {mode:>8} v{version:<3} {label:8}: {result.payload_bytes / MiB:8.1f} MiB, publish->ack "
                    f"{publish_s:6.2f} s ({result.payload_bytes / publish_s / 1e9:.2f} GB/s), raw zmq {zmq_s:.2f} s "
                    f"[{phases}]",
                    flush=True,
                )
                if round_index >= args.warmup:
                    row = rows[mode]
                    row.setdefault("payload_bytes", []).append(float(result.payload_bytes))
                    row.setdefault("publish_s", []).append(publish_s)
                    row.setdefault("zmq_s", []).append(zmq_s)
    finally:
        for publisher in publishers.values():
            publisher.close()
        raw.close()
        raw_bytes.close()
        broker.stop()
    return rows


def table(rows: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"trainer side of a FULL update: {args.model} model, {args.train_dtype} weights on {args.device}, published "
        f"in bf16, chunks of {args.chunk_mib} MiB, {args.repeats} updates per mode (min / median / max)",
        "",
        "| mode | payload | publish->ack | rate | raw zmq send | publish / raw |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        row = rows[mode]
        if not row:
            continue
        payload = row["payload_bytes"][0]
        publish = row["publish_s"]
        zmq = row["zmq_s"]
        ratios = [p / z for p, z in zip(publish, zmq, strict=True)]
        lines.append(
            f"| {mode} | {payload / MiB:.0f} MiB | {min(publish):.2f} / {statistics.median(publish):.2f} / "
            f"{max(publish):.2f} s | {payload / statistics.median(publish) / 1e9:.2f} GB/s | "
            f"{statistics.median(zmq):.2f} s | {statistics.median(ratios):.2f}x |"
        )
    if rows["whole"] and rows["streamed"]:
        paired = [s / w for s, w in zip(rows["streamed"]["publish_s"], rows["whole"]["publish_s"], strict=True)]
        lines += ["", f"streamed / whole, paired by round: {' '.join(f'{r:.2f}' for r in paired)}"]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1b", choices=["100m", "500m", "1b"], help="model of part e (default 1b)")
    parser.add_argument("--train-dtype", default="bf16", choices=["bf16", "fp32"], help="the trainer's weights")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the trainer's weights are")
    parser.add_argument("--repeats", type=int, default=3, help="measured updates per mode")
    parser.add_argument("--warmup", type=int, default=1, help="updates per mode before measuring")
    parser.add_argument("--chunk-mib", type=int, default=64, help="the publisher's chunk size (the trainer: 64)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.chunk_mib < 1:
        parser.error("--repeats and --chunk-mib must be >= 1, --warmup >= 0")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = f"CPU: {cpu_model_name()}" + (f"; GPU: {gpu_name(args.device)}" if args.device == "cuda" else "")
    print(machine, flush=True)
    with tempfile.TemporaryDirectory(prefix="primerl-publish-side-") as tmp:
        rows = measure(args, Path(tmp))
    lines = table(rows, args) + ["", machine]
    print("\n".join(lines))
    if args.markdown is not None:
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
